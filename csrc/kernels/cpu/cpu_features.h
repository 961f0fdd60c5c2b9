// CPU feature detection (CPUID) and the ISA the CPU kernels dispatch to.
//
// Every vectorised kernel has a portable path plus per-ISA paths compiled in separate translation
// units (*_avx2.cpp, *_avx512f.cpp, *_avx512vnni.cpp, *_avx512.cpp) with their own -m flags; the choice
// is made here, at run time, so a wheel built on an AVX-512 machine still runs on a laptop without it.
// INFLIGHT_CPU_ISA (portable | avx2 | avx512f | avx512) or set_selected_isa() can force a lower path,
// e.g. to test it.
#pragma once

#include <string>

namespace inflight::kernels::cpu {

// In order: each level's CPUs run every lower one. kAvx512F: AVX-512 F/BW/VL/DQ without BF16 (Skylake-SP to
// Ice Lake servers, and VMs that hide BF16); kAvx512: with BF16 and VNNI (Zen 4, Sapphire Rapids on).
enum class Isa : int { kPortable = 0, kAvx2 = 1, kAvx512F = 2, kAvx512 = 3 };

struct CpuFeatures {
  bool avx2 = false, fma = false, f16c = false;
  bool avx512f = false, avx512bw = false, avx512vl = false, avx512dq = false;
  bool avx512bf16 = false, avx512vnni = false, avx512fp16 = false;
  // AMX: the CPU has it (CPUID), the OS saves its state (XCR0 bits 17-18) and Linux granted this
  // process the tile data (arch_prctl ARCH_REQ_XCOMP_PERM). A refusal means no AMX, never a crash.
  bool amx_tile = false, amx_bf16 = false, amx_int8 = false;
  bool amx_cpu = false;  // CPUID alone says AMX (before the OS and the permission)
  std::string vendor;    // "GenuineIntel", "AuthenticAMD", ...
  std::string model;     // the brand string, e.g. "Intel(R) Xeon(R) Processor"
  int family = 0, model_id = 0, stepping = 0;
};

CpuFeatures const& cpu_features();
// No kernel runs AMX yet: amx_* say whether one may (CPU, OS state and permission all present).
// The best ISA this CPU supports (kAvx512 needs F/BW/VL/DQ/BF16/VNNI + FMA; kAvx512F F/BW/VL/DQ + FMA;
// kAvx2 needs AVX2/FMA/F16C). The int8 W8A8 kernel runs VNNI under either AVX-512 level (avx512vnni).
Isa best_isa();
// What kernels use now: best_isa(), lowered by INFLIGHT_CPU_ISA or set_selected_isa().
Isa selected_isa();
// Forces `isa` (capped at best_isa()); returns the ISA now selected. Throws on an unknown name.
Isa set_selected_isa(std::string const& name);
char const* isa_name(Isa isa);

// Batch invariance (on by default): every kernel computes an output element with a reduction order
// that depends only on that element's own inputs and the shapes of the weights, never on how many
// rows share the call, how a prefill is chunked or how the threads split the work. A row's result is
// then bit-identical alone, in a batch of 16, in a chunk of 64 or of 300, or as a decode. Off
// (INFLIGHT_BATCH_INVARIANT=0 or set_batch_invariant(false)), the GEMMs may pick a strategy by the
// row count (bf16 panels from 12 rows, W4Dot for one fp32 row, group sums for one int8 row) and
// decode attention may split a sequence's keys by the batch's total work; LLM(batch_invariant=False)
// sets it for a process. Like the ISA, it is process-wide and read by every launcher on each call.
bool batch_invariant();
void set_batch_invariant(bool on);

}  // namespace inflight::kernels::cpu
