#include "cpu_features.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif
#if defined(__linux__) && defined(__x86_64__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace inflight::kernels::cpu {
namespace {

#if defined(__x86_64__) || defined(__i386__)
// Vendor, brand string and family / model / stepping (CPUID 0, 1 and 0x80000002-4).
void identify(CpuFeatures& f) {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid(0, &eax, &ebx, &ecx, &edx)) {
    char v[13] = {};
    std::memcpy(v, &ebx, 4);
    std::memcpy(v + 4, &edx, 4);
    std::memcpy(v + 8, &ecx, 4);
    f.vendor = v;
  }
  if (__get_cpuid(1, &eax, &ebx, &ecx, &edx)) {
    unsigned const base_family = (eax >> 8) & 0xf, ext_family = (eax >> 20) & 0xff;
    unsigned const base_model = (eax >> 4) & 0xf, ext_model = (eax >> 16) & 0xf;
    f.family = static_cast<int>(base_family == 0xf ? base_family + ext_family : base_family);
    f.model_id =
        static_cast<int>(base_family == 0x6 || base_family == 0xf ? (ext_model << 4) | base_model : base_model);
    f.stepping = static_cast<int>(eax & 0xf);
  }
  if (__get_cpuid(0x80000000, &eax, &ebx, &ecx, &edx) && eax >= 0x80000004) {
    char brand[49] = {};
    for (unsigned i = 0; i < 3; ++i) {
      unsigned r[4] = {};
      __get_cpuid(0x80000002 + i, &r[0], &r[1], &r[2], &r[3]);
      std::memcpy(brand + 16 * i, r, 16);
    }
    std::string b = brand;
    auto const first = b.find_first_not_of(' ');
    auto const last = b.find_last_not_of(' ');
    f.model = first == std::string::npos ? "" : b.substr(first, last - first + 1);
  }
}

// Asks Linux for the AMX tile data state (off by default: a process must request it once).
bool request_amx_permission() {
#if defined(__linux__) && defined(__x86_64__)
  constexpr long kArchGetXcompPerm = 0x1022, kArchReqXcompPerm = 0x1023;
  constexpr int kXfeatureXtiledata = 18;
  if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0) return false;
  unsigned long bitmask = 0;
  if (syscall(SYS_arch_prctl, kArchGetXcompPerm, &bitmask) != 0) return false;
  return (bitmask & (1UL << kXfeatureXtiledata)) != 0;
#else
  return false;
#endif
}
#endif

CpuFeatures detect() {
  CpuFeatures f;
#if defined(__x86_64__) || defined(__i386__)
  identify(f);
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return f;
  bool const osxsave = ecx & bit_OSXSAVE;
  f.fma = ecx & bit_FMA;
  f.f16c = ecx & bit_F16C;
  bool avx_state = false, avx512_state = false, amx_state = false;
  if (osxsave) {
    // The OS must save the YMM (and ZMM/opmask, AMX tile) registers on context switches.
    unsigned xcr0_lo = 0, xcr0_hi = 0;
    __asm__ volatile("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0));
    avx_state = (xcr0_lo & 0x6) == 0x6;
    avx512_state = (xcr0_lo & 0xe6) == 0xe6;
    amx_state = (xcr0_lo & 0x60000) == 0x60000;  // XTILECFG (17) and XTILEDATA (18)
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
      f.avx512fp16 = edx & (1u << 23);
    }
    // CPUID.(7,0):EDX bit 22 AMX-BF16, 24 AMX-TILE, 25 AMX-INT8.
    bool const tile = edx & (1u << 24);
    f.amx_cpu = tile;
    if (tile && amx_state && request_amx_permission()) {
      f.amx_tile = true;
      f.amx_bf16 = edx & (1u << 22);
      f.amx_int8 = edx & (1u << 25);
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
  if (f.avx512f && f.avx512bw && f.avx512vl && f.avx512dq && f.fma && f.avx2 && f.f16c) return Isa::kAvx512F;
  if (f.avx2 && f.fma && f.f16c) return Isa::kAvx2;
  return Isa::kPortable;
}

Isa parse(std::string const& name) {
  if (name == "portable" || name == "generic") return Isa::kPortable;
  if (name == "avx2") return Isa::kAvx2;
  if (name == "avx512f") return Isa::kAvx512F;
  if (name == "avx512") return Isa::kAvx512;
  throw std::invalid_argument("INFLIGHT_CPU_ISA must be one of portable, avx2, avx512f, avx512, got '" + name + "'");
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

namespace {
std::atomic<bool>& invariant_flag() {
  static std::atomic<bool> on = [] {
    char const* env = std::getenv("INFLIGHT_BATCH_INVARIANT");
    return env == nullptr || *env == '\0' || std::string(env) != "0";
  }();
  return on;
}
}  // namespace

bool batch_invariant() { return invariant_flag().load(std::memory_order_relaxed); }
void set_batch_invariant(bool on) { invariant_flag().store(on, std::memory_order_relaxed); }

char const* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kPortable:
      return "portable";
    case Isa::kAvx2:
      return "avx2";
    case Isa::kAvx512F:
      return "avx512f";
    case Isa::kAvx512:
      return "avx512";
  }
  return "unknown";
}

}  // namespace inflight::kernels::cpu
