// Stage 4 on the engine thread: small host all-reduces moved by the thread that negotiated them.
//
// Through a channel, a synchronous all-reduce of a few bytes crosses three threads per rank (the caller, the
// engine thread, a channel thread), and each hand-off is a wake-up that costs more than the collective. The
// units a process set routes here (ProcessSet::dispatch: host all-reduces of at most engine_lane_bytes that
// MPI's own algorithm would carry; the same choice on every rank, since it depends only on the negotiated
// plan) run on the engine thread instead: one at a time, in unit order, each as a non-blocking all-reduce on
// the lane's own communicator, which step() polls. The engine thread goes on negotiating, reading control
// messages and hearing aborts while one is in flight; it never blocks in a collective.
//
// Data moves through the lane's own buffer (copied in with the prescale, out with the postscale), so a
// collective that a failure leaves in flight never writes into memory the caller may have freed.
#pragma once

#include <memory>
#include <vector>

#include "channels.h"
#include "fifo.h"
#include "fusion.h"
#include "transport.h"

namespace perseus {

class EngineLane {
 public:
  // comm: a communicator of the set's ranks for the lane alone. max_bytes: the largest unit it takes.
  EngineLane(std::unique_ptr<Comm> comm, ChannelHooks hooks, int64_t max_bytes);
  ~EngineLane();
  // Whether u is a unit for the lane (any thread; depends only on the unit and the settings).
  bool takes(const Unit& u) const;
  // Engine thread: queue u; it starts at once when the lane is idle.
  void submit(Unit* u);
  // Engine thread: finish the unit in flight if its collective completed, start the next. True when a unit
  // finished or failed. A transport failure fails the unit on every rank (ChannelHooks::unit_failed).
  bool step();
  bool busy() const { return !queue_.empty(); }
  // Engine thread, the set being dead: release the units not started (their requests carry the error
  // already) and the one in flight once its collective has completed. One still in flight stays held (its
  // buffer with it) until a later call finds it complete; at destruction it is left behind.
  void release();

 private:
  void start_next();
  void finish_front();
  void fail_front(const std::string& what);
  void drop(Unit* u);

  std::unique_ptr<Comm> comm_;
  ChannelHooks hooks_;
  const int64_t max_bytes_;
  Fifo<Unit*> queue_;  // the front is in flight while op_ is set
  std::unique_ptr<PendingOp> op_;
  std::vector<uint8_t>* buffer_;  // max_bytes_; left behind (never freed) if a collective on it is abandoned
};

}  // namespace perseus
