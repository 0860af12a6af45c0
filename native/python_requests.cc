// The binding's requests (see python_binding.h): submit (a group of requests as tuples), submit_one (one
// request as arguments: the per-gradient path), join, and the launcher's device units. A submitted request
// is collective: every rank of its process set must submit a matching one. A malformed request raises
// ValueError or TypeError and nothing of it is queued; the engine's refusal raises as PyEngine::raise says.
#include "python_binding.h"

#include <string>

namespace perseus {
namespace python_binding {
namespace {

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

}  // namespace

int64_t PyEngine::submit(int ps_id, int op_type, py::sequence items, py::object finish, py::object keepalive,
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

int64_t PyEngine::submit_one(py::args a) {
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

void PyEngine::add_request(Handle* h, int ps_id, OpType op, PyObject* const* f, PyObject* timing) {
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

int64_t PyEngine::enqueue(int ps_id, Handle* h) {
  Error err = engine_->submit(ps_id, h);
  if (err) {
    discard(h);
    raise(err);
  }
  return h->id;
}

int64_t PyEngine::join(int ps_id) {
  Handle* h = engine_->handles().new_handle();
  h->extra.reset(new PyExtra());
  Error err = engine_->join(ps_id, h);
  if (err) {
    discard(h);
    raise(err);
  }
  return h->id;
}

py::object PyEngine::next_device_unit(double timeout_s) {
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

void PyEngine::device_unit_done(intptr_t ticket, py::object error) {
  auto* t = reinterpret_cast<DeviceTicket*>(ticket);
  std::string message;
  if (!error.is_none()) message = error.cast<std::string>();
  py::gil_scoped_release release;
  DeviceChannel::finish(t, error.is_none() ? nullptr : &message);
}

void bind_requests(py::module_& m) {
  engine_class(m)
      .def("submit", &PyEngine::submit, py::arg("ps_id"), py::arg("op_type"), py::arg("items"), py::arg("finish"),
           py::arg("keepalive"), py::arg("device") = -1)
      .def("next_device_unit", &PyEngine::next_device_unit, py::arg("timeout_s"))
      .def("device_unit_done", &PyEngine::device_unit_done, py::arg("ticket"), py::arg("error") = py::none())
      .def("submit_one", &PyEngine::submit_one)
      .def("join", &PyEngine::join);
}

}  // namespace python_binding
}  // namespace perseus
