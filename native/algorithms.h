// Stage 4c: what the collective algorithms built from point-to-point transfers share. Each algorithm has a
// file of its own: the ring (ring.h), the hierarchical algorithms (hierarchical.h) and Adasum (adasum.h); all
// move data through a PointToPoint (transport.h): a Comm's own messages or a channel's Links.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "common.h"

namespace perseus {

// Scratch memory an algorithm may reuse between calls (owned by the channel).
class Scratch {
 public:
  // A buffer of at least nbytes for `slot` (0-2), kept between calls; with huge pages on, its frames are
  // offered for collapsing (huge_pages.h).
  uint8_t* get(size_t nbytes, int slot);
  // An index vector for `slot` (one of the k*Index slots below), kept between calls so that the per-segment
  // counts and offsets of an algorithm allocate nothing once the rank count has been seen.
  std::vector<size_t>* index(int slot) { return &index_[slot]; }
  static constexpr int kRingCounts = 0;  // ring_allreduce's segment sizes
  static constexpr int kDispls = 1;      // a ring step function's segment offsets (used only within the call)
  static constexpr int kHostCounts = 2;  // hierarchical_allreduce's local segment sizes
  void set_huge_pages(bool on) { huge_pages_ = on; }
 private:
  std::vector<uint8_t> slots_[3];
  std::vector<size_t> index_[3];
  bool huge_pages_ = false;
};

// `total` elements in `parts` segments whose sizes differ by at most one (the first ones larger).
// Written into *out (its capacity reused).
void even_counts(size_t total, int parts, std::vector<size_t>* out);
// Where each segment of `counts` starts, in elements, written into *out (its capacity reused).
void displacements(const std::vector<size_t>& counts, std::vector<size_t>* out);

}  // namespace perseus
