// The run-time tuner's step timer: cuts the stream of submissions of a process set into training steps and
// keeps, for each, its time, its bytes and a digest of what it submitted (Settings::track_steps).
//
// A step ends when a name it already submitted comes again: a training loop submits the same names each
// step. Names map to the last step that submitted them (no allocation once every name was seen).
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "handles.h"

namespace perseus {

// One training step as the run-time tuner sees it: from the first submission of the step to the last
// completion before the next step began, and the bytes its requests carried.
struct StepSample {
  int64_t begin_ns = 0, end_ns = 0;
  int64_t bytes = 0;
  uint64_t digest = 0;  // of the step's names, ops, dtypes and shapes (not data-dependent ones), whatever their order
};

class StepTimer {
 public:
  explicit StepTimer(bool on);
  bool on() const { return on_; }
  // A request submitted at `now` (ns). Not thread-safe: the owner calls it under the lock that guards steps().
  void submitted(const Request& r, int64_t now);
  // A request finished at `now` (ns). Any thread, lock-free.
  void finished(int64_t now) { last_done_ns_.store(now, std::memory_order_release); }
  // Completed steps with index >= since (at most the last kKept); *first = index of out[0]. Under the same
  // lock as submitted().
  void steps(int64_t since, int64_t* first, std::vector<StepSample>* out) const;

  static constexpr size_t kKept = 1024;
  static constexpr size_t kNamesMax = 1 << 16;  // unique names each call (unnamed ops) must not grow it forever

 private:
  void end_step();
  static uint64_t digest(const Request& r);

  bool on_;
  std::unordered_map<std::string, int64_t> step_of_;
  int64_t step_ = 0, begin_ns_ = 0, bytes_ = 0;
  uint64_t digest_ = 0;
  std::vector<StepSample> steps_;  // ring of the last kKept completed steps
  std::atomic<int64_t> last_done_ns_{0};
};

}  // namespace perseus
