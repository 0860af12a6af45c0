// Stage 4c: the hierarchical algorithms, for a process set whose hosts each run the same number (> 1) of
// ranks, and the host layout they need. The all-reduce reduces inside each host over the local ranks,
// all-reduces every rank's shard with the same shard of the other hosts over the cross ranks (each local
// rank at once, so a host drives local_size flows; ring.h), then gathers inside the host.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "algorithms.h"
#include "common.h"
#include "transport.h"

namespace perseus {

// Which host every rank of a process set is on (ranks of one host share a host key), and what follows.
struct HostLayout {
  std::vector<int> host_of;      // per rank: host index, numbered by first appearance
  std::vector<int> local_rank;   // per rank: position among the ranks of its host
  std::vector<std::vector<int>> ranks_on;  // per host: its ranks in order
  int hosts = 1;
  bool homogeneous = true;       // every host has the same number of ranks
  int local_size(int rank) const { return static_cast<int>(ranks_on[host_of[rank]].size()); }

  // Collective over comm: every rank gives its host key.
  static HostLayout exchange(Comm& comm, int64_t host_key);
};

// The result of ring_allreduce by hosts: local reduce-scatter, cross all-reduce of each shard, local
// allgather. `local`: the ranks of this host; `cross`: this local rank's peers on the other hosts.
void hierarchical_allreduce(PointToPoint& local, PointToPoint& cross, const void* send, void* recv, size_t count,
                            DType dt, ReduceOp op, double postscale, Scratch& scratch);
// Allgather by hosts: gather inside the host, exchange host blocks between the hosts' first ranks (cross
// over local rank 0 only), broadcast inside the host, then put blocks in rank order. counts are per rank of
// the set, in elements; recv holds the sum of counts.
void hierarchical_allgatherv(Comm& local, Comm* cross0, const HostLayout& layout, int rank, const void* send,
                             void* recv, const std::vector<size_t>& counts, DType dt, Scratch& scratch);

}  // namespace perseus
