// Stage 4c: the ring algorithms (see ring.h).
#include "ring.h"

#include <algorithm>
#include <numeric>

#include "buffers.h"
#include "kernels.h"

namespace perseus {

void ring_reduce_scatter(PointToPoint& path, void* buf, const std::vector<size_t>& counts, DType dt, ReduceOp op,
                         const void* src, Scratch& scratch, double scale) {
  const int n = path.size(), r = path.rank();
  if (n == 1) return;
  std::vector<size_t>& displs = *scratch.index(Scratch::kDispls);
  displacements(counts, &displs);
  const int right = (r + 1) % n, left = (r - 1 + n) % n;
  const size_t max_count = *std::max_element(counts.begin(), counts.end());
  uint8_t* tmp = scratch.get(max_count * itemsize(dt), 0);
  for (int step = 0; step < n - 1; ++step) {
    const int s = ((r - step - 1) % n + n) % n, q = ((r - step - 2) % n + n) % n;
    const void* origin = (src != nullptr && step == 0) ? src : buf;
    path.sendrecv(element_at(origin, displs[s], dt), counts[s] * itemsize(dt), right, tmp, counts[q] * itemsize(dt), left);
    const void* mine = element_at(src != nullptr ? src : buf, displs[q], dt);
    // The last step completes this rank's own segment (q == r): scale it as it is combined.
    combine_scaled(mine, tmp, element_at(buf, displs[q], dt), counts[q], dt, op, step == n - 2 ? scale : 1.0);
  }
}

void ring_reduce_scatter_to(PointToPoint& path, const void* src, void* out, const std::vector<size_t>& counts,
                            DType dt, ReduceOp op, Scratch& scratch) {
  const int n = path.size(), r = path.rank();
  std::vector<size_t>& displs = *scratch.index(Scratch::kDispls);
  displacements(counts, &displs);
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

void ring_allgather(PointToPoint& path, void* buf, const std::vector<size_t>& counts, DType dt, Scratch& scratch) {
  const int n = path.size(), r = path.rank();
  std::vector<size_t>& displs = *scratch.index(Scratch::kDispls);
  displacements(counts, &displs);
  const int right = (r + 1) % n, left = (r - 1 + n) % n;
  for (int step = 0; step < n - 1; ++step) {
    const int s = ((r - step) % n + n) % n, q = ((r - step - 1) % n + n) % n;
    path.sendrecv(element_at(buf, displs[s], dt), counts[s] * itemsize(dt), right, element_at(buf, displs[q], dt),
                  counts[q] * itemsize(dt), left);
  }
}

// Each rank scales only the segment it owns, in the last combine of the reduce-scatter, so Average costs no
// pass over the data of its own.
void ring_allreduce(PointToPoint& path, const void* send, void* recv, size_t count, DType dt, ReduceOp op,
                    double postscale, Scratch& scratch) {
  const int n = path.size();
  std::vector<size_t>& counts = *scratch.index(Scratch::kRingCounts);
  even_counts(count, n, &counts);
  if (n == 1) {  // no combine to fold the scale into
    if (postscale != 1.0) scale_into(send != nullptr ? send : recv, recv, count, dt, postscale);
    else if (send != nullptr && send != recv) copy_bytes(recv, send, count * itemsize(dt));
    return;
  }
  ring_reduce_scatter(path, recv, counts, dt, op, send, scratch, postscale);
  ring_allgather(path, recv, counts, dt, scratch);
}

}  // namespace perseus
