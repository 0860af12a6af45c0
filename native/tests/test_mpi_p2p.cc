// The MPI transport's point-to-point traffic: sendrecv (empty, small and 1 MiB, and to itself), control
// messages (empty, binary and large ones in order from every peer, never matched by data traffic, a dup's
// kept from its parent) and the bytes counted on the wire by sendrecv, collectives and control messages
// (wire.h); on MPI_COMM_WORLD, a dup of it (control messages) and its halves split by parity.
// Run under mpirun with 2 or more ranks (run_native_tests.sh runs 2 and 3); every rank checks its own results,
// and the job exits 1 if any rank saw a failure.
#include <mpi.h>

#include <chrono>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "mpi_test.h"

using namespace perseus;
using namespace perseus::mpi_test;

namespace {

void test_sendrecv(Comm& c) {
  const int size = c.size(), rank = c.rank();
  const int right = (rank + 1) % size, left = (rank + size - 1) % size;
  for (size_t base : {size_t(0), size_t(100), size_t(1) << 20}) {
    auto bytes_of = [&](int r) { return base == 0 ? size_t(0) : base + 10 * static_cast<size_t>(r); };
    Bytes send(bytes_of(rank)), recv(bytes_of(left) + 1, 0xEE);
    for (size_t j = 0; j < send.size(); ++j) send[j] = static_cast<unsigned char>(rank * 13 + j);
    c.sendrecv(send.data(), send.size(), right, recv.data(), bytes_of(left), left);
    int bad = 0;
    for (size_t j = 0; j < bytes_of(left); ++j) {
      if (recv[j] != static_cast<unsigned char>(left * 13 + j) && ++bad <= 3) {
        EXPECT(false, "sendrecv byte " << j << " from rank " << left);
      }
    }
    EXPECT(recv[bytes_of(left)] == 0xEE, "sendrecv wrote past the end");
  }
  // To itself.
  const char hello[] = "hello";
  char back[6] = {};
  c.sendrecv(hello, 6, rank, back, 6, rank);
  EXPECT(std::string(back) == "hello", "sendrecv to self gave " << back);
}

std::string control_message(int from, int to, int k) {
  std::string s = "from " + std::to_string(from) + " to " + std::to_string(to) + " #" + std::to_string(k);
  if (k == 1) return std::string();                     // empty messages arrive too
  if (k == 2) s += std::string("\0\x01\xff", 3);         // binary
  if (k == 3) s += std::string(200000 + from, 'x');      // large (rendezvous protocol)
  return s;
}

void test_control_messages(Comm& c) {
  const int size = c.size(), rank = c.rank();
  const int per_peer = 5;
  for (int k = 0; k < per_peer; ++k) {
    for (int d = 0; d < size; ++d) {
      if (d != rank) c.send_message(d, control_message(rank, d, k));
    }
  }
  std::map<int, int> next;  // per source: the index of the next expected message (arrival order is kept)
  int received = 0;
  const int expected = per_peer * (size - 1);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (received < expected && std::chrono::steady_clock::now() < deadline) {
    int source = -1;
    std::string bytes;
    if (!c.poll_message(&source, &bytes)) {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
      continue;
    }
    EXPECT(source >= 0 && source < size && source != rank, "control message from " << source);
    if (source < 0 || source >= size) continue;
    const int k = next[source]++;
    EXPECT(bytes == control_message(source, rank, k),
           "control message " << k << " from " << source << " has " << bytes.size() << " bytes");
    ++received;
  }
  EXPECT(received == expected, "received " << received << " of " << expected << " control messages");
  int source;
  std::string extra;
  EXPECT(!c.poll_message(&source, &extra), "an unexpected control message");
  c.flush_messages(10.0);
  c.barrier();
  // Control messages never match data traffic on the same Comm: send one, run collectives, then poll.
  c.send_message((rank + 1) % size, "after");
  c.barrier();
  std::vector<int64_t> v(size);
  int64_t me = rank;
  c.allgather_i64(&me, 1, v.data());
  bool got = false;
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (!got && std::chrono::steady_clock::now() < until) {
    std::string m;
    got = c.poll_message(&source, &m);
    if (got) EXPECT(m == "after" && source == (rank + size - 1) % size, "control message after collectives");
  }
  EXPECT(got, "control message after collectives did not arrive");
  c.flush_messages(10.0);
  c.barrier();
}

// sendrecv and control messages count what they move; MPI's collectives the textbook volume (wire.h).
void test_wire_counters(Comm& c) {
  const int size = c.size(), rank = c.rank();
  const int right = (rank + 1) % size, left = (rank + size - 1) % size;
  std::unique_ptr<Comm> d = c.dup();
  EXPECT(d->wire_counters() == c.wire_counters(), "a dup counts into its parent's counters");
  const WireBytes w0 = c.wire_counters()->read();
  Bytes out(1000 + rank), in(1000 + left);
  d->sendrecv(out.data(), out.size(), right, in.data(), in.size(), left);
  const WireBytes w1 = c.wire_counters()->read();
  EXPECT(w1.sent - w0.sent == out.size() && w1.received - w0.received == in.size(),
         "sendrecv counted " << w1.sent - w0.sent << " / " << w1.received - w0.received);
  std::vector<float> v(6 * 100, 1.0f);
  c.allreduce(nullptr, v.data(), v.size(), DType::FLOAT32, ReduceOp::SUM);
  const WireBytes w2 = c.wire_counters()->read();
  const uint64_t ar = 2ull * (size - 1) * 2400 / size;
  EXPECT(w2.sent - w1.sent == ar && w2.received - w1.received == ar, "allreduce counted " << w2.sent - w1.sent);
  std::vector<size_t> counts(size);
  for (int r = 0; r < size; ++r) counts[r] = static_cast<size_t>(r + 1);
  std::vector<int32_t> mine(rank + 1, rank), all((size + 1) * size / 2);
  c.allgatherv(mine.data(), all.data(), counts, DType::INT32);
  const WireBytes w3 = c.wire_counters()->read();
  const uint64_t others = 4ull * ((size + 1) * size / 2 - (rank + 1));
  EXPECT(w3.sent - w2.sent == 4ull * (rank + 1) * (size - 1) && w3.received - w2.received == others,
         "allgatherv counted " << w3.sent - w2.sent << " / " << w3.received - w2.received);
  EXPECT(w3.control_sent == w0.control_sent && w3.control_received == w0.control_received,
         "data-plane calls counted control bytes");
  d->send_message(right, std::string(17, 'c'));
  int source = -1;
  std::string m;
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (!d->poll_message(&source, &m) && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  d->flush_messages(10.0);
  const WireBytes w4 = c.wire_counters()->read();
  EXPECT(m.size() == 17 && w4.control_sent - w3.control_sent == 17 && w4.control_received - w3.control_received == 17,
         "control message counted " << w4.control_sent - w3.control_sent);
  EXPECT(w4.sent == w3.sent && w4.received == w3.received, "a control message counted as data");
  c.barrier();
}

}  // namespace

int main(int argc, char** argv) {
  mpi_test_init(&argc, &argv);
  run_or_abort([] {
    run_on_world_and_halves({test_sendrecv, test_control_messages, test_wire_counters}, [](Comm& world, Comm& dup) {
      test_control_messages(dup);
      // Messages sent on the dup are not seen by the original.
      int source;
      std::string m;
      EXPECT(!world.poll_message(&source, &m), "a dup's control message leaked into its parent");
    });
  });
  return mpi_test_finish("test_mpi_p2p");
}
