// CPU ISA selection, exposed for tests (force the portable path) and for logs.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "cpu_features.h"
#include "registry.h"

namespace nb = nanobind;
namespace kc = inflight::kernels::cpu;

INFLIGHT_REGISTER_OPS(cpu_info) {
  m.def(
      "cpu_isa", [] { return std::string(kc::isa_name(kc::selected_isa())); },
      "The ISA the CPU kernels use now: portable, avx2 or avx512.");
  m.def("cpu_best_isa", [] { return std::string(kc::isa_name(kc::best_isa())); }, "The best ISA this CPU supports.");
  m.def(
      "set_cpu_isa", [](std::string const& name) { return std::string(kc::isa_name(kc::set_selected_isa(name))); },
      nb::arg("name"), "Forces portable / avx2 / avx512 (capped at what the CPU has); returns the ISA now used.");
}
