// Stages 3-6 as one process set drives them: negotiated requests become units (fusion.h), units go to the
// channels or to the device queue, TUNE requests change the set's parameters, and finished pieces complete
// their requests (see process_set.h).
#include <algorithm>

#include "process_set.h"

namespace perseus {

// Engine thread: whether some open device bucket holds a request a user waits for and misses a name this rank
// has not submitted (it never will while that user waits).
bool ProcessSet::buckets_stuck() {
  std::lock_guard<std::mutex> lock(mu_);
  return buckets_.stuck([this](const std::string& name) { return inflight_.count(name) != 0; });
}

// Engine thread.
void ProcessSet::dispatch(std::vector<Request*>& ready, bool flush) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (Request* r : ready) r->dispatched = true;
  }
  if (ctx_.timeline.on())
    for (Request* r : ready)
      if (!r->phantom) ctx_.timeline.record(TimelineKind::OP_START, r->sig.op_type, r->name);
  // TUNE requests take effect after this round's other requests are planned: the same point of the
  // negotiated sequence on every rank.
  tunes_.clear();
  size_t kept = 0;
  for (Request* r : ready) {
    if (r->sig.op_type == OpType::TUNE) tunes_.push_back(r);
    else ready[kept++] = r;
  }
  ready.resize(kept);
  // Device all-reduces of learned buckets wait in them; full buckets (and, on a flush, every open one) come back.
  // A TUNE that changes the budget flushes first: the plan is learned again under the new budget.
  for (Request* r : tunes_)
    if (r->shape.size() == 6 && r->shape[5] >= 0 && r->shape[5] != buckets_.budget()) flush = true;
  released_.clear();
  buckets_.take(&ready, &released_);
  if (flush) buckets_.flush(&released_);
  recheck_buckets_ = buckets_.any_open();
  units_.clear();
  plan_units(ready, params_.fusion_threshold_bytes, params_.inplace_threshold_bytes, size_, &unit_pool_, &units_,
             device_fusion_threshold_bytes_);
  // A released bucket is one unit: its members are each below the budget and together at most the budget.
  const int64_t bucket_limit = std::max(device_fusion_threshold_bytes_, buckets_.budget());
  for (auto& bucket : released_)
    plan_units(bucket, params_.fusion_threshold_bytes, params_.inplace_threshold_bytes, size_, &unit_pool_, &units_,
               bucket_limit);
  const size_t n = static_cast<size_t>(params_.channels);
  for (Unit* u : units_) {
    u->index = unit_counter_++;
    u->algorithm = params_.algorithm;
    // Never a blocking collective here: it waits until every peer joins it, and an engine thread blocked in
    // one could not receive the abort of a peer that failed before joining.
    // Small host all-reduces move on this thread, as non-blocking collectives step() polls (engine_lane.h).
    if (u->device >= 0)
      device_channel_->submit(u);  // the framework's launcher moves device memory, in this same order
    else if (lane_->takes(*u))
      lane_->submit(u);
    else
      channels_[u->index % n]->submit(u);
  }
  for (Request* r : tunes_) apply_tune(r);
}

// Engine thread. shape = (fusion_threshold_bytes, inplace_threshold_bytes, channels, cycle_time_us,
// algorithm[, device_bucket_bytes]); -1 keeps a value. Every rank got the same values (negotiation compares shapes),
// so every rank accepts or rejects them alike. A new bucket budget forgets the plan (dispatch flushed the open
// buckets).
void ProcessSet::apply_tune(Request* r) {
  const std::vector<int64_t>& v = r->shape;
  Error error;
  const int64_t max_channels = static_cast<int64_t>(channels_.size());
  auto keep = [&](size_t i) { return v[i] == -1; };  // -1: this value stays as it is
  if ((v.size() != 5 && v.size() != 6) || (v[0] < 0 && !keep(0)) || (v[1] < 0 && !keep(1)) ||
      (!keep(2) && (v[2] < 1 || v[2] > max_channels)) || (v[3] < 0 && !keep(3)) ||
      (!keep(4) && (v[4] < 0 || v[4] > 3)) || (v.size() == 6 && v[5] < 0)) {
    error = {ErrorKind::VALUE, "perseus: invalid run-time parameters " + py_repr(r->name) + ": expected (fusion "
             "bytes >= 0, in-place bytes >= 0, channels 1.." + std::to_string(max_channels) +
             ", cycle time us >= 0, algorithm 0..3[, device bucket bytes >= 0]; -1 keeps a value)"};
  } else {
    std::lock_guard<std::mutex> lock(mu_);
    if (!keep(0)) params_.fusion_threshold_bytes = v[0];
    if (!keep(1)) params_.inplace_threshold_bytes = v[1];
    if (!keep(2)) params_.channels = static_cast<int>(v[2]);
    if (!keep(3)) params_.cycle_time_ms = static_cast<double>(v[3]) * 1e-3;
    if (!keep(4)) params_.algorithm = static_cast<Algorithm>(v[4]);
    if (v.size() == 6 && v[5] != buckets_.budget()) {
      params_.device_bucket_bytes = v[5];
      buckets_.configure(v[5]);
    }
  }
  forget(r);
  ctx_.timeline.record(TimelineKind::OP_END, r->sig.op_type, r->name);
  finish(r, error ? &error : nullptr);
}

// Channel threads (and the launcher's, through the device channel): one piece of r has moved.
void ProcessSet::piece_done(Request* r) {
  if (r->remaining.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
  if (timer_.on()) timer_.finished(now_ns());
  if (r->phantom) {
    delete r;
    return;
  }
  forget(r);
  ctx_.timeline.record(TimelineKind::OP_END, r->sig.op_type, r->name);
  finish(r, nullptr);
}

// Channel threads: the transport failed inside u's collective. Every rank fails.
void ProcessSet::unit_failed(Unit* u, const std::string& what, ErrorKind kind) {
  std::string names;
  for (const Piece& p : u->pieces) {
    if (!names.empty()) names += ", ";
    names += p.request->name;
  }
  std::string message = std::string("perseus.") + op_name(u->op_type) + "(" + names + ") failed in the transport: " +
                        what;
  ctx_.abort(message, ctx_.world_rank, true, kind);
  // The channel is done with these requests: they already carry the abort's error.
  for (const Piece& p : u->pieces) piece_done(p.request);
}

// r is no longer in flight: its name may be submitted again (unless fail_all already took it out).
void ProcessSet::forget(Request* r) {
  std::lock_guard<std::mutex> lock(mu_);
  auto f = inflight_.find(r->name);
  if (f != inflight_.end() && f->second == r) inflight_nodes_.erase(inflight_, f);
}

// Complete r (with `error`, or successfully when null) and let go of its memory.
void ProcessSet::finish(Request* r, const Error* error) {
  ctx_.handles.finish_request(r, error);
  ctx_.handles.release_engine(r);
}

}  // namespace perseus
