// What a process set receives from the engine that owns it: its options, taken from the engine's Settings
// when the set is created, and the engine-wide services it uses (SetContext). A process set sees nothing
// else of the engine.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "channels.h"
#include "device_channel.h"
#include "handles.h"
#include "stall.h"
#include "timeline.h"

namespace perseus {

// The parameters a TUNE request changes at run time (at the same negotiated point on every rank).
struct TuneParams {
  int64_t fusion_threshold_bytes = 0;
  int64_t inplace_threshold_bytes = 0;
  int channels = 1;  // active channels: unit k goes to channel k % channels
  double cycle_time_ms = 0.0;
  Algorithm algorithm = Algorithm::AUTO;
  int64_t device_bucket_bytes = 0;  // device buckets' budget; 0: none (device_buckets.h)
};

struct SetOptions {
  TuneParams params;  // in force until a TUNE request changes them
  int channels_created = 1;  // >= params.channels: the most a TUNE request may activate
  int64_t device_fusion_threshold_bytes = 64 << 20;  // units of device requests (device_channel.h)
  double device_cycle_time_ms = 1.0;  // the cycle when only device requests are new
  int64_t cache_capacity = 4096;      // names the negotiation registry keeps
  bool track_steps = false;           // time training steps (step_timer.h)
  StallSettings stall;
  int64_t host_key = 0;  // ranks with equal keys are on one host
  bool hierarchical_allgather = false;
  bool huge_pages = true;  // huge_pages.h
  int64_t engine_lane_bytes = 64 << 10;  // host all-reduce units up to this size run on the engine thread
  LinkOptions links;  // interfaces and timeout of the channels' links (cancel and world_ranks: the set's own)
};

// The engine's hooks into Python; each takes the GIL, so the engine thread calls them rarely.
struct EngineHooks {
  std::function<std::string()> where;                      // main thread location
  std::function<void(int level, const std::string&)> log;  // 30 warning, 40 error
};

// The engine-wide services a process set uses; the referenced objects belong to the engine that created it.
struct SetContext {
  HandleTable& handles;
  TimelineRecorder& timeline;
  FaultInjection& faults;
  DeviceQueue& device_queue;
  const EngineHooks& hooks;
  int world_rank;
  // Fail every request of every set here and, when propagate, on every rank (Engine::abort).
  std::function<void(const std::string& message, int origin, bool propagate, ErrorKind kind)> abort;
};

}  // namespace perseus
