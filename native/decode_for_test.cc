// A test hook, perseus._core._decode_for_test(kind, data): runs one of the engine's decoders of the messages
// ranks send each other on arbitrary bytes, so that tests/unit/test_decoder_fuzz.py can feed it random,
// truncated and mutated messages and check that a malformed one raises a Python exception (TransportError
// becomes RuntimeError) and never crashes the process. perseus itself never calls it.
//
//   kind "control":      `data` (bytes) is one control message (control.h); returns a tuple of its fields
//   kind "negotiation":  `data` is one rank's negotiation payload (bytes), or a list of them, one per rank of
//                        a set of that size; runs the whole exchange (negotiation.h) on a fresh negotiator
//                        and returns (names ready, [(name, error message)])
#include "decode_for_test.h"

#include <pybind11/stl.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "control.h"
#include "negotiation.h"

namespace py = pybind11;

namespace perseus {

namespace {

py::object control_fields(const std::string& bytes) {
  switch (message_type(bytes)) {
    case MessageType::WAKE: {
      WakeMessage m;
      decode(bytes, &m);
      return py::make_tuple("wake", m.round);
    }
    case MessageType::PROBE: {
      ProbeMessage m;
      decode(bytes, &m);
      return py::make_tuple("probe", m.id);
    }
    case MessageType::ANSWER: {
      ProbeAnswer m;
      decode(bytes, &m);
      py::list pending;
      for (const std::string& name : m.pending) pending.append(py::bytes(name));
      return py::make_tuple("answer", m.id, m.joined, m.round, pending, py::bytes(m.where));
    }
    case MessageType::ABORT: {
      AbortMessage m;
      decode(bytes, &m);
      return py::make_tuple("abort", m.origin, py::bytes(m.text));
    }
    case MessageType::SHUTDOWN: {
      ShutdownMessage m;
      decode(bytes, &m);
      return py::make_tuple("shutdown");
    }
  }
  throw TransportError("perseus: unreachable control message type");
}

py::object exchange(const std::vector<std::string>& payloads) {
  if (payloads.empty()) throw std::invalid_argument("_decode_for_test: give at least one payload");
  Negotiator negotiator(0, static_cast<int>(payloads.size()));
  RoundResult result;
  negotiator.apply_exchange(&result, payloads, std::vector<int>(), 1);
  py::list ready, errors;
  for (int idx : result.ready) ready.append(py::bytes(negotiator.registry().name(idx)));
  for (auto& e : result.errors) errors.append(py::make_tuple(py::bytes(e.first), py::bytes(e.second)));
  return py::make_tuple(ready, errors);
}

py::object decode_for_test(const std::string& kind, const py::object& data) {
  if (kind == "control") return control_fields(data.cast<std::string>());
  if (kind == "negotiation") {
    if (py::isinstance<py::bytes>(data)) return exchange({data.cast<std::string>()});
    return exchange(data.cast<std::vector<std::string>>());
  }
  throw std::invalid_argument("_decode_for_test: kind must be 'control' or 'negotiation', not '" + kind + "'");
}

}  // namespace

void register_decode_for_test(py::module_& m) {
  m.def("_decode_for_test", &decode_for_test, py::arg("kind"), py::arg("data"),
        "Test hook: decode `data` as a control message ('control') or negotiation payloads ('negotiation'); "
        "raises RuntimeError for a malformed message. Not used by perseus.");
}

}  // namespace perseus
