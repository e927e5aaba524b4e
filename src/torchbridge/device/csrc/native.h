// What the files of the native extension share: native.cpp (allocator, hooks, guard, view kernels)
// and fast_path.cpp (the eager cache key and the fast path).
#pragma once

#include <torch/extension.h>

namespace torchbridge {

constexpr c10::DeviceType kDevice = c10::DeviceType::PrivateUse1;

// A fresh device tensor: the device's empty_strided kernel, without torch.empty_strided's argument parsing.
at::Tensor new_device_tensor(c10::IntArrayRef size, c10::IntArrayRef stride, at::ScalarType dtype,
                             c10::DeviceIndex index);

// Whether the allocator queued frees or resizes that Python has not drained yet.
bool has_storage_events();

// Adds the eager cache key and the fast path (fast_path.cpp) to the extension's Python module.
void bind_fast_path(pybind11::module_& m);

}  // namespace torchbridge
