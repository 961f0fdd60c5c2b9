// inflight._C: the always-importable native module (no CUDA, no torch).
#include <nanobind/nanobind.h>

#include "registry.h"

namespace nb = nanobind;

namespace inflight::bindings {
void bind_batch_manager(nb::module_& m);
}

NB_MODULE(_C, m) {
  m.doc() = "inflight native runtime: batch manager (requests, KV cache accounting, schedulers)";
  // Objects still alive at interpreter exit (module globals, torch's own) are not leaks worth a
  // report on every exit.
  nb::set_leak_warnings(false);
  inflight::bindings::bind_batch_manager(m);
  inflight::bindings::bind_registered_ops(m);  // CPU kernels (csrc/bindings/ops_*.cpp)
}
