// Stage 1-2 driver: construction, the submission queue, the engine thread's step and the set's failure and
// closing (see process_set.h).
#include "process_set.h"

#include <algorithm>
#include <set>

#include "control.h"

namespace perseus {

namespace {

constexpr double kControlPollS = 100e-6;  // control messages are rare: look for them at most this often

}  // namespace

ProcessSet::ProcessSet(SetContext context, const SetOptions& options, int id, std::unique_ptr<Comm> control,
                       std::vector<int> world_ranks)
    : ctx_(std::move(context)), id_(id), rank_(control->rank()), size_(control->size()),
      world_ranks_(std::move(world_ranks)), control_(std::move(control)), wire_(control_->wire_counters()),
      negotiator_(rank_, size_), params_(options.params),
      device_fusion_threshold_bytes_(options.device_fusion_threshold_bytes),
      device_cycle_time_ms_(options.device_cycle_time_ms), cache_capacity_(options.cache_capacity),
      timer_(options.track_steps), stall_(options.stall, rank_, world_ranks_, ctx_.world_rank) {
  ChannelHooks hooks;
  hooks.piece_done = [this](Request* r) { piece_done(r); };
  hooks.unit_failed = [this](Unit* u, const std::string& what, ErrorKind kind) { unit_failed(u, what, kind); };
  hooks.recycle = [this](Unit* u) { unit_pool_.put(u); };
  hooks.timeline = &ctx_.timeline;
  hooks.faults = &ctx_.faults;
  ChannelConfig config;
  config.hierarchical_allgather = options.hierarchical_allgather;
  config.huge_pages = options.huge_pages;
  // One allgather of host keys at creation: a set on one host keeps MPI's shared-memory paths only.
  HostLayout layout = HostLayout::exchange(*control_, options.host_key);
  if (layout.hosts > 1) config.layout = std::make_shared<const HostLayout>(std::move(layout));
  config.links = options.links;
  config.links.cancel = &is_dead_;
  config.links.world_ranks = world_ranks_;
  // Channels beyond params.channels (up to channels_created) wait idle until a TUNE request activates them:
  // they are created now because creating one is collective.
  for (int i = 0; i < std::max(1, options.channels_created); ++i)
    channels_.emplace_back(new Channel(control_->dup(), config, hooks));
  lane_ = std::make_unique<EngineLane>(control_->dup(), hooks, options.engine_lane_bytes);
  device_channel_ = std::make_shared<DeviceChannel>(&ctx_.device_queue, hooks, id);
  buckets_.configure(params_.device_bucket_bytes);
}

ProcessSet::~ProcessSet() = default;

// -- user threads ------------------------------------------------------------------------------------------
Error ProcessSet::submit(const std::vector<Request*>& requests) {
  std::lock_guard<std::mutex> lock(mu_);
  if (is_dead_.load()) return {ErrorKind::INTERNAL, dead_};
  for (Request* r : requests)
    if (inflight_.count(r->name))
      return {ErrorKind::VALUE, "perseus: a request named " + py_repr(r->name) +
                                    " is already in flight on this rank; wait for it (synchronize) before "
                                    "submitting the name again, or give the new request another name."};
  if (requests.size() > 1) {
    std::set<std::string> names;
    for (Request* r : requests) names.insert(r->name);
    if (names.size() != requests.size())
      return {ErrorKind::VALUE, "perseus: a grouped request names the same tensor twice"};
  }
  if (timer_.on()) {
    const int64_t now = now_ns();
    for (Request* r : requests) timer_.submitted(*r, now);
  }
  for (Request* r : requests) {
    r->dispatched = false;
    r->awaited.store(false, std::memory_order_relaxed);
    inflight_nodes_.put(inflight_, r->name, r);
    incoming_.push_back(r);
    if (r->sig.device < 0) host_dirty_.store(true, std::memory_order_relaxed);
  }
  incoming_count_.store(static_cast<int>(incoming_.size()), std::memory_order_release);
  if (first_dirty_ns_.load(std::memory_order_relaxed) == 0) first_dirty_ns_.store(now_ns());
  return Error();
}

Error ProcessSet::submit_join(Handle* h) {
  std::lock_guard<std::mutex> lock(mu_);
  if (is_dead_.load()) return {ErrorKind::INTERNAL, dead_};
  if (join_handle_ != nullptr)
    return {ErrorKind::VALUE, "perseus.join(): this rank has already joined; wait for the join to complete"};
  join_handle_ = h;
  join_waiting_.store(true);
  host_dirty_.store(true, std::memory_order_relaxed);
  if (first_dirty_ns_.load(std::memory_order_relaxed) == 0) first_dirty_ns_.store(now_ns());
  return Error();
}

TuneParams ProcessSet::params() {
  std::lock_guard<std::mutex> lock(mu_);
  return params_;
}

int ProcessSet::max_channels() const { return static_cast<int>(channels_.size()); }

void ProcessSet::steps(int64_t since, int64_t* first, std::vector<StepSample>* out) {
  std::lock_guard<std::mutex> lock(mu_);
  timer_.steps(since, first, out);
}

// -- engine thread -----------------------------------------------------------------------------------------
bool ProcessSet::has_work() {
  return !pending_.empty() || incoming_count_.load(std::memory_order_acquire) != 0 ||
         join_waiting_.load(std::memory_order_acquire);
}

StepResult ProcessSet::step(double now) {
  if (now - last_poll_ >= kControlPollS) {
    last_poll_ = now;
    poll_control();
  }
  if (is_dead_.load()) {
    // Requests this thread still holds can never run: release them (their handles already failed).
    release_held({ErrorKind::INTERNAL, dead_});
    return {false, false, 1e300};
  }
  const bool moved = lane_->step();
  StepResult r = step_rounds(now);
  r.progressed = r.progressed || moved;
  r.waiting = r.waiting || lane_->busy();  // polled again at once (a backoff while nothing moves)
  return r;
}

// The negotiation state machine's part of a step (process_set.h's rules).
StepResult ProcessSet::step_rounds(double now) {
  switch (state_) {
    case State::IDLE:
      return maybe_start(now);
    case State::BAND:
      if (!op_->test()) {
        check_stall(now);
        return {false, true, 1e300};
      }
      finish_band();
      return {true, state_ != State::IDLE, now};
    case State::EXCHANGE:
      if (!op_->test()) {
        check_stall(now);
        return {false, true, 1e300};
      }
      return step_exchange(now);
    case State::JOINGATHER:
      if (!op_->test()) return {false, true, 1e300};
      finish_join();
      return {true, false, now};
  }
  return {};
}

// Fail and release what the engine thread holds and no channel has: the queue and the pending requests.
void ProcessSet::release_held(const Error& error) {
  std::vector<Request*> drop;
  {
    std::lock_guard<std::mutex> lock(mu_);
    drop.swap(incoming_);
    incoming_count_.store(0);
  }
  for (auto& kv : pending_) drop.push_back(kv.second);
  pending_.clear();
  for (Request* r : drop) finish(r, &error);
  // Negotiated requests held in device buckets: no unit will carry them now.
  drop.clear();
  buckets_.take_all_held(&drop);
  for (Request* r : drop) {
    if (r->phantom) {
      delete r;
      continue;
    }
    forget(r);
    finish(r, &error);
  }
  lane_->release();  // its units' requests carry the error already
}

// -- failure and closing -----------------------------------------------------------------------------------
void ProcessSet::mark_dead(const std::string& message) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!is_dead_.load()) {
    dead_ = message;
    is_dead_.store(true);
  }
}

void ProcessSet::fail_all(const Error& error, bool dispatched) {
  std::vector<Request*> failed;
  Handle* join = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = inflight_.begin(); it != inflight_.end();) {
      if (dispatched || !it->second->dispatched) {
        failed.push_back(it->second);
        it = inflight_nodes_.erase(inflight_, it);
      } else {
        ++it;
      }
    }
    std::swap(join, join_handle_);
    join_waiting_.store(false);
  }
  // Only the error is set here; whoever holds a request (engine thread, channel) releases it.
  for (Request* r : failed) ctx_.handles.finish_request(r, &error);
  if (join != nullptr) ctx_.handles.set_join_result(join, -1, &error);
}

bool ProcessSet::close(bool notify_peers) {
  const double timeout = is_dead_.load() ? 0.5 : 5.0;
  // Drain the channels first: by the time peers hear of the shutdown, this rank has taken part in every
  // collective it had agreed to.
  bool clean = true;
  for (auto& ch : channels_) clean = ch->stop(timeout) && clean;
  clean = device_channel_->stop(timeout) && clean;
  // A broken transport cannot carry the notice; closing must still finish (this runs outside the engine
  // thread's try block, where an exception would terminate the process). The flush also sends an abort
  // queued just before.
  try {
    if (notify_peers) send_to_all(encode(ShutdownMessage{}));
    control_->flush_messages(2.0);
  } catch (const std::exception&) {
    // A broken transport: the peers see their own transport error; closing must still finish.
  }
  // Whatever this thread still holds will never run.
  release_held({ErrorKind::INTERNAL, "perseus has been shut down"});
  return clean;
}

}  // namespace perseus
