// The run-time tuner's step timer (see step_timer.h).
#include "step_timer.h"

#include <algorithm>

namespace perseus {

StepTimer::StepTimer(bool on) : on_(on) {
  if (on_) steps_.reserve(kKept);
}

void StepTimer::submitted(const Request& r, int64_t now) {
  if (r.sig.op_type == OpType::TUNE || r.timing == StepTiming::NONE) return;
  auto it = step_of_.find(r.name);
  if (it != step_of_.end() && it->second == step_) end_step();
  if (it != step_of_.end()) {
    it->second = step_;
  } else {
    if (step_of_.size() >= kNamesMax) step_of_.clear();
    step_of_.emplace(r.name, step_);
  }
  if (begin_ns_ == 0) begin_ns_ = now;
  bytes_ += static_cast<int64_t>(r.nbytes());
  // A request its submitter marks UNSIGNED (the sparse paths' messages, whose sizes vary from step to step)
  // counts in the step's time and bytes but not in its digest.
  if (r.timing == StepTiming::UNSIGNED) return;
  digest_ += digest(r);
}

void StepTimer::end_step() {
  const StepSample s{begin_ns_, std::max(last_done_ns_.load(std::memory_order_acquire), begin_ns_), bytes_, digest_};
  if (steps_.size() < kKept) steps_.push_back(s);
  else steps_[static_cast<size_t>(step_) % kKept] = s;
  ++step_;
  begin_ns_ = 0;
  bytes_ = 0;
  digest_ = 0;
}

// FNV-1a over the name, op, dtype and shape; the step sums them, so that the order of submission does not
// matter. An all-gather's or all-to-all's first dimension is this rank's data of this step: not part of it.
uint64_t StepTimer::digest(const Request& r) {
  uint64_t h = 1469598103934665603ull;
  auto mix = [&h](const void* p, size_t n) {
    for (size_t i = 0; i < n; ++i) h = (h ^ static_cast<const uint8_t*>(p)[i]) * 1099511628211ull;
  };
  mix(r.name.data(), r.name.size());
  const int32_t codes[2] = {static_cast<int32_t>(r.sig.op_type), static_cast<int32_t>(r.sig.dtype)};
  mix(codes, sizeof(codes));
  const bool variable_rows = r.sig.op_type == OpType::ALLGATHER || r.sig.op_type == OpType::ALLTOALL;
  const size_t skip = variable_rows && !r.shape.empty() ? 1 : 0;
  mix(r.shape.data() + skip, (r.shape.size() - skip) * sizeof(int64_t));
  return h;
}

void StepTimer::steps(int64_t since, int64_t* first, std::vector<StepSample>* out) const {
  out->clear();
  const int64_t oldest = std::max<int64_t>(0, step_ - static_cast<int64_t>(steps_.size()));
  *first = std::max(since, oldest);
  for (int64_t i = *first; i < step_; ++i) out->push_back(steps_[static_cast<size_t>(i) % kKept]);
}

}  // namespace perseus
