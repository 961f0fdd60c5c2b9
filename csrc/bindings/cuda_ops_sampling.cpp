// CUDA fused sampling (csrc/kernels/cuda/sampling.h). The arguments and their checks are the CPU op's
// (op_checks.h), with the stream (an integer cudaStream_t) last instead of num_threads. The per-row
// parameters live on the device, so their ranges are the caller's contract here (the CPU op checks
// them on the host): temperature >= 0, top_p in (0, 1], min_p in [0, 1], steps >= 0.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <string>

#include "cuda_launch.h"
#include "op_checks.h"
#include "registry.h"
#include "sampling.h"

namespace nb = nanobind;
namespace ck = inflight::kernels::cuda;
using namespace inflight::bindings;

namespace {

void sample(Tensor const& logits, Tensor const& temperature, Tensor const& top_k, Tensor const& top_p,
            Tensor const& min_p, Tensor const& seeds, Tensor const& steps, Tensor const& out, std::uintptr_t stream) {
  SamplingArgs const s = check_sampling_args(logits, temperature, top_k, top_p, min_p, seeds, steps, out);
  if (s.num_rows > 0x7fffffffLL) {  // one CTA per row
    throw_value_error("logits.shape[0] (N) must be < 2^31, got " + std::to_string(s.num_rows));
  }
  int const device = require_one_cuda_device(s.tensors);
  ck::SamplingParams p{};
  fill_sampling_params(p, s);
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
