// The engine thread (see engine.h): its loop (take what user threads changed, step every set, then spin,
// back off or sleep as the sets' state asks), closing removed sets, and the way out: draining the rounds in
// flight, sending the aborts not yet sent, and closing every set. An exception from a step fails the engine
// on every rank (abort) instead of escaping the thread.
#include <sched.h>
#include <sys/prctl.h>

#include <algorithm>
#include <chrono>
#include <thread>

#include "engine.h"
#include "engine_abandoned.h"

namespace perseus {

namespace {

constexpr double kIdleSpinS = 50e-6;
constexpr double kDrainS = 2.0;  // longest a shutdown waits for rounds in flight
constexpr double kFirstIdleWaitS = 50e-6;
constexpr double kBusyWaitMaxS = 1e-3;  // the longest idle sleep while some set has work pending

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

using engine_detail::abandoned;

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
