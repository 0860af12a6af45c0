// Stage 4c: the hierarchical algorithms and the host layout (see hierarchical.h).
#include "hierarchical.h"

#include <map>
#include <numeric>

#include "buffers.h"
#include "ring.h"

namespace perseus {

HostLayout HostLayout::exchange(Comm& comm, int64_t host_key) {
  const int n = comm.size();
  std::vector<int64_t> keys(n);
  comm.allgather_i64(&host_key, 1, keys.data());
  HostLayout h;
  h.host_of.resize(n);
  h.local_rank.resize(n);
  std::map<int64_t, int> index;
  for (int r = 0; r < n; ++r) {
    auto it = index.emplace(keys[r], static_cast<int>(index.size())).first;
    if (static_cast<size_t>(it->second) == h.ranks_on.size()) h.ranks_on.emplace_back();
    h.host_of[r] = it->second;
    h.local_rank[r] = static_cast<int>(h.ranks_on[it->second].size());
    h.ranks_on[it->second].push_back(r);
  }
  h.hosts = static_cast<int>(h.ranks_on.size());
  for (const auto& on : h.ranks_on) h.homogeneous = h.homogeneous && on.size() == h.ranks_on[0].size();
  return h;
}

void hierarchical_allreduce(PointToPoint& local, PointToPoint& cross, const void* send, void* recv, size_t count,
                            DType dt, ReduceOp op, double postscale, Scratch& scratch) {
  const int lsize = local.size(), lr = local.rank();
  if (lsize == 1) {
    ring_allreduce(cross, send, recv, count, dt, op, postscale, scratch);
    return;
  }
  std::vector<size_t>& counts = *scratch.index(Scratch::kHostCounts);
  even_counts(count, lsize, &counts);
  ring_reduce_scatter(local, recv, counts, dt, op, send, scratch);
  const size_t start = std::accumulate(counts.begin(), counts.begin() + lr, size_t(0));
  ring_allreduce(cross, nullptr, element_at(recv, start, dt), counts[lr], dt, op, postscale, scratch);
  ring_allgather(local, recv, counts, dt, scratch);
}

void hierarchical_allgatherv(Comm& local, Comm* cross0, const HostLayout& layout, int rank, const void* send,
                             void* recv, const std::vector<size_t>& counts, DType dt, Scratch& scratch) {
  const size_t item = itemsize(dt);
  const int host = layout.host_of[rank];
  // The gathered layout: host blocks in host order, each block in local-rank order.
  std::vector<size_t> host_totals(layout.hosts, 0), order;
  for (int h = 0; h < layout.hosts; ++h)
    for (int r : layout.ranks_on[h]) host_totals[h] += counts[r], order.push_back(static_cast<size_t>(r));
  bool identity = true;
  for (size_t i = 0; i < order.size(); ++i) identity = identity && order[i] == i;
  const size_t total = std::accumulate(counts.begin(), counts.end(), size_t(0));
  uint8_t* gathered = identity ? static_cast<uint8_t*>(recv) : scratch.get(total * item, 1);
  const size_t host_start = std::accumulate(host_totals.begin(), host_totals.begin() + host, size_t(0));

  std::vector<size_t> local_counts;
  for (int r : layout.ranks_on[host]) local_counts.push_back(counts[r]);
  uint8_t* block = gathered + host_start * item;
  local.allgatherv(send, block, local_counts, dt);
  if (cross0 != nullptr) {
    // MPI forbids overlapping send and receive buffers: send the block from a copy.
    uint8_t* copy = scratch.get(host_totals[host] * item, 2);
    copy_bytes(copy, block, host_totals[host] * item);
    cross0->allgatherv(copy, gathered, host_totals, dt);
  }
  local.broadcast(gathered, total, dt, 0);
  if (identity) return;
  std::vector<size_t> displs;
  displacements(counts, &displs);
  size_t at_g = 0;
  for (size_t r : order) {
    copy_bytes(static_cast<uint8_t*>(recv) + displs[r] * item, gathered + at_g * item, counts[r] * item);
    at_g += counts[r];
  }
}

}  // namespace perseus
