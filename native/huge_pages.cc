// Transparent huge pages for reused host buffers (see huge_pages.h).
#include "huge_pages.h"

#include <sys/mman.h>

#include <mutex>
#include <unordered_map>

namespace perseus {
namespace {

#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25
#endif

constexpr uintptr_t kFrame = uintptr_t(2) << 20;
constexpr size_t kMaxTracked = size_t(1) << 20;  // buffers remembered; beyond, no new ones are
constexpr int64_t kGiveUpAfter = 16;             // refusals with no success before the process stops asking
constexpr uint8_t kSightings = 3;                // the sighting of the same buffer that collapses it
constexpr uint8_t kDone = 255;

struct Tracker {
  std::mutex mu;
  // (start, length) of a buffer -> times seen, kDone once collapsed. The same start and length again and
  // again means memory kept between steps; a training loop that allocates its gradients anew each step
  // (zero_grad(set_to_none=True)) hands over buffers whose addresses change, and those are never collapsed:
  // a collapse copies the frame, a cost only memory that stays can repay.
  std::unordered_map<uint64_t, uint8_t> seen;
  HugePageStats stats;
};

Tracker& tracker() {
  static Tracker* t = new Tracker();  // never destroyed: channel threads may outlive static destruction
  return *t;
}

uint64_t key_of(uintptr_t start, size_t nbytes) {
  return static_cast<uint64_t>(start) * 0x9E3779B97F4A7C15ull ^ static_cast<uint64_t>(nbytes);
}

// Whether this sighting of [start, start + nbytes) is the one that collapses it.
bool due(Tracker& t, uintptr_t start, size_t nbytes) {
  const uint64_t key = key_of(start, nbytes);
  auto it = t.seen.find(key);
  if (it == t.seen.end()) {
    if (t.seen.size() < kMaxTracked) t.seen.emplace(key, 1);
    return false;
  }
  if (it->second == kDone) return false;
  if (++it->second < kSightings) return false;
  it->second = kDone;
  return true;
}

}  // namespace

void advise_huge_pages(const void* p, size_t nbytes) {
  if (p == nullptr || nbytes < kHugePageMinBytes) return;
  Tracker& t = tracker();
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  {
    std::lock_guard<std::mutex> lock(t.mu);
    if (t.stats.gave_up || !due(t, a, nbytes)) return;
  }
  int64_t ok = 0, refused = 0;
  // The frames at the ends may hold other memory of the process too: collapsing keeps every byte.
  for (uintptr_t f = a & ~(kFrame - 1); f < a + nbytes; f += kFrame) {
    if (madvise(reinterpret_cast<void*>(f), kFrame, MADV_COLLAPSE) == 0) ++ok; else ++refused;
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
