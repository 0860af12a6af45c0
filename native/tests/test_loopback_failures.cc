// The loopback transport's failures: collectives that do not match across ranks (every rank is told who
// called what, and the communicator stays in step), local misuse, loopback_world_fail waking ranks blocked
// in every kind of wait (every later call throws), and invalid worlds and ranks. Build and run:
// run_loopback_tests.sh.
#include "loopback_test.h"

using namespace perseus;
using namespace perseus::loopback_test;

namespace {

void test_mismatch(int n) {
  if (n < 2) return;
  run_world(n, [&](Comm& c) {
    const int me = c.rank();
    // Different counts at the same position: every rank is told, and who called what.
    std::vector<float> v(5, 1.0f);
    CHECK_THROWS(c.allreduce(v.data(), v.data(), me == 1 ? 5 : 4, DType::FLOAT32, ReduceOp::SUM),
                 "rank 1 called allreduce(count=5");
    // Different collectives.
    int64_t x = 0, all[4];
    if (me == 0) CHECK_THROWS(c.barrier(), "called barrier()");
    else CHECK_THROWS(c.allgather_i64(&x, 1, all), "called barrier()");
    // Local misuse on one rank fails the collective everywhere instead of hanging the others.
    std::vector<size_t> counts(me == n - 1 ? n + 1 : n, 0);
    CHECK_THROWS(c.allgatherv(nullptr, nullptr, counts, DType::FLOAT32), "allgatherv(counts=");
    std::string bytes(3, 'x'), out(8, '?');
    std::vector<size_t> zero(n, 0);
    auto op = c.iallgatherv_bytes(bytes.data(), me == 1 ? 3 : 0, &out[0], zero);
    CHECK_THROWS(while (!op->test()) std::this_thread::yield(), "sends 3 bytes but counts[1] is 0");
    CHECK_THROWS(op->test(), "sends 3 bytes");  // keeps failing
    CHECK(out == "????????");
    // alltoallv counts that do not pair up are caught on completion.
    std::vector<size_t> sc(n, 0), rc(n, 0);
    if (me == 0) sc[1] = 1;
    float f = 0;
    CHECK_THROWS(c.alltoallv(&f, sc, &f, rc, DType::FLOAT32, false), "which expects 0");
    // The communicator is still in step afterwards.
    int64_t one = 1, sum = 0;
    c.allreduce(&one, &sum, 1, DType::INT64, ReduceOp::SUM);
    CHECK(sum == n);
    // A sendrecv whose size does not match what arrives.
    int64_t a = me, b = 0;
    if (me == 0) CHECK_THROWS(c.sendrecv(&a, 8, 1, &b, 4, 1), "expected 4 bytes");
    if (me == 1) c.sendrecv(&a, 8, 0, &b, 8, 0);
    CHECK_THROWS(c.sendrecv(&a, 8, n, &b, 8, 0), "out of range");
    c.barrier();
  });
}

// loopback_world_fail wakes ranks blocked in every kind of wait, and every later call throws.
void test_fail(int n) {
  if (n < 2) return;
  auto world = make_loopback_world(n);
  std::atomic<int> blocked_done{0}, ready{0};
  std::thread killer([&] {
    while (ready.load() < n) std::this_thread::yield();
    std::this_thread::sleep_for(std::chrono::milliseconds(100));  // let them block (if not: "future" ops)
    loopback_world_fail(world, "rank 0 died");
    loopback_world_fail(world, "second message is ignored");
  });
  run_world(n, [&](Comm& c) {
    const int me = c.rank();
    std::unique_ptr<Comm> d = c.dup();
    ++ready;
    if (me == 0) {
      // The "dead" rank: never enters what the others wait in.
      while (blocked_done.load() < n - 1) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    } else if (me == 1) {
      float f = 1;
      CHECK_THROWS(c.allreduce(&f, &f, 1, DType::FLOAT32, ReduceOp::SUM), "rank 0 died");
      ++blocked_done;
    } else if (me == 2) {
      int64_t x = 0;
      CHECK_THROWS(d->sendrecv(&x, 8, 1, &x, 8, 0), "rank 0 died");  // waits on rank 0 forever
      ++blocked_done;
    } else {
      uint64_t w = 1;
      auto op = d->iallreduce_band(&w, 1);
      CHECK_THROWS(while (!op->test()) std::this_thread::yield(), "rank 0 died");
      ++blocked_done;
    }
    // Every later call fails too, on every communicator; rank() and size() still answer.
    float f = 1;
    int src;
    std::string bytes;
    CHECK_THROWS(c.allreduce(&f, &f, 1, DType::FLOAT32, ReduceOp::SUM), "rank 0 died");
    CHECK_THROWS(d->barrier(), "rank 0 died");
    CHECK_THROWS(c.dup(), "rank 0 died");
    CHECK_THROWS(c.send_message(0, "x"), "rank 0 died");
    CHECK_THROWS(c.poll_message(&src, &bytes), "rank 0 died");
    CHECK_THROWS(c.flush_messages(0.1), "rank 0 died");
    uint64_t w = 1;
    CHECK_THROWS(c.iallreduce_band(&w, 1), "rank 0 died");
    CHECK(c.rank() == me && c.size() == n);
  }, world, /*expect_clean=*/false);
  killer.join();
}

void test_world_errors() {
  bool thrown = false;
  try {
    make_loopback_world(0);
  } catch (const std::invalid_argument&) {
    thrown = true;
  }
  CHECK(thrown);
  thrown = false;
  try {
    make_loopback_comm(make_loopback_world(2), 2);
  } catch (const std::invalid_argument&) {
    thrown = true;
  }
  CHECK(thrown);
}

}  // namespace

int main() {
  test_world_errors();
  run_on_1_to_4_ranks({
      {"mismatch", test_mismatch},
      {"fail", test_fail},
  });
  return summary("test_loopback_failures");
}
