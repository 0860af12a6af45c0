// The core's heap allocations, counted: the global operator new of this library (not exported: native/core.map,
// so they replace operator new for the core's own code only) counts every call, so a test can check that a
// training step's steady state allocates nothing. Allocations made inside libstdc++'s compiled code (e.g.
// std::string's growth) use libstdc++'s operator new and are not counted.
#pragma once

#include <cstdint>

namespace perseus {

// Heap allocations the core has made since the process started (every thread; relaxed).
uint64_t native_allocations();

}  // namespace perseus
