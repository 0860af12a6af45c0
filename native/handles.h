// Stage 6 (completion): requests and the handles users wait on.
//
// A Request is one named tensor of one submission; a Handle is one submission (one or several requests
// negotiated together), identified to Python by an integer. Both are pooled: a training step reuses the
// objects, strings and vectors of the previous one.
//
// Lifetime: a handle lives until the user has collected it (wait/synchronize, or the table is cleared) AND
// the engine no longer touches any of its requests' memory. Only then are the Python objects that keep the
// tensors alive released (the binding layer does that, holding the GIL).
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "common.h"
#include "node_pool.h"

namespace perseus {

struct Handle;

// How the run-time tuner's step timer (step_timer.h) counts a request; the submitter says (the same codes as
// perseus.engine.messages.Timing).
enum class StepTiming : int8_t {
  NONE = 0,      // in no step (the tuner's own collectives, which come at irregular times)
  UNSIGNED = 1,  // in the step's time and bytes, not in its digest (collectives whose shapes vary by step)
  FULL = 2,      // in the step and in its digest
};

struct Request {
  std::string name;
  Signature sig;
  std::vector<int64_t> shape;   // full shape (allgather/alltoall: first dimension this rank's)
  const void* input = nullptr;  // nullptr: in place on output (or a phantom)
  void* output = nullptr;       // nullptr for allgather/alltoall: the engine allocates `result`
  std::vector<int64_t> splits;  // alltoall rows per destination
  int ps_id = 0;
  StepTiming timing = StepTiming::FULL;
  Handle* handle = nullptr;
  double submit_time = 0;
  std::atomic<int> remaining{0};  // units still to finish (set by fusion)
  bool phantom = false;           // stands in for a tensor a joined rank did not submit
  bool dispatched = false;        // handed to a channel (guarded by the process set's mutex)
  std::atomic<bool> awaited{false};  // a user waits for (or polls) it: a held bucket must not wait for ever
  std::atomic<bool> finished{false};
  // Results of ops whose output size is known only after the exchange (allgather, alltoall):
  std::unique_ptr<uint8_t[]> result;
  size_t result_bytes = 0;
  std::vector<int64_t> result_shape;
  std::vector<int64_t> received_splits;
  std::vector<uint8_t> phantom_data;

  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
  size_t nbytes() const { return static_cast<size_t>(numel()) * itemsize(sig.dtype); }
};

// Requests by name. The key views the request's own name, which lives as long as the request is listed.
using NameMap = std::unordered_map<std::string_view, Request*>;

// What the binding layer attaches to a handle: Python objects, callbacks. Opaque here.
struct HandleExtra {
  virtual ~HandleExtra() = default;
};

struct Handle {
  int64_t id = 0;
  std::vector<Request*> requests;
  std::vector<Request*> spare;      // requests of earlier uses, reused before any new one
  std::atomic<int> unfinished{0};   // requests without a result or error yet
  std::atomic<int> engine_refs{0};  // requests whose memory the engine may still touch
  std::atomic<uint32_t> done{0};    // 1 once unfinished reached 0 (a futex word)
  std::atomic<uint32_t> sleepers{0};  // threads asleep on `done`: finishing wakes them only if any
  std::atomic<bool> user_released{false};
  bool is_join = false;
  int64_t join_result = -1;
  std::mutex mu;  // guards error, wants_callback and the binding layer's callbacks in `extra`
  Error error;
  bool wants_callback = false;      // a completion callback is registered (binding layer runs it)
  std::unique_ptr<HandleExtra> extra;
};

// Finishing and releasing: the engine's side of completion.
class Completion {
 public:
  virtual ~Completion() = default;
  // A handle whose last request finished and which has a callback registered (called on an engine or
  // channel thread; must not block on Python -- hand it to a thread that may).
  virtual void on_callback_due(Handle* h) = 0;
  // A handle the user has collected and the engine no longer references: release it (Python objects).
  virtual void on_reclaim(Handle* h) = 0;
};

// Integer handle ids -> handles; pools of handles and requests.
class HandleTable {
 public:
  explicit HandleTable(Completion* completion) : completion_(completion) {}
  ~HandleTable();

  Handle* new_handle();             // with a fresh id, registered
  Request* new_request(Handle* h);  // owned by h (kept with it when it is recycled)
  Handle* find(int64_t id);         // nullptr when unknown
  // The user collected `h` (after wait): forget its id; reclaim once the engine is done with it.
  void release_user(Handle* h);
  // Forget every id (elastic reset / shutdown); handles still referenced by the engine are reclaimed later.
  void clear();

  // Engine side.
  void finish_request(Request* r, const Error* error);  // exactly once per request; later calls ignored
  void release_engine(Request* r);                      // the engine will not touch r's memory again
  static void wait(Handle* h, double timeout_s, bool* timed_out);  // no GIL held by the caller
  // Requests submitted and not yet finished (relaxed; for "is the network quiet now?" questions).
  int64_t open_requests() const { return open_requests_.load(std::memory_order_relaxed); }
  void set_join_result(Handle* h, int64_t last_rank, const Error* error);

 private:
  void maybe_reclaim(Handle* h);
  void recycle(Handle* h);

  Completion* completion_;
  std::mutex mu_;
  int64_t next_id_ = 0;
  std::unordered_map<int64_t, Handle*> live_;
  NodePool<std::unordered_map<int64_t, Handle*>> live_nodes_;  // live_'s nodes, reused (under mu_)
  std::atomic<int64_t> open_requests_{0};
  std::vector<Handle*> free_handles_;
};

}  // namespace perseus
