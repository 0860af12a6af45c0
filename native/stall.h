// The stall inspector of a process set: notices requests that have waited long for other ranks, asks the
// peers what they have pending (a PROBE, answered with a ProbeAnswer: control.h), and writes the report that
// names, for each stalled request, the ranks that have and have not submitted it. Past the shutdown time
// the report becomes fatal. Engine thread only.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "control.h"
#include "handles.h"

namespace perseus {

struct StallSettings {
  bool disable = false;
  double check_time_s = 60.0;      // warn after requests waited this long, and at most this often
  double shutdown_time_s = 300.0;  // fail every rank after this long; 0: never
};

class StallInspector {
 public:
  // `world_ranks`: the world rank of each rank of the set; `me`: this rank's world rank.
  StallInspector(StallSettings settings, int rank, std::vector<int> world_ranks, int me);

  // What check() asks the set to do.
  struct Action {
    int64_t probe = 0;      // send a PROBE with this id to every peer (0: none)
    std::string report;     // log this report (empty: none)
    bool shutdown = false;  // the report is fatal: fail every rank with it
  };
  // Look at the requests still pending (at most every 50 ms): start a probe, or report once every peer
  // answered it or its answers are overdue.
  Action check(double now, const NameMap& pending);
  // A peer's answer to the probe in flight (answers to earlier probes are ignored).
  void answer(int world_rank, ProbeAnswer a);
  bool probing() const { return probe_ != nullptr; }

 private:
  struct Probe {
    int64_t id;
    std::vector<int> waiting_for;  // world ranks that have not answered yet
    std::unordered_map<int, ProbeAnswer> answers;
    double deadline;
  };
  Action start_probe(double now);
  std::string report(const Probe& probe, double now, const NameMap& pending, double waited) const;
  std::vector<std::string> stalled_lines(const Probe& probe, double now, const NameMap& pending) const;

  StallSettings settings_;
  int rank_;
  std::vector<int> world_ranks_;
  int me_;
  std::unique_ptr<Probe> probe_;
  int64_t probe_counter_ = 0;
  double last_warn_ = 0, last_check_ = 0;
};

}  // namespace perseus
