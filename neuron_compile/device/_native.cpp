// The neuron device's C++ side: what PyTorch calls from places where Python must not run, or cannot be
// reached from torch._C._acc's Python bindings (built by neuron_compile/device/hooks.py; see its docstring).
//
// Why C++ at all: torch._C._acc's PythonDeviceGuard answers getStream/exchangeStream (noexcept) by calling the
// Python method type_. The autograd engine's stream guard calls exchangeStream while unwinding from a Python
// exception of a backward hook, with that exception still set in the thread: the call into Python fails, the
// failure leaves a noexcept function, and the process aborts. This guard never calls Python.

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/Generator.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/alloc_cpu.h>
#include <pybind11/pybind11.h>
#include <torch/csrc/autograd/engine.h>

#include <atomic>
#include <mutex>
#include <thread>
#include <unordered_set>
#include <vector>

namespace py = pybind11;

namespace {

constexpr c10::DeviceType kNeuron = c10::DeviceType::PrivateUse1;

std::atomic<c10::DeviceIndex> g_device_count{1};
// Per thread, as CUDA's: the autograd engine's thread for device i sets device i.
thread_local c10::DeviceIndex t_current_device = 0;

// Python callables set by install(); leaked on purpose (called from C++ that may outlive the interpreter's
// teardown of module globals).
py::object* g_synchronize = nullptr;  // (index) -> None
py::object* g_stats = nullptr;        // (index) -> (allocated, peak)
py::object* g_reset_peak = nullptr;   // (index) -> None

struct NeuronGuard final : public c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kNeuron; }
  c10::Device exchangeDevice(c10::Device d) const override {
    auto old = getDevice();
    if (d.index() >= 0) t_current_device = d.index();
    return old;
  }
  c10::Device getDevice() const override { return c10::Device(kNeuron, t_current_device); }
  void setDevice(c10::Device d) const override {
    if (d.index() >= 0) t_current_device = d.index();
  }
  void uncheckedSetDevice(c10::Device d) const noexcept override {
    if (d.index() >= 0) t_current_device = d.index();
  }
  // One stream per device: every execution is synchronous.
  c10::Stream getStream(c10::Device d) const noexcept override {
    return c10::Stream(c10::Stream::DEFAULT, c10::Device(kNeuron, d.index() < 0 ? t_current_device : d.index()));
  }
  c10::Stream getNewStream(c10::Device d, int /*priority*/) const override { return getStream(d); }
  c10::Stream exchangeStream(c10::Stream s) const noexcept override { return s; }
  c10::DeviceIndex deviceCount() const noexcept override { return g_device_count.load(); }
  void record(void** /*event*/, const c10::Stream& /*stream*/, const c10::DeviceIndex /*index*/,
              const c10::EventFlag /*flag*/) const override {}
  void block(void* /*event*/, const c10::Stream& /*stream*/) const override {}
  bool queryEvent(void* /*event*/) const override { return true; }
  void destroyEvent(void* /*event*/, const c10::DeviceIndex /*index*/) const noexcept override {}
  bool queryStream(const c10::Stream& /*stream*/) const override { return true; }
  void synchronizeStream(const c10::Stream& stream) const override { synchronizeDevice(stream.device_index()); }
  void synchronizeEvent(void* /*event*/) const override {}
  // torch.accelerator.synchronize(): torch.neuron.synchronize, which reports a failed deferred value check.
  void synchronizeDevice(const c10::DeviceIndex index) const override {
    if (g_synchronize == nullptr) return;
    py::gil_scoped_acquire gil;
    (*g_synchronize)(static_cast<int>(index));
  }
};

// Pinned host memory: host memory is what the device copies from anyway, so "pinned" is ordinary CPU memory
// whose pointers are remembered, so that is_pinned() can say true for what pin_memory() made.
std::mutex g_pinned_mutex;
std::unordered_set<void*> g_pinned;

void pinned_free(void* ptr) {
  {
    std::lock_guard<std::mutex> lock(g_pinned_mutex);
    g_pinned.erase(ptr);
  }
  c10::free_cpu(ptr);
}

struct PinnedAllocator final : public c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) override {
    void* ptr = nbytes ? c10::alloc_cpu(nbytes) : nullptr;
    if (ptr != nullptr) {
      std::lock_guard<std::mutex> lock(g_pinned_mutex);
      g_pinned.insert(ptr);
    }
    return {ptr, ptr, &pinned_free, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &pinned_free; }
  void copy_data(void* dest, const void* src, std::size_t count) const final { default_copy_data(dest, src, count); }
};

PinnedAllocator g_pinned_allocator;

// A device generator: CPU's mt19937 (so manual_seed/seed/get_state/set_state behave as torch's), labelled with
// the device so torch accepts it for device tensors.
struct NeuronGenerator final : public at::CPUGeneratorImpl {
  explicit NeuronGenerator(c10::DeviceIndex index, uint64_t seed = c10::default_rng_seed_val)
      : at::CPUGeneratorImpl(seed) {
    device_ = c10::Device(kNeuron, index);
    key_set_ = c10::DispatchKeySet(c10::DispatchKey::PrivateUse1);
  }

 private:
  NeuronGenerator* clone_impl() const override {
    auto* copy = new NeuronGenerator(device_.index());
    copy->set_state(*get_state());
    return copy;
  }
};

c10::DeviceIndex resolve(c10::DeviceIndex index) { return index < 0 ? t_current_device : index; }

struct NeuronHooks final : public at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex /*index*/) const override { return true; }
  c10::DeviceIndex deviceCount() const override { return g_device_count.load(); }
  c10::DeviceIndex getCurrentDevice() const override { return t_current_device; }
  void setCurrentDevice(c10::DeviceIndex index) const override { t_current_device = index; }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex index) const override {
    auto old = t_current_device;
    t_current_device = index;
    return old;
  }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex index) const override { return exchangeDevice(index); }
  bool isPinnedPtr(const void* data) const override {
    std::lock_guard<std::mutex> lock(g_pinned_mutex);
    return g_pinned.count(const_cast<void*>(data)) != 0;
  }
  c10::Allocator* getPinnedMemoryAllocator() const override { return &g_pinned_allocator; }
  const at::Generator& getDefaultGenerator(c10::DeviceIndex index) const override {
    static std::once_flag once;
    static std::vector<at::Generator> defaults;
    std::call_once(once, [] {
      for (c10::DeviceIndex i = 0; i < std::max<c10::DeviceIndex>(g_device_count.load(), 1); ++i) {
        defaults.push_back(at::make_generator<NeuronGenerator>(i));
        defaults.back().set_current_seed(c10::detail::getNonDeterministicRandom());
      }
    });
    index = resolve(index);
    TORCH_CHECK(index >= 0 && index < static_cast<c10::DeviceIndex>(defaults.size()), "neuron: no device ",
                static_cast<int>(index));
    return defaults[index];
  }
  at::Generator getNewGenerator(c10::DeviceIndex index) const override {
    return at::make_generator<NeuronGenerator>(resolve(index));
  }
};

// Device memory is counted by neuron_compile.device.storage; this wraps the allocator already registered for
// the device (kept for what it does) to answer torch.accelerator's memory questions with those counts.
struct NeuronDeviceAllocator final : public c10::DeviceAllocator {
  explicit NeuronDeviceAllocator(c10::Allocator* previous) : previous_(previous) {}
  c10::DataPtr allocate(size_t nbytes) override {
    if (previous_ != nullptr) return previous_->allocate(nbytes);
    // torch makes a storage of the device itself (copy.deepcopy: UntypedStorage(n, device=...)): it gets a fake
    // address, never dereferenced, as storage.py's own (another range); its bytes are allocated by Python at its
    // first use (storage.device_storage).
    static std::atomic<uint64_t> cursor{uint64_t{1} << 53};
    const uint64_t size = std::max<uint64_t>(nbytes, 1);
    const uint64_t address = cursor.fetch_add(size + (512 - size % 512) % 512);
    return c10::DataPtr(reinterpret_cast<void*>(address), c10::Device(c10::DeviceType::PrivateUse1, resolve(-1)));
  }
  c10::DeleterFnPtr raw_deleter() const override { return previous_ ? previous_->raw_deleter() : nullptr; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    TORCH_CHECK(previous_ != nullptr, "neuron: copy_data is not supported");
    previous_->copy_data(dest, src, count);
  }
  bool initialized() override { return true; }
  // Nothing is cached: freed tensors give their memory back at once.
  void emptyCache(c10::MempoolId_t /*pool*/) override {}
  void recordStream(const c10::DataPtr& /*ptr*/, c10::Stream /*stream*/) override {}
  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex index) override {
    c10::CachingDeviceAllocator::DeviceStats stats;
    if (g_stats == nullptr) return stats;
    int64_t allocated = 0, peak = 0;
    {
      py::gil_scoped_acquire gil;
      auto pair = (*g_stats)(static_cast<int>(resolve(index)));
      allocated = pair[py::int_(0)].cast<int64_t>();
      peak = pair[py::int_(1)].cast<int64_t>();
    }
    // No cache: what is reserved is what is allocated.
    for (auto* array : {&stats.allocated_bytes, &stats.reserved_bytes, &stats.active_bytes}) {
      auto& stat = (*array)[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)];
      stat.current = allocated;
      stat.peak = peak;
    }
    return stats;
  }
  void resetAccumulatedStats(c10::DeviceIndex /*index*/) override {}
  void resetPeakStats(c10::DeviceIndex index) override {
    if (g_reset_peak == nullptr) return;
    py::gil_scoped_acquire gil;
    (*g_reset_peak)(static_cast<int>(resolve(index)));
  }

 private:
  c10::Allocator* previous_;
};

// The autograd engine sizes its per-device threads once, at the first backward of the process, from the
// device guards registered then: registered later, the device would have no thread and every backward
// through it would fail an internal assert. Give it the threads it would have made.
struct EngineAccess : torch::autograd::Engine {
  static void add_device_threads(torch::autograd::Engine& engine, c10::DeviceIndex count) {
    auto& pool = engine.*(&EngineAccess::thread_pool_shared_);
    if (pool == nullptr) return;  // no backward yet: the engine will count our devices itself
    auto& queues = engine.*(&EngineAccess::device_ready_queues_);
    auto have = static_cast<c10::DeviceIndex>(queues.size());
    for (c10::DeviceIndex i = have; i < count; ++i) {
      queues.push_back(std::make_shared<torch::autograd::ReadyQueue>());
    }
    for (c10::DeviceIndex i = have; i < count; ++i) {
      std::thread t(&torch::autograd::Engine::thread_init, &engine, static_cast<int>(i), queues[i], true);
      t.detach();
    }
  }
};

void install(int device_count, py::object synchronize, py::object stats, py::object reset_peak) {
  g_device_count.store(static_cast<c10::DeviceIndex>(std::max(device_count, 1)));
  g_synchronize = new py::object(std::move(synchronize));
  g_stats = new py::object(std::move(stats));
  g_reset_peak = new py::object(std::move(reset_peak));
  static NeuronDeviceAllocator* allocator = nullptr;
  if (allocator == nullptr) {
    c10::Allocator* previous = nullptr;
    try {
      previous = c10::GetAllocator(kNeuron);
    } catch (const c10::Error&) {
    }
    allocator = new NeuronDeviceAllocator(previous);
    c10::SetAllocator(kNeuron, allocator, /*priority=*/UINT8_MAX);
  }
}

void add_engine_threads() {
  py::gil_scoped_release release;
  EngineAccess::add_device_threads(torch::autograd::Engine::get_default_engine(), g_device_count.load());
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Subclasses of the classes torch._C._acc binds, so torch's register functions take them.
  py::module_::import("torch");
  py::class_<NeuronHooks, at::PrivateUse1HooksInterface>(m, "NeuronHooks").def(py::init<>());
  py::class_<NeuronGuard, c10::impl::DeviceGuardImplInterface>(m, "NeuronGuard").def(py::init<>());
  m.def("install", &install);
  m.def("add_engine_threads", &add_engine_threads);
}
