// Stage 4: concurrent communication channels.
//
// A channel is a duplicated communicator driven by its own thread (and, when its process set spans hosts,
// its own TCP connections between them: links.h). Units go to channels by their position
// in the set's unit sequence (index % channels), the same on every rank, so each communicator sees the same
// sequence of collectives everywhere while different channels run at once. The thread never holds the GIL.
// It waits for work with a short spin (back-to-back units of one step arrive microseconds apart), then on a
// condition variable: an idle channel costs nothing.
#pragma once

#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "algorithms.h"
#include "fifo.h"
#include "fusion.h"
#include "hierarchical.h"
#include "links.h"
#include "timeline.h"
#include "transport.h"

namespace perseus {

// What a channel knows about where the ranks of its process set are.
struct ChannelConfig {
  bool hierarchical_allgather = false;
  bool huge_pages = true;                     // collapse reused large buffers (huge_pages.h)
  std::shared_ptr<const HostLayout> layout;  // null: one host
  LinkOptions links;                          // world_ranks filled in per communicator
};

// Tests: make the next collective of any channel fail as a broken transport would.
struct FaultInjection {
  std::atomic<bool> armed{false};
  std::mutex mu;
  std::string message;
};

struct ChannelHooks {
  std::function<void(Request*)> piece_done;                  // one piece of the request finished
  std::function<void(Unit*, const std::string&, ErrorKind)> unit_failed;  // the engine fails every rank
  std::function<void(Unit*)> recycle;                        // the unit is no longer used
  TimelineRecorder* timeline = nullptr;
  FaultInjection* faults = nullptr;
};

class Channel {
 public:
  // Collective over comm's ranks when the set spans hosts (opens links, splits local and cross comms).
  Channel(std::unique_ptr<Comm> comm, ChannelConfig config, ChannelHooks hooks);
  ~Channel();
  void submit(Unit* u);
  // Stop after the queued units; false if the thread is still inside a collective after timeout_s (it is
  // then left behind, detached).
  bool stop(double timeout_s);

 private:
  void run();
  void run_unit(Unit* u);
  void execute(Unit* u);
  void allreduce(Unit* u);
  void allreduce_buffer(const void* send, void* recv, size_t count, DType dtype, ReduceOp op, double postscale,
                        Algorithm algorithm);
  // Reduce-scatter and allgather: ring or MPI (ring_within_host: `auto` takes the ring on one host too).
  bool use_ring(Algorithm a, size_t bytes, bool ring_within_host) const;
  void allgather(Unit* u);
  void broadcast(Request* r);
  void alltoall(Request* r);
  void reducescatter(Unit* u);
  void activity(Unit* u, const char* label);
  // Where the set's flat ring travels: the channel's links across hosts, else the Comm's own messages.
  PointToPoint& flat() { return links_ != nullptr ? static_cast<PointToPoint&>(*links_) : *comm_; }

  std::unique_ptr<Comm> comm_;
  ChannelConfig config_;
  std::unique_ptr<Links> links_;         // set spans hosts: the flat ring's connections
  std::unique_ptr<Comm> local_, cross_;  // homogeneous hosts with several ranks each
  std::unique_ptr<Links> cross_links_;
  Scratch scratch_;
  ChannelHooks hooks_;
  std::mutex mu_;
  std::condition_variable cv_;
  Fifo<Unit*> queue_;
  std::atomic<size_t> queued_{0};
  bool stop_ = false;
  bool sleeping_ = false;
  std::atomic<bool> exited_{false};
  std::vector<uint8_t> fusion_;
  std::thread thread_;
};

}  // namespace perseus
