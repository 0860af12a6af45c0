// Adasum (adaptive summation) of floating-point gradients, on CPU buffers.
//
// Two gradients a (the lower half of the ranks) and b (the upper half) combine as
//     (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b
// (a zero vector's coefficient is 1): orthogonal gradients add, parallel ones average. Over 2^k ranks the
// combination is the balanced binary tree ((g0 + g1) + (g2 + g3)) + ..., computed by recursive vector
// halving and distance doubling: at distance d each rank swaps half of its current region with rank ^ d, the
// three dot products of the region are summed over the 2d ranks of the group (recursive doubling of
// 3 doubles per tensor), and each rank combines its half; an allgather in the reverse order returns the
// whole vector to every rank. With n ranks not a power of two, rank P + i (P the largest power of two
// below n) first hands its vector to rank i, which combines the two (its own as a); the P ranks then run
// the tree, and rank i sends the result back to rank P + i.
//
// Dot products and combinations are computed in double for every dtype (float16/bfloat16 are widened and
// rounded once), so tiny and huge gradients stay exact enough. Each tensor of a fused buffer has its own
// coefficients: `segments` lists the element counts of the tensors laid end to end in the buffer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "algorithms.h"
#include "common.h"
#include "fusion.h"
#include "transport.h"

namespace perseus {

// Whether Adasum applies to this dtype (float16, bfloat16, float32, float64).
bool adasum_supports(DType dt);

// In place: every rank's buf (count elements) becomes the Adasum of all ranks' bufs. Collective over path.
void adasum_allreduce(PointToPoint& path, void* buf, size_t count, DType dt, const std::vector<size_t>& segments,
                      Scratch& scratch);

// One all-reduce unit with reduce op ADASUM (whole tensors only: fusion never splits one): copies in
// (times prescale), reduces with each tensor's own coefficients, copies out (times postscale).
void adasum_unit(PointToPoint& path, Unit* u, std::vector<uint8_t>& fusion, Scratch& scratch);

}  // namespace perseus
