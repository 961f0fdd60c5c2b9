// Fused CPU sampling (csrc/kernels/cpu/sampling.h). The typed wrapper is inflight.ops.sample.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>

#include "cpu_features.h"
#include "registry.h"
#include "sampling.h"

namespace nb = nanobind;
namespace kc = inflight::kernels::cpu;
namespace ik = inflight::kernels;

namespace {

template <typename T>
using Column = nb::ndarray<T const, nb::ndim<1>, nb::device::cpu, nb::c_contig>;
using OutColumn = nb::ndarray<std::int64_t, nb::ndim<1>, nb::device::cpu, nb::c_contig>;
using Logits = nb::ndarray<nb::ndim<2>, nb::device::cpu>;

void check_rows(char const* name, std::size_t got, std::int64_t rows) {
  if (static_cast<std::int64_t>(got) != rows) {
    throw std::invalid_argument(std::string(name) + " must have one entry per logits row (" + std::to_string(rows) +
                                "), got " + std::to_string(got));
  }
}

template <typename T, typename Ok>
void check_values(char const* name, Column<T> const& v, Ok ok, char const* what) {
  for (std::size_t i = 0; i < v.shape(0); ++i) {
    if (!ok(v(i))) {
      throw std::invalid_argument(std::string(name) + "[" + std::to_string(i) + "] must be " + what + ", got " +
                                  std::to_string(v(i)));
    }
  }
}

ik::ScalarType logits_dtype(Logits const& logits) {
  nb::dlpack::dtype const dt = logits.dtype();
  if (dt == nb::dtype<float>()) return ik::ScalarType::kFloat32;
  if (dt.bits == 16 && dt.lanes == 1) {
    if (dt.code == static_cast<std::uint8_t>(nb::dlpack::dtype_code::Bfloat)) return ik::ScalarType::kBFloat16;
    if (dt.code == static_cast<std::uint8_t>(nb::dlpack::dtype_code::Float)) return ik::ScalarType::kFloat16;
  }
  throw std::invalid_argument("logits must be float32, bfloat16 or float16");
}

void sample(Logits logits, Column<float> temperature, Column<std::int32_t> top_k, Column<float> top_p,
            Column<float> min_p, Column<std::uint64_t> seeds, Column<std::int64_t> steps, OutColumn out,
            int num_threads) {
  auto const rows = static_cast<std::int64_t>(logits.shape(0));
  auto const vocab = static_cast<std::int64_t>(logits.shape(1));
  if (vocab < 1) throw std::invalid_argument("logits must have at least one column, got 0");
  if (rows > 0 && vocab > 1 && logits.stride(1) != 1) {
    throw std::invalid_argument("logits must have unit stride along the vocabulary, got " +
                                std::to_string(logits.stride(1)));
  }
  if (rows > 1 && logits.stride(0) < 0) {
    throw std::invalid_argument("logits must have a row stride >= 0, got " + std::to_string(logits.stride(0)));
  }
  check_rows("temperature", temperature.shape(0), rows);
  check_rows("top_k", top_k.shape(0), rows);
  check_rows("top_p", top_p.shape(0), rows);
  check_rows("min_p", min_p.shape(0), rows);
  check_rows("seeds", seeds.shape(0), rows);
  check_rows("steps", steps.shape(0), rows);
  check_rows("out", out.shape(0), rows);
  check_values("temperature", temperature, [](float v) { return std::isfinite(v) && v >= 0.f; }, "finite and >= 0");
  check_values("top_p", top_p, [](float v) { return v > 0.f && v <= 1.f; }, "in (0, 1]");
  check_values("min_p", min_p, [](float v) { return v >= 0.f && v <= 1.f; }, "in [0, 1]");
  check_values("steps", steps, [](std::int64_t v) { return v >= 0; }, ">= 0");

  kc::SamplingParams p;
  p.logits = logits.data();
  p.dtype = logits_dtype(logits);
  p.num_rows = rows;
  p.vocab_size = vocab;
  p.row_stride = rows > 1 ? logits.stride(0) : 0;
  p.temperature = temperature.data();
  p.top_k = top_k.data();
  p.top_p = top_p.data();
  p.min_p = min_p.data();
  p.seeds = seeds.data();
  p.steps = steps.data();
  p.out = out.data();
  p.num_threads = num_threads < 1 ? 1 : num_threads;
  p.workspace_bytes = kc::sampling_workspace_size(rows, vocab, p.num_threads);
  // Uninitialised on purpose: only the pages a row touches get faulted in.
  std::unique_ptr<std::byte[]> workspace(new std::byte[static_cast<std::size_t>(p.workspace_bytes)]);
  p.workspace = workspace.get();
  kc::launch_sampling(p, kc::ThreadPool::global());
}

}  // namespace

INFLIGHT_REGISTER_OPS(sampling) {
  m.def("sample", &sample, nb::arg("logits"), nb::arg("temperature"), nb::arg("top_k"), nb::arg("top_p"),
        nb::arg("min_p"), nb::arg("seeds"), nb::arg("steps"), nb::arg("out").noconvert(), nb::arg("num_threads"),
        nb::call_guard<nb::gil_scoped_release>(),
        "Fused temperature / top-k / top-p / min-p sampling, one token per row into `out` (int64). "
        "logits: [N, V] float32/bfloat16/float16, unit stride along V; temperature, top_p, min_p: [N] "
        "float32; top_k: [N] int32; seeds: [N] uint64; steps: [N] int64. Row i's token depends only on "
        "its logits, its parameters and (seeds[i], steps[i]).");
  m.def("sampling_uniform", &kc::sampling_uniform, nb::arg("seed"), nb::arg("step"),
        "The uniform in [0, 1) that `sample` draws with for (seed, step).");
}
