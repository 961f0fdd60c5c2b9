// ShmComm: the shared-memory collectives of the tensor-parallel ranks of one machine
// (csrc/kernels/cpu/shm_comm.h), on CPU tensors. Every call releases the GIL while it waits.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <cstdint>
#include <optional>
#include <string>

#include "registry.h"
#include "shm_comm.h"
#include "tensor_checks.h"

namespace nb = nanobind;
namespace kc = inflight::kernels::cpu;
using namespace nb::literals;
using namespace inflight::bindings;

namespace {

std::int64_t nbytes(Tensor const& t) {
  ScalarType type;
  if (!scalar_type_of(t, &type)) throw_type_error("unsupported dtype " + dtype_str(t));
  return std::int64_t(t.size()) * std::int64_t(inflight::kernels::scalar_type_size(type));
}

void all_reduce(kc::ShmComm& comm, Tensor t, double timeout_s) {
  ScalarType const type = float_type(t, "tensor");
  require_cpu_contiguous({{&t, "tensor"}});
  nb::gil_scoped_release release;
  comm.all_reduce(t.data(), std::int64_t(t.size()), type, timeout_s);
}

void gather(kc::ShmComm& comm, Tensor t, std::optional<Tensor> out, int root, double timeout_s) {
  require_cpu_contiguous({{&t, "tensor"}});
  std::int64_t const bytes = nbytes(t);
  if (root < 0 || root >= comm.world()) throw_value_error("root must be a rank, got " + std::to_string(root));
  void* dst = nullptr;
  if (comm.rank() == root) {
    if (!out) throw_value_error("the root of a gather needs out (world_size x the tensor's bytes)");
    require_cpu_contiguous({{&*out, "out"}});
    if (nbytes(*out) != bytes * comm.world()) {
      throw_value_error("out must hold world_size x " + std::to_string(bytes) + " bytes, got " +
                        std::to_string(nbytes(*out)));
    }
    dst = out->data();
  }
  nb::gil_scoped_release release;
  comm.gather(t.data(), bytes, dst, root, timeout_s);
}

void broadcast(kc::ShmComm& comm, Tensor t, int root, double timeout_s) {
  require_cpu_contiguous({{&t, "tensor"}});
  if (root < 0 || root >= comm.world()) throw_value_error("root must be a rank, got " + std::to_string(root));
  std::int64_t const bytes = nbytes(t);
  nb::gil_scoped_release release;
  comm.broadcast(t.data(), bytes, root, timeout_s);
}

}  // namespace

INFLIGHT_REGISTER_OPS(shm_comm) {
  nb::class_<kc::ShmComm>(m, "ShmComm",
                          "Collectives between the ranks of one machine over a POSIX shared-memory segment "
                          "(rank 0 creates it, the others attach). Sums are fp32 in rank order, identical on "
                          "every rank; a rank that is gone or a timeout raises RuntimeError naming the rank.")
      .def(nb::init<std::string const&, int, int, std::int64_t, bool>(), "name"_a, "rank"_a, "world_size"_a,
           "slot_bytes"_a, "create"_a)
      .def("unlink", &kc::ShmComm::unlink, "Removes the segment's name once every rank has attached.")
      .def("all_reduce", &all_reduce, "tensor"_a.noconvert(), "timeout_s"_a,
           "Sums a contiguous CPU float tensor over the ranks, in place.")
      .def("gather", &gather, "tensor"_a.noconvert(), "out"_a.none(), "root"_a, "timeout_s"_a,
           "Every rank's tensor into out (world_size x its bytes, rank order) on root.")
      .def("broadcast", &broadcast, "tensor"_a.noconvert(), "root"_a, "timeout_s"_a,
           "Root's tensor into every rank's, in place.")
      .def("abort", &kc::ShmComm::abort,
           "Marks the segment aborted by this rank: every collective of every rank raises from now on "
           "(a rank that failed calls it so that its peers stop waiting at once).")
      .def_prop_ro("aborted_by", &kc::ShmComm::aborted_by, "the rank that aborted the segment, or -1")
      .def_prop_ro("rank", &kc::ShmComm::rank)
      .def_prop_ro("world_size", &kc::ShmComm::world)
      .def_prop_ro("slot_bytes", &kc::ShmComm::slot_bytes)
      .def_prop_ro("rounds", &kc::ShmComm::rounds)
      .def_prop_ro("seconds", &kc::ShmComm::seconds, "seconds in the collectives so far, on this rank")
      .def_prop_ro("calls", &kc::ShmComm::calls);
}
