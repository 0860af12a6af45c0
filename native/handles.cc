// Stage 6 (completion): finishing requests, waking waiters, recycling handles.
#include "handles.h"

#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <climits>
#include <cmath>

namespace perseus {

namespace {

void futex_wait(std::atomic<uint32_t>* word, uint32_t expected, const timespec* timeout) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT_PRIVATE, expected, timeout, nullptr, 0);
}

void futex_wake_all(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
}

// Wake the threads asleep on h->done, if any: a system call per finished request would cost more than
// the request. The sleeper registers before its last check of `done` (both sequentially consistent), so
// either it sees done == 1 or this sees it registered.
void wake_waiters(Handle* h) {
  if (h->sleepers.load() != 0) futex_wake_all(&h->done);
}

}  // namespace

HandleTable::~HandleTable() {
  // Whatever is left belongs to a finished engine; Python objects were released by clear().
  for (Handle* h : free_handles_) {
    for (Request* r : h->spare) delete r;
    delete h;
  }
}

Handle* HandleTable::new_handle() {
  Handle* h;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (free_handles_.empty()) {
      h = new Handle();
    } else {
      h = free_handles_.back();
      free_handles_.pop_back();
    }
    h->id = ++next_id_;
    live_nodes_.put(live_, h->id, h);
  }
  h->requests.clear();
  h->unfinished.store(0, std::memory_order_relaxed);
  h->engine_refs.store(0, std::memory_order_relaxed);
  h->done.store(0, std::memory_order_relaxed);
  h->sleepers.store(0, std::memory_order_relaxed);
  h->user_released.store(false, std::memory_order_relaxed);
  h->is_join = false;
  h->join_result = -1;
  h->error = Error();
  h->wants_callback = false;
  return h;
}

Request* HandleTable::new_request(Handle* h) {
  Request* r;
  if (!h->spare.empty()) {
    r = h->spare.back();
    h->spare.pop_back();
  } else {
    r = new Request();
  }
  h->requests.push_back(r);
  r->handle = h;
  open_requests_.fetch_add(1, std::memory_order_relaxed);
  return r;
}

Handle* HandleTable::find(int64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = live_.find(id);
  return it == live_.end() ? nullptr : it->second;
}

void HandleTable::release_user(Handle* h) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    live_nodes_.erase(live_, h->id);
  }
  h->user_released.store(true, std::memory_order_release);
  maybe_reclaim(h);
}

void HandleTable::clear() {
  std::vector<Handle*> handles;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& kv : live_) handles.push_back(kv.second);
    live_.clear();
  }
  for (Handle* h : handles) {
    h->user_released.store(true, std::memory_order_release);
    maybe_reclaim(h);
  }
}

void HandleTable::finish_request(Request* r, const Error* error) {
  if (r->finished.exchange(true, std::memory_order_acq_rel)) return;
  open_requests_.fetch_sub(1, std::memory_order_relaxed);
  Handle* h = r->handle;
  if (error != nullptr && *error) {
    std::lock_guard<std::mutex> lock(h->mu);
    if (!h->error) h->error = *error;
  }
  if (h->unfinished.fetch_sub(1, std::memory_order_acq_rel) == 1) {
    bool callback;
    {
      std::lock_guard<std::mutex> lock(h->mu);
      h->done.store(1);
      callback = h->wants_callback;
    }
    wake_waiters(h);
    if (callback) completion_->on_callback_due(h);
  }
}

void HandleTable::set_join_result(Handle* h, int64_t last_rank, const Error* error) {
  bool callback;
  {
    std::lock_guard<std::mutex> lock(h->mu);
    if (h->done.load(std::memory_order_acquire)) return;
    if (error != nullptr && *error) h->error = *error;
    h->join_result = last_rank;
    h->unfinished.store(0, std::memory_order_release);
    h->done.store(1);
    callback = h->wants_callback;
  }
  wake_waiters(h);
  if (callback) completion_->on_callback_due(h);
  if (h->engine_refs.fetch_sub(1, std::memory_order_acq_rel) == 1) maybe_reclaim(h);
}

void HandleTable::release_engine(Request* r) {
  Handle* h = r->handle;
  if (h->engine_refs.fetch_sub(1, std::memory_order_acq_rel) == 1) maybe_reclaim(h);
}

void HandleTable::maybe_reclaim(Handle* h) {
  if (!h->user_released.load(std::memory_order_acquire) || h->engine_refs.load(std::memory_order_acquire) != 0)
    return;
  // Both sides are done; exactly one caller gets here with the flag still set.
  if (!h->user_released.exchange(false, std::memory_order_acq_rel)) return;
  completion_->on_reclaim(h);
  recycle(h);
}

void HandleTable::recycle(Handle* h) {
  for (Request* r : h->requests) {
    r->finished.store(false, std::memory_order_relaxed);
    r->handle = nullptr;
    r->input = nullptr;
    r->output = nullptr;
    r->phantom = false;
    r->result.reset();
    r->result_bytes = 0;
    r->splits.clear();
    r->received_splits.clear();
    r->phantom_data.clear();
    if (h->spare.size() < 64) h->spare.push_back(r); else delete r;
  }
  h->requests.clear();
  h->extra.reset();
  std::lock_guard<std::mutex> lock(mu_);
  if (free_handles_.size() < 16384) {
    free_handles_.push_back(h);
  } else {
    for (Request* r : h->spare) delete r;
    delete h;
  }
}

void HandleTable::wait(Handle* h, double timeout_s, bool* timed_out) {
  *timed_out = false;
  // A short spin first: a small collective often completes within microseconds, and sleeping on the
  // futex costs a wake-up on both sides.
  // Yield while spinning: on a busy host the engine thread may need this core to finish the request.
  const double spin_until = now_s() + 60e-6;
  for (int i = 0; !h->done.load(std::memory_order_acquire); ++i) {
    if ((i & 7) == 7 && now_s() > spin_until) break;
    sched_yield();
  }
  double deadline = timeout_s >= 0 ? now_s() + timeout_s : 0;
  while (!h->done.load(std::memory_order_acquire)) {
    if (timeout_s >= 0) {
      double left = deadline - now_s();
      if (left <= 0) {
        *timed_out = true;
        return;
      }
      timespec ts;
      ts.tv_sec = static_cast<time_t>(left);
      ts.tv_nsec = static_cast<long>((left - std::floor(left)) * 1e9);
      h->sleepers.fetch_add(1);
      if (!h->done.load()) futex_wait(&h->done, 0, &ts);
      h->sleepers.fetch_sub(1);
    } else {
      h->sleepers.fetch_add(1);
      if (!h->done.load()) futex_wait(&h->done, 0, nullptr);
      h->sleepers.fetch_sub(1);
    }
  }
}

}  // namespace perseus
