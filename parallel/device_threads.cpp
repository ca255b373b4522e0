#include "parallel/device_threads.h"

#include <exception>
#include <mutex>
#include <optional>

#include "amp/autocast.h"
#include "autograd/grad_mode.h"
#include "tensor/device_guard.h"
#include "tensor/random.h"
#ifdef MPT_WITH_CUDA
#include "tensor/backend_settings.h"
#endif

namespace mpt::dist {

DeviceThreads::DeviceThreads(std::vector<Device> devices) : devices_(std::move(devices)) {
  for (const Device& d : devices_) {
    streams_.push_back(d.is_cuda() ? Stream::create(d) : Stream());
    workers_.push_back(std::make_unique<WorkQueue>());
  }
}

DeviceThreads::~DeviceThreads() = default;

void DeviceThreads::run(const std::function<void(size_t index)>& fn) {
  const bool grad_mode = grad_enabled();
  const amp::AutocastSettings autocast = amp::current_autocast_settings();
  // Each device's random numbers (dropout) come from a fork of the caller's
  // default generator: manual_seed() decides them, and no two devices draw
  // the same mask.
  std::vector<Generator> generators;
  for (size_t i = 0; i < devices_.size(); ++i) generators.push_back(default_generator().fork());
#ifdef MPT_WITH_CUDA
  const bool tf32 = allow_tf32();
#endif
  // The error raised first is the cause; the others (a peer timing out in a
  // collective the failed thread never joined, say) are its consequences.
  std::mutex mutex;
  std::exception_ptr first_error;
  // queued[i]: the caller's work on device i so far; done[i]: the thread's.
  std::vector<std::unique_ptr<Event>> queued, done;
  for (const Device& d : devices_) {
    queued.push_back(d.is_cuda() ? std::make_unique<Event>(d) : nullptr);
    done.push_back(d.is_cuda() ? std::make_unique<Event>(d) : nullptr);
    if (queued.back()) queued.back()->record(current_stream(d));
  }
  std::vector<WorkPtr> works;
  for (size_t i = 0; i < devices_.size(); ++i)
    works.push_back(workers_[i]->enqueue([&, i] {
      try {
        set_grad_enabled(grad_mode);  // the thread is ours: no need to restore it
        default_generator() = generators[i];
#ifdef MPT_WITH_CUDA
        set_allow_tf32(tf32);
#endif
        // Only an enabled region: a guard opens an autocast region whose
        // weight casts live until it ends, and fn may run many steps.
        std::optional<amp::AutocastSettingsGuard> autocast_guard;
        if (autocast.enabled[0] || autocast.enabled[1]) autocast_guard.emplace(autocast);
        DeviceGuard on_device(devices_[i]);
        StreamGuard on_stream(streams_[i]);
        if (queued[i]) queued[i]->wait(streams_[i]);
        try {
          fn(i);
        } catch (...) {
          if (done[i]) done[i]->record(streams_[i]);
          throw;
        }
        if (done[i]) done[i]->record(streams_[i]);
      } catch (...) {
        std::lock_guard lock(mutex);
        if (!first_error) first_error = std::current_exception();
      }
    }));
  for (auto& w : works) w->wait();
  for (size_t i = 0; i < devices_.size(); ++i)
    if (done[i]) done[i]->wait(current_stream(devices_[i]));
  if (first_error) std::rethrow_exception(first_error);
}

}  // namespace mpt::dist
