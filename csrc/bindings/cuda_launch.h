// What every CUDA op binding (cuda_ops_*.cpp) does around a launch: make the tensors' device current,
// pass the caller's stream, and turn a failed status into a Python exception. The tensor checks before
// it are tensor_checks.h's and op_checks.h's, shared with the CPU bindings. Launches run with the GIL
// released.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <stdexcept>
#include <string>

namespace inflight::bindings {

// RuntimeError "{what} failed: cudaErrorX (description)".
inline void check_cuda(cudaError_t status, char const* what) {
  if (status != cudaSuccess) {
    cudaGetLastError();  // clear a non-sticky error so the next call reports its own
    throw std::runtime_error(std::string(what) + " failed: " + cudaGetErrorName(status) + " (" +
                             cudaGetErrorString(status) + ")");
  }
}

// Makes `device` current for the launch and restores the previous device afterwards. The package's
// static CUDA runtime keeps its own notion of the current device, independent of torch's.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    check_cuda(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device) check_cuda(cudaSetDevice(device), "cudaSetDevice");
  }
  ~DeviceGuard() {
    int current = previous_;
    if (cudaGetDevice(&current) == cudaSuccess && current != previous_) cudaSetDevice(previous_);
  }
  DeviceGuard(DeviceGuard const&) = delete;
  DeviceGuard& operator=(DeviceGuard const&) = delete;

 private:
  int previous_ = 0;
};

// The stream argument of every CUDA op: an integer cudaStream_t (torch.cuda.current_stream().cuda_stream).
inline cudaStream_t as_stream(std::uintptr_t stream) { return reinterpret_cast<cudaStream_t>(stream); }

}  // namespace inflight::bindings
