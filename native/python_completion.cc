// The binding's completion (see python_binding.h): waiting for a handle (in slices, so that Python signal
// handlers run), polling it, callbacks once a group of handles has finished, and the callback thread that
// runs those callbacks and frees the Python objects of finished submissions. Waiting raises the request's
// error (as PyEngine::raise says), TimeoutError past its timeout, or what a signal handler raised; an
// exception in a callback is reported as unraisable and does not stop the thread.
#include "python_binding.h"

#include <algorithm>
#include <cstring>
#include <string>

namespace perseus {
namespace python_binding {
namespace {

const char* numpy_name(DType d) {
  switch (d) {
    case DType::BFLOAT16: return "uint16";
    case DType::BOOL: return "bool";
    default: return dtype_name(d);
  }
}

}  // namespace

// -- the callback thread -------------------------------------------------------------------------------

void CallbackThread::start() {
  if (!thread_.joinable()) thread_ = std::thread([this] { run(); });
}

void CallbackThread::stop() {
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

void CallbackThread::on_callback_due(Handle* h) {
  std::vector<std::shared_ptr<Countdown>> cbs;
  {
    std::lock_guard<std::mutex> lock(h->mu);
    auto* extra = static_cast<PyExtra*>(h->extra.get());
    if (extra == nullptr) return;
    cbs.swap(extra->callbacks);
  }
  push(std::move(cbs), nullptr);
}

void CallbackThread::on_reclaim(Handle* h) {
  auto* extra = static_cast<PyExtra*>(h->extra.release());
  if (extra == nullptr) return;
  if (PyGILState_Check()) {
    delete extra;
    return;
  }
  push({}, extra);
}

void CallbackThread::push(std::vector<std::shared_ptr<Countdown>> cbs, PyExtra* dead) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& c : cbs) callbacks_.push_back(std::move(c));
    if (dead != nullptr) dead_.push_back(dead);
  }
  cv_.notify_one();
}

void CallbackThread::run() {
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

// -- waiting for handles -------------------------------------------------------------------------------

py::object PyEngine::wait(int64_t hid, double timeout_s) {
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

bool PyEngine::poll(int64_t hid) {
  Handle* h = engine_->handles().find(hid);
  if (h == nullptr)
    throw py::value_error("perseus.poll(): unknown handle " + std::to_string(hid) +
                          " (already synchronized, or never issued)");
  if (h->done.load(std::memory_order_acquire)) return true;
  engine_->note_awaited(h);
  return false;
}

void PyEngine::on_done(std::vector<int64_t> hids, py::object callback) {
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

void PyEngine::clear_handles() { engine_->handles().clear(); }

int64_t PyEngine::open_requests() { return engine_->handles().open_requests(); }

void bind_completion(py::module_& m) {
  engine_class(m)
      .def("wait", &PyEngine::wait, py::arg("hid"), py::arg("timeout_s") = -1.0)
      .def("poll", &PyEngine::poll)
      .def("on_done", &PyEngine::on_done)
      .def("clear_handles", &PyEngine::clear_handles)
      .def("open_requests", &PyEngine::open_requests);
}

}  // namespace python_binding
}  // namespace perseus
