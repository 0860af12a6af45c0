// The MPI transport's communicators and their errors: made from MPI handles (refused before MPI_Init, after
// MPI_Finalize and for MPI_COMM_NULL), their ranks and sizes (a dup's, a sub-communicator's split by parity,
// one of a single rank), one that outlives MPI_Finalize, threads moving data on dups while another negotiates
// and sends control messages (MPI_THREAD_MULTIPLE), and the TransportErrors of counts above MPI's int limit,
// of counts for the wrong number of ranks, of an MPI error code and of Adasum.
// Run under mpirun with 2 or more ranks (run_native_tests.sh runs 2 and 3); every rank checks its own results,
// and the job exits 1 if any rank saw a failure.
#include <mpi.h>

#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "mpi_test.h"

using namespace perseus;
using namespace perseus::mpi_test;

namespace {

void test_errors(Comm& c) {
  const int size = c.size();
  // The data-plane collectives run counts above MPI's int in pieces (tests/mpi/test_large_tensors.py, which
  // has the memory for it); the negotiation's exchanges have no such path and refuse them, before any
  // buffer is touched.
  const size_t huge = size_t(3) << 30;
  std::vector<size_t> counts(size, 1);
  counts[size - 1] = huge;
  EXPECT_THROWS(c.iallgatherv_bytes(nullptr, 0, nullptr, counts), "above MPI's 2^31-1 element limit");
  EXPECT_THROWS(c.iallgatherv_bytes(nullptr, huge, nullptr, std::vector<size_t>(size, 0)), std::to_string(huge));
  EXPECT_THROWS(c.allgather_i64(nullptr, huge, nullptr), "2^31-1");
  EXPECT_THROWS(c.iallgather_i64(nullptr, huge, nullptr), "2^31-1");
  EXPECT_THROWS(c.iallreduce_band(nullptr, huge), "2^31-1");
  EXPECT_THROWS(c.allgatherv(nullptr, nullptr, std::vector<size_t>(size + 1, 1), DType::UINT8), "counts for");
  EXPECT_THROWS(c.iallgatherv_bytes(nullptr, 0, nullptr, std::vector<size_t>(size + 2, 0)), "counts for");
  // An MPI error code becomes a TransportError naming the call (Open MPI and MPICH check the root).
  float x = 1;
  EXPECT_THROWS(c.broadcast(&x, 1, DType::FLOAT32, size + 3), "MPI_Bcast failed: ");
  EXPECT_THROWS(c.allreduce(nullptr, &x, 1, DType::FLOAT32, ReduceOp::ADASUM), "Adasum");
  c.barrier();
}

void test_threads(Comm& c) {
  // The engine's layout: one thread negotiates and exchanges control messages on one Comm while channel
  // threads move data on their own dups, all at the same time (needs MPI_THREAD_MULTIPLE).
  std::unique_ptr<Comm> a = c.dup(), b = c.dup();
  const int size = c.size(), rank = c.rank();
  std::thread ta([&] {
    for (int i = 0; i < 200; ++i) {
      std::vector<float> v(1000 + i, static_cast<float>(rank + i));
      a->allreduce(nullptr, v.data(), v.size(), DType::FLOAT32, ReduceOp::SUM);
      const float want = static_cast<float>(size * (size - 1) / 2 + size * i);
      if (v[0] != want || v.back() != want) {
        EXPECT(false, "thread A allreduce " << i << " = " << v[0]);
        break;
      }
    }
  });
  std::thread tb([&] {
    for (int i = 0; i < 200; ++i) {
      std::vector<uint16_t> v(513, float_to_bf16(static_cast<float>(rank)));
      b->allreduce(nullptr, v.data(), v.size(), DType::BFLOAT16, ReduceOp::MAX);
      if (bf16_to_float(v[7]) != static_cast<float>(size - 1)) {
        EXPECT(false, "thread B bfloat16 max " << i << " = " << bf16_to_float(v[7]));
        break;
      }
    }
  });
  for (int i = 0; i < 50; ++i) {
    std::vector<uint64_t> w(2, ~0ull);
    auto op = c.iallreduce_band(w.data(), w.size());
    wait_for(*op, "iallreduce_band beside channel threads");
    c.send_message((rank + 1) % size, std::to_string(i));
    int source;
    std::string m;
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    bool got = false;
    while (!(got = c.poll_message(&source, &m)) && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
    EXPECT(got && m == std::to_string(i), "control message " << i << " beside channel threads");
  }
  ta.join();
  tb.join();
  c.flush_messages(10.0);
  c.barrier();
}

}  // namespace

int main(int argc, char** argv) {
  // Before MPI_Init: the symptom of a core whose libmpi is not the one mpi4py initialised.
  EXPECT_THROWS(make_mpi_comm(handle_of(MPI_COMM_WORLD)), "is not initialised");
  const int provided = mpi_test_init(&argc, &argv);
  int world_size = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &world_size);
  EXPECT(provided == MPI_THREAD_MULTIPLE, "MPI_THREAD_MULTIPLE not provided");
  EXPECT(world_size >= 2, "run with at least 2 ranks");
  std::unique_ptr<Comm> outlives_mpi;
  run_or_abort([&] {
    EXPECT(mpi_library_version().size() > 3, "mpi_library_version() = " << mpi_library_version());
    if (g_rank == 0) std::printf("test_mpi_comms: %s\n", mpi_library_version().substr(0, 60).c_str());
    std::unique_ptr<Comm> world = make_mpi_comm(handle_of(MPI_COMM_WORLD));
    EXPECT(world->rank() == g_rank && world->size() == world_size, "rank/size");
    run_all(*world, "world", {test_errors});
    {
      std::unique_ptr<Comm> dup = world->dup();
      EXPECT(dup->rank() == g_rank && dup->size() == world_size, "dup rank/size");
    }
    test_threads(*world);
    // A sub-communicator (ranks split by parity, in reverse order): its own ranks and sizes.
    on_parity_halves([](Comm& sub, MPI_Comm half, const char* label) {
      int want_size = 0;
      MPI_Comm_size(half, &want_size);
      EXPECT(sub.size() == want_size, "sub-communicator size");
      if (sub.size() >= 2) {
        run_all(sub, label, {test_errors});
      } else {
        float v = 3;
        sub.allreduce(nullptr, &v, 1, DType::FLOAT32, ReduceOp::SUM);
        EXPECT(v == 3, "allreduce on a 1-rank communicator");
      }
    });
    EXPECT_THROWS(make_mpi_comm(handle_of(MPI_COMM_NULL)), "MPI_COMM_NULL");
    world->barrier();
    outlives_mpi = world->dup();  // destroyed after MPI_Finalize: must neither free nor crash
  });
  return mpi_test_finish("test_mpi_comms", [&] {
    outlives_mpi.reset();
    bool threw = false;
    try {
      make_mpi_comm(handle_of(MPI_COMM_WORLD));
    } catch (const TransportError& e) {
      threw = std::string(e.what()).find("finalized") != std::string::npos;
    }
    if (!threw) {
      std::fprintf(stderr, "[rank %d] make_mpi_comm after MPI_Finalize did not refuse\n", g_rank);
      return 1;
    }
    return 0;
  });
}
