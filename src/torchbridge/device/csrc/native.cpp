// The native half of the device backend: the pieces Python cannot supply on torch 2.13.
//
// Device memory does not live here. Each storage gets a unique fake address from the allocator;
// Python keeps a table from that address to an immutable XLA buffer, and mutation swaps the entry.
// The addresses are never dereferenced (no CPU kernel may see them) and never reused, so a stale
// table entry can never be mistaken for a live storage. Frees and storage resizes are queued here as
// events and drained by Python in order, which keeps the allocator free of the GIL (it is called from
// autograd worker threads too).

#include "native.h"

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

using torchbridge::kDevice;

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

namespace torchbridge {

at::Tensor new_device_tensor(c10::IntArrayRef size, c10::IntArrayRef stride, at::ScalarType dtype,
                             c10::DeviceIndex index) {
  return empty_strided(size, stride, dtype, std::nullopt, c10::Device(kDevice, index), std::nullopt);
}

bool has_storage_events() { return g_has_events.load(std::memory_order_relaxed); }

}  // namespace torchbridge

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
  // sym_size: a traced call with symbolic sizes (fake tensors) must not turn them into numbers (guards)
  if (k.sym_size(1) != v.sym_size(1) || q.sym_size(3) != k.sym_size(3) || k.sym_size(2) != v.sym_size(2)) return math;
  const auto qh = q.sym_size(1), kh = k.sym_size(1);
  if (qh != kh && !(enable_gqa && kh > 0 && qh % kh == 0)) return math;
  return static_cast<int64_t>(at::SDPBackend::overrideable);
}
REGISTER_PRIVATEUSE1_DISPATCH(_fused_sdp_choice_stub, &torchbridge_sdp_choice)
}  // namespace at::native

void* torchbridge_host_gemm_handler();  // host_calls.cpp
void* torchbridge_fence_handler();      // host_calls.cpp
void* torchbridge_attention_handler();  // host_calls.cpp
void* torchbridge_attention_backward_handler();  // host_calls.cpp
void* torchbridge_adam_step_handler();  // host_calls.cpp
void* torchbridge_adagrad_step_handler();  // host_calls.cpp
void* torchbridge_paged_decode_handler();  // host_calls.cpp
void* torchbridge_held_linear_handler();  // host_calls.cpp
void* torchbridge_prefill_attention_handler();  // host_calls.cpp

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
  m.def("adam_step_capsule", []() { return pybind11::capsule(torchbridge_adam_step_handler()); },
        "the XLA FFI handler of the CPU platform's one-pass Adam/AdamW update");
  m.def("held_linear_capsule", []() { return pybind11::capsule(torchbridge_held_linear_handler()); },
        "XLA FFI handler: a linear by a weight the engine's kernel library holds (host_calls.cpp)");
  m.def("paged_decode_capsule", []() { return pybind11::capsule(torchbridge_paged_decode_handler()); },
        "XLA FFI handler: the engine's paged decode attention kernel (host_calls.cpp)");
  m.def("prefill_attention_capsule", []() { return pybind11::capsule(torchbridge_prefill_attention_handler()); },
        "XLA FFI handler: the engine's packed causal attention of fresh prompts (host_calls.cpp)");
  m.def("adagrad_step_capsule", []() { return pybind11::capsule(torchbridge_adagrad_step_handler()); },
        "the XLA FFI handler of the CPU platform's one-pass Adagrad update");
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
  m.def("describe", &describe, "per-tensor layout tuples for the eager dispatcher");
  torchbridge::bind_fast_path(m);
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
