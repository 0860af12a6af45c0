// What the loopback transport's test programs share (transport_loopback.h, run on rank-threads of one
// process): the checks (CHECK, CHECK_MSG, CHECK_THROWS report a failure with its file and line and carry on;
// any rank-thread may call them), element access for every dtype, the inputs and expected folds of the
// reduction tests, run_world (a test body on n rank-threads of one world, then the check that the world's
// tables are empty), and the runner and summary line of each program.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "../kernels.h"
#include "../transport_loopback.h"

namespace perseus::loopback_test {

inline std::atomic<int> g_failures{0};
inline std::mutex g_print_mu;

inline void report(const char* file, int line, const std::string& what) {
  std::lock_guard<std::mutex> g(g_print_mu);
  std::fprintf(stderr, "%s:%d: FAILED: %s\n", file, line, what.c_str());
  ++g_failures;
}

#define CHECK(cond)                                                           \
  do {                                                                        \
    if (!(cond)) ::perseus::loopback_test::report(__FILE__, __LINE__, #cond); \
  } while (0)
#define CHECK_MSG(cond, msg)                                                                              \
  do {                                                                                                    \
    if (!(cond)) ::perseus::loopback_test::report(__FILE__, __LINE__, std::string(#cond) + ": " + (msg)); \
  } while (0)
// Runs stmt and checks that it throws TransportError (whose message contains `needle`).
#define CHECK_THROWS(stmt, needle)                                                    \
  do {                                                                                \
    bool thrown_ = false;                                                             \
    try {                                                                             \
      stmt;                                                                           \
    } catch (const ::perseus::TransportError& e_) {                                   \
      thrown_ = true;                                                                 \
      CHECK_MSG(std::string(e_.what()).find(needle) != std::string::npos, e_.what()); \
    }                                                                                 \
    CHECK_MSG(thrown_, "no TransportError from " #stmt);                              \
  } while (0)

inline constexpr DType kAllDTypes[] = {DType::UINT8,   DType::INT8,    DType::INT16,   DType::INT32,
                                       DType::INT64,   DType::FLOAT16, DType::BFLOAT16, DType::FLOAT32,
                                       DType::FLOAT64, DType::BOOL,    DType::UINT16};
inline constexpr DType kMainDTypes[] = {DType::FLOAT32, DType::INT64, DType::FLOAT16, DType::BOOL};

inline bool is_unsigned(DType d) { return d == DType::UINT8 || d == DType::UINT16 || d == DType::BOOL; }

template <class T>
void store(void* buf, size_t i, T v) { std::memcpy(static_cast<char*>(buf) + i * sizeof(T), &v, sizeof(T)); }
template <class T>
T load(const void* buf, size_t i) {
  T v;
  std::memcpy(&v, static_cast<const char*>(buf) + i * sizeof(T), sizeof(T));
  return v;
}

// Element i of a buffer of dtype d, as a double (values in the tests are small integers: exact everywhere).
inline void put(DType d, void* buf, size_t i, double v) {
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
inline double get(DType d, const void* buf, size_t i) {
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
inline Bytes buffer(DType d, size_t count) { return Bytes(count * itemsize(d) + 1, 0xAB); }  // +1: never empty
       
       // Rank r's element i in the reduction tests: {-1..2} for signed types, {0..3} unsigned, {0,1} bool, so
       // sums and products of 4 ranks fit int8.
       double value(DType d, int r, size_t i) {
  if (d == DType::BOOL) return (r + i) % 3 == 0 ? 1 : 0;
  double v = static_cast<double>((r + 2 * i) % 4);
  return is_unsigned(d) ? v : v - 1;
}

inline double fold(DType d, ReduceOp op, const std::vector<double>& vs) {
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

inline std::string describe(const char* what, int n, DType d, int extra = -1) {
  return std::string(what) + " n=" + std::to_string(n) + " dtype=" + dtype_name(d) +
         (extra >= 0 ? " #" + std::to_string(extra) : "");
}

// Runs fn(comm) on n rank-threads of a fresh world (or `world`), then checks that nothing is left in its
// tables: no live collective, no queued message, and no communicator once every rank dropped its Comms.
inline void run_world(int n, const std::function<void(Comm&)>& fn, std::shared_ptr<LoopbackWorld> world = nullptr,
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

// One test of a program: a name for its result lines and a body run on n rank-threads.
struct Test {
  const char* name;
  std::function<void(int)> fn;
};

// Runs each test on 1, 2, 3 and 4 rank-threads; a line for each run: the test, n, ok or FAILED, and the time.
inline void run_on_1_to_4_ranks(const std::vector<Test>& tests) {
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
}

// The program's last line: how many checks failed, or that all passed. Returns the exit status (1: a failure).
inline int summary(const char* program) {
  if (g_failures.load()) {
    std::printf("%s: %d check(s) failed\n", program, g_failures.load());
    return 1;
  }
  std::printf("%s: all loopback tests passed\n", program);
  return 0;
}

}  // namespace perseus::loopback_test
