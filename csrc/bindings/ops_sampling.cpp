// Fused CPU sampling (csrc/kernels/cpu/sampling.h). The arguments and their checks are the CUDA op's
// (op_checks.h), with num_threads last instead of the stream; the per-row parameters are on the host
// here, so their ranges are checked too. The typed wrapper is inflight.ops.sample.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "op_checks.h"
#include "registry.h"
#include "sampling.h"

namespace nb = nanobind;
namespace kc = inflight::kernels::cpu;
using namespace inflight::bindings;

namespace {

template <typename T, typename Ok>
void check_values(char const* name, Tensor const& column, Ok ok, char const* what) {
  auto const* v = static_cast<T const*>(column.data());
  for (std::size_t i = 0; i < column.shape(0); ++i) {
    if (!ok(v[i])) {
      throw_value_error(std::string(name) + "[" + std::to_string(i) + "] must be " + what + ", got " +
                        std::to_string(v[i]));
    }
  }
}

// The columns may be read-only numpy views; nothing but out is written.
void sample(ReadOnlyTensor logits_in, ReadOnlyTensor temperature_in, ReadOnlyTensor top_k_in, ReadOnlyTensor top_p_in,
            ReadOnlyTensor min_p_in, ReadOnlyTensor seeds_in, ReadOnlyTensor steps_in, Tensor out, int num_threads) {
  Tensor const logits(logits_in), temperature(temperature_in), top_k(top_k_in), top_p(top_p_in), min_p(min_p_in),
      seeds(seeds_in), steps(steps_in);
  require_at_least(num_threads, 1, "num_threads");
  SamplingArgs const s = check_sampling_args(logits, temperature, top_k, top_p, min_p, seeds, steps, out);
  require_cpu(s.tensors);
  check_values<float>(
      "temperature", temperature, [](float v) { return std::isfinite(v) && v >= 0.f; }, "finite and >= 0");
  check_values<float>("top_p", top_p, [](float v) { return v > 0.f && v <= 1.f; }, "in (0, 1]");
  check_values<float>("min_p", min_p, [](float v) { return v >= 0.f && v <= 1.f; }, "in [0, 1]");
  check_values<std::int64_t>("steps", steps, [](std::int64_t v) { return v >= 0; }, ">= 0");
  if (s.num_rows == 0) return;

  kc::SamplingParams p;
  fill_sampling_params(p, s);
  p.num_threads = num_threads;
  p.workspace_bytes = kc::sampling_workspace_size(p.num_rows, p.vocab_size, p.num_threads);
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
