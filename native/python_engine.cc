// The binding's Engine class and its settings (see python_binding.h): perseus._core.Settings, which Python
// fills before it creates the Engine, and the Engine's construction, start, shutdown and abort. An Engine
// dropped without shutdown() shuts itself down. The Engine's errors reach Python as ValueError or as the
// exception classes it was given (`errors`: an internal failure, a mismatch, a stall).
#include "python_binding.h"

#include "settings.h"

namespace perseus {
namespace python_binding {

PyEngine::PyEngine(const Settings& settings, int world_rank, py::object where, py::object log, py::tuple errors)
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

PyEngine::~PyEngine() {
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

void PyEngine::start() {
  callbacks_.start();
  engine_->start();
  started_ = true;
}

void PyEngine::shutdown(double timeout_s) {
  shut_down_ = true;
  {
    py::gil_scoped_release release;
    engine_->shutdown(timeout_s);
  }
  callbacks_.stop();
}

void PyEngine::abort(const std::string& message) {
  engine_->abort(message, engine_->world_rank(), true, ErrorKind::INTERNAL);
}

void PyEngine::discard(Handle* h) {
  h->unfinished.store(0);
  h->engine_refs.store(0);
  h->done.store(1);
  engine_->handles().release_user(h);
}

void PyEngine::raise(const Error& e) {
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

void bind_engine(py::module_& m) {
  py::class_<PyEngine>(m, "Engine")
      .def(py::init<const Settings&, int, py::object, py::object, py::tuple>(), py::arg("settings"),
           py::arg("world_rank"), py::arg("where"), py::arg("log"), py::arg("errors"))
      .def("start", &PyEngine::start)
      .def("shutdown", &PyEngine::shutdown, py::arg("timeout_s") = 30.0)
      .def("abort", &PyEngine::abort);
}

}  // namespace python_binding
}  // namespace perseus
