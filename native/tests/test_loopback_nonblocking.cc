// The loopback transport's non-blocking operations on 1-4 rank-threads: iallreduce_band, iallgather_i64 and
// iallgatherv_bytes polled to completion, beside a blocking collective, dropped before completion, and many
// back to back as the engine's negotiation runs them. Build and run: run_loopback_tests.sh.
#include "loopback_test.h"

using namespace perseus;
using namespace perseus::loopback_test;

namespace {

// Polls op until done (a real caller does other work between tests; here: yield).
void wait_op(PendingOp& op) {
  while (!op.test()) std::this_thread::yield();
}

void test_nonblocking(int n) {
  std::atomic<bool> gate{false};
  run_world(n, [&](Comm& c) {
    const int me = c.rank();
    // Rank 0 starts first and sees "not yet" while the others are held back; repeated tests are harmless.
    if (me != 0)
      while (!gate.load()) std::this_thread::yield();
    uint64_t words[3] = {~(uint64_t{1} << me), ~uint64_t{0}, 0xF0F0u | (uint64_t{1} << (8 + me))};
    auto op = c.iallreduce_band(words, 3);
    if (me == 0) {
      for (int i = 0; i < 1000 && n > 1; ++i) CHECK(!op->test());
      gate = true;
    }
    wait_op(*op);
    CHECK(op->test());  // stays true
    uint64_t want0 = ~uint64_t{0};
    for (int r = 0; r < n; ++r) want0 &= ~(uint64_t{1} << r);
    CHECK(words[0] == want0);
    CHECK(words[1] == ~uint64_t{0});
    CHECK(words[2] == (n == 1 ? (0xF0F0u | (1u << 8)) : 0xF0F0u));

    int64_t mine[2] = {me, me * me};
    std::vector<int64_t> all(2 * n);
    auto op2 = c.iallgather_i64(mine, 2, all.data());
    wait_op(*op2);
    for (int r = 0; r < n; ++r) CHECK(all[2 * r] == r && all[2 * r + 1] == r * r);

    std::vector<size_t> counts;
    size_t total = 0;
    for (int r = 0; r < n; ++r) counts.push_back(r % 3), total += r % 3;  // 0, 1, 2, 0 bytes
    std::string send(counts[me], static_cast<char>('A' + me));
    std::string recv(total + 1, '?');
    auto op3 = c.iallgatherv_bytes(send.data(), send.size(), &recv[0], counts);
    wait_op(*op3);
    std::string want;
    for (int r = 0; r < n; ++r) want += std::string(counts[r], static_cast<char>('A' + r));
    CHECK(recv == want + "?");

    // A non-blocking op in flight while a blocking collective runs on the same comm (ordered by call).
    uint64_t w = uint64_t{1} << me | 1;
    auto op4 = c.iallreduce_band(&w, 1);
    int64_t x = 1, sum = 0;
    c.allreduce(&x, &sum, 1, DType::INT64, ReduceOp::SUM);
    CHECK(sum == n);
    wait_op(*op4);
    CHECK(w == 1);

    // Ops dropped before completion: the caller's buffers are left alone and the slot is still freed.
    int64_t y = me;
    std::vector<int64_t> ys(n);
    { auto dropped = c.iallgather_i64(&y, 1, ys.data()); }
    c.barrier();

    // Many back-to-back ops, as the engine's negotiation cycle: one in flight at a time, table stays small.
    for (int i = 0; i < 2000; ++i) {
      uint64_t v = (i % 2 ? ~uint64_t{0} : ~(uint64_t{1} << (i % 64)));
      auto o = c.iallreduce_band(&v, 1);
      wait_op(*o);
      CHECK(v == (i % 2 ? ~uint64_t{0} : ~(uint64_t{1} << (i % 64))));
    }
  });
}

}  // namespace

int main() {
  run_on_1_to_4_ranks({
      {"nonblocking", test_nonblocking},
  });
  return summary("test_loopback_nonblocking");
}
