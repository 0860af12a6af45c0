// Stage 4c: what the collective algorithms share (see algorithms.h).
#include "algorithms.h"

#include <algorithm>

#include "huge_pages.h"

namespace perseus {

uint8_t* Scratch::get(size_t nbytes, int slot) {
  auto& s = slots_[slot];
  if (s.size() < nbytes) s.resize(std::max(nbytes, 2 * s.size()));
  if (huge_pages_) advise_huge_pages(s.data(), s.size());
  return s.data();
}

void even_counts(size_t total, int parts, std::vector<size_t>* out) {
  out->assign(parts, total / parts);
  for (size_t i = 0; i < total % parts; ++i) (*out)[i] += 1;
}

void displacements(const std::vector<size_t>& counts, std::vector<size_t>* out) {
  out->resize(counts.size());
  size_t acc = 0;
  for (size_t i = 0; i < counts.size(); ++i) (*out)[i] = acc, acc += counts[i];
}

}  // namespace perseus
