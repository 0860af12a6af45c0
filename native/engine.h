// The engine: one background thread per process that drives every process set's negotiation, plus the
// channels of each set. Framework adapters submit from their own threads (one native call per request or
// group) and wait on handles without the GIL.
//
// The engine thread never takes the GIL except through the two rare hooks of EngineHooks (set_context.h:
// where the main thread is, for a stall probe; a log line). Waiting for peers inside a round is a short spin, then sleeps of
// growing length; an engine with nothing to do sleeps on a condition variable and looks for control
// messages (stall probes, aborts) only every idle_poll_max_ms.
#pragma once

#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "device_channel.h"
#include "handles.h"
#include "process_set.h"
#include "set_context.h"
#include "step_timer.h"
#include "settings.h"
#include "timeline.h"

namespace perseus {

class Engine {
 public:
  Engine(Settings settings, int world_rank, Completion* completion, EngineHooks hooks);
  ~Engine();

  void start();
  // Collective over the ranks of `control`: creates the set's channels (dups of it).
  void add_process_set(int id, std::unique_ptr<Comm> control, std::vector<int> world_ranks);
  void remove_process_set(int id);  // fails its pending requests, stops its channels
  // Stop the engine thread; fail what is still pending; tell peers this rank has shut down.
  void shutdown(double timeout_s);
  bool clean() const { return clean_.load(); }

  // Requests: allocate from the table, fill in, then submit. Errors as ProcessSet::submit, plus INTERNAL
  // once the engine has failed or shut down.
  Error submit(int ps_id, Handle* h);
  Error join(int ps_id, Handle* h);
  // Fail every request here and, when propagate, on every rank.
  void abort(const std::string& message, int origin, bool propagate, ErrorKind kind);
  Error failed();
  bool set_exists(int ps_id);
  int set_size(int ps_id);
  // The set's run-time parameters and how many channels it has; false when there is no such set.
  bool set_params(int ps_id, TuneParams* params, int* max_channels);
  bool set_steps(int ps_id, int64_t since, int64_t* first, std::vector<StepSample>* out);
  // Bytes on the wire for the set so far (wire.h); false when there is no such set.
  bool set_wire_bytes(int ps_id, WireBytes* out);

  HandleTable& handles() { return handles_; }
  TimelineRecorder& timeline() { return timeline_; }
  const Settings& settings() const { return settings_; }
  int world_rank() const { return world_rank_; }
  EngineHooks& hooks() { return hooks_; }

  FaultInjection& faults() { return faults_; }
  DeviceQueue& device_queue() { return device_queue_; }
  void wake();  // a submission arrived (lock-free unless the engine thread is waiting)
  // A user waits for h (wait, poll or a callback): its device all-reduces are marked awaited and their sets
  // told, so that a device bucket holding one of them never waits for a tensor that will not come.
  void note_awaited(Handle* h);

 private:
  using Sets = std::vector<std::shared_ptr<ProcessSet>>;
  struct Loop;  // the engine thread's own state (engine_loop.cc)
  SetContext set_context();
  SetOptions set_options() const;
  void run();
  bool turn(Loop* loop);
  bool take_control(Loop* loop);
  void close_removed(Sets* closing);
  bool idle(Loop* loop, uint64_t seen, double deadline);
  void fail_thread(const std::exception& e, const Sets& sets);
  void drain(const Sets& sets);
  void close_all();
  void send_outbox(const Sets& sets, std::vector<std::string>* outbox);
  void write_logs(std::vector<std::string>* logs);
  std::shared_ptr<ProcessSet> find(int ps_id);

  Settings settings_;
  int world_rank_;
  HandleTable handles_;
  TimelineRecorder timeline_;
  EngineHooks hooks_;
  FaultInjection faults_;
  DeviceQueue device_queue_;  // units of device requests, for the framework's launcher thread

  std::mutex mu_;
  std::condition_variable cv_;
  std::map<int, std::shared_ptr<ProcessSet>> sets_;
  // Lock-free lookup for submissions (ids below kFastSets). A removed set stays allocated (retired_) until
  // the engine is destroyed, since a submission may have just loaded its pointer.
  static constexpr int kFastSets = 256;
  std::atomic<ProcessSet*> fast_[kFastSets] = {};
  std::vector<std::shared_ptr<ProcessSet>> retired_;
  std::atomic<bool> stopping_{false};
  // Set whenever sets_, to_close_, outbox_, logs_ or stop_ change: the engine loop takes mu_ only then.
  std::atomic<bool> control_dirty_{true};
  std::vector<std::shared_ptr<ProcessSet>> to_close_;
  Error failed_;
  std::atomic<bool> has_failed_{false};
  std::vector<std::string> outbox_;  // abort messages for set 0's peers, sent by the engine thread
  std::vector<std::string> logs_;    // error lines logged by the engine thread (it may take the GIL)
  bool stop_ = false;
  std::atomic<bool> idle_{false};
  std::atomic<uint64_t> submissions_{0};
  std::atomic<bool> clean_{true};
  std::atomic<bool> exited_{false};
  bool started_ = false;
  std::thread thread_;
  uint64_t close_generation_ = 0;
  uint64_t closed_done_ = 0;
  std::condition_variable closed_cv_;
};

// How many process sets of this process (of every engine so far) were left with a channel thread that could
// not be stopped: stuck inside a collective that a failed peer will never finish. Such a thread may still be
// inside MPI when the process exits.
size_t abandoned_process_sets();

}  // namespace perseus
