// Stage 2 driver: the negotiation rounds of one process set (see process_set.h for the rules and
// negotiation.h for what a round computes). Engine thread only.
#include <algorithm>

#include "control.h"
#include "process_set.h"

namespace perseus {

StepResult ProcessSet::maybe_start(double now) {
  if (draining_) return {false, false, 1e300};
  // A user waits for a request held in a device bucket that cannot fill: ask every rank for a flush (a round
  // that carries the flag; this rank starts it as if it had new work).
  if (buckets_.any_open() && !flush_wanted_ &&
      (awaited_news_.exchange(false, std::memory_order_acq_rel) || recheck_buckets_)) {
    recheck_buckets_ = false;
    if (buckets_stuck()) {
      flush_wanted_ = true;
      int64_t zero = 0;
      first_dirty_ns_.compare_exchange_strong(zero, now_ns());
    }
  }
  const int64_t first_dirty = first_dirty_ns_.load();
  const bool dirty = first_dirty != 0;
  const bool woken = woken_round_ >= round_;
  if (dirty && !woken) {
    const double start_at = first_dirty * 1e-9 + start_delay_ms() * 1e-3;
    if (now < start_at) return {false, false, start_at};
    if (!continue_mode_) send_to_all(encode(WakeMessage{round_}));
  } else if (!(woken || (continue_mode_ && has_work()))) {
    double deadline = 1e300;
    if (has_work()) {
      check_stall(now);
      if (stall_.probing()) deadline = now + 1e-3;
    }
    return {false, false, deadline};
  }
  start_round();
  return {true, true, now};
}

// How long after the first new request a round starts. Only device requests new while a burst is under way
// (the last round found work and earlier requests are still in flight): the device cycle (an NCCL launch
// costs more than a round), so that the gradients of a backward pass travel in few units. A device request
// reaching an idle set (a loop of synchronous calls) is negotiated at once, like any other. Once device buckets
// are planned they decide what travels together, so rounds need not wait: a bucket's last gradient is
// negotiated (and the bucket launched) as soon as it arrives.
double ProcessSet::start_delay_ms() {
  bool device_burst = continue_mode_ && !host_dirty_.load(std::memory_order_relaxed) && !buckets_.planned();
  if (device_burst) {
    std::lock_guard<std::mutex> lock(mu_);
    device_burst = inflight_.size() > incoming_.size();
  }
  return device_burst ? std::max(params_.cycle_time_ms, device_cycle_time_ms_) : params_.cycle_time_ms;
}

void ProcessSet::start_round() {
  bool joined;
  {
    std::lock_guard<std::mutex> lock(mu_);
    round_dirty_ = first_dirty_ns_.load() != 0;
    first_dirty_ns_.store(0);
    host_dirty_.store(false, std::memory_order_relaxed);
    for (Request* r : incoming_) pending_nodes_.put(pending_, r->name, r);
    incoming_.clear();
    incoming_count_.store(0, std::memory_order_release);
    joined = join_handle_ != nullptr;
  }
  round_joined_ = joined;
  const bool flush = flush_wanted_;
  flush_wanted_ = false;
  negotiator_.build_words(pending_, round_dirty_, joined, flush);
  if (joined && join_round_ < 0) join_round_ = round_;
  ctx_.timeline.record(TimelineKind::CYCLE, OpType::ALLREDUCE, std::string());
  auto& words = negotiator_.words();
  op_ = control_->iallreduce_band(words.data(), words.size());
  state_ = State::BAND;
}

void ProcessSet::finish_band() {
  const bool exchange = negotiator_.decode(&result_);
  if (exchange) {
    // Joined as this round's band said (not as now: join() may have been called since), or ranks would
    // disagree with the band's flags and run a non-allreduce op against a rank that joined meanwhile.
    negotiator_.exchange_payload(pending_, round_joined_, &payload_);
    sizes_mine_.assign(1, static_cast<int64_t>(payload_.size()));
    sizes_all_.assign(size_, 0);
    exchange_phase_ = 0;
    op_ = control_->iallgather_i64(sizes_mine_.data(), 1, sizes_all_.data());
    state_ = State::EXCHANGE;
    return;
  }
  finish_round();
}

// The exchange's operation in flight has completed: after the sizes, gather every rank's pending list; after
// the lists, merge them and finish the round.
StepResult ProcessSet::step_exchange(double now) {
  if (exchange_phase_ == 0) {
    std::vector<size_t> counts(size_);
    size_t total = 0;
    for (int r = 0; r < size_; ++r) counts[r] = static_cast<size_t>(sizes_all_[r]), total += counts[r];
    gathered_.resize(std::max<size_t>(total, 1));
    exchange_phase_ = 1;
    op_ = control_->iallgatherv_bytes(payload_.data(), payload_.size(), gathered_.data(), counts);
    return {true, true, now};
  }
  std::vector<std::string> payloads(size_);
  size_t off = 0;
  for (int r = 0; r < size_; ++r) {
    payloads[r].assign(reinterpret_cast<const char*>(gathered_.data()) + off, sizes_all_[r]);
    off += sizes_all_[r];
  }
  negotiator_.apply_exchange(&result_, payloads, world_ranks_, round_);
  finish_round();
  return {true, false, now};
}

void ProcessSet::finish_round() {
  Registry& reg = negotiator_.registry();
  negotiator_.reject_while_joined(&result_);
  for (int idx : result_.ready) reg.touch(idx, round_);
  ++round_;
  continue_mode_ = result_.any_dirty || !result_.ready.empty() || !result_.errors.empty();
  fail_mismatches();
  negotiator_.order(&result_);
  take_ready();
  state_ = State::IDLE;
  if (!ready_.empty() || (result_.any_flush && buckets_.any_open())) dispatch(ready_, result_.any_flush);
  // Same names on every rank (use is counted in agreed rounds); after dispatch, which still reads them.
  reg.evict(cache_capacity_);
  if (result_.all_joined) {
    join_mine_[0] = join_round_;
    join_mine_[1] = rank_;
    join_all_.assign(2 * size_, 0);
    op_ = control_->iallgather_i64(join_mine_, 2, join_all_.data());
    state_ = State::JOINGATHER;
  }
}

// The round's errors (every rank has the same): fail this rank's requests of those names.
void ProcessSet::fail_mismatches() {
  for (auto& e : result_.errors) {
    auto it = pending_.find(e.first);
    if (it == pending_.end()) continue;
    Request* r = it->second;
    pending_nodes_.erase(pending_, it);
    forget(r);
    const Error err{ErrorKind::MISMATCH, e.second};
    finish(r, &err);
  }
}

// The round's ready names, in execution order, into ready_: this rank's requests, or phantoms where it has
// joined and has none.
void ProcessSet::take_ready() {
  ready_.clear();
  for (int idx : result_.ready) {
    auto it = pending_.find(negotiator_.registry().name(idx));
    if (it != pending_.end()) {
      ready_.push_back(it->second);
      pending_nodes_.erase(pending_, it);
    } else {
      ready_.push_back(phantom(idx));
    }
  }
}

void ProcessSet::finish_join() {
  int last = 0;
  for (int r = 1; r < size_; ++r)
    if (join_all_[2 * r] >= join_all_[2 * last]) last = r;
  Handle* h;
  {
    std::lock_guard<std::mutex> lock(mu_);
    h = join_handle_;
    join_handle_ = nullptr;
    join_waiting_.store(false);
  }
  join_round_ = -1;
  state_ = State::IDLE;
  if (h != nullptr) ctx_.handles.set_join_result(h, id_ == 0 ? world_ranks_[last] : last, nullptr);
}

// Stand-in for an allreduce this joined rank did not submit: it contributes zeros, results are discarded.
// (While a rank is joined only allreduce runs: see Negotiator::reject_while_joined.)
Request* ProcessSet::phantom(int idx) {
  const Signature& sig = negotiator_.registry().signature(idx);
  Request* r = new Request();
  r->name = negotiator_.registry().name(idx);
  r->sig = sig;
  r->shape = sig.shape;
  r->phantom = true;
  r->ps_id = id_;
  r->phantom_data.assign(r->nbytes(), 0);
  r->output = r->phantom_data.data();
  return r;
}

}  // namespace perseus
