// Stage 4c: the ring algorithms over the ranks of a PointToPoint (transport.h): reduce-scatter, allgather
// and all-reduce (the two in sequence). Each of the size - 1 steps sends one segment to the right neighbour
// while receiving one from the left, so every rank sends and receives 2 (size - 1) / size of the buffer in
// an all-reduce, whatever the number of ranks.
#pragma once

#include <cstddef>
#include <vector>

#include "algorithms.h"
#include "common.h"
#include "transport.h"

namespace perseus {

// Reduce across the ranks; afterwards rank r holds the reduced segment r (counts[r] elements at their
// offset) of buf, times `scale` (applied in the last combine, not as a pass of its own). src (or buf when
// null) is this rank's input.
void ring_reduce_scatter(PointToPoint& path, void* buf, const std::vector<size_t>& counts, DType dt, ReduceOp op,
                         const void* src, Scratch& scratch, double scale = 1.0);
// The same reduction without a whole-size result buffer: this rank's reduced segment (counts[rank]
// elements) goes to out; src holds every segment and is only read. Partial sums live in two segment-sized
// scratch slots (0 and 2), so out may be as small as this rank's segment.
void ring_reduce_scatter_to(PointToPoint& path, const void* src, void* out, const std::vector<size_t>& counts,
                            DType dt, ReduceOp op, Scratch& scratch);
// Each rank's segment r of buf reaches every rank.
void ring_allgather(PointToPoint& path, void* buf, const std::vector<size_t>& counts, DType dt, Scratch& scratch);
// recv = reduction of every rank's send (recv itself when send is null), times postscale.
void ring_allreduce(PointToPoint& path, const void* send, void* recv, size_t count, DType dt, ReduceOp op,
                    double postscale, Scratch& scratch);

}  // namespace perseus
