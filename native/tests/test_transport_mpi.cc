// Tests for transport_mpi.cc: every Comm method, on every dtype and reduction, with known answers built
// from rank-dependent inputs. Run under mpirun with 2 or more ranks (run_native_tests.sh runs 2 and 3).
// Every rank checks its own results; the job exits 1 if any rank saw a failure.
#include <mpi.h>

#include <atomic>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "../kernels.h"
#include "../transport.h"

using namespace perseus;

namespace {

int g_rank = 0;
std::atomic<int> g_checks{0};
std::atomic<int> g_failures{0};

void fail(int line, const std::string& what) {
  const int n = ++g_failures;
  if (n <= 30) std::fprintf(stderr, "[rank %d] test_transport_mpi.cc:%d: FAILED: %s\n", g_rank, line, what.c_str());
  if (n == 30) std::fprintf(stderr, "[rank %d] (further failures not shown)\n", g_rank);
}

#define EXPECT(cond, msg)          \
  do {                             \
    ++g_checks;                    \
    if (!(cond)) {                 \
      std::ostringstream os_;      \
      os_ << #cond << ": " << msg; \
      fail(__LINE__, os_.str());   \
    }                              \
  } while (0)

// Runs f, expecting a TransportError whose message contains `needle`.
#define EXPECT_THROWS(stmt, needle)                                                                    \
  do {                                                                                                 \
    std::string what_;                                                                                 \
    bool threw_ = false;                                                                               \
    try {                                                                                              \
      stmt;                                                                                            \
    } catch (const TransportError& e) {                                                                \
      threw_ = true;                                                                                   \
      what_ = e.what();                                                                                \
    }                                                                                                  \
    EXPECT(threw_ && what_.find(needle) != std::string::npos,                                         \
           #stmt << " should throw TransportError with \"" << needle << "\", got \"" << what_ << "\""); \
  } while (0)

const DType kDTypes[] = {DType::UINT8,   DType::INT8,    DType::INT16,   DType::INT32,
                         DType::INT64,   DType::FLOAT16, DType::BFLOAT16, DType::FLOAT32,
                         DType::FLOAT64, DType::BOOL,    DType::UINT16};
const ReduceOp kOps[] = {ReduceOp::SUM, ReduceOp::MIN, ReduceOp::MAX, ReduceOp::PRODUCT};

bool is_unsigned(DType d) { return d == DType::UINT8 || d == DType::UINT16; }

// Element i of a typed buffer as a double, and the reverse. The values used are exact in every dtype.
double get(DType d, const void* p, size_t i) {
  switch (d) {
    case DType::UINT8: return static_cast<const uint8_t*>(p)[i];
    case DType::INT8: return static_cast<const int8_t*>(p)[i];
    case DType::INT16: return static_cast<const int16_t*>(p)[i];
    case DType::INT32: return static_cast<const int32_t*>(p)[i];
    case DType::INT64: return static_cast<double>(static_cast<const int64_t*>(p)[i]);
    case DType::UINT16: return static_cast<const uint16_t*>(p)[i];
    case DType::FLOAT16: return half_to_float(static_cast<const uint16_t*>(p)[i]);
    case DType::BFLOAT16: return bf16_to_float(static_cast<const uint16_t*>(p)[i]);
    case DType::FLOAT32: return static_cast<const float*>(p)[i];
    case DType::FLOAT64: return static_cast<const double*>(p)[i];
    case DType::BOOL: return static_cast<const uint8_t*>(p)[i];
  }
  return 0;
}

void put(DType d, void* p, size_t i, double v) {
  switch (d) {
    case DType::UINT8: static_cast<uint8_t*>(p)[i] = static_cast<uint8_t>(v); break;
    case DType::INT8: static_cast<int8_t*>(p)[i] = static_cast<int8_t>(v); break;
    case DType::INT16: static_cast<int16_t*>(p)[i] = static_cast<int16_t>(v); break;
    case DType::INT32: static_cast<int32_t*>(p)[i] = static_cast<int32_t>(v); break;
    case DType::INT64: static_cast<int64_t*>(p)[i] = static_cast<int64_t>(v); break;
    case DType::UINT16: static_cast<uint16_t*>(p)[i] = static_cast<uint16_t>(v); break;
    case DType::FLOAT16: static_cast<uint16_t*>(p)[i] = float_to_half(static_cast<float>(v)); break;
    case DType::BFLOAT16: static_cast<uint16_t*>(p)[i] = float_to_bf16(static_cast<float>(v)); break;
    case DType::FLOAT32: static_cast<float*>(p)[i] = static_cast<float>(v); break;
    case DType::FLOAT64: static_cast<double*>(p)[i] = v; break;
    case DType::BOOL: static_cast<uint8_t*>(p)[i] = v != 0; break;
  }
}

using Bytes = std::vector<unsigned char>;
Bytes buffer(DType d, size_t n, unsigned char fill = 0xA5) { return Bytes(n * itemsize(d) + 8, fill); }

// Rank r's element i for the reduction tests: small integers whose sums and products over a few ranks
// are exact in every dtype (int8 and uint8 included).
double reduce_input(DType d, int r, size_t i) {
  if (d == DType::BOOL) return ((i >> (r % 8)) & 1) ? 1 : 0;
  const int v = static_cast<int>((i * 7 + static_cast<size_t>(r) * 3) % 5);
  return is_unsigned(d) ? v : v - 2;
}

double reduce_expected(DType d, ReduceOp op, int size, size_t i) {
  double acc = reduce_input(d, 0, i);
  for (int r = 1; r < size; ++r) {
    const double x = reduce_input(d, r, i);
    if (d == DType::BOOL) {
      acc = (op == ReduceOp::MIN || op == ReduceOp::PRODUCT) ? (acc != 0 && x != 0) : (acc != 0 || x != 0);
      continue;
    }
    switch (op) {
      case ReduceOp::MIN: acc = std::min(acc, x); break;
      case ReduceOp::MAX: acc = std::max(acc, x); break;
      case ReduceOp::PRODUCT: acc *= x; break;
      default: acc += x; break;
    }
  }
  return acc;
}

// Element j of the block that rank `from` sends to rank `to` (alltoallv), or owns (allgatherv, broadcast).
double pattern(DType d, int from, int to, size_t j) {
  if (d == DType::BOOL) return (from + to + j) % 2;
  return static_cast<double>((static_cast<size_t>(from) * 31 + static_cast<size_t>(to) * 7 + j) % 50);
}

// Compares n elements of buf with want(i); reports the first few mismatches.
void expect_elements(const std::string& what, DType d, const void* buf, size_t n,
                     const std::function<double(size_t)>& want) {
  int bad = 0;
  for (size_t i = 0; i < n; ++i) {
    const double got = get(d, buf, i), w = want(i);
    if (!(got == w || (std::isnan(got) && std::isnan(w)))) {
      if (++bad <= 3) EXPECT(false, what << " " << dtype_name(d) << " [" << i << "] = " << got << ", want " << w);
    }
  }
  ++g_checks;
}

// -- data plane ----------------------------------------------------------------------------------------

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

// 16-bit float sums of random values: each pairwise combine happens in float32 and is rounded once, so
// on 2 ranks the result is exactly float32(a + b) rounded once; on more ranks the order of the combines is
// MPI's choice, and the result stays within one rounding per combine of the exact sum.
void test_16bit_random_sums(Comm& c) {
  const int size = c.size(), rank = c.rank();
  const size_t n = 50000;
  for (DType d : {DType::FLOAT16, DType::BFLOAT16}) {
    auto value = [&](int r, size_t i) {
      uint64_t s = (static_cast<uint64_t>(r) << 32) ^ (i * 0x9E3779B97F4A7C15ull);
      s ^= s >> 29;
      s *= 0xBF58476D1CE4E5B9ull;
      s ^= s >> 32;
      const double u = static_cast<double>(s % 2000001) / 1000000.0 - 1.0;  // [-1, 1]
      const double scale = std::ldexp(1.0, static_cast<int>((s >> 40) % 16) - 8);
      const float f = static_cast<float>(u * scale);
      return d == DType::FLOAT16 ? float_to_half(f) : float_to_bf16(f);
    };
    auto widen = [&](uint16_t w) { return d == DType::FLOAT16 ? half_to_float(w) : bf16_to_float(w); };
    std::vector<uint16_t> in(n), out(n);
    for (size_t i = 0; i < n; ++i) in[i] = value(rank, i);
    in[0] = rank == 0 ? (d == DType::FLOAT16 ? 0x7E00 : 0x7FC0) : in[0];  // a NaN anywhere gives NaN
    in[1] = rank == size - 1 ? (d == DType::FLOAT16 ? 0x7C00 : 0x7F80) : in[1];  // +inf
    c.allreduce(in.data(), out.data(), n, d, ReduceOp::SUM);
    EXPECT(std::isnan(widen(out[0])), dtype_name(d) << " NaN + x = " << widen(out[0]));
    EXPECT(std::isinf(widen(out[1])) && widen(out[1]) > 0, dtype_name(d) << " inf + x = " << widen(out[1]));
    const double eps = d == DType::FLOAT16 ? std::ldexp(1.0, -11) : std::ldexp(1.0, -8);  // half an ulp
    int bad = 0;
    for (size_t i = 2; i < n; ++i) {
      const float got = widen(out[i]);
      if (size == 2) {
        const float sum32 = widen(value(0, i)) + widen(value(1, i));  // float32 reference, rounded once
        const uint16_t want = d == DType::FLOAT16 ? float_to_half(sum32) : float_to_bf16(sum32);
        if (out[i] != want && ++bad <= 3) {
          EXPECT(false, dtype_name(d) << " sum [" << i << "] = " << got << ", want " << widen(want));
        }
      } else {
        double exact = 0, magnitude = 0;
        for (int r = 0; r < size; ++r) {
          exact += widen(value(r, i));
          magnitude += std::fabs(widen(value(r, i)));
        }
        const double tolerance = 2 * eps * (size - 1) * magnitude + std::ldexp(1.0, -24) * size;
        if (std::fabs(got - exact) > tolerance && ++bad <= 3) {
          EXPECT(false, dtype_name(d) << " sum [" << i << "] = " << got << ", exact " << exact);
        }
      }
    }
    ++g_checks;
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

// -- negotiation ---------------------------------------------------------------------------------------

void wait_for(PendingOp& op, const char* what) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!op.test()) {
    if (std::chrono::steady_clock::now() > deadline) {
      EXPECT(false, what << " did not complete in 60 s");
      return;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

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

// -- control messages ----------------------------------------------------------------------------------

std::string control_message(int from, int to, int k) {
  std::string s = "from " + std::to_string(from) + " to " + std::to_string(to) + " #" + std::to_string(k);
  if (k == 1) return std::string();                     // empty messages arrive too
  if (k == 2) s += std::string("\0\x01\xff", 3);         // binary
  if (k == 3) s += std::string(200000 + from, 'x');      // large (rendezvous protocol)
  return s;
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

// -- bytes on the wire ----------------------------------------------------------------------------------

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

// -- errors --------------------------------------------------------------------------------------------

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

template <typename C>
intptr_t handle_of(C comm) {
  if constexpr (std::is_pointer_v<C>) {
    return reinterpret_cast<intptr_t>(comm);
  } else if constexpr (std::is_integral_v<C>) {
    return static_cast<intptr_t>(comm);
  } else {
    intptr_t h = 0;
    std::memcpy(&h, &comm, sizeof comm);
    return h;
  }
}

void run_all(Comm& c, const char* label) {
  const auto start = std::chrono::steady_clock::now();
  test_allreduce(c);
  test_16bit_random_sums(c);
  test_allgatherv(c);
  test_broadcast(c);
  test_alltoallv(c);
  test_reduce_scatter(c);
  test_sendrecv(c);
  test_small_collectives(c);
  test_nonblocking(c);
  test_iallreduce(c);
  test_control_messages(c);
  test_wire_counters(c);
  test_errors(c);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (c.rank() == 0) std::printf("  %s (%d ranks): done in %.1f s\n", label, c.size(), s);
}

}  // namespace

int main(int argc, char** argv) {
  // Before MPI_Init: the symptom of a core whose libmpi is not the one mpi4py initialised.
  EXPECT_THROWS(make_mpi_comm(handle_of(MPI_COMM_WORLD)), "is not initialised");
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
  int world_size = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &world_size);
  EXPECT(provided == MPI_THREAD_MULTIPLE, "MPI_THREAD_MULTIPLE not provided");
  EXPECT(world_size >= 2, "run with at least 2 ranks");
  std::unique_ptr<Comm> outlives_mpi;
  try {
    EXPECT(mpi_library_version().size() > 3, "mpi_library_version() = " << mpi_library_version());
    if (g_rank == 0) std::printf("test_transport_mpi: %s\n", mpi_library_version().substr(0, 60).c_str());
    std::unique_ptr<Comm> world = make_mpi_comm(handle_of(MPI_COMM_WORLD));
    EXPECT(world->rank() == g_rank && world->size() == world_size, "rank/size");
    run_all(*world, "world");
    {
      std::unique_ptr<Comm> dup = world->dup();
      EXPECT(dup->rank() == g_rank && dup->size() == world_size, "dup rank/size");
      test_allreduce(*dup);
      test_control_messages(*dup);
      // Messages sent on the dup are not seen by the original.
      int source;
      std::string m;
      EXPECT(!world->poll_message(&source, &m), "a dup's control message leaked into its parent");
    }
    test_threads(*world);
    // A sub-communicator (ranks split by parity, in reverse order): its own ranks and sizes.
    MPI_Comm half;
    MPI_Comm_split(MPI_COMM_WORLD, g_rank % 2, -g_rank, &half);
    {
      std::unique_ptr<Comm> sub = make_mpi_comm(handle_of(half));
      int want_size = 0;
      MPI_Comm_size(half, &want_size);
      EXPECT(sub->size() == want_size, "sub-communicator size");
      if (sub->size() >= 2) {
        run_all(*sub, g_rank % 2 ? "odd ranks" : "even ranks");
      } else {
        float v = 3;
        sub->allreduce(nullptr, &v, 1, DType::FLOAT32, ReduceOp::SUM);
        EXPECT(v == 3, "allreduce on a 1-rank communicator");
      }
    }
    MPI_Comm_free(&half);  // the Comm made from it owned duplicates, so freeing the original is fine
    EXPECT_THROWS(make_mpi_comm(handle_of(MPI_COMM_NULL)), "MPI_COMM_NULL");
    world->barrier();
    outlives_mpi = world->dup();  // destroyed after MPI_Finalize: must neither free nor crash
  } catch (const std::exception& e) {
    fail(__LINE__, std::string("exception: ") + e.what());
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  int failures = g_failures, total = 0, checks = g_checks, all_checks = 0;
  MPI_Allreduce(&failures, &total, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  MPI_Allreduce(&checks, &all_checks, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  MPI_Finalize();
  outlives_mpi.reset();
  bool threw = false;
  try {
    make_mpi_comm(handle_of(MPI_COMM_WORLD));
  } catch (const TransportError& e) {
    threw = std::string(e.what()).find("finalized") != std::string::npos;
  }
  if (!threw) {
    std::fprintf(stderr, "[rank %d] make_mpi_comm after MPI_Finalize did not refuse\n", g_rank);
    total += 1;
  }
  if (g_rank == 0) {
    if (total) {
      std::fprintf(stderr, "test_transport_mpi: %d of %d checks FAILED on %d ranks\n", total, all_checks, world_size);
    } else {
      std::printf("test_transport_mpi: all %d checks passed on %d ranks\n", all_checks, world_size);
    }
  }
  return total ? 1 : 0;
}
