#include "cpu_features.h"

#include <atomic>
#include <cstdlib>
#include <stdexcept>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

namespace inflight::kernels::cpu {
namespace {

CpuFeatures detect() {
  CpuFeatures f;
#if defined(__x86_64__) || defined(__i386__)
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return f;
  bool const osxsave = ecx & bit_OSXSAVE;
  f.fma = ecx & bit_FMA;
  f.f16c = ecx & bit_F16C;
  bool avx_state = false, avx512_state = false;
  if (osxsave) {
    // The OS must save the YMM (and ZMM/opmask) registers on context switches.
    unsigned xcr0_lo = 0, xcr0_hi = 0;
    __asm__ volatile("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0));
    avx_state = (xcr0_lo & 0x6) == 0x6;
    avx512_state = (xcr0_lo & 0xe6) == 0xe6;
  }
  if (!avx_state) f.fma = f.f16c = false;
  if (__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) {
    f.avx2 = avx_state && (ebx & bit_AVX2);
    if (avx512_state) {
      f.avx512f = ebx & bit_AVX512F;
      f.avx512dq = ebx & bit_AVX512DQ;
      f.avx512bw = ebx & bit_AVX512BW;
      f.avx512vl = ebx & bit_AVX512VL;
      f.avx512vnni = ecx & bit_AVX512VNNI;
    }
  }
  if (avx512_state && __get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx)) f.avx512bf16 = eax & bit_AVX512BF16;
#endif
  return f;
}

Isa compute_best() {
  CpuFeatures const& f = cpu_features();
  if (f.avx512f && f.avx512bw && f.avx512vl && f.avx512dq && f.avx512bf16 && f.avx512vnni && f.fma && f.avx2 &&
      f.f16c) {
    return Isa::kAvx512;
  }
  if (f.avx2 && f.fma && f.f16c) return Isa::kAvx2;
  return Isa::kPortable;
}

Isa parse(std::string const& name) {
  if (name == "portable" || name == "generic") return Isa::kPortable;
  if (name == "avx2") return Isa::kAvx2;
  if (name == "avx512") return Isa::kAvx512;
  throw std::invalid_argument("INFLIGHT_CPU_ISA must be one of portable, avx2, avx512, got '" + name + "'");
}

std::atomic<int>& selected() {
  static std::atomic<int> isa = [] {
    Isa best = best_isa();
    if (char const* env = std::getenv("INFLIGHT_CPU_ISA"); env != nullptr && *env != '\0') {
      Isa wanted = parse(env);
      return static_cast<int>(wanted < best ? wanted : best);
    }
    return static_cast<int>(best);
  }();
  return isa;
}

}  // namespace

CpuFeatures const& cpu_features() {
  static CpuFeatures const features = detect();
  return features;
}

Isa best_isa() {
  static Isa const best = compute_best();
  return best;
}

Isa selected_isa() { return static_cast<Isa>(selected().load(std::memory_order_relaxed)); }

Isa set_selected_isa(std::string const& name) {
  Isa wanted = parse(name);
  Isa best = best_isa();
  selected().store(static_cast<int>(wanted < best ? wanted : best));
  return selected_isa();
}

char const* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kPortable:
      return "portable";
    case Isa::kAvx2:
      return "avx2";
    case Isa::kAvx512:
      return "avx512";
  }
  return "unknown";
}

}  // namespace inflight::kernels::cpu
