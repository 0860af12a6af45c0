// Stage 1-2 driver: one process set's request queue and negotiation state machine, stepped by the engine
// thread, plus its channels. The class is spread over one file per stage:
//   process_set.cc           construction, the queue user threads submit to, step(), failure and closing
//   process_set_rounds.cc    negotiation rounds (the state machine below)
//   process_set_dispatch.cc  negotiated requests to units, units to channels or the device queue; TUNE; completion
//   process_set_control.cc   control messages (control.h) and the stall inspector's probes (stall.h)
// The set uses nothing of the engine but its SetContext (set_context.h).
//
// Rounds follow three rules, identical on every rank, so no rank waits in a round that others will not
// join for a reason other than missing work:
//  * a rank with new requests starts a round (after cycle_time_ms, if set, to gather requests that arrive
//    together);
//  * after a round in which some rank had new requests or something became ready, every rank with pending
//    work starts the next round at once (continue mode);
//  * after a fruitless round ranks wait; the first rank with new requests sends a wake message to its
//    peers, which then join the round even if they have nothing pending.
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "channels.h"
#include "device_buckets.h"
#include "device_channel.h"
#include "engine_lane.h"
#include "handles.h"
#include "negotiation.h"
#include "node_pool.h"
#include "set_context.h"
#include "stall.h"
#include "step_timer.h"
#include "transport.h"

namespace perseus {

struct StepResult {
  bool progressed = false;
  bool waiting = false;  // inside a round, waiting for peers
  double deadline = 1e300;
};

class ProcessSet {
 public:
  // Collective over the ranks of `control`: creates the set's channels (dups of it).
  ProcessSet(SetContext context, const SetOptions& options, int id, std::unique_ptr<Comm> control,
             std::vector<int> world_ranks);
  ~ProcessSet();
  int id() const { return id_; }
  int size() const { return size_; }

  // -- user threads ----------------------------------------------------------------------------------
  // Queue requests atomically (a group is negotiated together). Errors: VALUE for a duplicate in-flight
  // name; INTERNAL when the set is dead.
  Error submit(const std::vector<Request*>& requests);
  Error submit_join(Handle* h);

  // -- engine thread ---------------------------------------------------------------------------------
  // One engine-thread step: the lane's unit in flight, then the negotiation state machine.
  StepResult step(double now);
  bool has_work();
  // Fail requests of this set: all of them, or (dispatched=false) only those not yet in a channel.
  void fail_all(const Error& error, bool dispatched);
  // Stop the channels (and tell peers this rank is gone); false if a channel is stuck in a collective.
  bool close(bool notify_peers);
  void mark_dead(const std::string& message);
  // Shutting down: finish a round in flight, start no new one.
  void begin_drain() { draining_ = true; }
  void send_to_all(const std::string& message);  // engine thread only
  TuneParams params();  // any thread
  // Completed steps with index >= since (at most the last StepTimer::kKept); *first = index of out[0].
  void steps(int64_t since, int64_t* first, std::vector<StepSample>* out);
  int max_channels() const;
  // Bytes this rank has sent and received for the set since it was created (any thread; see wire.h).
  WireBytes wire_bytes() const { return wire_->read(); }
  // Any thread: a user waits for (or polls) a device all-reduce of this set; the engine thread then checks
  // whether a device bucket holding it can still fill (device_buckets.h). The caller wakes the engine.
  void note_awaited() { awaited_news_.store(true, std::memory_order_release); }

 private:
  enum class State { IDLE, BAND, EXCHANGE, JOINGATHER };
  // process_set.cc
  void release_held(const Error& error);
  StepResult step_rounds(double now);
  // process_set_rounds.cc
  StepResult maybe_start(double now);
  double start_delay_ms();
  void start_round();
  void finish_band();
  StepResult step_exchange(double now);
  void finish_round();
  void fail_mismatches();
  void take_ready();
  void finish_join();
  Request* phantom(int idx);
  // process_set_dispatch.cc
  void dispatch(std::vector<Request*>& ready, bool flush);
  bool buckets_stuck();
  void apply_tune(Request* r);
  void piece_done(Request* r);
  void unit_failed(Unit* u, const std::string& what, ErrorKind kind);
  void forget(Request* r);
  void finish(Request* r, const Error* error);
  // process_set_control.cc
  void poll_control();
  void answer_probe(int source, const ProbeMessage& probe);
  void check_stall(double now);
  void peer_shutdown(int world_rank);

  SetContext ctx_;
  int id_, rank_, size_;
  std::vector<int> world_ranks_;
  std::unique_ptr<Comm> control_;
  // The control Comm's counters, which its dups (the channels), their splits and links share.
  std::shared_ptr<WireCounters> wire_;
  Negotiator negotiator_;
  UnitPool unit_pool_;
  std::vector<std::unique_ptr<Channel>> channels_;
  std::unique_ptr<EngineLane> lane_;  // small host all-reduces, moved by the engine thread (engine_lane.h)
  std::shared_ptr<DeviceChannel> device_channel_;  // units of device requests go to the launcher
  TuneParams params_;  // written by the engine thread under mu_
  const int64_t device_fusion_threshold_bytes_;
  DeviceBuckets buckets_;  // engine thread
  std::vector<std::vector<Request*>> released_;  // buckets released by a round (reused)
  bool flush_wanted_ = false;   // this rank asks for a flush in its next round
  bool recheck_buckets_ = false;  // buckets changed since the last stuck check
  const double device_cycle_time_ms_;
  const int64_t cache_capacity_;
  std::vector<Request*> tunes_;

  // Shared with user threads.
  std::mutex mu_;  // guards incoming_, inflight_, join_handle_, dead_, timer_'s steps
  std::vector<Request*> incoming_;
  NameMap inflight_;  // submitted, not yet finished (duplicate check)
  NodePool<NameMap> inflight_nodes_;  // inflight_'s nodes, reused
  Handle* join_handle_ = nullptr;
  std::atomic<int64_t> first_dirty_ns_{0};  // when the oldest unseen submission arrived; 0 if none
  std::atomic<bool> host_dirty_{false};  // an unseen submission is a host request (or a join)
  std::atomic<int> incoming_count_{0};  // size of incoming_, readable without the lock
  std::atomic<bool> join_waiting_{false};
  std::atomic<bool> awaited_news_{false};  // note_awaited() since the engine thread last looked
  std::string dead_;
  StepTimer timer_;  // submitted() under mu_; finished() from channel threads
  std::atomic<bool> is_dead_{false};

  // Engine-thread state.
  NameMap pending_;  // seen by the engine, not yet negotiated
  NodePool<NameMap> pending_nodes_;  // pending_'s nodes, reused
  State state_ = State::IDLE;
  int64_t round_ = 0;
  bool continue_mode_ = false;
  bool draining_ = false;
  int64_t woken_round_ = -1;
  int64_t unit_counter_ = 0;
  std::unique_ptr<PendingOp> op_;
  RoundResult result_;
  bool round_dirty_ = false;
  int64_t join_round_ = -1;
  bool round_joined_ = false;  // this rank's joined flag in the current round's band
  int64_t join_mine_[2] = {0, 0};
  std::vector<int64_t> join_all_;
  std::string payload_;
  std::vector<uint8_t> gathered_;
  std::vector<int64_t> sizes_mine_, sizes_all_;
  int exchange_phase_ = 0;
  std::vector<Request*> ready_;
  std::vector<Unit*> units_;
  StallInspector stall_;
  double last_poll_ = 0;
};

}  // namespace perseus
