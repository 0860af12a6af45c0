// The Python binding's own declarations, shared by its files (module perseus._core; python.cc defines the
// module and calls each area's bind_* function in turn):
//   python_engine.cc       Settings, the Engine class: construction, start, shutdown, abort
//   python_transport.cc    the MPI library's version, loopback worlds, adding and removing process sets
//   python_requests.cc     submitting requests and joins; the launcher's device units
//   python_completion.cc   waiting for handles, polling them, completion callbacks (the callback thread)
//   python_diagnostics.cc  parameters, timed steps, bytes on the wire, the timeline, failure state, test hooks
//
// Python calls in with the GIL; every call that can wait (wait, add/remove a process set, shutdown) releases
// it. Engine and channel threads never take the GIL; a dedicated callback thread does, to run completion
// callbacks (batched) and to release the Python objects that kept a request's tensors alive.
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <pybind11/numpy.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "engine.h"
#include "recycled.h"
#include "transport_loopback.h"

namespace perseus {
namespace python_binding {

namespace py = pybind11;

struct Countdown {
  std::atomic<int> left;
  py::object callback;
};

struct PyExtra : HandleExtra, perseus::Recycled<PyExtra, 4096> {  // one per submission
  py::object finish;
  py::object keepalive;
  std::vector<std::shared_ptr<Countdown>> callbacks;
};

// Runs Python work handed over by threads that must not take the GIL themselves (python_completion.cc).
class CallbackThread : public Completion {
 public:
  CallbackThread() = default;
  ~CallbackThread() override { stop(); }

  void start();
  void stop();
  void on_callback_due(Handle* h) override;
  void on_reclaim(Handle* h) override;

 private:
  void push(std::vector<std::shared_ptr<Countdown>> cbs, PyExtra* dead);
  void run();

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Countdown>> callbacks_;
  std::vector<PyExtra*> dead_;
  bool stop_ = false;
  std::thread thread_;
};

// A loopback world as Python sees it (the world itself is opaque).
struct PyWorld {
  std::shared_ptr<LoopbackWorld> world;
};

// perseus._core.Engine. Each method is defined in the file of its area (see above).
class PyEngine {
 public:
  // -- python_engine.cc
  // `settings`: every field filled by Python (perseus/engine/native.py); the engine keeps a copy.
  PyEngine(const Settings& settings, int world_rank, py::object where, py::object log, py::tuple errors);
  ~PyEngine();
  void start();
  void shutdown(double timeout_s);
  void abort(const std::string& message);

  // -- python_transport.cc
  void add_process_set(int id, uintptr_t comm_handle, std::vector<int> world_ranks);
  void add_loopback_process_set(int id, const PyWorld& world, int rank, std::vector<int> world_ranks);
  void remove_process_set(int id);

  // -- python_requests.cc
  // items: sequence of (name, dtype, shape, input, output, reduce_op, root_rank, prescale, postscale,
  // priority, splits[, timing]) (perseus.engine.messages.Request; timing defaults to Timing.FULL). device >= 0: the buffers are device memory, moved by the launcher (next_device_unit)
  // rather than the channels. Returns the handle id.
  int64_t submit(int ps_id, int op_type, py::sequence items, py::object finish, py::object keepalive,
                 int device);
  // One request: (ps_id, op_type, the first 11 fields of submit()'s tuple, finish, keepalive[, timing[,
  // device]]) as arguments (the per-gradient path: no tuple, no list). timing None: Timing.FULL; device as in
  // submit().
  int64_t submit_one(py::args a);
  // A request of h from `f`, the first 11 fields of a Request in order; timing null: Timing.FULL.
  void add_request(Handle* h, int ps_id, OpType op, PyObject* const* f, PyObject* timing);
  int64_t enqueue(int ps_id, Handle* h);
  int64_t join(int ps_id);
  // The launcher's next device unit, waiting up to timeout_s with the GIL released: None on timeout, False
  // once the engine has stopped, else (ticket, ps_id, unit index, op_type, dtype, reduce_op, prescale,
  // postscale, [(name, offset, count, phantom), ...], device). Every ticket must be given back once, to
  // device_unit_done. Offsets and counts are elements of the request's tensor.
  py::object next_device_unit(double timeout_s);
  // Give back a ticket of next_device_unit: error None when the unit's data has moved, else what failed
  // (every rank then fails the unit's requests with it).
  void device_unit_done(intptr_t ticket, py::object error);

  // -- python_completion.cc
  // Wait for `hid` and return its value: None for an unknown handle; the last rank for a join; else from
  // the submission's `finish`: None -> None, a 1-tuple (value,) -> value (the per-gradient path: no Python
  // call), a callable -> finish(results), results[i] being None or (array, received_splits) for ops whose
  // output the engine allocated. Raises the request's error.
  py::object wait(int64_t hid, double timeout_s);
  // True when every request of hid has finished. Raises ValueError for an unknown id.
  bool poll(int64_t hid);
  // Call callback() once every request of every id has finished (at once if they have; otherwise on the
  // callback thread). Unknown ids count as finished.
  void on_done(std::vector<int64_t> hids, py::object callback);
  void clear_handles();
  int64_t open_requests();

  // -- python_diagnostics.cc
  // The set's run-time parameters: (fusion bytes, in-place bytes, channels, cycle time us, algorithm code,
  // channels created, device bucket bytes).
  py::tuple params(int ps_id);
  // Steps timed since step `since`: (first index, [(seconds, bytes, digest), ...]) for the completed steps
  // kept (the last 1024).
  py::tuple steps(int ps_id, int64_t since);
  // Bytes this rank has put on the wire and taken off it for the set since the set was created:
  // {"sent_bytes", "received_bytes", "control_sent_bytes", "control_received_bytes"} (see wire.h).
  py::dict wire_bytes(int ps_id);
  bool clean() const;
  py::object failed();
  void set_timeline(bool on);
  py::list drain_timeline();
  void fail_next_collective(const std::string& message);

 private:
  // -- python_engine.cc
  void discard(Handle* h);
  [[noreturn]] void raise(const Error& e);

  py::tuple errors_;
  py::object where_, log_;
  bool started_ = false, shut_down_ = false;
  CallbackThread callbacks_;
  std::unique_ptr<Engine> engine_;
};

// The Engine class that bind_engine() created, for the other areas to add their methods to.
inline py::class_<PyEngine> engine_class(py::module_& m) {
  py::object engine = m.attr("Engine");
  return py::reinterpret_borrow<py::class_<PyEngine>>(engine);
}

// Each area's part of the module, in the order python.cc calls them: Settings before the Engine (its
// constructor takes one), the Engine before the areas that add methods to it, LoopbackWorld before
// add_loopback_process_set.
void bind_settings(py::module_& m);     // python_engine.cc
void bind_engine(py::module_& m);       // python_engine.cc
void bind_transport(py::module_& m);    // python_transport.cc
void bind_requests(py::module_& m);     // python_requests.cc
void bind_completion(py::module_& m);   // python_completion.cc
void bind_diagnostics(py::module_& m);  // python_diagnostics.cc

}  // namespace python_binding
}  // namespace perseus
