// Transparent huge pages for reused host buffers (see huge_pages.h).
#include "huge_pages.h"

#include <sys/mman.h>

#include <mutex>
#include <unordered_map>
#include <vector>

namespace perseus {
namespace {

#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25
#endif

constexpr uintptr_t kFrame = uintptr_t(2) << 20;
constexpr size_t kMaxTracked = size_t(1) << 20;  // frames remembered (2 TiB of memory): beyond, no new ones
constexpr int64_t kGiveUpAfter = 16;             // refusals with no success before the process stops asking

struct Tracker {
  std::mutex mu;
  std::unordered_map<uintptr_t, uint8_t> seen;  // frame -> 1: seen once, 2: asked for
  HugePageStats stats;
};

Tracker& tracker() {
  static Tracker* t = new Tracker();  // never destroyed: channel threads may outlive static destruction
  return *t;
}

// The frames of [first, last] seen for the second time, as runs of consecutive frames.
void frames_due(Tracker& t, uintptr_t first, uintptr_t last, std::vector<std::pair<uintptr_t, uintptr_t>>* runs) {
  for (uintptr_t f = first; f <= last; f += kFrame) {
    auto it = t.seen.find(f);
    if (it == t.seen.end()) {
      if (t.seen.size() < kMaxTracked) t.seen.emplace(f, 1);
      continue;
    }
    if (it->second != 1) continue;
    it->second = 2;
    if (!runs->empty() && runs->back().second == f) runs->back().second = f + kFrame;
    else runs->push_back({f, f + kFrame});
  }
}

}  // namespace

void advise_huge_pages(const void* p, size_t nbytes) {
  if (p == nullptr || nbytes < kHugePageMinBytes) return;
  Tracker& t = tracker();
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  std::vector<std::pair<uintptr_t, uintptr_t>> runs;
  {
    std::lock_guard<std::mutex> lock(t.mu);
    if (t.stats.gave_up) return;
    frames_due(t, a & ~(kFrame - 1), (a + nbytes - 1) & ~(kFrame - 1), &runs);
  }
  if (runs.empty()) return;
  int64_t ok = 0, refused = 0;
  for (const auto& run : runs) {
    // The frames at the ends may hold other memory of the process too: collapsing keeps every byte.
    for (uintptr_t f = run.first; f < run.second; f += kFrame) {
      if (madvise(reinterpret_cast<void*>(f), kFrame, MADV_COLLAPSE) == 0) ++ok; else ++refused;
    }
  }
  std::lock_guard<std::mutex> lock(t.mu);
  t.stats.collapsed_frames += ok;
  t.stats.refused_frames += refused;
  if (t.stats.collapsed_frames == 0 && t.stats.refused_frames >= kGiveUpAfter) {
    t.stats.gave_up = true;
    t.seen.clear();
  }
}

HugePageStats huge_page_stats() {
  Tracker& t = tracker();
  std::lock_guard<std::mutex> lock(t.mu);
  return t.stats;
}

}  // namespace perseus
