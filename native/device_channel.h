// Stage 4b: units whose tensors live on a device (a GPU), executed by the framework's launcher thread.
//
// The engine negotiates and plans device requests like any other: every rank gets the same units in the same
// order. Instead of a channel thread, a DeviceChannel hands each unit to the engine-wide DeviceQueue, from which
// one launcher thread per process (in the framework adapter, e.g. perseus/torch/device.py) takes them in that
// order, moves the data with the device's own library (NCCL through torch.distributed), and gives each unit
// back with finish(). The engine never touches device memory; nothing here takes the GIL.
#pragma once

#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>

#include "channels.h"

namespace perseus {

class DeviceChannel;

// Separates the tensor names of a unit in its one DEVICE_LAUNCH timeline record (the timeline writer splits them).
constexpr char kUnitNameSeparator = '\x1f';

// One unit on its way through the launcher. Owned by the queue until popped, then by the launcher until it
// calls DeviceChannel::finish (which deletes it).
struct DeviceTicket {
  std::shared_ptr<DeviceChannel> channel;
  Unit* unit = nullptr;
  int ps_id = 0;
};

// The engine-wide FIFO of device units (thread-safe).
class DeviceQueue {
 public:
  ~DeviceQueue();
  void push(DeviceTicket* t);
  // The next ticket, waiting up to timeout_s; nullptr on timeout, or (and *stopped set) once stopped.
  DeviceTicket* pop(double timeout_s, bool* stopped);
  // pop() returns stopped from now on; tickets still queued are dropped (their channels are closed).
  void stop();

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<DeviceTicket*> queue_;
  bool stopped_ = false;
};

class DeviceChannel : public std::enable_shared_from_this<DeviceChannel> {
 public:
  DeviceChannel(DeviceQueue* queue, ChannelHooks hooks, int ps_id);
  // Engine thread: hand the unit to the launcher.
  void submit(Unit* u);
  // Launcher: the unit is done (error null) or failed (the engine then fails it on every rank). Deletes t.
  // A unit given back after stop() gave up on it is only dropped: its requests were failed by then.
  static void finish(DeviceTicket* t, const std::string* error);
  // Wait up to timeout_s for every submitted unit to come back; false if some did not (they are abandoned).
  bool stop(double timeout_s);

 private:
  void done(Unit* u, const std::string* error);

  DeviceQueue* queue_;
  ChannelHooks hooks_;
  int ps_id_;
  std::mutex mu_;
  std::condition_variable cv_;
  int outstanding_ = 0;
  bool closed_ = false;
};

}  // namespace perseus
