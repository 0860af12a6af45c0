// The process sets that an engine gave up on (engine.cc, engine_loop.cc): sets whose channel threads could not
// be stopped (stuck in a collective a dead peer will never finish) stay allocated, since those threads still
// point at them. One list for the whole process, never freed; abandoned_process_sets() (engine.h) counts it.
#pragma once

#include <memory>
#include <vector>

#include "process_set.h"

namespace perseus {
namespace engine_detail {

inline std::vector<std::shared_ptr<ProcessSet>>& abandoned() {
  static auto* sets = new std::vector<std::shared_ptr<ProcessSet>>();
  return *sets;
}

}  // namespace engine_detail
}  // namespace perseus
