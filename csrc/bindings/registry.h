// Self-registration of op bindings: each csrc/bindings/ops_*.cpp (cuda_ops_*.cpp for _C_cuda) defines
//   INFLIGHT_REGISTER_OPS(name) { m.def(...); }
// and the module calls every registered function at import. The files are globbed by CMake, so adding
// an op touches no shared file.
#pragma once

#include <nanobind/nanobind.h>

#include <utility>
#include <vector>

namespace inflight::bindings {

using BindFn = void (*)(nanobind::module_&);

inline std::vector<std::pair<char const*, BindFn>>& ops_registry() {
  static std::vector<std::pair<char const*, BindFn>> registry;
  return registry;
}

struct OpsRegistrar {
  OpsRegistrar(char const* name, BindFn fn) { ops_registry().emplace_back(name, fn); }
};

inline void bind_registered_ops(nanobind::module_& m) {
  for (auto const& [name, fn] : ops_registry()) fn(m);
}

}  // namespace inflight::bindings

#define INFLIGHT_REGISTER_OPS(name)                                                                  \
  static void inflight_bind_##name(nanobind::module_& m);                                            \
  static ::inflight::bindings::OpsRegistrar inflight_registrar_##name(#name, &inflight_bind_##name); \
  static void inflight_bind_##name(nanobind::module_& m)
