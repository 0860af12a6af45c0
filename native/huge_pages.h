// Transparent huge pages for the host memory that all-reduces move between processes.
//
// Within a host, MPI's shared-memory transport copies large messages straight between the processes' memory
// (the kernel's cross-memory copy), whose cost grows with the number of pages it must look up and pin: on
// 4 KiB pages an all-reduce of a ResNet-50 gradient set took 2.4x as long as on 2 MiB pages (docs/benchmarks.md).
// Framework allocators hand out 4 KiB pages unless the system makes every mapping huge, so the channels ask
// the kernel (madvise MADV_COLLAPSE, Linux 6.1+) to back the 2 MiB frames under a large buffer with huge pages
// the third time they are handed the same buffer (same start, same length): memory kept step after step
// (gradients that persist, fusion and scratch buffers) is collapsed once; buffers at new addresses every
// step (gradients allocated anew) are left alone, since a collapse copies its frames.
// Collapsing keeps the contents (it may round a frame's resident memory up to 2 MiB). Best effort: where the
// kernel refuses (no support, THP disabled, shared or file memory), nothing changes, and after repeated
// refusals with no success the process stops asking.
#pragma once

#include <cstddef>
#include <cstdint>

namespace perseus {

struct HugePageStats {
  int64_t collapsed_frames = 0;  // 2 MiB frames the kernel collapsed at this process's request
  int64_t refused_frames = 0;    // frames it refused
  bool gave_up = false;          // every request so far was refused: no more are made
};

// Note that [p, p + nbytes) is about to be moved by a collective; buffers under kHugePageMinBytes are
// ignored. Thread-safe; a lock and a hash lookup per call. Callers pass a buffer's whole extent where it is
// reused in parts (fusion and scratch buffers), so that its key does not change with each unit's size.
void advise_huge_pages(const void* p, size_t nbytes);
constexpr size_t kHugePageMinBytes = size_t(1) << 20;

HugePageStats huge_page_stats();

}  // namespace perseus
