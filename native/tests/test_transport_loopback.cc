// Tests of the in-process loopback transport (transport_loopback.h): every Comm call with known answers on
// 1-4 rank-threads, concurrent dups, non-blocking ops, control messages, bounded tables over many
// collectives, collective mismatches and loopback_world_fail; and the ring reduce-scatter and allgather of
// ring.h over it (the channels' algorithms across hosts are tested through the engine in
// tests/unit/test_engine_loopback.py). Build and run: run_loopback_tests.sh.
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "../ring.h"
#include "../kernels.h"
#include "../transport_loopback.h"

using namespace perseus;

namespace {

std::atomic<int> g_failures{0};
std::mutex g_print_mu;

void report(const char* file, int line, const std::string& what) {
  std::lock_guard<std::mutex> g(g_print_mu);
  std::fprintf(stderr, "%s:%d: FAILED: %s\n", file, line, what.c_str());
  ++g_failures;
}

#define CHECK(cond)                                   \
  do {                                                \
    if (!(cond)) report(__FILE__, __LINE__, #cond);   \
  } while (0)
#define CHECK_MSG(cond, msg)                                                    \
  do {                                                                          \
    if (!(cond)) report(__FILE__, __LINE__, std::string(#cond) + ": " + (msg)); \
  } while (0)
// Runs stmt and checks that it throws TransportError (whose message contains `needle`).
#define CHECK_THROWS(stmt, needle)                                                          \
  do {                                                                                      \
    bool thrown_ = false;                                                                   \
    try {                                                                                   \
      stmt;                                                                                 \
    } catch (const TransportError& e_) {                                                    \
      thrown_ = true;                                                                       \
      CHECK_MSG(std::string(e_.what()).find(needle) != std::string::npos, e_.what());       \
    }                                                                                       \
    CHECK_MSG(thrown_, "no TransportError from " #stmt);                                    \
  } while (0)

const DType kAllDTypes[] = {DType::UINT8,   DType::INT8,    DType::INT16,   DType::INT32,
                            DType::INT64,   DType::FLOAT16, DType::BFLOAT16, DType::FLOAT32,
                            DType::FLOAT64, DType::BOOL,    DType::UINT16};
const DType kMainDTypes[] = {DType::FLOAT32, DType::INT64, DType::FLOAT16, DType::BOOL};

bool is_unsigned(DType d) { return d == DType::UINT8 || d == DType::UINT16 || d == DType::BOOL; }

template <class T>
void store(void* buf, size_t i, T v) { std::memcpy(static_cast<char*>(buf) + i * sizeof(T), &v, sizeof(T)); }
template <class T>
T load(const void* buf, size_t i) {
  T v;
  std::memcpy(&v, static_cast<const char*>(buf) + i * sizeof(T), sizeof(T));
  return v;
}

// Element i of a buffer of dtype d, as a double (values in the tests are small integers: exact everywhere).
void put(DType d, void* buf, size_t i, double v) {
  switch (d) {
    case DType::UINT8: store<uint8_t>(buf, i, static_cast<uint8_t>(v)); break;
    case DType::INT8: store<int8_t>(buf, i, static_cast<int8_t>(v)); break;
    case DType::INT16: store<int16_t>(buf, i, static_cast<int16_t>(v)); break;
    case DType::INT32: store<int32_t>(buf, i, static_cast<int32_t>(v)); break;
    case DType::INT64: store<int64_t>(buf, i, static_cast<int64_t>(v)); break;
    case DType::FLOAT16: store<uint16_t>(buf, i, float_to_half(static_cast<float>(v))); break;
    case DType::BFLOAT16: store<uint16_t>(buf, i, float_to_bf16(static_cast<float>(v))); break;
    case DType::FLOAT32: store<float>(buf, i, static_cast<float>(v)); break;
    case DType::FLOAT64: store<double>(buf, i, v); break;
    case DType::BOOL: store<uint8_t>(buf, i, v != 0 ? 1 : 0); break;
    case DType::UINT16: store<uint16_t>(buf, i, static_cast<uint16_t>(v)); break;
  }
}
double get(DType d, const void* buf, size_t i) {
  switch (d) {
    case DType::UINT8: return load<uint8_t>(buf, i);
    case DType::INT8: return load<int8_t>(buf, i);
    case DType::INT16: return load<int16_t>(buf, i);
    case DType::INT32: return load<int32_t>(buf, i);
    case DType::INT64: return static_cast<double>(load<int64_t>(buf, i));
    case DType::FLOAT16: return half_to_float(load<uint16_t>(buf, i));
    case DType::BFLOAT16: return bf16_to_float(load<uint16_t>(buf, i));
    case DType::FLOAT32: return load<float>(buf, i);
    case DType::FLOAT64: return load<double>(buf, i);
    case DType::BOOL: return load<uint8_t>(buf, i);
    case DType::UINT16: return load<uint16_t>(buf, i);
  }
  return 0;
}

using Bytes = std::vector<unsigned char>;
Bytes buffer(DType d, size_t count) { return Bytes(count * itemsize(d) + 1, 0xAB); }  // +1: never empty

// Rank r's element i in the reduction tests: {-1..2} for signed types, {0..3} unsigned, {0,1} bool, so
// sums and products of 4 ranks fit int8.
double value(DType d, int r, size_t i) {
  if (d == DType::BOOL) return (r + i) % 3 == 0 ? 1 : 0;
  double v = static_cast<double>((r + 2 * i) % 4);
  return is_unsigned(d) ? v : v - 1;
}

double fold(DType d, ReduceOp op, const std::vector<double>& vs) {
  double acc = vs[0];
  for (size_t k = 1; k < vs.size(); ++k) {
    double v = vs[k];
    if (d == DType::BOOL) {
      acc = (op == ReduceOp::MIN || op == ReduceOp::PRODUCT) ? (acc && v) : (acc || v);
    } else if (op == ReduceOp::SUM) {
      acc += v;
    } else if (op == ReduceOp::MIN) {
      acc = std::min(acc, v);
    } else if (op == ReduceOp::MAX) {
      acc = std::max(acc, v);
    } else {
      acc *= v;
    }
  }
  return acc;
}

std::string describe(const char* what, int n, DType d, int extra = -1) {
  return std::string(what) + " n=" + std::to_string(n) + " dtype=" + dtype_name(d) +
         (extra >= 0 ? " #" + std::to_string(extra) : "");
}

// Runs fn(comm) on n rank-threads of a fresh world (or `world`), then checks that nothing is left in its
// tables: no live collective, no queued message, and no communicator once every rank dropped its Comms.
void run_world(int n, const std::function<void(Comm&)>& fn, std::shared_ptr<LoopbackWorld> world = nullptr,
               bool expect_clean = true) {
  if (!world) world = make_loopback_world(n);
  std::vector<std::unique_ptr<Comm>> comms(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      auto comm = make_loopback_comm(world, r);
      CHECK(comm->rank() == r);
      CHECK(comm->size() == n);
      try {
        fn(*comm);
      } catch (const std::exception& e) {
        report(__FILE__, __LINE__, "rank " + std::to_string(r) + " threw: " + e.what());
      }
      comms[r] = std::move(comm);
    });
  }
  for (auto& t : threads) t.join();
  if (!expect_clean) return;
  LoopbackStats s = loopback_world_stats(world);
  CHECK_MSG(s.slots == 0, std::to_string(s.slots) + " slots left");
  CHECK_MSG(s.messages == 0, std::to_string(s.messages) + " messages left");
  comms.clear();
  s = loopback_world_stats(world);
  CHECK_MSG(s.comms == 0, std::to_string(s.comms) + " comms left");
}

// ---------------------------------------------------------------------------------------------------------

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
  int iters = 100000;
  if (const char* e = std::getenv("LOOPBACK_ITERS")) iters = std::atoi(e);
  struct Test {
    const char* name;
    std::function<void(int)> fn;
  };
  const std::vector<Test> tests = {
      {"allreduce", test_allreduce},
      {"allreduce_bit_identical", test_allreduce_bit_identical},
      {"allgatherv", test_allgatherv},
      {"broadcast", test_broadcast},
      {"alltoallv", test_alltoallv},
      {"reduce_scatter", test_reduce_scatter},
      {"ring_reduce_scatter_allgather", test_ring_reduce_scatter_and_allgather},
      {"sendrecv", test_sendrecv},
      {"small_collectives", test_small_collectives},
      {"nonblocking", test_nonblocking},
      {"concurrent_dups", test_concurrent_dups},
      {"messages", test_messages},
      {"wire_counters", test_wire_counters},
      {"dup_lifecycle", test_dup_lifecycle},
      {"mismatch", test_mismatch},
      {"fail", test_fail},
  };
  test_world_errors();
  for (const auto& t : tests) {
    for (int n = 1; n <= 4; ++n) {
      int before = g_failures.load();
      auto t0 = std::chrono::steady_clock::now();
      t.fn(n);
      double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      std::printf("%-26s n=%d %s (%.0f ms)\n", t.name, n, g_failures.load() == before ? "ok" : "FAILED", ms);
      std::fflush(stdout);
    }
  }
  for (int n : {2, 4}) test_many_collectives(n, iters);
  if (g_failures.load()) {
    std::printf("%d check(s) failed\n", g_failures.load());
    return 1;
  }
  std::printf("all loopback tests passed\n");
  return 0;
}
