// The ring reduce-scatter and allgather of ring.h over the loopback transport, on 1-4 rank-threads, against
// the transport's own collectives (the channels' algorithms across hosts are tested through the engine in
// tests/unit/test_engine_loopback.py). Build and run: run_loopback_tests.sh.
#include "../ring.h"

#include "loopback_test.h"

using namespace perseus;
using namespace perseus::loopback_test;

namespace {

// The ring reduce-scatter (whole-buffer and into a segment-sized output) and the ring allgather against the
// transport's own collectives, with uneven counts (empty segments included), every main dtype and op, and
// what they count on the wire: every segment but this rank's own goes out of a reduce-scatter, every
// segment but the left neighbour's comes in; an allgather forwards every block but the right neighbour's.
void test_ring_reduce_scatter_and_allgather(int n) {
  for (int layout = 0; layout < 3; ++layout) {
    std::vector<size_t> counts;
    for (int r = 0; r < n; ++r)
      counts.push_back(layout == 0 ? 5 : layout == 1 ? (r % 2 == 0 ? 2 * r + 3 : 0) : 1000 + 7 * r);
    size_t total = 0;
    for (size_t x : counts) total += x;
    run_world(n, [&](Comm& c) {
      const int me = c.rank(), left = (me - 1 + n) % n, right = (me + 1) % n;
      PointToPoint& path = c;
      Scratch scratch;
      size_t offset = 0;
      for (int r = 0; r < me; ++r) offset += counts[r];
      for (DType d : kMainDTypes) {
        const size_t item = itemsize(d);
        for (ReduceOp op : {ReduceOp::SUM, ReduceOp::MIN, ReduceOp::MAX, ReduceOp::PRODUCT}) {
          const std::string what = describe("ring reduce-scatter", n, d, static_cast<int>(op) * 10 + layout);
          Bytes send = buffer(d, total), want = buffer(d, counts[me]), out = buffer(d, counts[me]);
          for (size_t i = 0; i < total; ++i) put(d, send.data(), i, value(d, me, i));
          c.reduce_scatter(send.data(), want.data(), counts, d, op);
          const Bytes kept = send;
          const WireBytes w0 = c.wire_counters()->read();
          ring_reduce_scatter_to(path, send.data(), out.data(), counts, d, op, scratch);
          const WireBytes w1 = c.wire_counters()->read();
          CHECK_MSG(std::memcmp(out.data(), want.data(), counts[me] * item) == 0, what);
          CHECK_MSG(out[counts[me] * item] == 0xAB, what + ": wrote past its segment");
          CHECK_MSG(send == kept, what + ": changed its input");
          uint64_t sent = 0, received = 0;
          for (int r = 0; r < n && n > 1; ++r) {
            if (r != me) sent += counts[r] * item;
            if (r != left) received += counts[r] * item;
          }
          CHECK_MSG(w1.sent - w0.sent == sent && w1.received - w0.received == received, what + ": wire bytes");
          // The whole-buffer form leaves this rank's reduced segment at its offset.
          Bytes whole = buffer(d, total);
          ring_reduce_scatter(path, whole.data(), counts, d, op, send.data(), scratch);
          if (n > 1)
            CHECK_MSG(std::memcmp(whole.data() + offset * item, want.data(), counts[me] * item) == 0, what);
          for (size_t i = 0; i < counts[me]; ++i) {
            std::vector<double> vs;
            for (int r = 0; r < n; ++r) vs.push_back(value(d, r, offset + i));
            CHECK_MSG(get(d, out.data(), i) == fold(d, op, vs), what + " i=" + std::to_string(i));
          }
        }
        const std::string what = describe("ring allgather", n, d, layout);
        Bytes gathered = buffer(d, total), want = buffer(d, total), mine = buffer(d, counts[me]);
        for (size_t i = 0; i < counts[me]; ++i) put(d, mine.data(), i, value(d, me, offset + i));
        c.allgatherv(mine.data(), want.data(), counts, d);
        if (counts[me] != 0) std::memcpy(gathered.data() + offset * item, mine.data(), counts[me] * item);
        const WireBytes w0 = c.wire_counters()->read();
        ring_allgather(path, gathered.data(), counts, d, scratch);
        const WireBytes w1 = c.wire_counters()->read();
        CHECK_MSG(gathered == want, what);
        uint64_t sent = 0, received = 0;
        for (int r = 0; r < n && n > 1; ++r) {
          if (r != right) sent += counts[r] * item;
          if (r != me) received += counts[r] * item;
        }
        CHECK_MSG(w1.sent - w0.sent == sent && w1.received - w0.received == received, what + ": wire bytes");
      }
    });
  }
}

}  // namespace

int main() {
  run_on_1_to_4_ranks({
      {"ring_reduce_scatter_and_allgather", test_ring_reduce_scatter_and_allgather},
  });
  return summary("test_loopback_ring");
}
