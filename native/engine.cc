// The engine's lifecycle and what user threads call (see engine.h): construction, start, adding and removing
// process sets, shutdown, submissions and joins, waking the engine thread, abort, and the queries about a
// set. The engine thread itself (Engine::run and what it calls) is in engine_loop.cc.
//
// add_process_set is collective over the set's ranks; remove_process_set fails the set's pending requests
// and waits for the engine thread to close it. Submissions report what is wrong (an unknown set, an engine
// that has failed or shut down) as an Error, not an exception.
#include "engine.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <chrono>

#include "control.h"
#include "engine_abandoned.h"

namespace perseus {

using engine_detail::abandoned;

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

}  // namespace perseus
