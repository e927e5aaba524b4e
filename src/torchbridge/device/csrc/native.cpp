// The native half of the device backend: the pieces Python cannot supply on torch 2.13.
//
// Device memory does not live here. Each storage gets a unique fake address from the allocator;
// Python keeps a table from that address to an immutable XLA buffer, and mutation swaps the entry.
// The addresses are never dereferenced (no CPU kernel may see them) and never reused, so a stale
// table entry can never be mistaken for a live storage. Frees and storage resizes are queued here as
// events and drained by Python in order, which keeps the allocator free of the GIL (it is called from
// autograd worker threads too).

#include <torch/extension.h>

#include <ATen/EmptyTensor.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/native/Resize.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/unfold_native.h>
#include <ATen/ops/view_native.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/util/strides.h>

#include <atomic>
#include <mutex>
#include <tuple>
#include <unordered_set>
#include <vector>

namespace {

constexpr c10::DeviceType kDevice = c10::DeviceType::PrivateUse1;

// ---- device index ---------------------------------------------------------------------------
std::atomic<int> g_device_count{1};
thread_local c10::DeviceIndex t_current_device = 0;

struct GuardImpl final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kDevice; }
  c10::Device exchangeDevice(c10::Device d) const override {
    auto old = getDevice();
    if (d.index() >= 0) t_current_device = d.index();
    return old;
  }
  c10::Device getDevice() const override { return c10::Device(kDevice, t_current_device); }
  void setDevice(c10::Device d) const override {
    TORCH_CHECK(d.index() < g_device_count.load(), "device index ", static_cast<int>(d.index()),
                " out of range: ", g_device_count.load(), " devices");
    if (d.index() >= 0) t_current_device = d.index();
  }
  void uncheckedSetDevice(c10::Device d) const noexcept override {
    if (d.index() >= 0) t_current_device = d.index();
  }
  c10::Stream getStream(c10::Device d) const override {
    return c10::Stream(c10::Stream::DEFAULT, d);
  }
  c10::Stream exchangeStream(c10::Stream s) const override {
    return c10::Stream(c10::Stream::DEFAULT, s.device());
  }
  c10::DeviceIndex deviceCount() const noexcept override {
    return static_cast<c10::DeviceIndex>(g_device_count.load());
  }
};
C10_REGISTER_GUARD_IMPL(PrivateUse1, GuardImpl);

// ---- allocator -------------------------------------------------------------------------------
// Event kinds drained by Python: 0 = free(ptr), 1 = resize(old_ptr -> new_ptr, new_nbytes).
std::mutex g_events_mutex;
std::vector<std::tuple<int, uint64_t, uint64_t, uint64_t>> g_events;
std::atomic<uint64_t> g_next_address{uint64_t(1) << 44};  // far from any real mapping
constexpr int kMaxDevices = 64;
std::atomic<int64_t> g_live_bytes[kMaxDevices];
std::atomic<int64_t> g_peak_bytes[kMaxDevices];

void push_event(int kind, uint64_t a, uint64_t b, uint64_t c) {
  std::lock_guard<std::mutex> lock(g_events_mutex);
  g_events.emplace_back(kind, a, b, c);
}

std::mutex g_sizes_mutex;
// live address -> (nbytes, device), for memory accounting
std::unordered_map<uint64_t, std::pair<uint64_t, int>> g_sizes;

void fake_free(void* ptr) {
  auto addr = reinterpret_cast<uint64_t>(ptr);
  {
    std::lock_guard<std::mutex> lock(g_sizes_mutex);
    auto it = g_sizes.find(addr);
    if (it != g_sizes.end()) {
      g_live_bytes[it->second.second] -= static_cast<int64_t>(it->second.first);
      g_sizes.erase(it);
    }
  }
  push_event(0, addr, 0, 0);
}

struct FakeAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) override {
    // Unique, never reused, 64-byte aligned; a zero-byte storage still gets its own address so
    // that every storage has a distinct key in the buffer table.
    uint64_t span = ((nbytes + 63) / 64) * 64 + 64;
    uint64_t addr = g_next_address.fetch_add(span);
    int dev = t_current_device;
    {
      std::lock_guard<std::mutex> lock(g_sizes_mutex);
      g_sizes[addr] = {nbytes, dev};
    }
    int64_t live = (g_live_bytes[dev] += static_cast<int64_t>(nbytes));
    int64_t peak = g_peak_bytes[dev].load();
    while (live > peak && !g_peak_bytes[dev].compare_exchange_weak(peak, live)) {
    }
    void* p = reinterpret_cast<void*>(addr);
    return {p, p, &fake_free, c10::Device(kDevice, t_current_device)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &fake_free; }
  void copy_data(void*, const void*, std::size_t) const override {
    TORCH_CHECK(false, "torchbridge: device memory is not host-addressable; copy through the buffer table");
  }
};

FakeAllocator g_allocator;

// ---- hooks -------------------------------------------------------------------------------------
void resize_storage_bytes(const c10::Storage& storage, size_t newsize) {
  auto* impl = storage.unsafeGetStorageImpl();
  TORCH_CHECK(impl->resizable(), "torchbridge: trying to resize storage that is not resizable");
  uint64_t old_addr = reinterpret_cast<uint64_t>(impl->data_ptr().get());
  c10::DeviceGuard guard(impl->device());
  c10::DataPtr fresh = g_allocator.allocate(newsize);
  uint64_t new_addr = reinterpret_cast<uint64_t>(fresh.get());
  // Queue the copy before the old pointer's free so Python moves the contents first.
  push_event(1, old_addr, new_addr, newsize);
  impl->set_data_ptr_noswap(std::move(fresh));
  impl->set_nbytes(newsize);
}

// ---- pinned host memory ------------------------------------------------------------------------
// `x.pin_memory()`, `.to("cpu", non_blocking=True)` and DataLoader(pin_memory=True) ask the backend for
// a pinned allocator. PJRT copies from any host buffer, so plain CPU memory serves; the live
// pointers are remembered so that `is_pinned()` answers truthfully.
std::mutex g_pinned_mutex;
std::unordered_set<void*> g_pinned;

void pinned_free(void* p) {
  {
    std::lock_guard<std::mutex> lock(g_pinned_mutex);
    g_pinned.erase(p);
  }
  c10::free_cpu(p);
}

struct PinnedAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) override {
    void* p = nbytes ? c10::alloc_cpu(nbytes) : nullptr;
    if (p) {
      std::lock_guard<std::mutex> lock(g_pinned_mutex);
      g_pinned.insert(p);
    }
    return {p, p, &pinned_free, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &pinned_free; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }
};

PinnedAllocator g_pinned_allocator;

struct Hooks final : at::PrivateUse1HooksInterface {
  at::Allocator* getPinnedMemoryAllocator() const override { return &g_pinned_allocator; }
  bool isPinnedPtr(const void* data) const override {
    std::lock_guard<std::mutex> lock(g_pinned_mutex);
    return g_pinned.count(const_cast<void*>(data)) > 0;
  }
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  at::Device getDeviceFromPtr(void*) const override { return c10::Device(kDevice, t_current_device); }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize) const override {
    resize_storage_bytes(storage, newsize);
  }
};

// ---- kernels -----------------------------------------------------------------------------------
c10::DispatchKeySet device_keys() { return c10::DispatchKeySet(c10::DispatchKey::PrivateUse1); }

at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<at::ScalarType> dtype,
                               std::optional<at::Layout>, std::optional<at::Device> device,
                               std::optional<bool>, std::optional<at::MemoryFormat> memory_format) {
  c10::DeviceGuard guard(device.value_or(c10::Device(kDevice, t_current_device)));
  return at::detail::empty_generic(size, &g_allocator, device_keys(),
                                   dtype.value_or(c10::get_default_dtype_as_scalartype()), memory_format);
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride, std::optional<at::ScalarType> dtype,
                         std::optional<at::Layout>, std::optional<at::Device> device, std::optional<bool>) {
  c10::DeviceGuard guard(device.value_or(c10::Device(kDevice, t_current_device)));
  return at::detail::empty_strided_generic(size, stride, &g_allocator, device_keys(),
                                           dtype.value_or(c10::get_default_dtype_as_scalartype()));
}

at::Tensor as_strided(const at::Tensor& self, c10::IntArrayRef size, c10::IntArrayRef stride,
                      std::optional<int64_t> storage_offset) {
  return at::native::as_strided_tensorimpl(self, size, stride, storage_offset);
}

at::Tensor& set_storage_offset(at::Tensor& self, c10::Storage source, int64_t offset, c10::IntArrayRef size,
                               c10::IntArrayRef stride) {
  TORCH_CHECK(source.device() == self.device() || source.device().type() == kDevice,
              "torchbridge: set_ expects a storage of the same device");
  self.unsafeGetTensorImpl()->set_storage_keep_dtype(std::move(source));
  // No strides means contiguous (set_(storage) passes none; storage copies rely on it).
  std::vector<int64_t> strides(stride.begin(), stride.end());
  if (strides.empty() && !size.empty()) {
    auto contiguous = c10::contiguous_strides(size);
    strides.assign(contiguous.begin(), contiguous.end());
  }
  at::native::setStrided(self, size, c10::IntArrayRef(strides), offset);
  return self;
}

at::Tensor& set_storage(at::Tensor& self, c10::Storage source) {
  int64_t numel = static_cast<int64_t>(source.nbytes() / self.dtype().itemsize());
  return set_storage_offset(self, std::move(source), 0, {numel}, {});
}

at::Tensor& set_tensor(at::Tensor& self, const at::Tensor& source) {
  if (self.unsafeGetTensorImpl() != source.unsafeGetTensorImpl()) {
    set_storage_offset(self, source.storage(), source.storage_offset(), source.sizes(), source.strides());
  }
  return self;
}

at::Tensor& set_empty(at::Tensor& self) {
  c10::Storage fresh(c10::Storage::use_byte_size_t(), 0, &g_allocator, /*resizable=*/true);
  return set_storage_offset(self, std::move(fresh), 0, {0}, {});
}

const at::Tensor& resize_(const at::Tensor& self, c10::IntArrayRef size,
                          std::optional<at::MemoryFormat> memory_format) {
  auto* impl = self.unsafeGetTensorImpl();
  impl->set_sizes_contiguous(size);
  if (memory_format.has_value() && *memory_format != at::MemoryFormat::Preserve) {
    impl->empty_tensor_restride(*memory_format);
  }
  size_t needed = at::detail::computeStorageNbytes(self.sizes(), self.strides(), self.dtype().itemsize(),
                                                   self.storage_offset());
  if (needed > self.storage().nbytes()) {
    resize_storage_bytes(self.storage(), needed);
  }
  return self;
}

// ---- Python surface ------------------------------------------------------------------------------
std::vector<std::tuple<int, uint64_t, uint64_t, uint64_t>> drain_events() {
  std::lock_guard<std::mutex> lock(g_events_mutex);
  std::vector<std::tuple<int, uint64_t, uint64_t, uint64_t>> out;
  out.swap(g_events);
  return out;
}

// One call per op instead of ~8 Python attribute reads per tensor (the eager hot path).
// Device tensor:  (true, storage address, storage nbytes, sizes, strides, offset, dtype code, device index)
// Other tensor:   (false, dim, dtype code, device type code, device index)
pybind11::list describe(const std::vector<at::Tensor>& tensors) {
  pybind11::list out;
  for (const auto& t : tensors) {
    auto dev = t.device();
    if (dev.type() == kDevice) {
      const auto& storage = t.storage();
      auto sizes = t.sizes();
      auto strides = t.strides();
      pybind11::tuple sz(sizes.size()), st(strides.size());
      for (size_t i = 0; i < sizes.size(); ++i) {
        sz[i] = pybind11::int_(sizes[i]);
        st[i] = pybind11::int_(strides[i]);
      }
      out.append(pybind11::make_tuple(true, reinterpret_cast<uint64_t>(storage.data()), storage.nbytes(), sz, st,
                                      t.storage_offset(), static_cast<int>(t.scalar_type()),
                                      static_cast<int>(dev.index() < 0 ? 0 : dev.index())));
    } else {
      out.append(pybind11::make_tuple(false, t.dim(), static_cast<int>(t.scalar_type()), static_cast<int>(dev.type()),
                                      static_cast<int>(dev.index())));
    }
  }
  return out;
}

// The eager fast path's cache key, built in one pass over a call's Python arguments.
//
// Returns None when the call needs the general path (CPU tensors, lists holding tensors, no device
// tensor at all), else (key, storage_ptrs, scalars). The key holds the op id, a byte string packing
// every device tensor's storage slot (aliasing), storage size, shape, strides, offset, dtype and
// device, plus the *type* of each dynamic scalar, and then every other argument as a constant.
// `dynamic` names, per position (then per kwarg name), the arguments whose numbers are traced values.
namespace sig {

void put(std::string& blob, int64_t v) { blob.append(reinterpret_cast<const char*>(&v), sizeof(v)); }

bool add(PyObject* obj, bool dynamic, std::string& blob, pybind11::list& consts, std::vector<uint64_t>& ptrs,
         pybind11::list& scalars, bool& any_device) {
  if (THPVariable_Check(obj)) {
    const at::Tensor& t = THPVariable_Unpack(obj);
    if (!t.defined() || t.device().type() != kDevice) return false;
    any_device = true;
    const auto& storage = t.storage();
    auto p = reinterpret_cast<uint64_t>(storage.data());
    int64_t slot = -1;
    for (size_t i = 0; i < ptrs.size(); ++i)
      if (ptrs[i] == p) slot = static_cast<int64_t>(i);
    if (slot < 0) {
      slot = static_cast<int64_t>(ptrs.size());
      ptrs.push_back(p);
    }
    put(blob, 'T');
    put(blob, slot);
    put(blob, static_cast<int64_t>(storage.nbytes()));
    put(blob, t.dim());
    for (auto v : t.sizes()) put(blob, v);
    for (auto v : t.strides()) put(blob, v);
    put(blob, t.storage_offset());
    put(blob, static_cast<int64_t>(t.scalar_type()));
    put(blob, t.device().index());
    return true;
  }
  if (dynamic && (PyFloat_CheckExact(obj) || PyLong_CheckExact(obj) || PyBool_Check(obj))) {
    put(blob, PyBool_Check(obj) ? 'b' : PyFloat_CheckExact(obj) ? 'f' : 'i');
    scalars.append(pybind11::handle(obj));
    return true;
  }
  if (PyList_Check(obj) || PyTuple_Check(obj)) {
    pybind11::sequence seq = pybind11::reinterpret_borrow<pybind11::sequence>(obj);
    for (auto item : seq)
      if (THPVariable_Check(item.ptr()) || PyList_Check(item.ptr()) || PyTuple_Check(item.ptr())) return false;
    put(blob, 'C');
    for (auto item : seq) put(blob, reinterpret_cast<int64_t>(Py_TYPE(item.ptr())));
    consts.append(pybind11::tuple(seq));
    return true;
  }
  put(blob, 'C');
  put(blob, reinterpret_cast<int64_t>(Py_TYPE(obj)));  // 1, 1.0 and True are equal keys but not equal programs
  consts.append(pybind11::handle(obj));
  return true;
}

pybind11::object signature(int64_t op_id, pybind11::tuple args, pybind11::dict kwargs, pybind11::tuple dynamic,
                           pybind11::frozenset dynamic_kw) {
  std::string blob;
  pybind11::list consts, scalars;
  std::vector<uint64_t> ptrs;
  bool any_device = false;
  for (size_t i = 0; i < args.size(); ++i) {
    bool dyn = i < dynamic.size() && dynamic[i].cast<bool>();
    if (!add(args[i].ptr(), dyn, blob, consts, ptrs, scalars, any_device)) return pybind11::none();
  }
  for (auto item : kwargs) {
    put(blob, 'K');
    consts.append(item.first);
    if (!add(item.second.ptr(), dynamic_kw.contains(item.first), blob, consts, ptrs, scalars, any_device))
      return pybind11::none();
  }
  if (!any_device) return pybind11::none();
  pybind11::tuple key(2 + consts.size());
  key[0] = pybind11::int_(op_id);
  key[1] = pybind11::bytes(blob);
  for (size_t i = 0; i < consts.size(); ++i) key[2 + i] = consts[i];
  pybind11::tuple p(ptrs.size());
  for (size_t i = 0; i < ptrs.size(); ++i) p[i] = pybind11::int_(ptrs[i]);
  return pybind11::make_tuple(key, p, pybind11::tuple(scalars));
}

}  // namespace sig

bool g_registered = false;

void install(int device_count) {
  TORCH_CHECK(device_count > 0 && device_count <= kMaxDevices, "torchbridge: unsupported device count ", device_count);
  g_device_count = device_count;
  if (g_registered) return;
  g_registered = true;
  c10::SetAllocator(kDevice, &g_allocator);
  at::RegisterPrivateUse1HooksInterface(new Hooks());
}

}  // namespace

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", empty_memory_format);
  m.impl("empty_strided", empty_strided);
  m.impl("as_strided", as_strided);
  m.impl("view", at::native::view);
  m.impl("_reshape_alias", at::native::_reshape_alias);
  m.impl("unfold", at::native::unfold);
  m.impl("set_.source_Storage", set_storage);
  m.impl("set_.source_Storage_storage_offset", set_storage_offset);
  m.impl("set_.source_Tensor", set_tensor);
  m.impl("set_", set_empty);
  m.impl("resize_", resize_);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("install", &install, "set the allocator and hooks; safe to call again to change the device count");
  m.def("drain_events", &drain_events, "queued (kind, a, b, nbytes) storage events, oldest first");
  m.def("live_bytes", [](int d) { return g_live_bytes[d].load(); });
  m.def("peak_bytes", [](int d) { return g_peak_bytes[d].load(); });
  m.def("reset_peak_bytes", [](int d) { g_peak_bytes[d] = g_live_bytes[d].load(); });
  m.def("describe", &describe, "per-tensor layout tuples for the eager cache key");
  m.def("signature", &sig::signature, "the eager fast path's cache key for one call, or None");
  m.def(
      "new_tensor",
      [](std::vector<int64_t> size, std::vector<int64_t> stride, int scalar_type, int device) {
        // The device's empty_strided kernel, without torch.empty_strided's Python argument parsing.
        at::Tensor t = empty_strided(size, stride, static_cast<at::ScalarType>(scalar_type), std::nullopt,
                                     c10::Device(kDevice, static_cast<c10::DeviceIndex>(device)), std::nullopt);
        return pybind11::make_tuple(t, reinterpret_cast<uint64_t>(t.storage().data()));
      },
      "a fresh device tensor and its storage key");
  m.def("current_device", []() { return static_cast<int>(t_current_device); });
  m.def("set_device", [](int d) {
    TORCH_CHECK(d >= 0 && d < g_device_count.load(), "torchbridge: invalid device index ", d, " (",
                g_device_count.load(), " devices)");
    t_current_device = static_cast<c10::DeviceIndex>(d);
  });
}
