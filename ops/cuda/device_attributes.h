// Device attributes, asked once per device: the launchers run at every op call, and asking the
// driver each time would cost more than some of the kernels.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <mutex>

#include "turboquant/split_plan.h"

namespace turboquant::cuda::detail {

constexpr int kMaxDevices = 64;

// Whether this build holds the sm_90a kernels (CMake defines TQ_SM90A where it compiles them).
#ifdef TQ_SM90A
constexpr bool kSm90aCode = true;
#else
constexpr bool kSm90aCode = false;
#endif

// The current device's value of kAttr; 0 if it cannot be asked.
template <cudaDeviceAttr kAttr>
int device_attribute() {
  static std::atomic<int> known[kMaxDevices];
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 0;
  if (dev < kMaxDevices && known[dev].load() > 0) return known[dev].load();
  int n = 0;
  if (cudaDeviceGetAttribute(&n, kAttr, dev) != cudaSuccess) return 0;
  if (dev < kMaxDevices) known[dev].store(n);
  return n;
}

// What plan_split needs of the current device; sms > 0 overrides its multiprocessor count (the
// callers' num_sms, which sized the workspace).
inline DeviceProps current_device_props(int sms = 0) {
  DeviceProps d;
  d.sms = sms > 0 ? sms : device_attribute<cudaDevAttrMultiProcessorCount>();
  d.smem_optin = device_attribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>();
  d.cc_major = device_attribute<cudaDevAttrComputeCapabilityMajor>();
  d.cc_minor = device_attribute<cudaDevAttrComputeCapabilityMinor>();
  d.sm90a = kSm90aCode && d.cc_major == 9 && d.cc_minor == 0;
  return d;
}

// A kernel's opt-in to its dynamic shared memory (cudaFuncAttributeMaxDynamicSharedMemorySize, a
// per-device attribute of the function; static and dynamic together beyond 48 KiB need it), raised
// on each device to the largest size asked there so far. One object per kernel: a static of the
// launcher that is instantiated per kernel.
class SharedMemoryOptIn {
 public:
  cudaError_t raise(const void* kernel, int bytes) {
    if (bytes <= 0) return cudaSuccess;
    int dev = 0;
    cudaError_t e = cudaGetDevice(&dev);
    if (e != cudaSuccess) return e;
    if (dev < kMaxDevices && opted_[dev].load() >= bytes) return cudaSuccess;
    // one setter at a time: a smaller size set after a larger one would undo it
    std::lock_guard<std::mutex> lock(mu_);
    if (dev < kMaxDevices && opted_[dev].load() >= bytes) return cudaSuccess;
    e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    if (e != cudaSuccess) return e;
    if (dev < kMaxDevices) opted_[dev].store(bytes);
    return cudaSuccess;
  }

 private:
  std::mutex mu_;
  std::atomic<int> opted_[kMaxDevices]{};
};

}  // namespace turboquant::cuda::detail
