// The MPI transport's non-blocking operations: the negotiation's iallreduce_band, iallgather_i64 and
// iallgatherv_bytes in flight together and completed in any order, dropped before completion, and the engine
// lane's iallreduce beside them (float32, and float16 in place); on MPI_COMM_WORLD and its halves split by
// parity.
// Run under mpirun with 2 or more ranks (run_native_tests.sh runs 2 and 3); every rank checks its own results,
// and the job exits 1 if any rank saw a failure.
#include <mpi.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "mpi_test.h"

using namespace perseus;
using namespace perseus::mpi_test;

namespace {

void test_nonblocking(Comm& c) {
  const int size = c.size(), rank = c.rank();
  for (int round = 0; round < 20; ++round) {
    // Three operations in flight at once, completed in whatever order they finish.
    std::vector<uint64_t> words(3, ~uint64_t(0));
    words[0] &= ~(uint64_t(1) << rank);             // everyone clears its own bit
    words[1] = rank == round % size ? 0x0F0F : ~0ull;  // one rank limits this word
    words[2] = uint64_t(1) << 63 | uint64_t(round);
    std::vector<int64_t> mine = {rank, round, -rank};
    std::vector<int64_t> all(3 * size, 0);
    std::vector<size_t> counts(size);
    size_t total = 0;
    for (int r = 0; r < size; ++r) total += counts[r] = r == 1 ? 0 : size_t(5 + 3 * r + round);
    std::string bytes(counts[rank], '\0');
    for (size_t j = 0; j < bytes.size(); ++j) bytes[j] = static_cast<char>(rank * 16 + j);
    std::string gathered(total + 1, '#');

    auto band = c.iallreduce_band(words.data(), words.size());
    auto ints = c.iallgather_i64(mine.data(), mine.size(), all.data());
    auto blob = c.iallgatherv_bytes(bytes.data(), bytes.size(), &gathered[0], counts);
    bool done[3] = {false, false, false};
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (!(done[0] && done[1] && done[2]) && std::chrono::steady_clock::now() < deadline) {
      done[2] = done[2] || blob->test();
      done[0] = done[0] || band->test();
      done[1] = done[1] || ints->test();
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
    EXPECT(done[0] && done[1] && done[2], "non-blocking operations did not complete");
    EXPECT(band->test() && ints->test() && blob->test(), "test() stays true once complete");

    uint64_t cleared = 0;
    for (int r = 0; r < size; ++r) cleared |= uint64_t(1) << r;
    EXPECT(words[0] == ~cleared, "iallreduce_band word 0 = " << std::hex << words[0]);
    EXPECT(words[1] == 0x0F0F, "iallreduce_band word 1");
    EXPECT(words[2] == (uint64_t(1) << 63 | uint64_t(round)), "iallreduce_band word 2");
    for (int r = 0; r < size; ++r) {
      EXPECT(all[3 * r] == r && all[3 * r + 1] == round && all[3 * r + 2] == -r, "iallgather_i64 from " << r);
    }
    size_t k = 0;
    for (int r = 0; r < size; ++r) {
      for (size_t j = 0; j < counts[r]; ++j, ++k) {
        if (gathered[k] != static_cast<char>(r * 16 + j)) {
          EXPECT(false, "iallgatherv_bytes byte " << j << " from rank " << r);
          break;
        }
      }
    }
    EXPECT(gathered[total] == '#', "iallgatherv_bytes wrote past the end");
  }
  // Dropping operations before they complete: they finish in the background, and the communicator
  // stays usable.
  {
    // Buffers of dropped operations must outlive them: MPI may still write after the owner is gone.
    static std::vector<uint64_t> words(1, ~0ull);
    static char send[4] = {1, 2, 3, 4};
    static std::vector<char> recv;
    recv.resize(4 * size);
    std::vector<size_t> counts(size, 4);
    {
      auto dropped = c.iallreduce_band(words.data(), 1);
      auto dropped2 = c.iallgatherv_bytes(send, 4, recv.data(), counts);
    }
    std::vector<uint64_t> again(1, uint64_t(rank + 1));
    auto op = c.iallreduce_band(again.data(), 1);
    wait_for(*op, "iallreduce_band after dropped operations");
    uint64_t want = ~0ull;
    for (int r = 0; r < size; ++r) want &= uint64_t(r + 1);
    EXPECT(again[0] == want, "iallreduce_band after dropped operations");
    c.barrier();
  }
}

// The engine lane's non-blocking all-reduce: beside a negotiation operation in flight, from a separate send
// buffer and in place, float32 and float16 (reduced in float32 through the user-defined op).
void test_iallreduce(Comm& c) {
  const int size = c.size(), rank = c.rank();
  for (int round = 0; round < 10; ++round) {
    std::vector<float> send(7), recv(7, -1.0f);
    for (int i = 0; i < 7; ++i) send[i] = static_cast<float>(rank + i + round);
    std::vector<uint16_t> half(5, float_to_half(static_cast<float>(rank + 1)));
    uint64_t word = ~uint64_t(0);
    auto band = c.iallreduce_band(&word, 1);
    auto sum = c.iallreduce(send.data(), recv.data(), recv.size(), DType::FLOAT32, ReduceOp::SUM);
    auto in_place = c.iallreduce(nullptr, half.data(), half.size(), DType::FLOAT16, ReduceOp::SUM);
    bool done[3] = {false, false, false};
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (!(done[0] && done[1] && done[2]) && std::chrono::steady_clock::now() < deadline) {
      done[0] = done[0] || sum->test();
      done[1] = done[1] || in_place->test();
      done[2] = done[2] || band->test();
    }
    EXPECT(done[0] && done[1] && done[2], "iallreduce did not complete");
    for (int i = 0; i < 7; ++i) {
      const float want = static_cast<float>(size * (i + round) + size * (size - 1) / 2);
      EXPECT(recv[i] == want, "iallreduce float32 [" << i << "] = " << recv[i] << ", want " << want);
    }
    EXPECT(send[0] == static_cast<float>(rank + round), "iallreduce changed its send buffer");
    for (uint16_t h : half)
      EXPECT(half_to_float(h) == static_cast<float>(size * (size + 1) / 2), "iallreduce float16 in place");
  }
}

}  // namespace

int main(int argc, char** argv) {
  mpi_test_init(&argc, &argv);
  run_or_abort([] { run_on_world_and_halves({test_nonblocking, test_iallreduce}); });
  return mpi_test_finish("test_mpi_nonblocking");
}
