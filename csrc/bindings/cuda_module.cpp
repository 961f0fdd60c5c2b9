// inflight._C_cuda: CUDA ops. Linked against the static CUDA runtime so that importing it needs no
// libcudart.so; on a machine without a driver every call raises instead of the import failing.
#include <nanobind/nanobind.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include <cuda_runtime_api.h>

#include "fill.h"
#include "registry.h"

namespace nb = nanobind;
namespace ck = inflight::kernels::cuda;

namespace {

void check(cudaError_t status, char const* what) {
  if (status != cudaSuccess) {
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorName(status) + " (" + cudaGetErrorString(status) +
                             ")");
  }
}

int version_of(cudaError_t (*get)(int*), char const* what) {
  int version = 0;
  check(get(&version), what);
  return version;
}

int device_count() {
  int count = 0;
  cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error so later calls report their own
    return 0;
  }
  return count;
}

}  // namespace

NB_MODULE(_C_cuda, m) {
  m.doc() = "CUDA ops of inflight (static CUDA runtime; imported lazily)";
  m.def("device_count", &device_count, "Number of visible CUDA devices; 0 without a driver or GPU.");
  m.def(
      "runtime_version", [] { return version_of(cudaRuntimeGetVersion, "cudaRuntimeGetVersion"); },
      "CUDA runtime version compiled in (e.g. 13000).");
  m.def(
      "driver_version", [] { return version_of(cudaDriverGetVersion, "cudaDriverGetVersion"); },
      "CUDA driver version (0 when no driver is installed).");
  m.def(
      "fill",
      [](std::uintptr_t out_ptr, std::int64_t num_elements, double value, int dtype, std::uintptr_t stream) {
        if (num_elements < 0)
          throw std::invalid_argument("num_elements must be >= 0, got " + std::to_string(num_elements));
        // The Python-facing codes predate ScalarType: 0 is int32, 1 float32.
        if (dtype != 0 && dtype != 1) {
          throw std::invalid_argument("dtype must be 0 (int32) or 1 (float32), got " + std::to_string(dtype));
        }
        ck::FillParams params{
            reinterpret_cast<void*>(out_ptr), num_elements, value,
            dtype == 0 ? inflight::kernels::ScalarType::kInt32 : inflight::kernels::ScalarType::kFloat32};
        check(ck::launch_fill(params, reinterpret_cast<cudaStream_t>(stream)), "fill");
      },
      nb::arg("out_ptr"), nb::arg("num_elements"), nb::arg("value"), nb::arg("dtype"), nb::arg("stream") = 0,
      "Fills num_elements elements at device pointer out_ptr with value (dtype 0: int32, 1: float32) on stream.");
  inflight::bindings::bind_registered_ops(m);  // CUDA ops (csrc/bindings/cuda_ops_*.cpp)
}
