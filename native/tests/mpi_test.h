// What the MPI transport's test programs share (transport.h's make_mpi_comm, run under mpirun with 2 or more
// ranks): the checks (EXPECT and EXPECT_THROWS count a check and report a failure with its rank, file and line,
// and carry on; any thread may call them), element access for every dtype, the inputs and expected results of
// the reduction and data-movement tests, and the frame of every program: MPI initialised for
// MPI_THREAD_MULTIPLE, the tests on MPI_COMM_WORLD and on its halves split by parity, and the checks and
// failures of every rank summed into rank 0's summary line (the job exits 1 if any rank saw a failure).
#pragma once

#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "../kernels.h"
#include "../transport.h"

namespace perseus::mpi_test {

inline int g_rank = 0;
inline std::atomic<int> g_checks{0};
inline std::atomic<int> g_failures{0};

inline void fail(const char* file, int line, const std::string& what) {
  const int n = ++g_failures;
  if (n <= 30) std::fprintf(stderr, "[rank %d] %s:%d: FAILED: %s\n", g_rank, file, line, what.c_str());
  if (n == 30) std::fprintf(stderr, "[rank %d] (further failures not shown)\n", g_rank);
}

#define EXPECT(cond, msg)                                       \
  do {                                                          \
    ++::perseus::mpi_test::g_checks;                            \
    if (!(cond)) {                                              \
      std::ostringstream os_;                                   \
      os_ << #cond << ": " << msg;                              \
      ::perseus::mpi_test::fail(__FILE__, __LINE__, os_.str()); \
    }                                                           \
  } while (0)

// Runs f, expecting a TransportError whose message contains `needle`.
#define EXPECT_THROWS(stmt, needle)                                                                     \
  do {                                                                                                  \
    std::string what_;                                                                                  \
    bool threw_ = false;                                                                                \
    try {                                                                                               \
      stmt;                                                                                             \
    } catch (const ::perseus::TransportError& e) {                                                      \
      threw_ = true;                                                                                    \
      what_ = e.what();                                                                                 \
    }                                                                                                   \
    EXPECT(threw_ && what_.find(needle) != std::string::npos,                                           \
           #stmt << " should throw TransportError with \"" << needle << "\", got \"" << what_ << "\""); \
  } while (0)

inline constexpr DType kDTypes[] = {DType::UINT8,   DType::INT8,    DType::INT16,   DType::INT32,
                                    DType::INT64,   DType::FLOAT16, DType::BFLOAT16, DType::FLOAT32,
                                    DType::FLOAT64, DType::BOOL,    DType::UINT16};
inline constexpr ReduceOp kOps[] = {ReduceOp::SUM, ReduceOp::MIN, ReduceOp::MAX, ReduceOp::PRODUCT};

inline bool is_unsigned(DType d) { return d == DType::UINT8 || d == DType::UINT16; }

// Element i of a typed buffer as a double, and the reverse. The values used are exact in every dtype.
inline double get(DType d, const void* p, size_t i) {
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

inline void put(DType d, void* p, size_t i, double v) {
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
inline Bytes buffer(DType d, size_t n, unsigned char fill = 0xA5) { return Bytes(n * itemsize(d) + 8, fill); }

// Rank r's element i for the reduction tests: small integers whose sums and products over a few ranks
// are exact in every dtype (int8 and uint8 included).
inline double reduce_input(DType d, int r, size_t i) {
  if (d == DType::BOOL) return ((i >> (r % 8)) & 1) ? 1 : 0;
  const int v = static_cast<int>((i * 7 + static_cast<size_t>(r) * 3) % 5);
  return is_unsigned(d) ? v : v - 2;
}

inline double reduce_expected(DType d, ReduceOp op, int size, size_t i) {
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
inline double pattern(DType d, int from, int to, size_t j) {
  if (d == DType::BOOL) return (from + to + j) % 2;
  return static_cast<double>((static_cast<size_t>(from) * 31 + static_cast<size_t>(to) * 7 + j) % 50);
}

// Compares n elements of buf with want(i); reports the first few mismatches.
inline void expect_elements(const std::string& what, DType d, const void* buf, size_t n,
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

inline void wait_for(PendingOp& op, const char* what) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!op.test()) {
    if (std::chrono::steady_clock::now() > deadline) {
      EXPECT(false, what << " did not complete in 60 s");
      return;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
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

// A test of one communicator.
using CommTest = void (*)(Comm&);

// MPI_Init_thread asking for MPI_THREAD_MULTIPLE (the engine's threads call MPI at the same time); sets g_rank.
// Returns the thread level MPI provides.
inline int mpi_test_init(int* argc, char*** argv) {
  int provided = 0;
  MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &provided);
  MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
  return provided;
}

// Runs body; an exception from it is a failure that ends the whole job (MPI_Abort).
inline void run_or_abort(const std::function<void()>& body) {
  try {
    body();
  } catch (const std::exception& e) {
    fail(__FILE__, __LINE__, std::string("exception: ") + e.what());
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
}

// Runs the tests on c in order; rank 0 prints how long they took.
inline void run_all(Comm& c, const char* label, const std::vector<CommTest>& tests) {
  const auto start = std::chrono::steady_clock::now();
  for (CommTest test : tests) test(c);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (c.rank() == 0) std::printf("  %s (%d ranks): done in %.1f s\n", label, c.size(), s);
}

// fn on a sub-communicator of MPI_COMM_WORLD (ranks split by parity, in reverse order: its own ranks and
// sizes), with the MPI communicator it was made from and its label ("even ranks" or "odd ranks").
inline void on_parity_halves(const std::function<void(Comm& sub, MPI_Comm half, const char* label)>& fn) {
  MPI_Comm half;
  MPI_Comm_split(MPI_COMM_WORLD, g_rank % 2, -g_rank, &half);
  {
    std::unique_ptr<Comm> sub = make_mpi_comm(handle_of(half));
    fn(*sub, half, g_rank % 2 ? "odd ranks" : "even ranks");
  }
  MPI_Comm_free(&half);  // the Comm made from it owned duplicates, so freeing the original is fine
}

// A program's tests on MPI_COMM_WORLD, then on_dup (when given) with the world and a dup of it, then the tests
// on each half of the ranks split by parity that has 2 ranks or more.
inline void run_on_world_and_halves(const std::vector<CommTest>& tests,
                                    const std::function<void(Comm& world, Comm& dup)>& on_dup = nullptr) {
  std::unique_ptr<Comm> world = make_mpi_comm(handle_of(MPI_COMM_WORLD));
  run_all(*world, "world", tests);
  if (on_dup) {
    std::unique_ptr<Comm> dup = world->dup();
    on_dup(*world, *dup);
  }
  on_parity_halves([&](Comm& sub, MPI_Comm, const char* label) {
    if (sub.size() >= 2) run_all(sub, label, tests);
  });
}

// The end of every program: the checks and failures of every rank summed, MPI_Finalize, after_finalize (when
// given: this rank's further failures, found with MPI finalised) and rank 0's summary line. Returns the exit
// status: 1 if any rank saw a failure.
inline int mpi_test_finish(const char* program, const std::function<int()>& after_finalize = nullptr) {
  int world_size = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &world_size);
  int failures = g_failures, total = 0, checks = g_checks, all_checks = 0;
  MPI_Allreduce(&failures, &total, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  MPI_Allreduce(&checks, &all_checks, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  MPI_Finalize();
  if (after_finalize) total += after_finalize();
  if (g_rank == 0) {
    if (total) {
      std::fprintf(stderr, "%s: %d of %d checks FAILED on %d ranks\n", program, total, all_checks, world_size);
    } else {
      std::printf("%s: all %d checks passed on %d ranks\n", program, all_checks, world_size);
    }
  }
  return total ? 1 : 0;
}

}  // namespace perseus::mpi_test
