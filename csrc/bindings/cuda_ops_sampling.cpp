// CUDA fused sampling (csrc/kernels/cuda/sampling.h). Same argument order as the CPU op, with the stream
// (an integer cudaStream_t) last instead of num_threads. The per-row parameters live on the device, so
// their ranges are the caller's contract here (the CPU op checks them on the host): temperature >= 0,
// top_p in (0, 1], min_p in [0, 1], steps >= 0.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "cuda_ops_util.h"
#include "registry.h"
#include "sampling.h"

namespace nb = nanobind;
namespace ck = inflight::kernels::cuda;
using namespace inflight::bindings::cuda_ops;

namespace {

void check_column(Tensor const& a, char const* name, std::int64_t rows, nb::dlpack::dtype_code code, int bits,
                  char const* dtype) {
  require_ndim(a, name, 1, "[N] (one entry per logits row)");
  require_dim(a, name, 0, rows, "logits.shape[0] (N)");
  require_dtype(a, name, code, bits, dtype);
  require_contiguous(a, name);
}

void sample(Tensor const& logits, Tensor const& temperature, Tensor const& top_k, Tensor const& top_p,
            Tensor const& min_p, Tensor const& seeds, Tensor const& steps, Tensor const& out, std::uintptr_t stream) {
  require_ndim(logits, "logits", 2, "[N, V]");
  ScalarType const dtype = float_type(logits, "logits", /*allow_float32=*/true);
  std::int64_t const rows = static_cast<std::int64_t>(logits.shape(0));
  std::int64_t const vocab = static_cast<std::int64_t>(logits.shape(1));
  if (vocab < 1 || vocab > 0x7fffffffLL) {
    throw std::invalid_argument("logits must have between 1 and 2^31 - 1 columns, got " + std::to_string(vocab));
  }
  if (rows > 0x7fffffffLL) throw std::invalid_argument("logits has too many rows: " + std::to_string(rows));
  if (vocab > 1 && logits.stride(1) != 1) {
    throw std::invalid_argument("logits must have unit stride along the vocabulary, got " +
                                std::to_string(logits.stride(1)));
  }
  if (rows > 1 && logits.stride(0) < 0) {
    throw std::invalid_argument("logits must have a row stride >= 0, got " + std::to_string(logits.stride(0)));
  }
  constexpr auto kFloat = nb::dlpack::dtype_code::Float;
  constexpr auto kInt = nb::dlpack::dtype_code::Int;
  check_column(temperature, "temperature", rows, kFloat, 32, "float32");
  check_column(top_k, "top_k", rows, kInt, 32, "int32");
  check_column(top_p, "top_p", rows, kFloat, 32, "float32");
  check_column(min_p, "min_p", rows, kFloat, 32, "float32");
  require_ndim(seeds, "seeds", 1, "[N] (one entry per logits row)");
  require_dim(seeds, "seeds", 0, rows, "logits.shape[0] (N)");
  if (!is_dtype(seeds, nb::dlpack::dtype_code::UInt, 64) && !is_dtype(seeds, kInt, 64)) {
    throw nb::type_error(("seeds must be uint64 (or int64, taken as its bits), got " + dtype_str(seeds)).c_str());
  }
  require_contiguous(seeds, "seeds");
  check_column(steps, "steps", rows, kInt, 64, "int64");
  check_column(out, "out", rows, kInt, 64, "int64");
  int const device = common_cuda_device({{&logits, "logits"},
                                         {&temperature, "temperature"},
                                         {&top_k, "top_k"},
                                         {&top_p, "top_p"},
                                         {&min_p, "min_p"},
                                         {&seeds, "seeds"},
                                         {&steps, "steps"},
                                         {&out, "out"}});
  ck::SamplingParams p{};
  p.logits = logits.data();
  p.row_stride = rows > 1 ? logits.stride(0) : 0;
  p.num_rows = rows;
  p.vocab_size = vocab;
  p.temperature = static_cast<float const*>(temperature.data());
  p.top_k = static_cast<std::int32_t const*>(top_k.data());
  p.top_p = static_cast<float const*>(top_p.data());
  p.min_p = static_cast<float const*>(min_p.data());
  p.seeds = static_cast<std::uint64_t const*>(seeds.data());
  p.steps = static_cast<std::int64_t const*>(steps.data());
  p.out = static_cast<std::int64_t*>(out.data());
  p.dtype = dtype;
  nb::gil_scoped_release release;
  DeviceGuard guard(device);
  check_cuda(ck::launch_sampling(p, as_stream(stream)), "sample");
}

}  // namespace

INFLIGHT_REGISTER_OPS(cuda_sampling) {
  m.def("sample", &sample, nb::arg("logits"), nb::arg("temperature"), nb::arg("top_k"), nb::arg("top_p"),
        nb::arg("min_p"), nb::arg("seeds"), nb::arg("steps"), nb::arg("out"), nb::arg("stream"),
        "Fused temperature / top-k / top-p / min-p sampling on the GPU, one token per row into `out` (int64), "
        "with the CPU op's semantics and random numbers (inverse CDF in id order at u = "
        "sampling_uniform(seeds[i], steps[i])). logits: [N, V] float32/bfloat16/float16, unit stride along V; "
        "temperature, top_p, min_p: [N] float32; top_k: [N] int32; seeds: [N] uint64 (or int64 bits); steps: "
        "[N] int64. All CUDA tensors on one device; nothing is synchronised.");
}
