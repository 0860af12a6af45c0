// The binding's diagnostics (see python_binding.h): a process set's run-time parameters, its timed steps and
// its bytes on the wire; whether the engine shut down cleanly and whether it failed; the timeline; process-wide
// counters (abandoned process sets, the core's heap allocations, huge-page requests); and the test hook that
// fails this rank's next collective. Asking about a process set this rank does not have raises ValueError.
#include "python_binding.h"

#include "alloc_count.h"
#include "huge_pages.h"

namespace perseus {
namespace python_binding {

py::tuple PyEngine::params(int ps_id) {
  TuneParams p;
  int max_channels = 0;
  if (!engine_->set_params(ps_id, &p, &max_channels))
    throw py::value_error("perseus: no process set with id " + std::to_string(ps_id));
  return py::make_tuple(p.fusion_threshold_bytes, p.inplace_threshold_bytes, p.channels,
                        static_cast<int64_t>(p.cycle_time_ms * 1e3 + 0.5), static_cast<int>(p.algorithm),
                        max_channels, p.device_bucket_bytes);
}

py::tuple PyEngine::steps(int ps_id, int64_t since) {
  std::vector<StepSample> out;
  int64_t first = 0;
  if (!engine_->set_steps(ps_id, since, &first, &out))
    throw py::value_error("perseus: no process set with id " + std::to_string(ps_id));
  py::list items;
  for (const StepSample& s : out)
    items.append(py::make_tuple((s.end_ns - s.begin_ns) * 1e-9, s.bytes, s.digest));
  return py::make_tuple(first, items);
}

py::dict PyEngine::wire_bytes(int ps_id) {
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

bool PyEngine::clean() const { return engine_->clean(); }

py::object PyEngine::failed() {
  Error e = engine_->failed();
  if (!e) return py::none();
  return py::make_tuple(static_cast<int>(e.kind), e.message);
}

void PyEngine::set_timeline(bool on) { engine_->timeline().set(on); }

py::list PyEngine::drain_timeline() {
  std::vector<TimelineEvent> events;
  engine_->timeline().drain(&events);
  py::list out;
  for (auto& e : events)
    out.append(py::make_tuple(static_cast<int>(e.kind), static_cast<int>(e.op), e.name,
                              e.label ? py::object(py::str(e.label)) : py::object(py::none()), e.ts_ns));
  return out;
}

void PyEngine::fail_next_collective(const std::string& message) {
  FaultInjection& f = engine_->faults();
  {
    std::lock_guard<std::mutex> lock(f.mu);
    f.message = message;
  }
  f.armed.store(true);
}

void bind_diagnostics(py::module_& m) {
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
  engine_class(m)
      .def("params", &PyEngine::params)
      .def("steps", &PyEngine::steps, py::arg("ps_id"), py::arg("since") = 0)
      .def("wire_bytes", &PyEngine::wire_bytes, py::arg("ps_id"),
           "Bytes on the wire for a process set since it was created: a dict of sent_bytes, received_bytes, "
           "control_sent_bytes, control_received_bytes.")
      .def_property_readonly("clean", &PyEngine::clean)
      .def("failed", &PyEngine::failed)
      .def("set_timeline", &PyEngine::set_timeline)
      .def("drain_timeline", &PyEngine::drain_timeline)
      .def("fail_next_collective", &PyEngine::fail_next_collective,
           "Tests: the next collective on this rank fails as a broken transport would.");
}

}  // namespace python_binding
}  // namespace perseus
