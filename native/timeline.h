// Timeline events, recorded by the engine's threads and drained by the Python timeline writer, which owns
// the file format. Recording is one atomic load when the timeline is off.
#pragma once

#include <atomic>
#include <mutex>
#include <string>
#include <vector>

#include "common.h"

namespace perseus {

enum class TimelineKind : int8_t {
  NEGOTIATE_START = 0,  // a request was submitted: NEGOTIATE_<OP> begins on its row
  OP_START = 1,         // negotiated: <OP> begins
  ACTIVITY = 2,         // a sub-activity of the op begins (label)
  OP_END = 3,           // the request finished
  CYCLE = 4,            // a negotiation round started
};

struct TimelineEvent {
  TimelineKind kind;
  OpType op;
  std::string name;
  const char* label;  // ACTIVITY only: a string literal
  int64_t ts_ns;
};

class TimelineRecorder {
 public:
  bool on() const { return on_.load(std::memory_order_relaxed); }
  void set(bool on) { on_.store(on, std::memory_order_relaxed); }
  void record(TimelineKind kind, OpType op, const std::string& name, const char* label = nullptr) {
    if (!on()) return;
    int64_t ts = now_ns();
    std::lock_guard<std::mutex> lock(mu_);
    events_.push_back({kind, op, name, label, ts});
  }
  void drain(std::vector<TimelineEvent>* out) {
    std::lock_guard<std::mutex> lock(mu_);
    out->swap(events_);
    events_.clear();
  }

 private:
  std::atomic<bool> on_{false};
  std::mutex mu_;
  std::vector<TimelineEvent> events_;
};

}  // namespace perseus
