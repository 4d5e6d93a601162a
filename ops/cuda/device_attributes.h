// Device attributes, asked once per device: the launchers run at every op call, and asking the
// driver each time would cost more than some of the kernels.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>

namespace turboquant::cuda::detail {

constexpr int kMaxDevices = 64;

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

}  // namespace turboquant::cuda::detail
