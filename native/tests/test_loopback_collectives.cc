// The loopback transport's collectives (transport_loopback.h) with known answers on 1-4 rank-threads:
// allreduce (every dtype and reduction, in place and not, bit-identical rank-order float sums), allgatherv,
// broadcast, alltoallv and reduce_scatter with uneven counts (zeros included), and the small collectives of the
// negotiation (allgather_i64, alltoall_i64, barrier). Build and run: run_loopback_tests.sh.
#include "loopback_test.h"

using namespace perseus;
using namespace perseus::loopback_test;

namespace {

void test_allreduce(int n) {
  const ReduceOp ops[] = {ReduceOp::SUM, ReduceOp::MIN, ReduceOp::MAX, ReduceOp::PRODUCT};
  const size_t counts[] = {0, 1, 7, 33};
  run_world(n, [&](Comm& c) {
    int k = 0;
    for (DType d : kAllDTypes) {
      for (ReduceOp op : ops) {
        for (size_t count : counts) {
          Bytes send = buffer(d, count), recv = buffer(d, count);
          const bool in_place = (k++ % 2) == 1;
          Bytes& in = in_place ? recv : send;
          for (size_t i = 0; i < count; ++i) put(d, in.data(), i, value(d, c.rank(), i));
          c.allreduce(in_place ? nullptr : send.data(), recv.data(), count, d, op);
          for (size_t i = 0; i < count; ++i) {
            std::vector<double> vs;
            for (int r = 0; r < n; ++r) vs.push_back(value(d, r, i));
            double want = fold(d, op, vs), got = get(d, recv.data(), i);
            CHECK_MSG(got == want, describe("allreduce", n, d, static_cast<int>(op)) + " i=" + std::to_string(i) +
                                       " got " + std::to_string(got) + " want " + std::to_string(want));
          }
          CHECK(recv[count * itemsize(d)] == 0xAB);  // nothing written past the end
        }
      }
    }
  });
}

// Non-associative float sums: every rank gets the same bits, the rank-order fold.
void test_allreduce_bit_identical(int n) {
  const size_t count = 257;
  run_world(n, [&](Comm& c) {
    for (DType d : {DType::FLOAT32, DType::FLOAT16, DType::BFLOAT16, DType::FLOAT64}) {
      const size_t nb = count * itemsize(d);
      auto contribution = [&](int r, Bytes& b) {
        for (size_t i = 0; i < count; ++i) put(d, b.data(), i, 0.1 * (r + 1) + 1e3 * ((i * 7 + r) % 5) + 1e-3 * i);
      };
      Bytes mine = buffer(d, count), out = buffer(d, count);
      contribution(c.rank(), mine);
      c.allreduce(mine.data(), out.data(), count, d, ReduceOp::SUM);
      Bytes want = buffer(d, count), other = buffer(d, count);
      contribution(0, want);
      for (int r = 1; r < n; ++r) {
        contribution(r, other);
        combine(want.data(), other.data(), want.data(), count, d, ReduceOp::SUM);
      }
      CHECK_MSG(std::memcmp(out.data(), want.data(), nb) == 0, describe("rank-order fold", n, d));
      Bytes all(nb * n + 1);
      c.allgatherv(out.data(), all.data(), std::vector<size_t>(n, nb), DType::UINT8);
      for (int r = 1; r < n; ++r)
        CHECK_MSG(std::memcmp(all.data(), all.data() + r * nb, nb) == 0, describe("bit-identical", n, d, r));
    }
  });
}

void test_allgatherv(int n) {
  std::vector<std::vector<size_t>> count_sets = {std::vector<size_t>(n, 0), std::vector<size_t>(n, 3)};
  std::vector<size_t> uneven;
  for (int r = 0; r < n; ++r) uneven.push_back((r * 2 + 1) % 3);  // 1, 0, 2, 1: zeros included
  count_sets.push_back(uneven);
  run_world(n, [&](Comm& c) {
    for (DType d : kAllDTypes) {
      for (const auto& counts : count_sets) {
        size_t total = 0;
        for (size_t x : counts) total += x;
        Bytes send = buffer(d, counts[c.rank()]), recv = buffer(d, total);
        auto v = [&](int r, size_t i) { return d == DType::BOOL ? double((r + i) % 2) : double(r * 10 + i); };
        for (size_t i = 0; i < counts[c.rank()]; ++i) put(d, send.data(), i, v(c.rank(), i));
        c.allgatherv(send.data(), recv.data(), counts, d);
        size_t at = 0;
        for (int r = 0; r < n; ++r)
          for (size_t i = 0; i < counts[r]; ++i, ++at)
            CHECK_MSG(get(d, recv.data(), at) == v(r, i), describe("allgatherv", n, d, static_cast<int>(at)));
        CHECK(recv[total * itemsize(d)] == 0xAB);
      }
    }
  });
}

void test_broadcast(int n) {
  run_world(n, [&](Comm& c) {
    for (DType d : kAllDTypes) {
      for (int root = 0; root < n; ++root) {
        for (size_t count : {size_t{0}, size_t{5}}) {
          Bytes buf = buffer(d, count);
          auto v = [&](size_t i) { return d == DType::BOOL ? double(i % 2) : double(root * 7 + i); };
          if (c.rank() == root)
            for (size_t i = 0; i < count; ++i) put(d, buf.data(), i, v(i));
          c.broadcast(buf.data(), count, d, root);
          for (size_t i = 0; i < count; ++i)
            CHECK_MSG(get(d, buf.data(), i) == v(i), describe("broadcast", n, d, root));
          CHECK(buf[count * itemsize(d)] == 0xAB);
        }
      }
    }
  });
}

void test_alltoallv(int n) {
  run_world(n, [&](Comm& c) {
    const int me = c.rank();
    for (DType d : kMainDTypes) {
      // s sends (s + 2*d) % 3 elements to d: zeros included, different in each direction.
      std::vector<size_t> send_counts(n), recv_counts(n);
      for (int x = 0; x < n; ++x) {
        send_counts[x] = (me + 2 * x) % 3;
        recv_counts[x] = (x + 2 * me) % 3;
      }
      auto v = [&](int src, int dst, size_t i) {
        return d == DType::BOOL ? double((src + dst + i) % 2) : double(src * 100 + dst * 10 + i);
      };
      size_t ns = 0, nr = 0;
      for (int x = 0; x < n; ++x) ns += send_counts[x], nr += recv_counts[x];
      Bytes send = buffer(d, ns), recv = buffer(d, nr);
      size_t at = 0;
      for (int dst = 0; dst < n; ++dst)
        for (size_t i = 0; i < send_counts[dst]; ++i) put(d, send.data(), at++, v(me, dst, i));
      c.alltoallv(send.data(), send_counts, recv.data(), recv_counts, d, false);
      at = 0;
      for (int src = 0; src < n; ++src)
        for (size_t i = 0; i < recv_counts[src]; ++i, ++at)
          CHECK_MSG(get(d, recv.data(), at) == v(src, me, i), describe("alltoallv", n, d, src));
      CHECK(recv[nr * itemsize(d)] == 0xAB);
    }
  });
}

void test_reduce_scatter(int n) {
  std::vector<size_t> counts;
  for (int r = 0; r < n; ++r) counts.push_back(r % 2 == 0 ? r + 1 : 0);  // 1, 0, 3, 0
  size_t total = 0;
  for (size_t x : counts) total += x;
  run_world(n, [&](Comm& c) {
    const int me = c.rank();
    size_t offset = 0;
    for (int r = 0; r < me; ++r) offset += counts[r];
    for (DType d : kMainDTypes) {
      for (ReduceOp op : {ReduceOp::SUM, ReduceOp::MIN, ReduceOp::PRODUCT}) {
        Bytes send = buffer(d, total), recv = buffer(d, counts[me]);
        for (size_t i = 0; i < total; ++i) put(d, send.data(), i, value(d, me, i));
        c.reduce_scatter(send.data(), recv.data(), counts, d, op);
        for (size_t i = 0; i < counts[me]; ++i) {
          std::vector<double> vs;
          for (int r = 0; r < n; ++r) vs.push_back(value(d, r, offset + i));
          CHECK_MSG(get(d, recv.data(), i) == fold(d, op, vs), describe("reduce_scatter", n, d, static_cast<int>(i)));
        }
        CHECK(recv[counts[me] * itemsize(d)] == 0xAB);
      }
    }
  });
}

void test_small_collectives(int n) {
  run_world(n, [&](Comm& c) {
    const int me = c.rank();
    int64_t mine[3] = {me, -me, 1000 + me};
    std::vector<int64_t> all(3 * n + 1, -7);
    c.allgather_i64(mine, 3, all.data());
    for (int r = 0; r < n; ++r) {
      CHECK(all[3 * r] == r);
      CHECK(all[3 * r + 1] == -r);
      CHECK(all[3 * r + 2] == 1000 + r);
    }
    CHECK(all[3 * n] == -7);
    c.allgather_i64(nullptr, 0, all.data());  // n == 0 is legal and writes nothing
    CHECK(all[0] == 0);

    std::vector<int64_t> send(n), recv(n + 1, -7);
    for (int d = 0; d < n; ++d) send[d] = me * 100 + d;
    c.alltoall_i64(send.data(), recv.data());
    for (int s = 0; s < n; ++s) CHECK(recv[s] == s * 100 + me);
    CHECK(recv[n] == -7);

    for (int i = 0; i < 10; ++i) c.barrier();
  });

  // A barrier really waits for everybody: no rank leaves before the last one arrives.
  std::atomic<int> arrived{0};
  run_world(n, [&](Comm& c) {
    if (c.rank() == n - 1) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    ++arrived;
    c.barrier();
    CHECK(arrived.load() == n);
  });
}

}  // namespace

int main() {
  run_on_1_to_4_ranks({
      {"allreduce", test_allreduce},
      {"allreduce_bit_identical", test_allreduce_bit_identical},
      {"allgatherv", test_allgatherv},
      {"broadcast", test_broadcast},
      {"alltoallv", test_alltoallv},
      {"reduce_scatter", test_reduce_scatter},
      {"small_collectives", test_small_collectives},
  });
  return summary("test_loopback_collectives");
}
