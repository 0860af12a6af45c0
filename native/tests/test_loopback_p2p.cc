// The loopback transport's point-to-point traffic on 1-4 rank-threads: sendrecv (both directions, zero
// bytes, FIFO per pair), control messages (per-source order, never blocking, a dup's own space), and the bytes
// counted on the wire by sendrecv, collectives and control messages (wire.h). Build and run:
// run_loopback_tests.sh.
#include "loopback_test.h"

using namespace perseus;
using namespace perseus::loopback_test;

namespace {

void test_sendrecv(int n) {
  run_world(n, [&](Comm& c) {
    const int me = c.rank(), right = (me + 1) % n, left = (me + n - 1) % n;
    auto payload = [](int src, int round) {
      return std::string(static_cast<size_t>((src + round) % 4), static_cast<char>('a' + src + round));
    };
    for (int round = 0; round < 20; ++round) {
      // Alternate directions; sizes depend on the sender so both ends agree, zero bytes included.
      const int dest = round % 2 ? left : right, source = round % 2 ? right : left;
      std::string out = payload(me, round), want = payload(source, round);
      std::string in(want.size() + 1, '?');
      c.sendrecv(out.data(), out.size(), dest, &in[0], want.size(), source);
      CHECK_MSG(in.compare(0, want.size(), want) == 0 && in.back() == '?', "sendrecv round " + std::to_string(round));
    }
    // Several messages queued before any is received arrive in order (FIFO per source and destination).
    if (n >= 2) {
      int64_t got[3];
      for (int64_t k = 0; k < 3; ++k) {
        int64_t mine = me * 10 + k;
        c.sendrecv(&mine, 8, right, &got[k], 8, left);
      }
      for (int64_t k = 0; k < 3; ++k) CHECK(got[k] == left * 10 + k);
    }
  });
}

void test_messages(int n) {
  run_world(n, [&](Comm& c) {
    const int me = c.rank();
    std::unique_ptr<Comm> d = c.dup();
    for (int i = 0; i < 50; ++i)
      for (int dest = 0; dest < n; ++dest) c.send_message(dest, std::to_string(me) + ":" + std::to_string(i));
    d->send_message(me, "on the dup");
    // send_message never blocks, however much is queued and unread.
    for (int i = 0; i < 10000; ++i) c.send_message((me + 1) % n, "bulk");
    c.flush_messages(1.0);
    c.barrier();
    std::vector<int> next(n, 0);
    int source = -1, bulk = 0;
    std::string bytes;
    while (c.poll_message(&source, &bytes)) {
      if (bytes == "bulk") {
        CHECK(source == (me + n - 1) % n);
        ++bulk;
        continue;
      }
      CHECK(source >= 0 && source < n);
      CHECK_MSG(bytes == std::to_string(source) + ":" + std::to_string(next[source]), bytes);  // per-source FIFO
      ++next[source];
    }
    CHECK(bulk == 10000);
    for (int r = 0; r < n; ++r) CHECK(next[r] == 50);
    CHECK(!c.poll_message(&source, &bytes));
    CHECK(d->poll_message(&source, &bytes) && source == me && bytes == "on the dup");  // its own space
    CHECK(!d->poll_message(&source, &bytes));
    c.barrier();
  });
}

// Bytes on the wire (wire.h): sendrecv and control messages count what they move, collectives the textbook
// volume; dups and splits count into their parent's counters.
void test_wire_counters(int n) {
  run_world(n, [&](Comm& c) {
    const int me = c.rank(), right = (me + 1) % n, left = (me + n - 1) % n;
    WireBytes w0 = c.wire_counters()->read();
    CHECK(w0.sent == 0 && w0.received == 0);
    std::unique_ptr<Comm> d = c.dup();
    std::unique_ptr<Comm> s = c.split(me % 2, me);
    CHECK(d->wire_counters() == c.wire_counters() && s->wire_counters() == c.wire_counters());
    // sendrecv: 100 + rank bytes out, what the left neighbour sent in (nothing crosses with one rank).
    std::vector<char> out(100 + me, 'x'), in(100 + left);
    d->sendrecv(out.data(), out.size(), right, in.data(), in.size(), left);
    WireBytes w1 = c.wire_counters()->read();
    CHECK_MSG(w1.sent == (n > 1 ? out.size() : 0u) && w1.received == (n > 1 ? in.size() : 0u),
              std::to_string(w1.sent) + " / " + std::to_string(w1.received));
    // allreduce of 12 float32 over the split: 2 (k-1)/k of 48 bytes each way (k ranks with this parity).
    const int k = (n - me % 2 + 1) / 2;
    std::vector<float> v(12, 1.0f);
    s->allreduce(nullptr, v.data(), v.size(), DType::FLOAT32, ReduceOp::SUM);
    WireBytes w2 = c.wire_counters()->read();
    const uint64_t ar = static_cast<uint64_t>(2 * (k - 1) * 48 / k);
    CHECK_MSG(w2.sent - w1.sent == ar && w2.received - w1.received == ar, std::to_string(w2.sent - w1.sent));
    CHECK(w2.control_sent == w1.control_sent && w2.control_received == w1.control_received);
    // Negotiation and control messages are control, never data.
    uint64_t words[3] = {~0ull, ~0ull, ~0ull};
    auto op = c.iallreduce_band(words, 3);
    while (!op->test()) std::this_thread::yield();
    c.send_message(right, std::string(10, 'm'));
    c.barrier();
    int source;
    std::string msg;
    CHECK(c.poll_message(&source, &msg) && msg.size() == 10);
    WireBytes w3 = c.wire_counters()->read();
    CHECK(w3.sent == w2.sent && w3.received == w2.received);
    const uint64_t band = static_cast<uint64_t>(2 * (n - 1) * 24 / n), m = n > 1 ? 10 : 0;
    CHECK_MSG(w3.control_sent - w2.control_sent == band + m && w3.control_received - w2.control_received == band + m,
              std::to_string(w3.control_sent - w2.control_sent));
  });
}

}  // namespace

int main() {
  run_on_1_to_4_ranks({
      {"sendrecv", test_sendrecv},
      {"messages", test_messages},
      {"wire_counters", test_wire_counters},
  });
  return summary("test_loopback_p2p");
}
