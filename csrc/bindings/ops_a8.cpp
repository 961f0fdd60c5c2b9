// A8 GEMM binding (a8_gemm.h): A8Weight packs int4 / int8 grouped weights once (panels for VPDPBUSD);
// gemm(x, out, num_threads) quantises x to int8 per group of 32 and multiplies. The Python wrapper is
// inflight.ops.gemm.A8Weight.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>

#include <optional>

#include "gemm_weights.h"
#include "registry.h"

namespace nb = nanobind;
using namespace nb::literals;
using namespace inflight::bindings;
using namespace inflight::bindings::gemm;

INFLIGHT_REGISTER_OPS(a8) {
  nb::class_<A8Weight>(m, "A8Weight",
                       "Grouped int4 / int8 weights (the W4A16 / W8A16 formats: qweight, scales, offsets for "
                       "asymmetric int4, group_size) packed once for the A8 GEMM (copied: the tensors are not kept). "
                       "gemm(x, out, num_threads): out = x @ W^T (+ bias) with x quantised to int8 per group of 32 "
                       "(16 for groups of 16), exact int32 sums per group, bit-identical on every ISA and at every "
                       "row count. act_bits=16 (A16): x quantised to 16-bit codes per group (two int8 limbs), "
                       "the same exact integer sums.")
      .def(nb::init<int, Tensor, Tensor, std::optional<Tensor>, int, std::optional<Tensor>, int>(), "bits"_a,
           "qweight"_a, "scales"_a, "offsets"_a.none(), "group_size"_a, "bias"_a.none(), "act_bits"_a = 8)
      .def("gemm", &A8Weight::gemm, "x"_a, "out"_a.noconvert(), "num_threads"_a)
      .def("unpack", &A8Weight::unpack, "qweight"_a.noconvert(), "scales"_a.noconvert(), "offsets"_a.none(),
           "Writes the tensors it was packed from, exactly: qweight ([n, k/2] uint8 or [n, k] int8), scales "
           "and (asymmetric int4) offsets ([n, k/group_size] float32).")
      .def("embed", &A8Weight::embed, "ids"_a, "out"_a.noconvert(),
           "out[i] = row ids[i] of an int8 weight (bits=8) dequantised: code x scale in fp32, rounded to out's "
           "dtype (ids [m] int64, out [m, k]).")
      .def_prop_ro("n", &A8Weight::n)
      .def_prop_ro("k", &A8Weight::k)
      .def_prop_ro("bits", &A8Weight::bits)
      .def_prop_ro("group_size", &A8Weight::group_size)
      .def_prop_ro("act_bits", &A8Weight::act_bits)
      .def_prop_ro("nbytes", &A8Weight::nbytes);
  m.def("a8_vectorised", &inflight::kernels::cpu::a8_vectorised,
        "Whether the A8 / A16 GEMM runs its AVX512-VNNI tiles with the CPU kernels selected now (else its "
        "portable loop).");
}
