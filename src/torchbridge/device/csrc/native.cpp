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
#include <ATen/core/Generator.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/SDPBackend.h>
#include <ATen/native/Resize.h>
#include <ATen/native/transformers/attention.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/unfold_native.h>
#include <ATen/ops/view_native.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/util/strides.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <tuple>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace {

constexpr c10::DeviceType kDevice = c10::DeviceType::PrivateUse1;

// ---- device index ---------------------------------------------------------------------------
std::atomic<int> g_device_count{1};
thread_local c10::DeviceIndex t_current_device = 0;

// ---- streams and events ------------------------------------------------------------------------
// A device has one queue: XLA orders its work by data dependence, so every stream is that queue under
// another id and waiting on an event has nothing to do (TorchTPU does the same "to enable FSDP").
// What must be real is synchronisation (a stream's, an event's, the device's): it calls the Python
// side's synchronize(device index), which waits for everything dispatched to that device. An event
// with timing (torch.Event(enable_timing=True)) synchronises when recorded and keeps the time.
std::atomic<c10::StreamId> g_next_stream{1};
thread_local std::unordered_map<int, c10::StreamId> t_current_stream;  // device index -> stream id
PyObject* g_synchronize = nullptr;  // Python: synchronize(device index)

void synchronize_device(c10::DeviceIndex index) {
  if (g_synchronize == nullptr) return;
  pybind11::gil_scoped_acquire gil;
  pybind11::handle{g_synchronize}(static_cast<int>(index));
}

struct DeviceEvent {
  c10::DeviceIndex device = 0;
  bool timed = false;
  std::chrono::steady_clock::time_point time{};
};

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
  static c10::Device resolved(c10::Device d) {  // no index: the current device, as CUDA's guard does
    return d.index() < 0 ? c10::Device(kDevice, t_current_device) : d;
  }
  c10::Stream getStream(c10::Device d) const override {
    d = resolved(d);
    auto it = t_current_stream.find(d.index());
    return c10::Stream(c10::Stream::UNSAFE, d, it == t_current_stream.end() ? 0 : it->second);
  }
  c10::Stream getDefaultStream(c10::Device d) const override {
    return c10::Stream(c10::Stream::UNSAFE, resolved(d), 0);
  }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool) const override { return getNewStream(d, 0); }
  c10::Stream getNewStream(c10::Device d, int) const override {
    return c10::Stream(c10::Stream::UNSAFE, resolved(d), g_next_stream.fetch_add(1));
  }
  c10::Stream exchangeStream(c10::Stream s) const override {
    auto old = getStream(s.device());
    t_current_stream[s.device_index()] = s.id();
    return old;
  }
  void record(void** event, const c10::Stream& stream, const c10::DeviceIndex device_index,
              const c10::EventFlag flag) const override {
    if (*event == nullptr) *event = new DeviceEvent();
    auto* e = static_cast<DeviceEvent*>(*event);
    e->device = device_index >= 0 ? device_index : stream.device_index();
    if (flag == c10::EventFlag::BACKEND_DEFAULT) {  // timing asked for: when the work so far is done
      synchronize_device(e->device);
      e->timed = true;
      e->time = std::chrono::steady_clock::now();
    }
  }
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  bool queryStream(const c10::Stream&) const override { return true; }
  void destroyEvent(void* event, const c10::DeviceIndex) const noexcept override {
    delete static_cast<DeviceEvent*>(event);
  }
  void synchronizeEvent(void* event) const override {
    if (event != nullptr) synchronize_device(static_cast<DeviceEvent*>(event)->device);
  }
  void synchronizeStream(const c10::Stream& stream) const override { synchronize_device(stream.device_index()); }
  void synchronizeDevice(const c10::DeviceIndex index) const override { synchronize_device(index); }
  void recordDataPtrOnStream(const c10::DataPtr&, const c10::Stream&) const override {}
  double elapsedTime(void* start, void* end, const c10::DeviceIndex) const override {
    auto* a = static_cast<DeviceEvent*>(start);
    auto* b = static_cast<DeviceEvent*>(end);
    TORCH_CHECK(a != nullptr && b != nullptr && a->timed && b->timed,
                "torchbridge: elapsed_time needs two events recorded with enable_timing=True");
    return std::chrono::duration<double, std::milli>(b->time - a->time).count();
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
std::atomic<bool> g_has_events{false};  // lets the fast path skip a Python drain() when nothing is queued
std::atomic<uint64_t> g_next_address{uint64_t(1) << 44};  // far from any real mapping
constexpr int kMaxDevices = 64;
std::atomic<int64_t> g_live_bytes[kMaxDevices];
std::atomic<int64_t> g_peak_bytes[kMaxDevices];
std::atomic<int64_t> g_live_count[kMaxDevices];
std::atomic<int64_t> g_peak_count[kMaxDevices];
std::atomic<int64_t> g_total_allocs[kMaxDevices];
std::atomic<int64_t> g_total_bytes[kMaxDevices];

void push_event(int kind, uint64_t a, uint64_t b, uint64_t c) {
  std::lock_guard<std::mutex> lock(g_events_mutex);
  g_events.emplace_back(kind, a, b, c);
  g_has_events.store(true, std::memory_order_relaxed);
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
      --g_live_count[it->second.second];
      g_sizes.erase(it);
    }
  }
  push_event(0, addr, 0, 0);
}

PyObject* g_memory_info = nullptr;  // Python: memory_info(device index) -> (free, total)
PyObject* g_empty_cache = nullptr;  // Python: empty_cache()

void raise_peak(std::atomic<int64_t>& peak, int64_t value) {
  int64_t seen = peak.load();
  while (value > seen && !peak.compare_exchange_weak(seen, value)) {
  }
}

// A DeviceAllocator (not a plain Allocator) so that torch.accelerator's memory functions reach it.
// The bytes counted are storages' sizes: what PyTorch's memory_allocated means. XLA's own buffers
// (intermediates, the compile cache) are the platform's to report (torch.<device>.memory_stats).
struct FakeAllocator final : c10::DeviceAllocator {
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
    raise_peak(g_peak_bytes[dev], g_live_bytes[dev] += static_cast<int64_t>(nbytes));
    raise_peak(g_peak_count[dev], ++g_live_count[dev]);
    ++g_total_allocs[dev];
    g_total_bytes[dev] += static_cast<int64_t>(nbytes);
    void* p = reinterpret_cast<void*>(addr);
    return {p, p, &fake_free, c10::Device(kDevice, t_current_device)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &fake_free; }
  void copy_data(void*, const void*, std::size_t) const override {
    TORCH_CHECK(false, "torchbridge: device memory is not host-addressable; copy through the buffer table");
  }
  bool initialized() override { return true; }
  void emptyCache(c10::MempoolId_t) override {
    if (g_empty_cache == nullptr) return;
    pybind11::gil_scoped_acquire gil;
    pybind11::handle{g_empty_cache}();
  }
  void recordStream(const c10::DataPtr&, c10::Stream) override {}
  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    c10::CachingDeviceAllocator::DeviceStats stats;
    auto fill = [](c10::CachingDeviceAllocator::StatArray& a, int64_t current, int64_t peak, int64_t total) {
      auto& s = a[static_cast<size_t>(c10::CachingDeviceAllocator::StatType::AGGREGATE)];
      s.current = current;
      s.peak = peak;
      s.allocated = total;
      s.freed = total - current;
    };
    int d = device < 0 ? t_current_device : device;
    int64_t bytes = g_live_bytes[d], peak = g_peak_bytes[d], total = g_total_bytes[d];
    fill(stats.allocation, g_live_count[d], g_peak_count[d], g_total_allocs[d]);
    fill(stats.active, g_live_count[d], g_peak_count[d], g_total_allocs[d]);
    for (auto* a : {&stats.allocated_bytes, &stats.active_bytes, &stats.requested_bytes, &stats.reserved_bytes}) {
      fill(*a, bytes, peak, total);
    }
    return stats;
  }
  void resetAccumulatedStats(c10::DeviceIndex device) override {
    int d = device < 0 ? t_current_device : device;
    g_total_allocs[d] = g_live_count[d].load();
    g_total_bytes[d] = g_live_bytes[d].load();
  }
  void resetPeakStats(c10::DeviceIndex device) override {
    int d = device < 0 ? t_current_device : device;
    g_peak_bytes[d] = g_live_bytes[d].load();
    g_peak_count[d] = g_live_count[d].load();
  }
  std::pair<size_t, size_t> getMemoryInfo(c10::DeviceIndex device) override {
    TORCH_CHECK(g_memory_info != nullptr, "torchbridge: the device backend is not set up");
    pybind11::gil_scoped_acquire gil;
    auto info = pybind11::handle{g_memory_info}(static_cast<int>(device < 0 ? t_current_device : device));
    auto pair = info.cast<std::pair<size_t, size_t>>();
    return pair;
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

// ---- generators --------------------------------------------------------------------------------
// torch.Generator(device="tpu"): a (seed, offset) pair. Python draws from it (seed, offset), then
// advances the offset, and hands the pair to the op's program as its RNG key, exactly as the device's
// default stream does; `manual_seed` restarts the offset, so a reseeded generator repeats itself.
struct DeviceGenerator final : c10::GeneratorImpl {
  explicit DeviceGenerator(c10::DeviceIndex index)
      : c10::GeneratorImpl(c10::Device(kDevice, index), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1)) {}
  void set_current_seed(uint64_t seed) override {
    seed_ = seed;
    offset_ = 0;
  }
  void set_offset(uint64_t offset) override { offset_ = offset; }
  uint64_t get_offset() const override { return offset_; }
  uint64_t current_seed() const override { return seed_; }
  uint64_t seed() override {
    set_current_seed(c10::detail::getNonDeterministicRandom());
    return seed_;
  }
  void set_state(const c10::TensorImpl& state) override {
    TORCH_CHECK(state.numel() == 16 && state.dtype() == caffe2::TypeMeta::Make<uint8_t>(),
                "torchbridge: a generator state is 16 bytes (seed, offset), got ", state.numel());
    const auto* bytes = static_cast<const uint64_t*>(state.data());
    seed_ = bytes[0];
    offset_ = bytes[1];
  }
  c10::intrusive_ptr<c10::TensorImpl> get_state() const override {
    at::Tensor state = at::empty({16}, at::TensorOptions().dtype(at::kByte));
    auto* bytes = static_cast<uint64_t*>(state.data_ptr());
    bytes[0] = seed_;
    bytes[1] = offset_;
    return state.getIntrusivePtr();
  }

 private:
  DeviceGenerator* clone_impl() const override {
    auto* g = new DeviceGenerator(device().index());
    g->seed_ = seed_;
    g->offset_ = offset_;
    return g;
  }
  uint64_t seed_ = c10::default_rng_seed_val;
  uint64_t offset_ = 0;
};

struct Hooks final : at::PrivateUse1HooksInterface {
  at::Generator getNewGenerator(c10::DeviceIndex index) const override {
    return at::make_generator<DeviceGenerator>(index < 0 ? t_current_device : index);
  }
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
  g_has_events.store(false, std::memory_order_relaxed);
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
// Returns None when the call needs the general path (CPU tensors, lists mixing tensors with other
// values, no device tensor at all), else (key, storage_ptrs, scalars). The key holds the op id, a byte string packing
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
    // conj/neg views reach some kernels unresolved (mm, dot, ...): a different program
    put(blob, static_cast<int64_t>(t.is_conj()) | (static_cast<int64_t>(t.is_neg()) << 1));
    return true;
  }
  if (dynamic && (PyFloat_CheckExact(obj) || PyLong_CheckExact(obj) || PyBool_Check(obj))) {
    put(blob, PyBool_Check(obj) ? 'b' : PyFloat_CheckExact(obj) ? 'f' : 'i');
    scalars.append(pybind11::handle(obj));
    return true;
  }
  if (PyList_Check(obj) || PyTuple_Check(obj)) {
    pybind11::sequence seq = pybind11::reinterpret_borrow<pybind11::sequence>(obj);
    Py_ssize_t n = PySequence_Size(obj);
    if (n > 0 && THPVariable_Check(PySequence_Fast_GET_ITEM(obj, 0))) {
      // a tensor list (cat's inputs, a _foreach_ op's operands): every item a device tensor, in the
      // order dispatch._Call.encode flattens them, so storage slots match the general path's
      put(blob, 'L');
      put(blob, n);
      for (auto item : seq)
        if (!THPVariable_Check(item.ptr()) || !add(item.ptr(), false, blob, consts, ptrs, scalars, any_device))
          return false;
      return true;
    }
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

// The key of one call: args[start:] and kwargs (may be null). False when the call needs the general path.
bool build(int64_t op_id, PyObject* args, Py_ssize_t start, PyObject* kwargs, PyObject* dynamic, PyObject* dynamic_kw,
           pybind11::object& key, std::vector<uint64_t>& ptrs, pybind11::list& scalars) {
  std::string blob;
  pybind11::list consts;
  bool any_device = false;
  Py_ssize_t n = PyTuple_GET_SIZE(args), ndyn = PyTuple_GET_SIZE(dynamic);
  for (Py_ssize_t i = start; i < n; ++i) {
    bool dyn = i - start < ndyn && PyTuple_GET_ITEM(dynamic, i - start) == Py_True;
    if (!add(PyTuple_GET_ITEM(args, i), dyn, blob, consts, ptrs, scalars, any_device)) return false;
  }
  if (kwargs != nullptr) {
    PyObject *name, *value;
    Py_ssize_t pos = 0;
    while (PyDict_Next(kwargs, &pos, &name, &value)) {
      put(blob, 'K');
      consts.append(pybind11::handle(name));
      int dyn = PySet_Contains(dynamic_kw, name);
      if (dyn < 0) throw pybind11::error_already_set();
      if (!add(value, dyn == 1, blob, consts, ptrs, scalars, any_device)) return false;
    }
  }
  if (!any_device) return false;
  pybind11::tuple k(2 + consts.size());
  k[0] = pybind11::int_(op_id);
  k[1] = pybind11::bytes(blob);
  for (size_t i = 0; i < consts.size(); ++i) k[2 + i] = consts[i];
  key = std::move(k);
  return true;
}

pybind11::object signature(int64_t op_id, pybind11::tuple args, pybind11::dict kwargs, pybind11::tuple dynamic,
                           pybind11::frozenset dynamic_kw) {
  pybind11::object key;
  pybind11::list scalars;
  std::vector<uint64_t> ptrs;
  if (!build(op_id, args.ptr(), 0, kwargs.ptr(), dynamic.ptr(), dynamic_kw.ptr(), key, ptrs, scalars))
    return pybind11::none();
  pybind11::tuple p(ptrs.size());
  for (size_t i = 0; i < ptrs.size(); ++i) p[i] = pybind11::int_(ptrs[i]);
  return pybind11::make_tuple(key, p, pybind11::tuple(scalars));
}

}  // namespace sig

// ---- the eager fast path's entry point ------------------------------------------------------------
// Every device kernel the Python side registers is `fast_call(op, *args, **kwargs)`. A repeat call
// (same key as a call the general path already ran) is served here: key, buffer lookup, the jitted
// program, the output tensors. Anything else, or anything unusual on the way, goes to the Python
// fallback, which runs the same call through the general path (and may remember it for next time).
namespace fastpath {

// Set once by Python (dispatch.install_fast_path) and kept for the life of the process.
PyObject* g_fast = nullptr;        // dict: key -> dispatch._Fast
PyObject* g_table = nullptr;       // dict: storage address -> buffer (the storage table)
PyObject* g_array_type = nullptr;  // the concrete buffer class; anything else goes slow ...
PyObject* g_pending_type = nullptr;  // ... but fused mode's placeholders (fused.Pending) while it records
PyObject* g_last = nullptr;        // dict: device index -> last results (what synchronize() waits on)
PyObject* g_slow = nullptr;        // ops.fallback(op, *args, **kwargs)
PyObject* g_drain = nullptr;       // the storage table's drain()
PyObject* g_next_rng = nullptr;    // STATE.next_rng(device index, values drawn)
PyObject* g_rebuild = nullptr;     // dispatch._rebuild(out_struct, outputs)
PyObject* g_record = nullptr;      // fused.record_fast(program, bufs, scalars, rng) -> (updated, new, flush)
PyObject* g_flush = nullptr;       // the storage table's flush(): runs what fused mode recorded
PyObject* g_zeros = nullptr;       // storage.zeros(count, dtype, device): a fresh storage's (shared) zero buffer
PyObject* g_dtype = nullptr;       // "dtype"
PyObject* g_call = nullptr;        // "call"
bool g_enabled = false;            // on once setup() ran
bool g_fused = false;              // fused eager mode: a hit records the program instead of running it
uint64_t g_hits = 0;               // calls served here (torchbridge.metrics()["fast_path_hits"])
std::unordered_map<PyObject*, std::pair<PyObject*, PyObject*>> g_ops;  // op -> (dynamic per position, dynamic kwargs)

// dispatch._Fast's fields, in order; setup() checks them.
enum Field { kProgram, kBufferDtypes, kDevIndex, kReturns, kReturnsNone, kZeros, kOutputs, kSingle, kFn,
             kWrites, kRandom, kOutStruct, kZeroes, kNumFields };
const char* kFieldNames[kNumFields] = {"program", "buffer_dtypes", "dev_index", "returns",
                                       "returns_none", "zeros", "outputs", "single", "fn", "writes",
                                       "random", "out_struct", "zeroes"};

void setup(pybind11::object fast, pybind11::object table, pybind11::object array_type, pybind11::object last,
           pybind11::object slow, pybind11::object drain, pybind11::object next_rng, pybind11::object rebuild,
           pybind11::object pending_type, pybind11::object record, pybind11::object flush, pybind11::object zeros,
           pybind11::tuple fields) {
  TORCH_CHECK(fields.size() == kNumFields, "torchbridge: _Fast has ", fields.size(), " fields, the fast path expects ",
              static_cast<int>(kNumFields));
  for (int i = 0; i < kNumFields; ++i)
    TORCH_CHECK(fields[i].cast<std::string>() == kFieldNames[i], "torchbridge: _Fast field ", i, " is ",
                fields[i].cast<std::string>(), ", the fast path expects ", kFieldNames[i]);
  g_fast = fast.release().ptr();
  g_table = table.release().ptr();
  g_array_type = array_type.release().ptr();
  g_last = last.release().ptr();
  g_slow = slow.release().ptr();
  g_drain = drain.release().ptr();
  g_next_rng = next_rng.release().ptr();
  g_rebuild = rebuild.release().ptr();
  g_pending_type = pending_type.release().ptr();
  g_record = record.release().ptr();
  g_flush = flush.release().ptr();
  g_zeros = zeros.release().ptr();
  g_dtype = PyUnicode_InternFromString("dtype");
  g_call = PyUnicode_InternFromString("call");
  g_enabled = true;
}

void register_op(pybind11::object op, pybind11::tuple dynamic, pybind11::frozenset dynamic_kw) {
  if (g_ops.count(op.ptr())) return;
  g_ops.emplace(op.release().ptr(), std::make_pair(dynamic.release().ptr(), dynamic_kw.release().ptr()));
}

using pybind11::object;
using pybind11::reinterpret_borrow;
using pybind11::reinterpret_steal;

object checked(PyObject* o) {
  if (o == nullptr) throw pybind11::error_already_set();
  return reinterpret_steal<object>(o);
}

std::vector<int64_t> ints(PyObject* seq) {
  std::vector<int64_t> out;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  out.reserve(n);
  for (Py_ssize_t i = 0; i < n; ++i) out.push_back(PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seq, i)));
  return out;
}

object finish(PyObject* entry, PyObject* args, PyObject* kwargs, PyObject* dev_index, const object& fresh);

// The result of a hit, or a null object for "take the general path" (no Python error set).
object hit(PyObject* op, PyObject* args, PyObject* kwargs) {
  auto known = g_ops.find(op);
  if (known == g_ops.end()) return object();
  object key;
  pybind11::list scalar_list;
  std::vector<uint64_t> ptrs;
  if (!sig::build(reinterpret_cast<int64_t>(op), args, 1, kwargs, known->second.first, known->second.second, key,
                  ptrs, scalar_list))
    return object();
  PyObject* entry = PyDict_GetItemWithError(g_fast, key.ptr());  // borrowed
  if (entry == nullptr) {
    if (PyErr_Occurred()) throw pybind11::error_already_set();
    return object();
  }
  object hold = reinterpret_borrow<object>(entry);  // the program call may run Python that clears the cache
  PyObject* dtypes = PyTuple_GET_ITEM(entry, kBufferDtypes);
  std::vector<object> keys;
  keys.reserve(ptrs.size());
  pybind11::list bufs(ptrs.size());
  for (size_t i = 0; i < ptrs.size(); ++i) {
    keys.push_back(checked(PyLong_FromUnsignedLongLong(ptrs[i])));
    PyObject* b = PyDict_GetItemWithError(g_table, keys.back().ptr());
    if (b == nullptr) {  // never written (torch.zeros' empty before its fill_, a fresh out= tensor): zeros
      if (PyErr_Occurred()) throw pybind11::error_already_set();
      if (PyTuple_GET_ITEM(entry, kZeroes) == Py_True)  // zero_ of it (e.g. autograd's zero gradients)
        return finish(entry, args, kwargs, PyTuple_GET_ITEM(entry, kDevIndex), object());
      object z = checked(PyObject_Call(g_zeros, PyTuple_GET_ITEM(PyTuple_GET_ITEM(entry, kZeros), i), nullptr));
      if (PyDict_SetItem(g_table, keys.back().ptr(), z.ptr()) < 0) throw pybind11::error_already_set();
      b = z.ptr();  // the table holds it now
    }
    PyTypeObject* type = Py_TYPE(b);
    if (type != reinterpret_cast<PyTypeObject*>(g_array_type) &&
        !(g_fused && type == reinterpret_cast<PyTypeObject*>(g_pending_type)))
      return object();
    object dt = checked(PyObject_GetAttr(b, g_dtype));
    int same = PyObject_RichCompareBool(dt.ptr(), PyList_GET_ITEM(dtypes, i), Py_EQ);
    if (same < 0) throw pybind11::error_already_set();
    if (!same) return object();  // the storage holds another dtype's bits now
    bufs[i] = reinterpret_borrow<object>(b);
  }
  PyObject* dev_index = PyTuple_GET_ITEM(entry, kDevIndex);
  // a random op draws `random` values: the device's (seed, offset), then the offset moves past them
  PyObject* draws = PyTuple_GET_ITEM(entry, kRandom);
  object rng = PyObject_IsTrue(draws) == 1
                   ? checked(PyObject_CallFunctionObjArgs(g_next_rng, dev_index, draws, nullptr))
                   : reinterpret_borrow<object>(Py_None);
  object scalars = checked(PySequence_Tuple(scalar_list.ptr()));
  object empty = checked(PyTuple_New(0));
  PyObject* writes = PyTuple_GET_ITEM(entry, kWrites);
  object result;
  bool flush = false;
  if (g_fused) {  // record it; the table takes the placeholders of its results below
    object tup = checked(PyList_AsTuple(bufs.ptr()));
    object rec = checked(PyObject_CallFunctionObjArgs(g_record, PyTuple_GET_ITEM(entry, kProgram), tup.ptr(),
                                                      scalars.ptr(), rng.ptr(), nullptr));
    flush = PyObject_IsTrue(PyTuple_GET_ITEM(rec.ptr(), 2)) == 1;
    result = checked(PyTuple_GetSlice(rec.ptr(), 0, 2));
  } else if (PyTuple_GET_SIZE(writes) > 0) {
    // _Program.call decides on buffer donation from reference counts: `bufs` must hold the only
    // references besides the table's.
    object call = checked(PyObject_GetAttr(PyTuple_GET_ITEM(entry, kProgram), g_call));
    result = checked(PyObject_CallFunctionObjArgs(call.ptr(), bufs.ptr(), scalars.ptr(), empty.ptr(), empty.ptr(),
                                                  rng.ptr(), dev_index, nullptr));
  } else {
    object tup = checked(PyList_AsTuple(bufs.ptr()));
    result = checked(PyObject_CallFunctionObjArgs(PyTuple_GET_ITEM(entry, kFn), tup.ptr(), scalars.ptr(),
                                                  empty.ptr(), empty.ptr(), rng.ptr(), nullptr));
  }
  bufs = pybind11::list();
  object parts = checked(PySequence_Tuple(result.ptr()));
  TORCH_CHECK(PyTuple_GET_SIZE(parts.ptr()) == 2, "torchbridge: a device program returned ",
              PyTuple_GET_SIZE(parts.ptr()), " parts, expected (updated, new)");
  if (!g_fused && PyDict_SetItem(g_last, dev_index, parts.ptr()) < 0) throw pybind11::error_already_set();
  object updated = checked(PySequence_Fast(PyTuple_GET_ITEM(parts.ptr(), 0), "updated buffers"));
  object fresh = checked(PySequence_Fast(PyTuple_GET_ITEM(parts.ptr(), 1), "new buffers"));
  Py_ssize_t nw = PyTuple_GET_SIZE(writes);
  TORCH_CHECK(PySequence_Fast_GET_SIZE(updated.ptr()) == nw, "torchbridge: a device program updated the wrong number of buffers");
  for (Py_ssize_t i = 0; i < nw; ++i) {
    Py_ssize_t slot = PyLong_AsSsize_t(PyTuple_GET_ITEM(writes, i));
    if (PyDict_SetItem(g_table, keys.at(slot).ptr(), PySequence_Fast_GET_ITEM(updated.ptr(), i)) < 0)
      throw pybind11::error_already_set();
  }
  object ret = finish(entry, args, kwargs, dev_index, fresh);
  if (flush) checked(PyObject_CallNoArgs(g_flush));  // after the table holds this op's placeholders
  return ret;
}

// The return value of a hit whose written buffers are in the table: the written arguments, or
// new output tensors holding `fresh`.
object finish(PyObject* entry, PyObject* args, PyObject* kwargs, PyObject* dev_index, const object& fresh) {
  PyObject* returns = PyTuple_GET_ITEM(entry, kReturns);
  if (returns != Py_None) {
    if (PyTuple_GET_ITEM(entry, kReturnsNone) == Py_True) return reinterpret_borrow<object>(Py_None);
    Py_ssize_t nr = PyTuple_GET_SIZE(returns);
    pybind11::tuple vals(nr);
    for (Py_ssize_t i = 0; i < nr; ++i) {
      PyObject* r = PyTuple_GET_ITEM(returns, i);
      PyObject* v = PyLong_Check(r) ? PyTuple_GET_ITEM(args, 1 + PyLong_AsSsize_t(r)) : PyDict_GetItem(kwargs, r);
      TORCH_CHECK(v != nullptr, "torchbridge: fast path lost a returned argument");
      vals[i] = reinterpret_borrow<object>(v);
    }
    return nr == 1 ? object(vals[0]) : object(vals);
  }
  PyObject* outputs = PyTuple_GET_ITEM(entry, kOutputs);
  Py_ssize_t no = PyTuple_GET_SIZE(outputs);
  TORCH_CHECK(PySequence_Fast_GET_SIZE(fresh.ptr()) == no, "torchbridge: a device program made the wrong number of outputs");
  auto device = c10::Device(kDevice, static_cast<c10::DeviceIndex>(PyLong_AsLong(dev_index)));
  pybind11::list outs(no);
  for (Py_ssize_t i = 0; i < no; ++i) {
    PyObject* spec = PyTuple_GET_ITEM(outputs, i);  // (shape, strides, dtype code)
    auto shape = ints(PyTuple_GET_ITEM(spec, 0));
    auto strides = ints(PyTuple_GET_ITEM(spec, 1));
    auto code = static_cast<at::ScalarType>(PyLong_AsLong(PyTuple_GET_ITEM(spec, 2)));
    at::Tensor t = empty_strided(shape, strides, code, std::nullopt, device, std::nullopt);
    object k = checked(PyLong_FromUnsignedLongLong(reinterpret_cast<uint64_t>(t.storage().data())));
    if (PyDict_SetItem(g_table, k.ptr(), PySequence_Fast_GET_ITEM(fresh.ptr(), i)) < 0)
      throw pybind11::error_already_set();
    outs[i] = checked(THPVariable_Wrap(std::move(t)));
  }
  if (PyTuple_GET_ITEM(entry, kSingle) == Py_True) return outs[0];
  return checked(PyObject_CallFunctionObjArgs(g_rebuild, PyTuple_GET_ITEM(entry, kOutStruct), outs.ptr(), nullptr));
}

PyObject* fast_call(PyObject*, PyObject* args, PyObject* kwargs) {
  if (!PyTuple_Check(args) || PyTuple_GET_SIZE(args) < 1) {
    PyErr_SetString(PyExc_TypeError, "torchbridge: fast_call(op, *args, **kwargs)");
    return nullptr;
  }
  if (!g_enabled) return PyObject_Call(g_slow, args, kwargs);
  try {
    if (g_has_events.load(std::memory_order_relaxed)) checked(PyObject_CallNoArgs(g_drain));
    object r = hit(PyTuple_GET_ITEM(args, 0), args, kwargs);
    if (r) {
      ++g_hits;
      return r.release().ptr();
    }
  } catch (pybind11::error_already_set& e) {
    e.restore();
    return nullptr;
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
  return PyObject_Call(g_slow, args, kwargs);
}

PyMethodDef g_fast_call_def = {"fast_call", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&fast_call)),
                               METH_VARARGS | METH_KEYWORDS,
                               "fast_call(op, *args, **kwargs): the device kernel of every op (see native.cpp)"};

}  // namespace fastpath

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

// ---- scaled_dot_product_attention's backend choice ------------------------------------------
// PyTorch asks each device which SDPA kernel to use. Where the fused kernel applies (float32/64, no
// dropout, 4-d, grouped-query heads allowed) the answer is the PrivateUse1 "overrideable" fused op,
// lowered as one attention in eager mode and in compiled graphs (lowerings/attention.py); otherwise
// PyTorch's math decomposition runs. set_fused_sdpa(false) answers "math" always (for comparisons).
bool g_fused_sdpa = true;

namespace at::native {
int64_t torchbridge_sdp_choice(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const std::optional<at::Tensor>& /*attn_mask*/, double dropout_p, bool /*is_causal*/,
                               std::optional<double> /*scale*/, bool enable_gqa) {
  const auto math = static_cast<int64_t>(at::SDPBackend::math);
  if (!g_fused_sdpa || dropout_p > 0.0 || q.dim() != 4 || k.dim() != 4 || v.dim() != 4) return math;
  if (q.scalar_type() != k.scalar_type() || q.scalar_type() != v.scalar_type() ||
      (q.scalar_type() != at::kFloat && q.scalar_type() != at::kDouble)) {
    return math;
  }
  if (k.size(1) != v.size(1) || q.size(3) != k.size(3) || k.size(2) != v.size(2)) return math;
  if (q.size(1) != k.size(1) && !(enable_gqa && k.size(1) > 0 && q.size(1) % k.size(1) == 0)) return math;
  return static_cast<int64_t>(at::SDPBackend::overrideable);
}
REGISTER_PRIVATEUSE1_DISPATCH(_fused_sdp_choice_stub, &torchbridge_sdp_choice)
}  // namespace at::native

void* torchbridge_host_gemm_handler();  // host_calls.cpp
void* torchbridge_fence_handler();      // host_calls.cpp
void* torchbridge_attention_handler();  // host_calls.cpp
void* torchbridge_attention_backward_handler();  // host_calls.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("host_gemm_capsule", []() { return pybind11::capsule(torchbridge_host_gemm_handler()); },
        "the XLA FFI handler of the CPU platform's GEMM custom call");
  m.def("fence_capsule", []() { return pybind11::capsule(torchbridge_fence_handler()); },
        "the XLA FFI handler of the CPU platform's fusion fence (a copy)");
  m.def("set_fused_sdpa", [](bool on) { return std::exchange(g_fused_sdpa, on); },
        "route scaled_dot_product_attention to the fused overrideable op (returns the previous setting)");
  m.def("attention_capsule", []() { return pybind11::capsule(torchbridge_attention_handler()); },
        "the XLA FFI handler of the CPU platform's fused attention");
  m.def("attention_backward_capsule", []() { return pybind11::capsule(torchbridge_attention_backward_handler()); },
        "the XLA FFI handler of the CPU platform's fused attention backward");
  m.def("install", &install, "set the allocator and hooks; safe to call again to change the device count");
  m.def("drain_events", &drain_events, "queued (kind, a, b, nbytes) storage events, oldest first");
  m.def("live_bytes", [](int d) { return g_live_bytes[d].load(); });
  m.def("peak_bytes", [](int d) { return g_peak_bytes[d].load(); });
  m.def("reset_peak_bytes", [](int d) { g_allocator.resetPeakStats(static_cast<c10::DeviceIndex>(d)); });
  m.def(
      "set_python_hooks",
      [](pybind11::object synchronize, pybind11::object memory_info, pybind11::object empty_cache) {
        g_synchronize = synchronize.release().ptr();
        g_memory_info = memory_info.release().ptr();
        g_empty_cache = empty_cache.release().ptr();
      },
      "synchronize(device), memory_info(device) -> (free, total), empty_cache(): what streams, events and "
      "torch.accelerator's memory functions call");
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
  m.def("fast_setup", &fastpath::setup, "hand the fast path its dictionaries and Python fallbacks");
  m.def("fast_register_op", &fastpath::register_op, "let fast_call serve this op's remembered calls");
  m.def("fast_hits", []() { return fastpath::g_hits; });
  m.def("fast_fused", [](bool on) { fastpath::g_fused = on; }, "fused eager mode: hits record instead of run");
  m.add_object("fast_call", pybind11::reinterpret_steal<pybind11::object>(
                                PyCFunction_NewEx(&fastpath::g_fast_call_def, nullptr, nullptr)));
  m.def("current_device", []() { return static_cast<int>(t_current_device); });
  m.def("set_device", [](int d) {
    TORCH_CHECK(d >= 0 && d < g_device_count.load(), "torchbridge: invalid device index ", d, " (",
                g_device_count.load(), " devices)");
    t_current_device = static_cast<c10::DeviceIndex>(d);
  });
}
