#include "device_channel.h"

#include <chrono>

namespace perseus {

DeviceQueue::~DeviceQueue() { stop(); }

void DeviceQueue::push(DeviceTicket* t) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!stopped_) {
      queue_.push_back(t);
      t = nullptr;
    }
  }
  if (t == nullptr) {
    cv_.notify_one();
    return;
  }
  // Stopped: nobody will run it.
  static const std::string stopped = "perseus has been shut down";
  DeviceChannel::finish(t, &stopped);
}

DeviceTicket* DeviceQueue::pop(double timeout_s, bool* stopped) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_for(lock, std::chrono::duration<double>(timeout_s), [this] { return stopped_ || !queue_.empty(); });
  *stopped = stopped_;
  if (stopped_ || queue_.empty()) return nullptr;
  DeviceTicket* t = queue_.front();
  queue_.pop_front();
  return t;
}

void DeviceQueue::stop() {
  std::deque<DeviceTicket*> left;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopped_ = true;
    left.swap(queue_);
  }
  cv_.notify_all();
  static const std::string stopped = "perseus has been shut down";
  for (DeviceTicket* t : left) DeviceChannel::finish(t, &stopped);
}

DeviceChannel::DeviceChannel(DeviceQueue* queue, ChannelHooks hooks, int ps_id)
    : queue_(queue), hooks_(std::move(hooks)), ps_id_(ps_id) {}

void DeviceChannel::submit(Unit* u) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++outstanding_;
  }
  TimelineRecorder* tl = hooks_.timeline;
  if (tl != nullptr && tl->on()) {
    // One record per unit (one launch): its tensors' names, separated by kUnitNameSeparator.
    std::string names;
    for (const Piece& p : u->pieces) {
      if (p.request->phantom) continue;
      if (!names.empty()) names += kUnitNameSeparator;
      names += p.request->name;
    }
    if (!names.empty()) tl->record(TimelineKind::ACTIVITY, u->op_type, names, "DEVICE_LAUNCH");
  }
  queue_->push(new DeviceTicket{shared_from_this(), u, ps_id_});
}

void DeviceChannel::finish(DeviceTicket* t, const std::string* error) {
  std::unique_ptr<DeviceTicket> owned(t);
  t->channel->done(t->unit, error);
}

void DeviceChannel::done(Unit* u, const std::string* error) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) return;  // abandoned by stop(): the set is gone or going
  }
  if (error != nullptr) {
    hooks_.unit_failed(u, *error, ErrorKind::INTERNAL);
  } else {
    for (const Piece& p : u->pieces) hooks_.piece_done(p.request);
  }
  hooks_.recycle(u);
  {
    std::lock_guard<std::mutex> lock(mu_);
    --outstanding_;
  }
  cv_.notify_all();
}

bool DeviceChannel::stop(double timeout_s) {
  std::unique_lock<std::mutex> lock(mu_);
  const bool drained =
      cv_.wait_for(lock, std::chrono::duration<double>(timeout_s), [this] { return outstanding_ == 0; });
  closed_ = true;
  return drained;
}

}  // namespace perseus
