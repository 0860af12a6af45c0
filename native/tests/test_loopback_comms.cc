// The loopback transport's communicators over time: dups driven concurrently by threads of each rank,
// dups created and dropped without piling up in the world's registry (1-4 rank-threads), and the world's
// tables (and, unsanitized, the process's RSS) staying bounded over many small collectives on 2 and 4
// rank-threads (LOOPBACK_ITERS of them, default 100000). Build and run: run_loopback_tests.sh.
#include <unistd.h>

#include <cstdlib>
#include <fstream>

#include "loopback_test.h"

using namespace perseus;
using namespace perseus::loopback_test;

namespace {

// Two dups driven concurrently by two threads per rank, plus barriers on the parent from the rank thread:
// every communicator's collectives match by their own order only.
void test_concurrent_dups(int n) {
  const int iters = 1500;
  run_world(n, [&](Comm& c) {
    const int me = c.rank();
    std::unique_ptr<Comm> a = c.dup(), b = c.dup();
    std::thread ta([&] {
      unsigned rng = 12345u + me;
      std::unique_ptr<Comm> nested;
      for (int i = 0; i < iters; ++i) {
        rng = rng * 1103515245u + 12345u;
        if ((rng >> 16) % 4 == 0) std::this_thread::yield();
        int64_t v[2] = {(me + 1) * i, me}, out[2];
        a->allreduce(v, out, 2, DType::INT64, ReduceOp::SUM);
        CHECK(out[0] == int64_t{i} * n * (n + 1) / 2);
        CHECK(out[1] == n * (n - 1) / 2);
        if (i == iters / 2) nested = a->dup();  // a dup of a dup, taken mid-stream
        if (nested) {
          float f = static_cast<float>(me), mx = -1;
          nested->allreduce(&f, &mx, 1, DType::FLOAT32, ReduceOp::MAX);
          CHECK(mx == static_cast<float>(n - 1));
        }
      }
    });
    std::thread tb([&] {
      unsigned rng = 999u + me;
      for (int i = 0; i < iters; ++i) {
        rng = rng * 1103515245u + 12345u;
        if ((rng >> 16) % 4 == 0) std::this_thread::yield();
        std::vector<size_t> counts(n);
        size_t total = 0;
        for (int r = 0; r < n; ++r) counts[r] = (r + i) % 3, total += counts[r];
        std::vector<int64_t> send(counts[me], int64_t{i} * 10 + me), recv(total);
        b->allgatherv(send.data(), recv.data(), counts, DType::INT64);
        size_t at = 0;
        for (int r = 0; r < n; ++r)
          for (size_t k = 0; k < counts[r]; ++k) CHECK(recv[at++] == int64_t{i} * 10 + r);
        int64_t tok = int64_t{i} * 100 + me, got = -1;
        b->sendrecv(&tok, 8, (me + 1) % n, &got, 8, (me + n - 1) % n);
        CHECK(got == int64_t{i} * 100 + (me + n - 1) % n);
      }
    });
    for (int i = 0; i < iters / 3; ++i) c.barrier();
    ta.join();
    tb.join();
  });
}

long rss_kb() {
  std::ifstream f("/proc/self/statm");
  long pages = 0, resident = 0;
  f >> pages >> resident;
  return resident * (sysconf(_SC_PAGESIZE) / 1024);
}

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kSanitized = true;  // quarantines and shadow memory make RSS meaningless
#else
constexpr bool kSanitized = false;
#endif

// Many small collectives: the table never holds more than the two collectives ranks can be between.
void test_many_collectives(int n, int iters) {
  auto world = make_loopback_world(n);
  size_t max_slots = 0;
  long rss_early = 0, rss_late = 0;
  run_world(n, [&](Comm& c) {
    float one = 1, sum = 0;
    for (int i = 0; i < iters; ++i) {
      c.allreduce(&one, &sum, 1, DType::FLOAT32, ReduceOp::SUM);
      if (sum != static_cast<float>(n)) {
        CHECK(sum == static_cast<float>(n));
        break;
      }
      if (c.rank() == 0 && i % 1000 == 0) {
        max_slots = std::max(max_slots, loopback_world_stats(world).slots);
        if (i == iters / 10) rss_early = rss_kb();
      }
    }
    if (c.rank() == 0) rss_late = rss_kb();
  }, world);
  CHECK_MSG(max_slots <= 2, std::to_string(max_slots) + " slots at once");
  std::printf("  %d ranks, %d allreduces: at most %zu live slots, RSS %ld kB -> %ld kB\n", n, iters, max_slots,
              rss_early, rss_late);
  if (!kSanitized)
    CHECK_MSG(rss_late - rss_early < 8 * 1024, "RSS grew by " + std::to_string(rss_late - rss_early) + " kB");
}

// Communicators created and dropped over and over do not pile up in the world's registry.
void test_dup_lifecycle(int n) {
  auto world = make_loopback_world(n);
  run_world(n, [&](Comm& c) {
    for (int i = 0; i < 300; ++i) {
      auto d = c.dup();
      d->barrier();
      d.reset();
      c.barrier();  // everybody dropped it
      if (c.rank() == 0) CHECK(loopback_world_stats(world).comms == 1);
      c.barrier();
    }
  }, world);
}

}  // namespace

int main() {
  int iters = 100000;
  if (const char* e = std::getenv("LOOPBACK_ITERS")) iters = std::atoi(e);
  run_on_1_to_4_ranks({
      {"concurrent_dups", test_concurrent_dups},
      {"dup_lifecycle", test_dup_lifecycle},
  });
  for (int n : {2, 4}) test_many_collectives(n, iters);
  return summary("test_loopback_comms");
}
