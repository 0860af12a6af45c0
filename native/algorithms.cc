// Stage 4c: ring and hierarchical algorithms (see algorithms.h).
#include "algorithms.h"

#include <algorithm>
#include <map>
#include <numeric>

#include "buffers.h"
#include "kernels.h"

namespace perseus {

namespace {

std::vector<size_t> displacements(const std::vector<size_t>& counts) {
  std::vector<size_t> out(counts.size());
  size_t acc = 0;
  for (size_t i = 0; i < counts.size(); ++i) out[i] = acc, acc += counts[i];
  return out;
}

}  // namespace

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

uint8_t* Scratch::get(size_t nbytes, int slot) {
  auto& s = slots_[slot];
  if (s.size() < nbytes) s.resize(std::max(nbytes, 2 * s.size()));
  return s.data();
}

std::vector<size_t> even_counts(size_t total, int parts) {
  std::vector<size_t> out(parts, total / parts);
  for (size_t i = 0; i < total % parts; ++i) out[i] += 1;
  return out;
}

void ring_reduce_scatter(const Path& path, void* buf, const std::vector<size_t>& counts, DType dt, ReduceOp op,
                         const void* src, Scratch& scratch) {
  const int n = path.size(), r = path.rank();
  if (n == 1) return;
  auto displs = displacements(counts);
  const int right = (r + 1) % n, left = (r - 1 + n) % n;
  const size_t max_count = *std::max_element(counts.begin(), counts.end());
  uint8_t* tmp = scratch.get(max_count * itemsize(dt), 0);
  for (int step = 0; step < n - 1; ++step) {
    const int s = ((r - step - 1) % n + n) % n, q = ((r - step - 2) % n + n) % n;
    const void* origin = (src != nullptr && step == 0) ? src : buf;
    path.sendrecv(element_at(origin, displs[s], dt), counts[s] * itemsize(dt), right, tmp, counts[q] * itemsize(dt), left);
    const void* mine = element_at(src != nullptr ? src : buf, displs[q], dt);
    combine(mine, tmp, element_at(buf, displs[q], dt), counts[q], dt, op);
  }
}

void ring_reduce_scatter_to(const Path& path, const void* src, void* out, const std::vector<size_t>& counts,
                            DType dt, ReduceOp op, Scratch& scratch) {
  const int n = path.size(), r = path.rank();
  auto displs = displacements(counts);
  const size_t item = itemsize(dt);
  if (n == 1) {
    copy_bytes(out, element_at(src, displs[0], dt), counts[0] * item);
    return;
  }
  const int right = (r + 1) % n, left = (r - 1 + n) % n;
  const size_t max_count = *std::max_element(counts.begin(), counts.end());
  uint8_t* tmp = scratch.get(max_count * item, 0);
  uint8_t* acc = scratch.get(max_count * item, 2);
  // Step k sends the partial sum of segment r-k-1 (this rank's own values at k = 0) and receives that of
  // segment r-k-2, adding this rank's values to it; the last step's segment is r itself. Only the partial
  // sum just computed is live, so one accumulator suffices: it is sent before it is overwritten.
  for (int step = 0; step < n - 1; ++step) {
    const int s = ((r - step - 1) % n + n) % n, q = ((r - step - 2) % n + n) % n;
    const void* outgoing = step == 0 ? element_at(src, displs[s], dt) : acc;
    path.sendrecv(outgoing, counts[s] * item, right, tmp, counts[q] * item, left);
    combine(element_at(src, displs[q], dt), tmp, step == n - 2 ? out : acc, counts[q], dt, op);
  }
}

void ring_allgather(const Path& path, void* buf, const std::vector<size_t>& counts, DType dt) {
  const int n = path.size(), r = path.rank();
  auto displs = displacements(counts);
  const int right = (r + 1) % n, left = (r - 1 + n) % n;
  for (int step = 0; step < n - 1; ++step) {
    const int s = ((r - step) % n + n) % n, q = ((r - step - 1) % n + n) % n;
    path.sendrecv(element_at(buf, displs[s], dt), counts[s] * itemsize(dt), right, element_at(buf, displs[q], dt),
                  counts[q] * itemsize(dt), left);
  }
}

// Each rank scales only the segment it owns, so Average costs 1/size of a pass instead of a whole one.
void ring_allreduce(const Path& path, const void* send, void* recv, size_t count, DType dt, ReduceOp op,
                    double postscale, Scratch& scratch) {
  const int n = path.size(), r = path.rank();
  auto counts = even_counts(count, n);
  ring_reduce_scatter(path, recv, counts, dt, op, send, scratch);
  const size_t start = std::accumulate(counts.begin(), counts.begin() + r, size_t(0));
  void* mine = element_at(recv, start, dt);
  if (n == 1 && send != nullptr) scale_into(element_at(send, start, dt), mine, counts[r], dt, postscale);
  else if (postscale != 1.0) scale_into(mine, mine, counts[r], dt, postscale);
  ring_allgather(path, recv, counts, dt);
}

void hierarchical_allreduce(const Path& local, const Path& cross, const void* send, void* recv, size_t count,
                            DType dt, ReduceOp op, double postscale, Scratch& scratch) {
  const int lsize = local.size(), lr = local.rank();
  if (lsize == 1) {
    ring_allreduce(cross, send, recv, count, dt, op, postscale, scratch);
    return;
  }
  auto counts = even_counts(count, lsize);
  ring_reduce_scatter(local, recv, counts, dt, op, send, scratch);
  const size_t start = std::accumulate(counts.begin(), counts.begin() + lr, size_t(0));
  ring_allreduce(cross, nullptr, element_at(recv, start, dt), counts[lr], dt, op, postscale, scratch);
  ring_allgather(local, recv, counts, dt);
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
  std::vector<size_t> displs = displacements(counts);
  size_t at_g = 0;
  for (size_t r : order) {
    copy_bytes(static_cast<uint8_t*>(recv) + displs[r] * item, gathered + at_g * item, counts[r] * item);
    at_g += counts[r];
  }
}

}  // namespace perseus
