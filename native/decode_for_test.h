// The test hook perseus._core._decode_for_test (decode_for_test.cc): the message decoders on arbitrary bytes.
#pragma once

#include <pybind11/pybind11.h>

namespace perseus {

void register_decode_for_test(pybind11::module_& m);

}  // namespace perseus
