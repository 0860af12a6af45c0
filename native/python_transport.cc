// The binding's transports and process sets (see python_binding.h): the MPI library's version (checked at
// import against the one the core was built with), loopback worlds of in-process ranks for tests, and the
// Engine's process sets. Adding a process set is collective over the set's ranks (it creates the set's
// channels); adding and removing release the GIL while they wait. Transport failures reach Python as
// RuntimeError.
#include "python_binding.h"

#include "transport.h"

namespace perseus {
namespace python_binding {

void PyEngine::add_process_set(int id, uintptr_t comm_handle, std::vector<int> world_ranks) {
  py::gil_scoped_release release;
  engine_->add_process_set(id, make_mpi_comm(static_cast<intptr_t>(comm_handle)), std::move(world_ranks));
}

void PyEngine::add_loopback_process_set(int id, const PyWorld& world, int rank, std::vector<int> world_ranks) {
  py::gil_scoped_release release;
  engine_->add_process_set(id, make_loopback_comm(world.world, rank), std::move(world_ranks));
}

void PyEngine::remove_process_set(int id) {
  py::gil_scoped_release release;
  engine_->remove_process_set(id);
}

void bind_transport(py::module_& m) {
  m.def("mpi_library_version", &mpi_library_version);
  py::class_<PyWorld>(m, "LoopbackWorld")
      .def(py::init([](int size) { return PyWorld{make_loopback_world(size)}; }), py::arg("size"),
           "In-process ranks (threads) for tests: pass it to Engine.add_loopback_process_set.")
      .def("fail", [](PyWorld& w, const std::string& message) { loopback_world_fail(w.world, message); });
  engine_class(m)
      .def("add_process_set", &PyEngine::add_process_set)
      .def("add_loopback_process_set", &PyEngine::add_loopback_process_set)
      .def("remove_process_set", &PyEngine::remove_process_set);
}

}  // namespace python_binding
}  // namespace perseus
