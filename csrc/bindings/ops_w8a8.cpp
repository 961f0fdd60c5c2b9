// W8A8 GEMM binding (w8a8_gemm.h): W8A8Weight packs int8 weights once (blocks for VPDPBUSD, column
// sums); gemm(x, out, num_threads) quantises x per token and multiplies. The Python wrapper is
// inflight.ops.gemm.W8A8Weight.
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

INFLIGHT_REGISTER_OPS(w8a8) {
  nb::class_<W8A8Weight>(m, "W8A8Weight",
                         "W8A8 (SmoothQuant) weights: int8 qweight [n, k] with fp32 scales [n] per output channel, "
                         "optional fp32 smooth [k] (multipliers of x before its per-token int8 quantisation) and fp32 "
                         "bias [n], packed once (copied: the tensors are not kept). gemm(x, out, num_threads): "
                         "out = x @ W^T (+ bias) with int8 activations and int32 sums, bit-identical on every ISA.")
      .def(nb::init<Tensor, Tensor, std::optional<Tensor>, std::optional<Tensor>>(), "qweight"_a, "scales"_a,
           "smooth"_a.none(), "bias"_a.none())
      .def("gemm", &W8A8Weight::gemm, "x"_a, "out"_a.noconvert(), "num_threads"_a)
      .def("unpack", &W8A8Weight::unpack, "qweight"_a.noconvert(), "scales"_a.noconvert(),
           "Writes the tensors it was packed from, exactly: qweight [n, k] int8, scales [n] float32.")
      .def_prop_ro("n", &W8A8Weight::n)
      .def_prop_ro("k", &W8A8Weight::k)
      .def_prop_ro("nbytes", &W8A8Weight::nbytes);
}
