// CPU feature detection (CPUID) and the ISA the CPU kernels dispatch to.
//
// Every vectorised kernel has a portable path plus per-ISA paths compiled in separate translation
// units (*_avx2.cpp, *_avx512.cpp) with their own -m flags; the choice is made here, at run time, so
// a wheel built on an AVX-512 machine still runs on a laptop without it. INFLIGHT_CPU_ISA
// (portable | avx2 | avx512) or set_selected_isa() can force a lower path, e.g. to test it.
#pragma once

#include <string>

namespace inflight::kernels::cpu {

enum class Isa : int { kPortable = 0, kAvx2 = 1, kAvx512 = 2 };

struct CpuFeatures {
  bool avx2 = false, fma = false, f16c = false;
  bool avx512f = false, avx512bw = false, avx512vl = false, avx512dq = false;
  bool avx512bf16 = false, avx512vnni = false;
};

CpuFeatures const& cpu_features();
// The best ISA this CPU supports (kAvx512 needs F/BW/VL/DQ/BF16/VNNI + FMA; kAvx2 needs AVX2/FMA/F16C).
Isa best_isa();
// What kernels use now: best_isa(), lowered by INFLIGHT_CPU_ISA or set_selected_isa().
Isa selected_isa();
// Forces `isa` (capped at best_isa()); returns the ISA now selected. Throws on an unknown name.
Isa set_selected_isa(std::string const& name);
char const* isa_name(Isa isa);

}  // namespace inflight::kernels::cpu
