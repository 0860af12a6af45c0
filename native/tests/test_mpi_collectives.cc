// The MPI transport's collectives with known answers built from rank-dependent inputs: allreduce (every dtype
// and reduction, in place and not, Average travelling as Sum, buffers large enough for MPI's segmented
// algorithms), allgatherv, broadcast from every root, alltoallv and reduce_scatter with uneven counts (zeros
// included), and the negotiation's small collectives (allgather_i64, alltoall_i64, barrier); on
// MPI_COMM_WORLD, a dup of it (allreduce) and its halves split by parity.
// Run under mpirun with 2 or more ranks (run_native_tests.sh runs 2 and 3); every rank checks its own results,
// and the job exits 1 if any rank saw a failure.
#include <mpi.h>

#include <cstring>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "mpi_test.h"

using namespace perseus;
using namespace perseus::mpi_test;

namespace {

void test_allreduce(Comm& c) {
  const int size = c.size(), rank = c.rank();
  for (DType d : kDTypes) {
    for (ReduceOp op : kOps) {
      for (size_t n : {size_t(0), size_t(1), size_t(7), size_t(1000), size_t(65543)}) {
        for (bool in_place : {false, true}) {
          Bytes in = buffer(d, n), out = buffer(d, n);
          for (size_t i = 0; i < n; ++i) put(d, in.data(), i, reduce_input(d, rank, i));
          const Bytes original = in;
          if (in_place) {
            out = in;
            c.allreduce(nullptr, out.data(), n, d, op);
          } else {
            c.allreduce(in.data(), out.data(), n, d, op);
            EXPECT(in == original, "out-of-place allreduce changed its input");
          }
          std::ostringstream what;
          what << "allreduce " << reduce_op_title(op) << (in_place ? " in place" : "") << " n=" << n;
          expect_elements(what.str(), d, out.data(), n, [&](size_t i) { return reduce_expected(d, op, size, i); });
          EXPECT(out[n * itemsize(d)] == (in_place ? original[n * itemsize(d)] : 0xA5),
                 "allreduce wrote past the end");
        }
      }
    }
  }
  // AVERAGE travels as SUM (the engine applies the postscale).
  Bytes avg = buffer(DType::FLOAT32, 3);
  for (size_t i = 0; i < 3; ++i) put(DType::FLOAT32, avg.data(), i, reduce_input(DType::FLOAT32, rank, i));
  c.allreduce(nullptr, avg.data(), 3, DType::FLOAT32, ReduceOp::AVERAGE);
  expect_elements("allreduce Average", DType::FLOAT32, avg.data(), 3,
                  [&](size_t i) { return reduce_expected(DType::FLOAT32, ReduceOp::SUM, size, i); });
  // A large buffer goes through MPI's segmented algorithms (and the user-defined 16-bit reductions get
  // called on pieces).
  for (DType d : {DType::FLOAT16, DType::BFLOAT16, DType::FLOAT32, DType::INT8}) {
    const size_t n = (size_t(1) << 21) + 5;
    Bytes buf = buffer(d, n);
    for (size_t i = 0; i < n; ++i) put(d, buf.data(), i, reduce_input(d, rank, i));
    c.allreduce(nullptr, buf.data(), n, d, ReduceOp::SUM);
    expect_elements("large allreduce", d, buf.data(), n,
                    [&](size_t i) { return reduce_expected(d, ReduceOp::SUM, size, i); });
  }
}

void test_allgatherv(Comm& c) {
  const int size = c.size(), rank = c.rank();
  // Uneven counts with zeros: rank 1 contributes nothing; then every rank differs; then nobody sends.
  const std::vector<std::function<size_t(int)>> layouts = {
      [](int r) { return r == 1 ? size_t(0) : size_t(2 * r + 3); },
      [](int r) { return size_t(1000 * (r + 1) + r); },
      [](int) { return size_t(0); },
  };
  for (const auto& layout : layouts) {
    std::vector<size_t> counts(size);
    size_t total = 0, offset = 0;
    for (int r = 0; r < size; ++r) total += counts[r] = layout(r);
    for (int r = 0; r < rank; ++r) offset += counts[r];
    for (DType d : kDTypes) {
      for (bool in_place : {false, true}) {
        Bytes mine = buffer(d, counts[rank]), out = buffer(d, total);
        for (size_t j = 0; j < counts[rank]; ++j) put(d, mine.data(), j, pattern(d, rank, 0, j));
        if (in_place) {
          std::memcpy(out.data() + offset * itemsize(d), mine.data(), counts[rank] * itemsize(d));
          c.allgatherv(nullptr, out.data(), counts, d);
        } else {
          c.allgatherv(mine.data(), out.data(), counts, d);
        }
        expect_elements(in_place ? "allgatherv in place" : "allgatherv", d, out.data(), total, [&](size_t i) {
          int r = 0;
          while (i >= counts[r]) i -= counts[r++];
          return pattern(d, r, 0, i);
        });
        EXPECT(out[total * itemsize(d)] == 0xA5, "allgatherv wrote past the end");
      }
    }
  }
}

void test_broadcast(Comm& c) {
  const int size = c.size(), rank = c.rank();
  for (int root = 0; root < size; ++root) {
    for (DType d : kDTypes) {
      for (size_t n : {size_t(0), size_t(1), size_t(333), size_t(100003)}) {
        Bytes buf = buffer(d, n, 0x5A);
        if (rank == root) {
          for (size_t i = 0; i < n; ++i) put(d, buf.data(), i, pattern(d, root, 1, i));
        }
        c.broadcast(buf.data(), n, d, root);
        expect_elements("broadcast from " + std::to_string(root), d, buf.data(), n,
                        [&](size_t i) { return pattern(d, root, 1, i); });
        EXPECT(buf[n * itemsize(d)] == 0x5A, "broadcast wrote past the end");
      }
    }
  }
}

void test_alltoallv(Comm& c) {
  const int size = c.size(), rank = c.rank();
  // Rank s sends count(s, d) elements to rank d; some are zero.
  const std::vector<std::function<size_t(int, int)>> layouts = {
      [](int s, int d) { return size_t((s + 2 * d + 1) % 3); },
      [](int s, int d) { return size_t(500 * (s + 1) + 17 * d); },
      [](int s, int d) { return s == d ? size_t(0) : size_t(3); },
  };
  for (const auto& count : layouts) {
    std::vector<size_t> send_counts(size), recv_counts(size);
    size_t send_total = 0, recv_total = 0;
    for (int p = 0; p < size; ++p) {
      send_total += send_counts[p] = count(rank, p);
      recv_total += recv_counts[p] = count(p, rank);
    }
    for (DType d : kDTypes) {
      Bytes send = buffer(d, send_total), recv = buffer(d, recv_total);
      size_t k = 0;
      for (int p = 0; p < size; ++p) {
        for (size_t j = 0; j < send_counts[p]; ++j) put(d, send.data(), k++, pattern(d, rank, p, j));
      }
      c.alltoallv(send.data(), send_counts, recv.data(), recv_counts, d, false);
      expect_elements("alltoallv", d, recv.data(), recv_total, [&](size_t i) {
        int s = 0;
        while (i >= recv_counts[s]) i -= recv_counts[s++];
        return pattern(d, s, rank, i);
      });
      EXPECT(recv[recv_total * itemsize(d)] == 0xA5, "alltoallv wrote past the end");
    }
  }
}

void test_reduce_scatter(Comm& c) {
  const int size = c.size(), rank = c.rank();
  const std::vector<std::function<size_t(int)>> layouts = {
      [](int r) { return r == 1 ? size_t(0) : size_t(r + 2); },
      [](int r) { return size_t(20000 + 3 * r); },
      [](int r) { return r == 0 ? size_t(5) : size_t(0); },
  };
  for (const auto& layout : layouts) {
    std::vector<size_t> counts(size);
    size_t total = 0, offset = 0;
    for (int r = 0; r < size; ++r) total += counts[r] = layout(r);
    for (int r = 0; r < rank; ++r) offset += counts[r];
    for (DType d : kDTypes) {
      for (ReduceOp op : kOps) {
        for (bool in_place : {false, true}) {
          Bytes in = buffer(d, total), out = buffer(d, counts[rank]);
          for (size_t i = 0; i < total; ++i) put(d, in.data(), i, reduce_input(d, rank, i));
          if (in_place) {
            c.reduce_scatter(nullptr, in.data(), counts, d, op);
            out.assign(in.begin(), in.begin() + counts[rank] * itemsize(d));
            out.push_back(0xA5);
          } else {
            c.reduce_scatter(in.data(), out.data(), counts, d, op);
          }
          std::string what = std::string("reduce_scatter ") + reduce_op_title(op) + (in_place ? " in place" : "");
          expect_elements(what, d, out.data(), counts[rank],
                          [&](size_t i) { return reduce_expected(d, op, size, offset + i); });
          EXPECT(out[counts[rank] * itemsize(d)] == 0xA5, "reduce_scatter wrote past the end");
        }
      }
    }
  }
}

void test_small_collectives(Comm& c) {
  const int size = c.size(), rank = c.rank();
  for (size_t n : {size_t(0), size_t(1), size_t(3)}) {
    std::vector<int64_t> mine(n), all(n * size + 1, -7);
    for (size_t i = 0; i < n; ++i) mine[i] = int64_t(rank) * 1000 + int64_t(i) - (int64_t(1) << 40);
    c.allgather_i64(mine.data(), n, all.data());
    for (int r = 0; r < size; ++r) {
      for (size_t i = 0; i < n; ++i) {
        EXPECT(all[r * n + i] == int64_t(r) * 1000 + int64_t(i) - (int64_t(1) << 40),
               "allgather_i64 [" << r << "," << i << "]");
      }
    }
    EXPECT(all[n * size] == -7, "allgather_i64 wrote past the end");
  }
  std::vector<int64_t> send(size), recv(size, -1);
  for (int d = 0; d < size; ++d) send[d] = int64_t(rank) * 100 + d + (int64_t(3) << 50);
  c.alltoall_i64(send.data(), recv.data());
  for (int s = 0; s < size; ++s) {
    EXPECT(recv[s] == int64_t(s) * 100 + rank + (int64_t(3) << 50), "alltoall_i64 from " << s << " = " << recv[s]);
  }
  for (int i = 0; i < 5; ++i) c.barrier();
}

}  // namespace

int main(int argc, char** argv) {
  mpi_test_init(&argc, &argv);
  run_or_abort([] {
    run_on_world_and_halves({test_allreduce, test_allgatherv, test_broadcast, test_alltoallv, test_reduce_scatter,
                             test_small_collectives},
                            [](Comm&, Comm& dup) { test_allreduce(dup); });
  });
  return mpi_test_finish("test_mpi_collectives");
}
