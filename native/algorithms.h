// Stage 4c: all-reduce and allgather algorithms built from point-to-point transfers, and the host layout
// of a process set that they need.
//
// A Path is where a ring's messages travel: a Comm's own point-to-point messages (MPI: shared memory on
// one host) or a channel's Links (its own TCP connections between hosts). The flat ring runs over all
// ranks of the set; the hierarchical all-reduce reduces inside each host over the local Comm, all-reduces
// every rank's shard with the same shard of the other hosts over the cross Comm's links (each local rank
// at once, so a host drives local_size flows), then gathers inside the host.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "common.h"
#include "links.h"
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

struct Path {
  Comm* comm = nullptr;
  Links* links = nullptr;  // when set, transfers go over it instead of comm's messages
  int rank() const { return links != nullptr ? links->rank() : comm->rank(); }
  int size() const { return links != nullptr ? links->size() : comm->size(); }
  void sendrecv(const void* send, size_t send_bytes, int dest, void* recv, size_t recv_bytes, int source) const {
    if (links != nullptr) links->sendrecv(send, send_bytes, dest, recv, recv_bytes, source);
    else comm->sendrecv(send, send_bytes, dest, recv, recv_bytes, source);
  }
};

// Scratch memory an algorithm may reuse between calls (owned by the channel).
class Scratch {
 public:
  uint8_t* get(size_t nbytes, int slot);
 private:
  std::vector<uint8_t> slots_[3];
};

std::vector<size_t> even_counts(size_t total, int parts);

// Reduce across the path's ranks; afterwards rank r holds the reduced segment r (counts[r] elements at
// their offset) of buf. src (or buf when null) is this rank's input.
void ring_reduce_scatter(const Path& path, void* buf, const std::vector<size_t>& counts, DType dt, ReduceOp op,
                         const void* src, Scratch& scratch);
// The same reduction without a whole-size result buffer: this rank's reduced segment (counts[rank]
// elements) goes to out; src holds every segment and is only read. Partial sums live in two segment-sized
// scratch slots (0 and 2), so out may be as small as this rank's segment.
void ring_reduce_scatter_to(const Path& path, const void* src, void* out, const std::vector<size_t>& counts,
                            DType dt, ReduceOp op, Scratch& scratch);
// Each rank's segment r of buf reaches every rank.
void ring_allgather(const Path& path, void* buf, const std::vector<size_t>& counts, DType dt);
// recv = reduction of every rank's send (recv itself when send is null), times postscale.
void ring_allreduce(const Path& path, const void* send, void* recv, size_t count, DType dt, ReduceOp op,
                    double postscale, Scratch& scratch);
// The same result by hosts: local reduce-scatter, cross all-reduce of each shard, local allgather.
void hierarchical_allreduce(const Path& local, const Path& cross, const void* send, void* recv, size_t count,
                            DType dt, ReduceOp op, double postscale, Scratch& scratch);
// Allgather by hosts: gather inside the host, exchange host blocks between the hosts' first ranks (cross
// over local rank 0 only), broadcast inside the host, then put blocks in rank order. counts are per rank of
// the set, in elements; recv holds the sum of counts.
void hierarchical_allgatherv(Comm& local, Comm* cross0, const HostLayout& layout, int rank, const void* send,
                             void* recv, const std::vector<size_t>& counts, DType dt, Scratch& scratch);

}  // namespace perseus
