// Stage 4: concurrent communication channels.
//
// A channel is a duplicated communicator driven by its own thread. Units go to channels by their position
// in the set's unit sequence (index % channels), the same on every rank, so each communicator sees the same
// sequence of collectives everywhere while different channels run at once. The thread never holds the GIL.
// It waits for work with a short spin (back-to-back units of one step arrive microseconds apart), then on a
// condition variable: an idle channel costs nothing.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "fusion.h"
#include "timeline.h"
#include "transport.h"

namespace perseus {

enum class Algorithm { AUTO, MPI, RING };

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
  Channel(std::unique_ptr<Comm> comm, Algorithm algorithm, ChannelHooks hooks);
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
  void allreduce_buffer(const void* send, void* recv, size_t count, DType dtype, ReduceOp op, double postscale);
  void ring_reduce_scatter(void* buf, const std::vector<size_t>& counts, DType dtype, ReduceOp op,
                           const void* src);
  void ring_allgather(void* buf, const std::vector<size_t>& counts, DType dtype);
  void allgather(Request* r);
  void broadcast(Request* r);
  void alltoall(Request* r);
  void reducescatter(Unit* u);
  uint8_t* scratch(size_t nbytes, int slot);
  void activity(Unit* u, const char* label);

  std::unique_ptr<Comm> comm_;
  Algorithm algorithm_;
  ChannelHooks hooks_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Unit*> queue_;
  std::atomic<size_t> queued_{0};
  bool stop_ = false;
  bool sleeping_ = false;
  std::atomic<bool> exited_{false};
  std::vector<uint8_t> fusion_;
  std::vector<uint8_t> scratch_[2];
  std::thread thread_;
};

}  // namespace perseus
