// The Python binding of the native core (module perseus._core). Python calls in with the GIL; every call
// that can wait (wait, add/remove a process set, shutdown) releases it. Engine and channel threads never
// take the GIL; a dedicated callback thread does, to run completion callbacks (batched) and to release
// the Python objects that kept a request's tensors alive.
//
// This file defines the module; each area binds its own part (python_binding.h lists them), in an order
// where every type is registered before a signature names it.
#include <pybind11/pybind11.h>

#include "decode_for_test.h"
#include "python_binding.h"

PYBIND11_MODULE(_core, m) {
  namespace binding = perseus::python_binding;
  m.doc() = "perseus native core: queue, negotiation, fusion, channels, transports, completion";
  binding::bind_settings(m);
  perseus::register_decode_for_test(m);  // a test hook: the message decoders on arbitrary bytes
  binding::bind_engine(m);
  binding::bind_transport(m);
  binding::bind_requests(m);
  binding::bind_completion(m);
  binding::bind_diagnostics(m);
}
