// The Python binding of the native core (module perseus._core). Python calls in with the GIL; every call
// that can wait (wait, add/remove a process set, shutdown) releases it. Engine and channel threads never
// take the GIL; a dedicated callback thread does, to run completion callbacks (batched) and to release
// the Python objects that kept a request's tensors alive.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <pybind11/numpy.h>

#include <condition_variable>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>

#include "alloc_count.h"
#include "decode_for_test.h"
#include "engine.h"
#include "huge_pages.h"
#include "recycled.h"
#include "settings.h"
#include "transport.h"
#include "transport_loopback.h"

namespace py = pybind11;
using namespace perseus;

namespace {

struct Countdown {
  std::atomic<int> left;
  py::object callback;
};

struct PyExtra : HandleExtra, perseus::Recycled<PyExtra, 4096> {  // one per submission
  py::object finish;
  py::object keepalive;
  std::vector<std::shared_ptr<Countdown>> callbacks;
};

const char* numpy_name(DType d) {
  switch (d) {
    case DType::BFLOAT16: return "uint16";
    case DType::BOOL: return "bool";
    default: return dtype_name(d);
  }
}

// Runs Python work handed over by threads that must not take the GIL themselves.
class CallbackThread : public Completion {
 public:
  CallbackThread() = default;
  ~CallbackThread() override { stop(); }

  void start() {
    if (!thread_.joinable()) thread_ = std::thread([this] { run(); });
  }
  void stop() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_one();
    if (thread_.joinable()) {
      py::gil_scoped_release release;
      thread_.join();
    }
  }
  void on_callback_due(Handle* h) override {
    std::vector<std::shared_ptr<Countdown>> cbs;
    {
      std::lock_guard<std::mutex> lock(h->mu);
      auto* extra = static_cast<PyExtra*>(h->extra.get());
      if (extra == nullptr) return;
      cbs.swap(extra->callbacks);
    }
    push(std::move(cbs), nullptr);
  }
  void on_reclaim(Handle* h) override {
    auto* extra = static_cast<PyExtra*>(h->extra.release());
    if (extra == nullptr) return;
    if (PyGILState_Check()) {
      delete extra;
      return;
    }
    push({}, extra);
  }

 private:
  void push(std::vector<std::shared_ptr<Countdown>> cbs, PyExtra* dead) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& c : cbs) callbacks_.push_back(std::move(c));
      if (dead != nullptr) dead_.push_back(dead);
    }
    cv_.notify_one();
  }
  void run() {
    std::vector<std::shared_ptr<Countdown>> cbs;
    std::vector<PyExtra*> dead;
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !callbacks_.empty() || !dead_.empty(); });
        if (callbacks_.empty() && dead_.empty() && stop_) return;
        cbs.assign(callbacks_.begin(), callbacks_.end());
        callbacks_.clear();
        dead.swap(dead_);
      }
      if (!Py_IsInitialized()) return;
      py::gil_scoped_acquire gil;
      for (auto& c : cbs) {
        if (c->left.fetch_sub(1) != 1) continue;
        try {
          c->callback();
        } catch (py::error_already_set& e) {
          e.discard_as_unraisable("perseus completion callback");
        }
        c->callback = py::object();
      }
      cbs.clear();
      for (PyExtra* e : dead) delete e;
      dead.clear();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Countdown>> callbacks_;
  std::vector<PyExtra*> dead_;
  bool stop_ = false;
  std::thread thread_;
};

// Pointer of a buffer: a Python int (a raw address; the caller keeps the memory alive) or an object with
// the buffer protocol (NumPy arrays). None gives nullptr.
void* pointer_of(PyObject* obj, bool writable) {
  if (obj == Py_None) return nullptr;
  if (PyLong_Check(obj)) return PyLong_AsVoidPtr(obj);
  Py_buffer view;
  int flags = PyBUF_ANY_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
  if (PyObject_GetBuffer(obj, &view, flags) != 0) throw py::error_already_set();
  void* p = view.buf;
  PyBuffer_Release(&view);  // the caller's keepalive holds the object (NumPy memory does not move)
  return p;
}

void shape_of(PyObject* obj, std::vector<int64_t>* out) {
  out->clear();
  if (PyTuple_Check(obj)) {
    Py_ssize_t n = PyTuple_GET_SIZE(obj);
    for (Py_ssize_t i = 0; i < n; ++i) out->push_back(PyLong_AsLongLong(PyTuple_GET_ITEM(obj, i)));
  } else {
    for (auto item : py::reinterpret_borrow<py::iterable>(obj)) out->push_back(item.cast<int64_t>());
  }
  if (PyErr_Occurred()) throw py::error_already_set();
}

// A request's Timing code (perseus.engine.messages.Timing).
StepTiming timing_of(PyObject* obj) {
  const long v = PyLong_AsLong(obj);
  if (v < 0 || v > 2) {
    if (PyErr_Occurred()) throw py::error_already_set();
    throw py::value_error("perseus: unknown timing code " + std::to_string(v));
  }
  return static_cast<StepTiming>(v);
}

// A loopback world as Python sees it (the world itself is opaque).
struct PyWorld {
  std::shared_ptr<LoopbackWorld> world;
};

class PyEngine {
 public:
  // `settings`: every field filled by Python (perseus/engine/native.py); the engine keeps a copy.
  PyEngine(const Settings& settings, int world_rank, py::object where, py::object log, py::tuple errors)
      : errors_(errors) {
    where_ = where;
    log_ = log;
    EngineHooks hooks;
    hooks.where = [this]() -> std::string {
      if (!Py_IsInitialized()) return std::string();
      py::gil_scoped_acquire gil;
      try {
        return where_.is_none() ? std::string() : where_().cast<std::string>();
      } catch (py::error_already_set& e) {
        return std::string("(unknown: ") + e.what() + ")";
      }
    };
    hooks.log = [this](int level, const std::string& message) {
      if (!Py_IsInitialized()) return;
      py::gil_scoped_acquire gil;
      try {
        if (!log_.is_none()) log_(level, message);
      } catch (py::error_already_set& e) {
        e.discard_as_unraisable("perseus log");
      }
    };
    engine_.reset(new Engine(settings, world_rank, &callbacks_, hooks));
  }

  ~PyEngine() {
    // An engine dropped without shutdown() (a test, say) must not leave its threads running on freed
    // memory: shut it down here (Python destroys objects with the GIL held).
    if (started_ && !shut_down_ && Py_IsInitialized()) {
      try {
        shutdown(5.0);
      } catch (...) {
        // A destructor must not throw; the engine has reported its own failure to every rank already.
      }
    }
  }

  void start() {
    callbacks_.start();
    engine_->start();
    started_ = true;
  }

  void add_process_set(int id, uintptr_t comm_handle, std::vector<int> world_ranks) {
    py::gil_scoped_release release;
    engine_->add_process_set(id, make_mpi_comm(static_cast<intptr_t>(comm_handle)), std::move(world_ranks));
  }

  void add_loopback_process_set(int id, const PyWorld& world, int rank, std::vector<int> world_ranks) {
    py::gil_scoped_release release;
    engine_->add_process_set(id, make_loopback_comm(world.world, rank), std::move(world_ranks));
  }

  void remove_process_set(int id) {
    py::gil_scoped_release release;
    engine_->remove_process_set(id);
  }

  void shutdown(double timeout_s) {
    shut_down_ = true;
    {
      py::gil_scoped_release release;
      engine_->shutdown(timeout_s);
    }
    callbacks_.stop();
  }

  // items: sequence of (name, dtype, shape, input, output, reduce_op, root_rank, prescale, postscale,
  // priority, splits[, timing]) (perseus.engine.messages.Request; timing defaults to Timing.FULL). device >= 0: the buffers are device memory, moved by the launcher (next_device_unit)
  // rather than the channels. Returns the handle id.
  int64_t submit(int ps_id, int op_type, py::sequence items, py::object finish, py::object keepalive,
                 int device) {
    HandleTable& table = engine_->handles();
    Handle* h = table.new_handle();
    auto* extra = new PyExtra();
    h->extra.reset(extra);
    extra->finish = std::move(finish);
    extra->keepalive = std::move(keepalive);
    const OpType op = static_cast<OpType>(op_type);
    try {
      const Py_ssize_t n = PySequence_Size(items.ptr());
      for (Py_ssize_t i = 0; i < n; ++i) {
        py::object item = py::reinterpret_steal<py::object>(PySequence_GetItem(items.ptr(), i));
        PyObject* t = item.ptr();
        const Py_ssize_t fields = PyTuple_Check(t) ? PyTuple_GET_SIZE(t) : 0;
        if (fields != 11 && fields != 12) throw py::value_error("perseus: bad request tuple");
        PyObject** f = &PyTuple_GET_ITEM(t, 0);
        add_request(h, ps_id, op, f, fields == 12 ? f[11] : nullptr);
        h->requests.back()->sig.device = device < 0 ? -1 : device;
      }
    } catch (...) {
      discard(h);
      throw;
    }
    return enqueue(ps_id, h);
  }

  // One request: (ps_id, op_type, the first 11 fields of submit()'s tuple, finish, keepalive[, timing[,
  // device]]) as arguments (the per-gradient path: no tuple, no list). timing None: Timing.FULL; device as in
  // submit().
  int64_t submit_one(py::args a) {
    if (a.size() < 15 || a.size() > 17) throw py::type_error("perseus: submit_one takes 15 to 17 arguments");
    PyObject** f = &PyTuple_GET_ITEM(a.ptr(), 0);
    const int ps_id = static_cast<int>(PyLong_AsLong(f[0]));
    const OpType op = static_cast<OpType>(PyLong_AsLong(f[1]));
    Handle* h = engine_->handles().new_handle();
    auto* extra = new PyExtra();
    h->extra.reset(extra);
    extra->finish = py::reinterpret_borrow<py::object>(f[13]);
    extra->keepalive = py::reinterpret_borrow<py::object>(f[14]);
    try {
      add_request(h, ps_id, op, f + 2, a.size() >= 16 && f[15] != Py_None ? f[15] : nullptr);
      if (a.size() == 17) {
        const long device = PyLong_AsLong(f[16]);
        if (device == -1 && PyErr_Occurred()) throw py::error_already_set();
        h->requests.back()->sig.device = device < 0 ? -1 : static_cast<int32_t>(device);
      }
    } catch (...) {
      discard(h);
      throw;
    }
    return enqueue(ps_id, h);
  }

  // A request of h from `f`, the first 11 fields of a Request in order; timing null: Timing.FULL.
  void add_request(Handle* h, int ps_id, OpType op, PyObject* const* f, PyObject* timing) {
    PyObject *name = f[0], *dtype = f[1], *shape = f[2], *input = f[3], *output = f[4], *reduce_op = f[5],
             *root = f[6], *pre = f[7], *post = f[8], *priority = f[9], *splits = f[10];
    Request* r = engine_->handles().new_request(h);
    r->ps_id = ps_id;
    r->timing = timing == nullptr ? StepTiming::FULL : timing_of(timing);
    r->remaining.store(0, std::memory_order_relaxed);
    Py_ssize_t len;
    const char* text = PyUnicode_AsUTF8AndSize(name, &len);
    if (text == nullptr) throw py::error_already_set();
    r->name.assign(text, len);
    Signature& s = r->sig;
    s.op_type = op;
    s.device = -1;  // (a reused request may carry an earlier use's)
    const long dt = PyLong_AsLong(dtype);
    if (dt < 0 || dt >= kNumDTypes) {
      if (PyErr_Occurred()) throw py::error_already_set();
      throw py::value_error("perseus: unknown dtype code " + std::to_string(dt));
    }
    s.dtype = static_cast<DType>(dt);
    shape_of(shape, &r->shape);
    if (op == OpType::ALLGATHER || op == OpType::ALLTOALL) {
      if (r->shape.empty()) r->shape.push_back(1);
      s.shape.assign(r->shape.begin() + 1, r->shape.end());
    } else {
      s.shape = r->shape;
    }
    r->input = pointer_of(input, false);
    r->output = pointer_of(output, true);
    s.reduce_op = static_cast<int32_t>(PyLong_AsLong(reduce_op));
    s.root_rank = static_cast<int32_t>(PyLong_AsLong(root));
    s.prescale = PyFloat_AsDouble(pre);
    s.postscale = PyFloat_AsDouble(post);
    s.priority = static_cast<int32_t>(PyLong_AsLong(priority));
    r->splits.clear();
    if (splits != Py_None) shape_of(splits, &r->splits);
    if (PyErr_Occurred()) throw py::error_already_set();
  }

  int64_t enqueue(int ps_id, Handle* h) {
    Error err = engine_->submit(ps_id, h);
    if (err) {
      discard(h);
      raise(err);
    }
    return h->id;
  }

  // The launcher's next device unit, waiting up to timeout_s with the GIL released: None on timeout, False
  // once the engine has stopped, else (ticket, ps_id, unit index, op_type, dtype, reduce_op, prescale,
  // postscale, [(name, offset, count, phantom), ...], device). Every ticket must be given back once, to
  // device_unit_done. Offsets and counts are elements of the request's tensor.
  py::object next_device_unit(double timeout_s) {
    bool stopped = false;
    DeviceTicket* t;
    {
      py::gil_scoped_release release;
      t = engine_->device_queue().pop(timeout_s, &stopped);
    }
    if (t == nullptr) return stopped ? py::object(py::bool_(false)) : py::object(py::none());
    const Unit* u = t->unit;
    py::list pieces;
    for (const Piece& p : u->pieces)
      pieces.append(py::make_tuple(p.request->name, p.offset, p.count, p.request->phantom));
    return py::make_tuple(reinterpret_cast<intptr_t>(t), t->ps_id, u->index, static_cast<int>(u->op_type),
                          static_cast<int>(u->dtype), static_cast<int>(u->reduce_op), u->prescale, u->postscale,
                          pieces, u->device);
  }

  // Give back a ticket of next_device_unit: error None when the unit's data has moved, else what failed
  // (every rank then fails the unit's requests with it).
  void device_unit_done(intptr_t ticket, py::object error) {
    auto* t = reinterpret_cast<DeviceTicket*>(ticket);
    std::string message;
    if (!error.is_none()) message = error.cast<std::string>();
    py::gil_scoped_release release;
    DeviceChannel::finish(t, error.is_none() ? nullptr : &message);
  }

  // The set's run-time parameters: (fusion bytes, in-place bytes, channels, cycle time us, algorithm code,
  // channels created, device bucket bytes).
  py::tuple params(int ps_id) {
    TuneParams p;
    int max_channels = 0;
    if (!engine_->set_params(ps_id, &p, &max_channels))
      throw py::value_error("perseus: no process set with id " + std::to_string(ps_id));
    return py::make_tuple(p.fusion_threshold_bytes, p.inplace_threshold_bytes, p.channels,
                          static_cast<int64_t>(p.cycle_time_ms * 1e3 + 0.5), static_cast<int>(p.algorithm),
                          max_channels, p.device_bucket_bytes);
  }

  // Steps timed since step `since`: (first index, [(seconds, bytes, digest), ...]) for the completed steps
  // kept (the last 1024).
  py::tuple steps(int ps_id, int64_t since) {
    std::vector<StepSample> out;
    int64_t first = 0;
    if (!engine_->set_steps(ps_id, since, &first, &out))
      throw py::value_error("perseus: no process set with id " + std::to_string(ps_id));
    py::list items;
    for (const StepSample& s : out)
      items.append(py::make_tuple((s.end_ns - s.begin_ns) * 1e-9, s.bytes, s.digest));
    return py::make_tuple(first, items);
  }

  // Bytes this rank has put on the wire and taken off it for the set since the set was created:
  // {"sent_bytes", "received_bytes", "control_sent_bytes", "control_received_bytes"} (see wire.h).
  py::dict wire_bytes(int ps_id) {
    WireBytes w;
    bool found;
    {
      py::gil_scoped_release release;  // the engine's lock, held only briefly by other threads
      found = engine_->set_wire_bytes(ps_id, &w);
    }
    if (!found) throw py::value_error("perseus: no process set with id " + std::to_string(ps_id));
    py::dict out;
    out["sent_bytes"] = w.sent;
    out["received_bytes"] = w.received;
    out["control_sent_bytes"] = w.control_sent;
    out["control_received_bytes"] = w.control_received;
    return out;
  }

  int64_t join(int ps_id) {
    Handle* h = engine_->handles().new_handle();
    h->extra.reset(new PyExtra());
    Error err = engine_->join(ps_id, h);
    if (err) {
      discard(h);
      raise(err);
    }
    return h->id;
  }

  // Wait for `hid` and return its value: None for an unknown handle; the last rank for a join; else from
  // the submission's `finish`: None -> None, a 1-tuple (value,) -> value (the per-gradient path: no Python
  // call), a callable -> finish(results), results[i] being None or (array, received_splits) for ops whose
  // output the engine allocated. Raises the request's error.
  py::object wait(int64_t hid, double timeout_s) {
    Handle* h = engine_->handles().find(hid);
    if (h == nullptr) return py::none();
    engine_->note_awaited(h);
    bool timed_out = false;
    // Wait in slices, so that Python signal handlers (Ctrl-C, pytest-timeout) run while this waits.
    const double deadline = timeout_s >= 0 ? now_s() + timeout_s : 0;
    while (!h->done.load(std::memory_order_acquire)) {
      double slice = 0.1;
      if (timeout_s >= 0) {
        slice = std::min(slice, deadline - now_s());
        if (slice <= 0) {
          timed_out = true;
          break;
        }
      }
      bool sliced_out = false;
      {
        py::gil_scoped_release release;
        HandleTable::wait(h, slice, &sliced_out);
      }
      if (PyErr_CheckSignals() != 0) throw py::error_already_set();
    }
    if (timed_out) {
      PyErr_SetString(PyExc_TimeoutError, ("perseus request not completed within " +
                                           std::to_string(timeout_s) + " s").c_str());
      throw py::error_already_set();
    }
    Error err;
    {
      std::lock_guard<std::mutex> lock(h->mu);
      err = h->error;
    }
    if (err) {
      engine_->handles().release_user(h);
      raise(err);
    }
    if (h->is_join) {
      int64_t last = h->join_result;
      engine_->handles().release_user(h);
      return py::int_(last);
    }
    auto* extra = static_cast<PyExtra*>(h->extra.get());
    py::object finish = extra != nullptr && extra->finish ? extra->finish : py::none();
    if (finish.is_none() || (PyTuple_Check(finish.ptr()) && PyTuple_GET_SIZE(finish.ptr()) == 1)) {
      py::object value = finish.is_none() ? py::none() : py::reinterpret_borrow<py::object>(
                                                              PyTuple_GET_ITEM(finish.ptr(), 0));
      engine_->handles().release_user(h);
      return value;
    }
    py::list results(h->requests.size());
    for (size_t i = 0; i < h->requests.size(); ++i) {
      Request* r = h->requests[i];
      if (!r->result) {
        results[i] = py::none();
        continue;
      }
      uint8_t* data = r->result.release();
      py::capsule owner(data, [](void* p) { delete[] static_cast<uint8_t*>(p); });
      std::vector<py::ssize_t> shape(r->result_shape.begin(), r->result_shape.end());
      py::array arr(py::dtype(numpy_name(r->sig.dtype)), shape, data, owner);
      py::array_t<int64_t> splits(static_cast<py::ssize_t>(r->received_splits.size()));
      if (!r->received_splits.empty())
        std::memcpy(splits.mutable_data(), r->received_splits.data(), r->received_splits.size() * 8);
      results[i] = py::make_tuple(arr, splits);
    }
    engine_->handles().release_user(h);
    return finish(results);
  }

  // True when every request of hid has finished. Raises ValueError for an unknown id.
  bool poll(int64_t hid) {
    Handle* h = engine_->handles().find(hid);
    if (h == nullptr)
      throw py::value_error("perseus.poll(): unknown handle " + std::to_string(hid) +
                            " (already synchronized, or never issued)");
    if (h->done.load(std::memory_order_acquire)) return true;
    engine_->note_awaited(h);
    return false;
  }

  // Call callback() once every request of every id has finished (at once if they have; otherwise on the
  // callback thread). Unknown ids count as finished.
  void on_done(std::vector<int64_t> hids, py::object callback) {
    auto cd = std::make_shared<Countdown>();
    cd->callback = callback;
    cd->left.store(1 + static_cast<int>(hids.size()));
    int finished_now = 1;
    for (int64_t hid : hids) {
      Handle* h = engine_->handles().find(hid);
      if (h == nullptr) {
        ++finished_now;
        continue;
      }
      engine_->note_awaited(h);
      std::lock_guard<std::mutex> lock(h->mu);
      if (h->done.load(std::memory_order_acquire)) {
        ++finished_now;
      } else {
        static_cast<PyExtra*>(h->extra.get())->callbacks.push_back(cd);
        h->wants_callback = true;
      }
    }
    if (cd->left.fetch_sub(finished_now) == finished_now) {
      cd->callback = py::object();
      callback();
    }
  }

  void clear_handles() { engine_->handles().clear(); }
  int64_t open_requests() { return engine_->handles().open_requests(); }
  bool clean() const { return engine_->clean(); }
  py::object failed() {
    Error e = engine_->failed();
    if (!e) return py::none();
    return py::make_tuple(static_cast<int>(e.kind), e.message);
  }
  void set_timeline(bool on) { engine_->timeline().set(on); }
  py::list drain_timeline() {
    std::vector<TimelineEvent> events;
    engine_->timeline().drain(&events);
    py::list out;
    for (auto& e : events)
      out.append(py::make_tuple(static_cast<int>(e.kind), static_cast<int>(e.op), e.name,
                                e.label ? py::object(py::str(e.label)) : py::object(py::none()), e.ts_ns));
    return out;
  }
  void fail_next_collective(const std::string& message) {
    FaultInjection& f = engine_->faults();
    {
      std::lock_guard<std::mutex> lock(f.mu);
      f.message = message;
    }
    f.armed.store(true);
  }
  void abort(const std::string& message) { engine_->abort(message, engine_->world_rank(), true, ErrorKind::INTERNAL); }

 private:
  void discard(Handle* h) {
    h->unfinished.store(0);
    h->engine_refs.store(0);
    h->done.store(1);
    engine_->handles().release_user(h);
  }
  [[noreturn]] void raise(const Error& e) {
    PyObject* type = PyExc_RuntimeError;
    switch (e.kind) {
      case ErrorKind::VALUE: type = PyExc_ValueError; break;
      case ErrorKind::MISMATCH: type = errors_[1].ptr(); break;
      case ErrorKind::STALL: type = errors_[2].ptr(); break;
      default: type = errors_[0].ptr(); break;
    }
    PyErr_SetString(type, e.message.c_str());
    throw py::error_already_set();
  }

  py::tuple errors_;
  py::object where_, log_;
  bool started_ = false, shut_down_ = false;
  CallbackThread callbacks_;
  std::unique_ptr<Engine> engine_;
};

// Settings (native/settings.h) as perseus._core.Settings: a default-constructed struct with one attribute per
// field, which Python fills before it creates the Engine. Algorithm is bound for its field.
void bind_settings(py::module_& m) {
  py::enum_<Algorithm>(m, "Algorithm", "How a large all-reduce unit runs (PERSEUS_ALLREDUCE_ALGORITHM).")
      .value("AUTO", Algorithm::AUTO)
      .value("MPI", Algorithm::MPI)
      .value("RING", Algorithm::RING)
      .value("HIERARCHICAL", Algorithm::HIERARCHICAL);
  py::class_<Settings> cls(m, "Settings", "The engine's settings (native/settings.h); read once, at Engine().");
  cls.def(py::init<>());
#define PERSEUS_BIND_SETTING(field) cls.def_readwrite(#field, &Settings::field);
  PERSEUS_SETTINGS_FIELDS(PERSEUS_BIND_SETTING)
#undef PERSEUS_BIND_SETTING
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "perseus native core: queue, negotiation, fusion, channels, transports, completion";
  m.def("mpi_library_version", &mpi_library_version);
  m.def("abandoned_process_sets", &abandoned_process_sets);
  m.def("native_allocations", &perseus::native_allocations,
        "Heap allocations the core has made in this process (native/alloc_count.h), for steady-state checks.");
  m.def("huge_page_stats", [] {
    const perseus::HugePageStats s = perseus::huge_page_stats();
    py::dict d;
    d["collapsed_frames"] = s.collapsed_frames;
    d["refused_frames"] = s.refused_frames;
    d["gave_up"] = s.gave_up;
    return d;
  }, "This process's requests to collapse reused buffers into 2 MiB huge pages (PERSEUS_HUGE_PAGES).");
  py::class_<PyWorld>(m, "LoopbackWorld")
      .def(py::init([](int size) { return PyWorld{make_loopback_world(size)}; }), py::arg("size"),
           "In-process ranks (threads) for tests: pass it to Engine.add_loopback_process_set.")
      .def("fail", [](PyWorld& w, const std::string& message) { loopback_world_fail(w.world, message); });
  bind_settings(m);
  perseus::register_decode_for_test(m);  // a test hook: the message decoders on arbitrary bytes
  py::class_<PyEngine>(m, "Engine")
      .def(py::init<const Settings&, int, py::object, py::object, py::tuple>(), py::arg("settings"),
           py::arg("world_rank"), py::arg("where"), py::arg("log"), py::arg("errors"))
      .def("start", &PyEngine::start)
      .def("add_process_set", &PyEngine::add_process_set)
      .def("add_loopback_process_set", &PyEngine::add_loopback_process_set)
      .def("remove_process_set", &PyEngine::remove_process_set)
      .def("shutdown", &PyEngine::shutdown, py::arg("timeout_s") = 30.0)
      .def("submit", &PyEngine::submit, py::arg("ps_id"), py::arg("op_type"), py::arg("items"), py::arg("finish"),
           py::arg("keepalive"), py::arg("device") = -1)
      .def("next_device_unit", &PyEngine::next_device_unit, py::arg("timeout_s"))
      .def("device_unit_done", &PyEngine::device_unit_done, py::arg("ticket"), py::arg("error") = py::none())
      .def("submit_one", &PyEngine::submit_one)
      .def("join", &PyEngine::join)
      .def("params", &PyEngine::params)
      .def("steps", &PyEngine::steps, py::arg("ps_id"), py::arg("since") = 0)
      .def("wire_bytes", &PyEngine::wire_bytes, py::arg("ps_id"),
           "Bytes on the wire for a process set since it was created: a dict of sent_bytes, received_bytes, "
           "control_sent_bytes, control_received_bytes.")
      .def("wait", &PyEngine::wait, py::arg("hid"), py::arg("timeout_s") = -1.0)
      .def("poll", &PyEngine::poll)
      .def("on_done", &PyEngine::on_done)
      .def("clear_handles", &PyEngine::clear_handles)
      .def("open_requests", &PyEngine::open_requests)
      .def_property_readonly("clean", &PyEngine::clean)
      .def("failed", &PyEngine::failed)
      .def("set_timeline", &PyEngine::set_timeline)
      .def("drain_timeline", &PyEngine::drain_timeline)
      .def("abort", &PyEngine::abort)
      .def("fail_next_collective", &PyEngine::fail_next_collective,
           "Tests: the next collective on this rank fails as a broken transport would.");
}
