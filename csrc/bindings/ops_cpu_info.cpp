// CPU ISA selection, exposed for tests (force the portable path) and for logs.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <utility>

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
      "cpu_features",
      [] {
        kc::CpuFeatures const& f = kc::cpu_features();
        nb::dict d;
        d["vendor"] = f.vendor;
        d["model"] = f.model;
        d["family"] = f.family;
        d["model_id"] = f.model_id;
        d["stepping"] = f.stepping;
        for (auto [name, value] : {std::pair{"avx2", f.avx2},
                                   {"fma", f.fma},
                                   {"f16c", f.f16c},
                                   {"avx512f", f.avx512f},
                                   {"avx512bw", f.avx512bw},
                                   {"avx512vl", f.avx512vl},
                                   {"avx512dq", f.avx512dq},
                                   {"avx512bf16", f.avx512bf16},
                                   {"avx512vnni", f.avx512vnni},
                                   {"avx512fp16", f.avx512fp16},
                                   {"amx_cpu", f.amx_cpu},
                                   {"amx_tile", f.amx_tile},
                                   {"amx_bf16", f.amx_bf16},
                                   {"amx_int8", f.amx_int8}}) {
          d[name] = value;
        }
        return d;
      },
      "What CPUID, the OS and Linux's AMX permission say: vendor, brand string, family / model / stepping, and "
      "one bool per feature the kernels care about (amx_*: usable by this process; amx_cpu: present in the CPU).");
  m.def(
      "set_cpu_isa", [](std::string const& name) { return std::string(kc::isa_name(kc::set_selected_isa(name))); },
      nb::arg("name"), "Forces portable / avx2 / avx512 (capped at what the CPU has); returns the ISA now used.");
  m.def("batch_invariant", &kc::batch_invariant,
        "Whether the CPU kernels are batch-invariant (a row's bits independent of the batch; the default).");
  m.def(
      "set_batch_invariant",
      [](bool on) {
        kc::set_batch_invariant(on);
        return kc::batch_invariant();
      },
      nb::arg("on"), "Turns the CPU kernels' batch invariance on or off (INFLIGHT_BATCH_INVARIANT); returns it.");
}
