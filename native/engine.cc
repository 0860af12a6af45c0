// The engine thread and its lifecycle (see engine.h).
#include "engine.h"

#include <pthread.h>
#include <sched.h>
#include <sys/prctl.h>

#include <algorithm>
#include <chrono>
#include <cstring>

#include "control.h"

namespace perseus {

namespace {

constexpr double kIdleSpinS = 50e-6;
constexpr double kDrainS = 2.0;  // longest a shutdown waits for rounds in flight
constexpr double kFirstIdleWaitS = 50e-6;
constexpr double kBusyWaitMaxS = 1e-3;  // the longest idle sleep while some set has work pending

// Sets whose channel threads could not be stopped (stuck in a collective a dead peer will never finish)
// stay allocated: those threads still point at them.
std::vector<std::shared_ptr<ProcessSet>>& abandoned() {
  static auto* sets = new std::vector<std::shared_ptr<ProcessSet>>();
  return *sets;
}

// Waiting for peers inside a round: spin (yielding the core) for a while, since the answer usually comes
// within microseconds, then sleep for growing intervals.
class Backoff {
 public:
  void reset() { spins_ = 0, delay_s_ = 0; }
  void wait() {
    if (spins_ < 200) {
      ++spins_;
      sched_yield();
      return;
    }
    delay_s_ = delay_s_ == 0 ? 20e-6 : std::min(delay_s_ * 2, 1e-3);
    std::this_thread::sleep_for(std::chrono::duration<double>(delay_s_));
  }

 private:
  int spins_ = 0;
  double delay_s_ = 0;
};

}  // namespace

size_t abandoned_process_sets() { return abandoned().size(); }

Engine::Engine(Settings settings, int world_rank, Completion* completion, EngineHooks hooks)
    : settings_(settings), world_rank_(world_rank), handles_(completion), hooks_(std::move(hooks)) {}

Engine::~Engine() {
  if (thread_.joinable()) {
    if (exited_.load()) thread_.join(); else thread_.detach();
  }
}

void Engine::start() {
  started_ = true;
  thread_ = std::thread([this] { run(); });
  // Named and placed here, before start() returns, so both hold from the thread's first instruction on.
  pthread_setname_np(thread_.native_handle(), "perseus-engine");  // as profilers and /proc show it
  if (settings_.cpu_core >= 0) {  // the engine thread only: channel and user threads keep their placement
    cpu_set_t cores;
    CPU_ZERO(&cores);
    CPU_SET(settings_.cpu_core, &cores);
    if (pthread_setaffinity_np(thread_.native_handle(), sizeof(cores), &cores) != 0 && hooks_.log)
      hooks_.log(30, "perseus: cannot pin the engine thread to core " + std::to_string(settings_.cpu_core) +
                 "; it runs where the system places it");
  }
}

// What a set uses of the engine: the engine's tables, recorders and queue, its hooks and its abort().
SetContext Engine::set_context() {
  return SetContext{handles_, timeline_, faults_, device_queue_, hooks_, world_rank_,
                    [this](const std::string& message, int origin, bool propagate, ErrorKind kind) {
                      abort(message, origin, propagate, kind);
                    }};
}

// A new set's options, from the engine's settings.
SetOptions Engine::set_options() const {
  const Settings& s = settings_;
  SetOptions o;
  o.params.fusion_threshold_bytes = s.fusion_threshold_bytes;
  o.params.inplace_threshold_bytes = s.inplace_threshold_bytes;
  o.params.channels = std::max(1, s.num_channels);
  o.params.cycle_time_ms = s.cycle_time_ms;
  o.params.algorithm = s.algorithm;
  o.channels_created = std::max({1, s.num_channels, s.max_channels});
  o.device_fusion_threshold_bytes = s.device_fusion_threshold_bytes;
  o.params.device_bucket_bytes = s.device_bucket_bytes;
  o.device_cycle_time_ms = s.device_cycle_time_ms;
  o.cache_capacity = s.cache_capacity;
  o.track_steps = s.track_steps;
  o.stall.disable = s.stall_check_disable;
  o.stall.check_time_s = s.stall_check_time_s;
  o.stall.shutdown_time_s = s.stall_shutdown_time_s;
  o.host_key = s.host_key;
  o.hierarchical_allgather = s.hierarchical_allgather;
  o.huge_pages = s.huge_pages;
  o.engine_lane_bytes = s.engine_lane_bytes;
  o.links.interfaces = s.network_interfaces;
  o.links.timeout_s = s.link_timeout_s;
  return o;
}

void Engine::add_process_set(int id, std::unique_ptr<Comm> control, std::vector<int> world_ranks) {
  auto set = std::make_shared<ProcessSet>(set_context(), set_options(), id, std::move(control),
                                          std::move(world_ranks));
  std::lock_guard<std::mutex> lock(mu_);
  sets_[id] = set;
  if (id >= 0 && id < kFastSets) fast_[id].store(set.get());
  control_dirty_.store(true);
  cv_.notify_one();
}

void Engine::remove_process_set(int id) {
  std::shared_ptr<ProcessSet> set;
  std::unique_lock<std::mutex> lock(mu_);
  auto it = sets_.find(id);
  if (it == sets_.end()) return;
  set = it->second;
  sets_.erase(it);
  if (id >= 0 && id < kFastSets) fast_[id].store(nullptr);
  retired_.push_back(set);
  control_dirty_.store(true);
  lock.unlock();
  set->fail_all({ErrorKind::INTERNAL, "perseus: process set " + std::to_string(id) + " was removed"}, true);
  lock.lock();
  if (started_ && !exited_.load()) {
    // The engine thread may be stepping the set right now: let it close the set between steps.
    to_close_.push_back(set);
    control_dirty_.store(true);
    uint64_t target = ++close_generation_;
    cv_.notify_one();
    closed_cv_.wait(lock, [&] { return closed_done_ >= target || exited_.load(); });
    return;
  }
  lock.unlock();
  set->mark_dead("perseus: process set " + std::to_string(id) + " was removed");
  if (!set->close(false)) abandoned().push_back(set);
}

void Engine::shutdown(double timeout_s) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    stopping_.store(true);
    control_dirty_.store(true);
  }
  cv_.notify_one();
  if (!started_) {
    close_all();
    exited_.store(true);
    return;
  }
  auto deadline = Clock::now() + std::chrono::duration<double>(timeout_s);
  while (!exited_.load() && Clock::now() < deadline) std::this_thread::sleep_for(std::chrono::microseconds(500));
  if (exited_.load()) {
    if (thread_.joinable()) thread_.join();
  } else {
    clean_.store(false);
  }
}

std::shared_ptr<ProcessSet> Engine::find(int ps_id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = sets_.find(ps_id);
  return it == sets_.end() ? nullptr : it->second;
}

bool Engine::set_exists(int ps_id) { return find(ps_id) != nullptr; }

bool Engine::set_params(int ps_id, TuneParams* params, int* max_channels) {
  auto set = find(ps_id);
  if (!set) return false;
  *params = set->params();
  *max_channels = set->max_channels();
  return true;
}

bool Engine::set_steps(int ps_id, int64_t since, int64_t* first, std::vector<StepSample>* out) {
  auto set = find(ps_id);
  if (!set) return false;
  set->steps(since, first, out);
  return true;
}

bool Engine::set_wire_bytes(int ps_id, WireBytes* out) {
  auto set = find(ps_id);
  if (!set) return false;
  *out = set->wire_bytes();
  return true;
}

int Engine::set_size(int ps_id) {
  auto set = find(ps_id);
  return set ? set->size() : 0;
}

Error Engine::failed() {
  if (!has_failed_.load()) return Error();
  std::lock_guard<std::mutex> lock(mu_);
  return failed_;
}

static Error not_registered(int ps_id) {
  return {ErrorKind::VALUE, "perseus: process set " + std::to_string(ps_id) +
                                " is not registered on this rank (this rank is not a member, or the set was removed)"};
}

Error Engine::submit(int ps_id, Handle* h) {
  if (has_failed_.load()) return {ErrorKind::INTERNAL, failed().message};
  if (stopping_.load()) return {ErrorKind::INTERNAL, "perseus has been shut down; call init() again to use it"};
  std::shared_ptr<ProcessSet> holder;
  ProcessSet* set = ps_id >= 0 && ps_id < kFastSets ? fast_[ps_id].load() : nullptr;
  if (set == nullptr) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = sets_.find(ps_id);
    if (it == sets_.end()) return not_registered(ps_id);
    holder = it->second;
    set = holder.get();
  }
  const double t = now_s();
  for (Request* r : h->requests) r->submit_time = t;
  h->unfinished.store(static_cast<int>(h->requests.size()), std::memory_order_relaxed);
  h->engine_refs.store(static_cast<int>(h->requests.size()), std::memory_order_relaxed);
  if (h->requests.empty()) h->done.store(1);
  if (timeline_.on())
    for (Request* r : h->requests) timeline_.record(TimelineKind::NEGOTIATE_START, r->sig.op_type, r->name);
  Error err = set->submit(h->requests);
  if (!err) wake();
  return err;
}

Error Engine::join(int ps_id, Handle* h) {
  if (has_failed_.load()) return {ErrorKind::INTERNAL, failed().message};
  auto set = find(ps_id);
  if (!set) return not_registered(ps_id);
  h->is_join = true;
  h->unfinished.store(1);
  h->engine_refs.store(1);
  Error err = set->submit_join(h);
  if (!err) wake();
  return err;
}

void Engine::note_awaited(Handle* h) {
  if (h->done.load(std::memory_order_acquire)) return;
  int ps_id = -1;
  for (Request* r : h->requests)
    if (r->sig.device >= 0 && r->sig.op_type == OpType::ALLREDUCE &&
        !r->awaited.exchange(true, std::memory_order_acq_rel))
      ps_id = r->ps_id;
  if (ps_id < 0) return;  // no device all-reduce, or already noted
  // (The lock-free lookup submit() uses; other sets through the table.)
  ProcessSet* set = ps_id < kFastSets ? fast_[ps_id].load() : nullptr;
  std::shared_ptr<ProcessSet> holder;
  if (set == nullptr) {
    holder = find(ps_id);
    set = holder.get();
  }
  if (set != nullptr) {
    set->note_awaited();
    wake();
  }
}

void Engine::wake() {
  // Lock-free unless the engine thread is waiting: it sets idle_ under mu_ and re-checks submissions before
  // it waits, so a submission is either seen by that check or finds idle_ set and notifies.
  submissions_.fetch_add(1);
  if (idle_.load()) {
    std::lock_guard<std::mutex> lock(mu_);
    cv_.notify_one();
  }
}

void Engine::abort(const std::string& message_in, int origin, bool propagate, ErrorKind kind) {
  std::string message = message_in;
  if (origin != world_rank_) {
    message = "perseus: rank " + std::to_string(origin) + " failed and stopped the job: " + message_in;
    kind = ErrorKind::INTERNAL;
  }
  if (kind != ErrorKind::STALL) kind = ErrorKind::INTERNAL;
  std::vector<std::shared_ptr<ProcessSet>> sets;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (has_failed_.load()) return;
    failed_ = {kind, message};
    has_failed_.store(true);
    for (auto& kv : sets_) sets.push_back(kv.second);
    if (propagate) outbox_.push_back(encode(AbortMessage{origin, message_in}));
    logs_.push_back(message);
    control_dirty_.store(true);
    cv_.notify_one();
  }
  Error error{kind, message};
  for (auto& s : sets) {
    s->mark_dead(message);
    s->fail_all(error, true);
  }
}

// The engine thread's own state.
struct Engine::Loop {
  Sets sets, closing;  // copies of sets_ and to_close_, taken when control_dirty_ is set
  std::vector<std::string> outbox, logs;
  Backoff backoff;
  double idle_wait = kFirstIdleWaitS;
};

void Engine::run() {
  prctl(PR_SET_TIMERSLACK, 1000, 0, 0, 0);  // wake short sleeps on time (default slack adds ~50 us)
  Loop loop;
  try {
    while (turn(&loop)) {
    }
  } catch (const std::exception& e) {  // reported: every rank's pending work fails with the cause
    fail_thread(e, loop.sets);
  }
  drain(loop.sets);
  loop.sets.clear();
  close_all();
  {
    std::lock_guard<std::mutex> lock(mu_);
    closed_done_ = close_generation_;
  }
  exited_.store(true);
  closed_cv_.notify_all();
}

// One turn of the engine loop: take what changed, step every set once, then wait as the sets' state asks
// (not at all after progress, a backoff inside a round, else spin and sleep). False when stopping.
bool Engine::turn(Loop* loop) {
  if (control_dirty_.load(std::memory_order_acquire) && !take_control(loop)) return false;
  close_removed(&loop->closing);
  send_outbox(loop->sets, &loop->outbox);
  write_logs(&loop->logs);
  const uint64_t seen = submissions_.load();
  const double now = now_s();
  bool progressed = false, waiting = false;
  double deadline = 1e300;
  for (auto& s : loop->sets) {
    StepResult r = s->step(now);
    progressed |= r.progressed;
    waiting |= r.waiting;
    deadline = std::min(deadline, r.deadline);
  }
  if (progressed) {
    loop->backoff.reset();
    loop->idle_wait = kFirstIdleWaitS;
    return true;
  }
  if (waiting) {
    loop->backoff.wait();
    return true;
  }
  return idle(loop, seen, deadline);
}

// Copy what user threads changed (sets, sets to close, aborts to send, lines to log). False when stopping:
// close_all() then sends what is still in the outbox.
bool Engine::take_control(Loop* loop) {
  std::lock_guard<std::mutex> lock(mu_);
  control_dirty_.store(false);
  if (stop_) return false;
  loop->sets.clear();
  for (auto& kv : sets_) loop->sets.push_back(kv.second);
  loop->closing.swap(to_close_);
  loop->outbox.swap(outbox_);
  loop->logs.swap(logs_);
  return true;
}

// Close the sets remove_process_set() handed over, between steps, and wake the threads waiting for that.
void Engine::close_removed(Sets* closing) {
  if (closing->empty()) return;
  for (auto& s : *closing) {
    s->mark_dead("perseus: process set " + std::to_string(s->id()) + " was removed");
    s->step(now_s());  // releases what it still holds
    if (!s->close(false)) abandoned().push_back(s);
  }
  closing->clear();
  std::lock_guard<std::mutex> lock(mu_);
  closed_done_ = close_generation_;
  closed_cv_.notify_all();
}

// Nothing to do: first spin (yielding) a little, since the next request of a step or of a loop of small
// synchronous collectives usually comes within microseconds; then sleep until a submission, a change or
// the earliest deadline of a set, for at most idle_wait (doubled each time, capped: short while some set
// has work, idle_poll_max_ms otherwise, the longest a control message waits). False when stopping.
bool Engine::idle(Loop* loop, uint64_t seen, double deadline) {
  if (loop->idle_wait == kFirstIdleWaitS) {  // only right after progress
    const double spin_until = now_s() + kIdleSpinS;
    while (submissions_.load() == seen && now_s() < spin_until) sched_yield();
    if (submissions_.load() != seen) return true;
  }
  std::unique_lock<std::mutex> lock(mu_);
  idle_.store(true);
  if (stop_) {
    idle_.store(false);
    return false;
  }
  if (submissions_.load() != seen || control_dirty_.load() || !to_close_.empty() || !outbox_.empty() ||
      !logs_.empty()) {
    idle_.store(false);
    return true;
  }
  lock.unlock();
  bool has_work = false;
  for (auto& s : loop->sets) has_work = has_work || s->has_work();
  lock.lock();
  const double cap = has_work ? kBusyWaitMaxS : settings_.idle_poll_max_ms * 1e-3;
  const double timeout = std::max(std::min({deadline - now_s(), loop->idle_wait, cap}), 0.0);
  if (submissions_.load() == seen && !stop_ && !control_dirty_.load())
    cv_.wait_for(lock, std::chrono::duration<double>(timeout));
  idle_.store(false);
  loop->idle_wait = std::min(loop->idle_wait * 2, cap);
  return true;
}

// The engine thread failed: fail every rank, and send the abort before closing. The transport that just
// failed may refuse these sends too; nothing more can be told to peers then (an exception escaping here
// would terminate the process).
void Engine::fail_thread(const std::exception& e, const Sets& sets) {
  abort(std::string("perseus engine thread failed: ") + e.what(), world_rank_, true, ErrorKind::INTERNAL);
  std::vector<std::string> out;
  {
    std::lock_guard<std::mutex> lock(mu_);
    out.swap(outbox_);
  }
  try {
    send_outbox(sets, &out);
  } catch (const std::exception&) {
    // The transport that failed refuses this too: the cause is reported already (abort above).
  }
}

// Finish the negotiation rounds already started, without starting new ones: a peer that is in the same
// round finishes it too and dispatches the same units, so the channels drain the same collectives on every
// rank. Left unfinished, a peer that completed the round would wait forever in a unit this rank never runs.
void Engine::drain(const Sets& sets) {
  if (has_failed_.load()) return;
  try {
    Backoff backoff;
    const double give_up = now_s() + kDrainS;
    for (auto& s : sets) s->begin_drain();
    for (;;) {
      bool busy = false;
      for (auto& s : sets) busy = s->step(now_s()).waiting || busy;
      if (!busy || now_s() > give_up) break;
      backoff.wait();
    }
  } catch (const std::exception&) {
    // The transport failed: nothing more can be finished.
  }
}

// Abort messages go to set 0's peers (every rank is a member of it). Throws what the transport throws.
void Engine::send_outbox(const Sets& sets, std::vector<std::string>* outbox) {
  if (outbox->empty()) return;
  for (auto& s : sets)
    if (s->id() == 0)
      for (auto& m : *outbox) s->send_to_all(m);
  outbox->clear();
}

void Engine::write_logs(std::vector<std::string>* logs) {
  for (auto& m : *logs)
    if (hooks_.log) hooks_.log(40, m);
  logs->clear();
}

void Engine::close_all() {
  Sets sets;
  std::vector<std::string> logs, outbox;
  bool notify;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& kv : sets_) sets.push_back(kv.second);
    sets_.clear();
    for (auto& s : to_close_) sets.push_back(s);
    to_close_.clear();
    notify = !has_failed_.load();
    logs.swap(logs_);
    outbox.swap(outbox_);
  }
  write_logs(&logs);
  // An abort not sent yet (the failure happened just before shutdown) must still reach the peers, or they
  // would wait forever in the collective this rank abandoned.
  // (A broken transport refuses: nothing more can be told then, and an exception must not escape here.)
  try {
    send_outbox(sets, &outbox);
  } catch (const std::exception& e) {
    // Shutting down on a broken transport: the peers learn of it from their own transport errors.
    if (hooks_.log)
      hooks_.log(30, std::string("perseus: the last control messages could not be sent at shutdown: ") + e.what());
  }
  for (auto& s : sets) {
    s->fail_all({ErrorKind::INTERNAL, "perseus has been shut down"}, true);
    if (!s->close(notify)) {
      clean_.store(false);
      abandoned().push_back(s);
    }
  }
  // The launcher's wait for device units ends: every set's device channel has drained or given up.
  device_queue_.stop();
}

}  // namespace perseus
