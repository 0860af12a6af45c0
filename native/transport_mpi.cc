// The MPI transport: Comm over an MPI communicator (Open MPI or an MPICH-ABI library).
//
// Each MpiComm owns two duplicates of the communicator it was built from: one for collectives and ring
// traffic, one for control messages, so that a control message can never match a data receive. Every MPI
// call checks its return code (the duplicates use MPI_ERRORS_RETURN) and throws TransportError.
//
// Bytes on the wire (wire.h): sendrecv and control messages count what they move. The collectives are MPI's
// own (MPI_Allreduce, MPI_Allgatherv, ...), which do not say what this rank sent to whom, so each counts the
// volume of the textbook algorithm for it (wire.h's *_volume functions), not a measurement.
//
// Sizes: MPI's counts and displacements are C ints. No single call here moves more than 1 GiB or 2^31 - 1
// elements: allreduce, broadcast and sendrecv go in pieces, and an allgatherv, alltoallv or reduce-scatter
// whose counts add up past 2^31 - 1 elements runs as a broadcast per rank, pairwise exchanges, or a reduce
// per rank, in pieces (MPI_Allgatherv and friends take int displacements, and Open MPI's reduce-scatter adds
// its counts up in an int).
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <list>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>

#include "buffers.h"
#include "kernels.h"
#include "recycled.h"
#include "transport.h"

namespace perseus {
namespace {

constexpr int kDataTag = 17;     // sendrecv on the data communicator (ring steps)
constexpr int kControlTag = 7;   // control messages on the control communicator
constexpr size_t kMaxCount = INT_MAX;
// The most one MPI call moves: an int count of elements, and at most 1 GiB, so that no byte count inside the
// library (an int in places) can overflow either.
constexpr size_t kMaxPieceBytes = size_t(1) << 30;

size_t piece_elements(DType dtype) { return std::min(kMaxCount, kMaxPieceBytes / itemsize(dtype)); }

// Whether a v-collective's counts, their offsets and their total all fit MPI's int counts.
bool fits_int(const std::vector<size_t>& counts) {
  size_t total = 0;
  for (size_t c : counts) total += c;
  return total <= kMaxCount;
}

// Where each rank's part starts, in elements (size_t: beyond MPI's int displacements).
std::vector<size_t> offsets_of(const std::vector<size_t>& counts) {
  std::vector<size_t> out(counts.size());
  size_t at = 0;
  for (size_t r = 0; r < counts.size(); ++r) out[r] = at, at += counts[r];
  return out;
}

// -- errors --------------------------------------------------------------------------------------------

std::string mpi_error_string(int code) {
  char buf[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, buf, &len) != MPI_SUCCESS || len <= 0) return "MPI error code " + std::to_string(code);
  return std::string(buf, static_cast<size_t>(len));
}

void check(int rc, const char* call) {
  if (rc != MPI_SUCCESS) throw TransportError(std::string(call) + " failed: " + mpi_error_string(rc));
}

// MPI counts and displacements are C ints.
int to_count(size_t n, const char* call, const std::string& what) {
  if (n > kMaxCount) {
    throw TransportError(std::string(call) + ": " + what + " is " + std::to_string(n) +
                         " elements, above MPI's 2^31-1 element limit");
  }
  return static_cast<int>(n);
}

// Counts (and their running offsets) for a v-collective, checked against the int limit.
void to_counts(const std::vector<size_t>& counts, const char* call, const char* what, std::vector<int>* out,
               std::vector<int>* displs) {
  out->resize(counts.size());
  displs->resize(counts.size());
  size_t offset = 0;
  for (size_t r = 0; r < counts.size(); ++r) {
    (*out)[r] = to_count(counts[r], call, std::string(what) + " for rank " + std::to_string(r));
    (*displs)[r] = to_count(offset, call, std::string("the offset of rank ") + std::to_string(r) + "'s part");
    offset += counts[r];
  }
}

// -- the MPI library -----------------------------------------------------------------------------------

// What mpi.h said at build time, to name it when the library found at run time is not the same kind.
#define PERSEUS_STR2(x) #x
#define PERSEUS_STR(x) PERSEUS_STR2(x)
#if defined(OMPI_MAJOR_VERSION)
constexpr const char* kBuiltAgainst = "Open MPI " PERSEUS_STR(OMPI_MAJOR_VERSION) "." PERSEUS_STR(
    OMPI_MINOR_VERSION) "." PERSEUS_STR(OMPI_RELEASE_VERSION);
bool same_family(const std::string& runtime) { return runtime.rfind("Open MPI", 0) == 0; }
#elif defined(MPICH_VERSION)
constexpr const char* kBuiltAgainst = "MPICH " MPICH_VERSION " (MPICH ABI)";
bool same_family(const std::string& runtime) { return runtime.find("Open MPI") == std::string::npos; }
#else
constexpr const char* kBuiltAgainst = "MPI " PERSEUS_STR(MPI_VERSION) "." PERSEUS_STR(MPI_SUBVERSION);
bool same_family(const std::string&) { return true; }
#endif

std::string first_line(const std::string& s) {
  std::string line = s.substr(0, s.find('\n'));
  while (!line.empty() && (line.back() == '\r' || line.back() == ' ' || line.back() == '\0')) line.pop_back();
  return line;
}

// A core built against one MPI may find another at run time: the library it links to by soname is then a
// second MPI that nobody initialised (mpi4py initialised its own), or not the kind of MPI its headers
// described. Both would crash or hang in the first collective; say what happened instead.
void check_library() {
  int finalized = 0, initialized = 0;
  check(MPI_Finalized(&finalized), "MPI_Finalized");
  if (finalized) throw TransportError("MPI has already been finalized");
  const std::string version = first_line(mpi_library_version());
  if (!same_family(version)) {
    throw TransportError(std::string("perseus's native core was built against ") + kBuiltAgainst +
                         " but runs with a different MPI library (" + version +
                         "); reinstall perseus from source in this environment so that it builds against "
                         "the MPI that mpi4py uses");
  }
  check(MPI_Initialized(&initialized), "MPI_Initialized");
  if (!initialized) {
    throw TransportError("the MPI library perseus's native core uses (" + version +
                         ") is not initialised, so mpi4py must have initialised a different one; reinstall "
                         "perseus from source in this environment so that it builds against the MPI that "
                         "mpi4py uses (built against " + kBuiltAgainst + ")");
  }
}

// -- datatypes and reductions --------------------------------------------------------------------------

// float16 and bfloat16 travel as two distinct 2-byte types, so that one user-defined reduction can tell
// them apart by the datatype MPI hands it. Created once per process and never freed: MPI_Finalize
// releases them, and an op may still be referenced by a request in flight at any earlier point.
struct HalfFloatTypes {
  MPI_Datatype f16 = MPI_DATATYPE_NULL;
  MPI_Datatype bf16 = MPI_DATATYPE_NULL;
  MPI_Op sum = MPI_OP_NULL, min = MPI_OP_NULL, max = MPI_OP_NULL, product = MPI_OP_NULL;
};
HalfFloatTypes g_half;
std::once_flag g_half_once;

template <ReduceOp Op>
void reduce_16bit(void* in, void* inout, int* len, MPI_Datatype* type) {
  DType dtype;
  if (*type == g_half.f16) {
    dtype = DType::FLOAT16;
  } else if (*type == g_half.bf16) {
    dtype = DType::BFLOAT16;
  } else {
    // Only this file uses these ops, always with the types above: anything else is memory corruption.
    std::fprintf(stderr, "perseus: a 16-bit float reduction received an unknown MPI datatype\n");
    std::abort();
  }
  combine(in, inout, inout, static_cast<size_t>(*len), dtype, Op);
}

MPI_Datatype make_2byte_type(const char* name) {
  MPI_Datatype t;
  check(MPI_Type_contiguous(2, MPI_BYTE, &t), "MPI_Type_contiguous");
  check(MPI_Type_commit(&t), "MPI_Type_commit");
  MPI_Type_set_name(t, name);  // only for debuggers and error messages
  return t;
}

MPI_Op make_op(MPI_User_function* fn) {
  MPI_Op op;
  check(MPI_Op_create(fn, /*commute=*/1, &op), "MPI_Op_create");
  return op;
}

const HalfFloatTypes& half_types() {
  // If creation throws, call_once leaves the flag unset and the next caller tries again.
  std::call_once(g_half_once, [] {
    HalfFloatTypes r;
    r.f16 = make_2byte_type("perseus_float16");
    r.bf16 = make_2byte_type("perseus_bfloat16");
    r.sum = make_op(&reduce_16bit<ReduceOp::SUM>);
    r.min = make_op(&reduce_16bit<ReduceOp::MIN>);
    r.max = make_op(&reduce_16bit<ReduceOp::MAX>);
    r.product = make_op(&reduce_16bit<ReduceOp::PRODUCT>);
    g_half = r;
  });
  return g_half;
}

MPI_Datatype mpi_type(DType dtype) {
  switch (dtype) {
    case DType::UINT8: return MPI_UINT8_T;
    case DType::INT8: return MPI_INT8_T;
    case DType::INT16: return MPI_INT16_T;
    case DType::INT32: return MPI_INT32_T;
    case DType::INT64: return MPI_INT64_T;
    case DType::UINT16: return MPI_UINT16_T;
    case DType::FLOAT32: return MPI_FLOAT;
    case DType::FLOAT64: return MPI_DOUBLE;
    case DType::BOOL: return MPI_C_BOOL;
    case DType::FLOAT16: return half_types().f16;
    case DType::BFLOAT16: return half_types().bf16;
  }
  throw TransportError("unknown dtype " + std::to_string(static_cast<int>(dtype)));
}

MPI_Op mpi_op(DType dtype, ReduceOp op) {
  if (op == ReduceOp::ADASUM) throw TransportError("Adasum is not an MPI reduction");
  if (dtype == DType::BOOL) {
    return (op == ReduceOp::MIN || op == ReduceOp::PRODUCT) ? MPI_LAND : MPI_LOR;
  }
  if (dtype == DType::FLOAT16 || dtype == DType::BFLOAT16) {
    const HalfFloatTypes& r = half_types();
    switch (op) {
      case ReduceOp::MIN: return r.min;
      case ReduceOp::MAX: return r.max;
      case ReduceOp::PRODUCT: return r.product;
      default: return r.sum;  // SUM, and AVERAGE (a sum plus a postscale)
    }
  }
  switch (op) {
    case ReduceOp::MIN: return MPI_MIN;
    case ReduceOp::MAX: return MPI_MAX;
    case ReduceOp::PRODUCT: return MPI_PROD;
    default: return MPI_SUM;
  }
}

bool mpi_finalized() {
  int finalized = 1;
  return MPI_Finalized(&finalized) != MPI_SUCCESS || finalized;
}

// -- requests that outlive their owner -----------------------------------------------------------------

// MPI may still read a send buffer or a count array until the request completes, and a request of a
// non-blocking collective may not be freed. What is dropped before completion is parked here for the rest
// of the process (this only happens on abnormal shutdown, so the leak is bounded).
struct Abandoned {
  std::mutex mu;
  std::vector<std::shared_ptr<void>> items;
};
Abandoned& abandoned() {
  static Abandoned* a = new Abandoned;  // never destroyed: MPI may touch the items until it finalizes
  return *a;
}
void abandon(std::shared_ptr<void> item) {
  Abandoned& a = abandoned();
  std::lock_guard<std::mutex> lock(a.mu);
  a.items.push_back(std::move(item));
}

// -- pending operations --------------------------------------------------------------------------------

// Recycled: the engine starts one per negotiation round and per small all-reduce.
class MpiPendingOp final : public PendingOp, public Recycled<MpiPendingOp> {
 public:
  struct State {
    MPI_Request request = MPI_REQUEST_NULL;
    std::vector<int> counts, displs;  // MPI reads these until the operation completes
  };

  ~MpiPendingOp() override {
    if (done_ || mpi_finalized()) return;
    int flag = 0;
    if (MPI_Test(&state_.request, &flag, MPI_STATUS_IGNORE) == MPI_SUCCESS && flag) return;
    // Still running: the request and the count arrays MPI reads (moved: the same buffers) outlive this.
    abandon(std::make_shared<State>(std::move(state_)));
  }

  State& state() { return state_; }

  bool test() override {
    if (done_) return true;
    int flag = 0;
    check(MPI_Test(&state_.request, &flag, MPI_STATUS_IGNORE), "MPI_Test");
    done_ = flag != 0;
    return done_;
  }

 private:
  State state_;
  bool done_ = false;
};

// -- the communicator ----------------------------------------------------------------------------------

class MpiComm final : public Comm {
 public:
  explicit MpiComm(MPI_Comm parent) {
    check(MPI_Comm_dup(parent, &data_), "MPI_Comm_dup");
    try {
      check(MPI_Comm_set_errhandler(data_, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
      check(MPI_Comm_dup(data_, &control_), "MPI_Comm_dup");
      check(MPI_Comm_set_errhandler(control_, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
      check(MPI_Comm_rank(data_, &rank_), "MPI_Comm_rank");
      check(MPI_Comm_size(data_, &size_), "MPI_Comm_size");
    } catch (...) {
      free_comms();
      throw;
    }
  }

  ~MpiComm() override {
    try {
      if (mpi_finalized()) return;  // MPI_Finalize has freed everything already
      // Sends still in flight keep their buffers alive past this object.
      reap_sends(/*throw_errors=*/false);
      if (!outbox_.empty()) {
        abandon(std::make_shared<std::list<Outgoing>>(std::move(outbox_)));
      }
      // The communicators are not freed: a peer may still send control messages to them, or have a
      // non-blocking negotiation in flight on them, and once freed their context id can be reused by a new
      // communicator (after an elastic reset, say), which would then receive those stale messages --
      // observed as both ranks hanging in the next communicator's creation. MPI_Finalize frees them.
      data_ = control_ = MPI_COMM_NULL;
    } catch (...) {
      // A destructor must not throw; there is nothing useful left to do with an error here.
    }
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::unique_ptr<Comm> dup() override {
    auto out = std::make_unique<MpiComm>(data_);
    out->set_wire_counters(wire_counters());
    return out;
  }
  std::unique_ptr<Comm> split(int color, int key) override {
    MPI_Comm part = MPI_COMM_NULL;
    check(MPI_Comm_split(data_, color, key, &part), "MPI_Comm_split");
    // The Comm keeps duplicates of `part`; nothing was ever sent on it, so it can go at once.
    std::unique_ptr<Comm> out;
    try {
      out = std::make_unique<MpiComm>(part);
    } catch (...) {
      MPI_Comm_free(&part);
      throw;
    }
    MPI_Comm_free(&part);
    out->set_wire_counters(wire_counters());
    return out;
  }

  void allreduce(const void* send, void* recv, size_t count, DType dtype, ReduceOp op) override {
    const MPI_Datatype type = mpi_type(dtype);
    const MPI_Op mop = mpi_op(dtype, op);
    const size_t item = itemsize(dtype);
    const bool in_place = send == nullptr || send == recv;
    // Larger than one piece: reduce in pieces (every rank cuts the same pieces).
    const size_t piece = piece_elements(dtype);
    for (size_t done = 0; done < count;) {
      const size_t n = std::min(count - done, piece);
      const void* s = in_place ? MPI_IN_PLACE : static_cast<const char*>(send) + done * item;
      check(MPI_Allreduce(s, static_cast<char*>(recv) + done * item, static_cast<int>(n), type, mop, data_),
            "MPI_Allreduce");
      done += n;
    }
    // The algorithm's volume (a ring's 2 (P-1)/P of the buffer): MPI does not say what it sent.
    const WireVolume v = allreduce_volume(static_cast<uint64_t>(count) * item, size_);
    wire().data(v.sent, v.received);
  }

  std::unique_ptr<PendingOp> iallreduce(const void* send, void* recv, size_t count, DType dtype,
                                        ReduceOp op) override {
    const int c = to_count(count, "MPI_Iallreduce", "the count");
    auto pending = std::make_unique<MpiPendingOp>();
    const void* s = send == nullptr || send == recv ? MPI_IN_PLACE : send;
    check(MPI_Iallreduce(s, recv, c, mpi_type(dtype), mpi_op(dtype, op), data_, &pending->state().request),
          "MPI_Iallreduce");
    const WireVolume v = allreduce_volume(static_cast<uint64_t>(count) * itemsize(dtype), size_);
    wire().data(v.sent, v.received);
    return pending;
  }

  void allgatherv(const void* send, void* recv, const std::vector<size_t>& counts, DType dtype) override {
    check_ranks(counts, "MPI_Allgatherv");
    if (fits_int(counts)) {
      const MPI_Datatype type = mpi_type(dtype);
      std::vector<int> c, d;
      to_counts(counts, "MPI_Allgatherv", "the count", &c, &d);
      const void* s = send == nullptr ? MPI_IN_PLACE : send;  // in place: this rank's part is already in recv
      check(MPI_Allgatherv(s, c[rank_], type, recv, c.data(), d.data(), type, data_), "MPI_Allgatherv");
    } else {
      // Beyond MPI's int counts: each rank's part goes out from it as a broadcast, in pieces.
      const std::vector<size_t> displs = offsets_of(counts);
      if (send != nullptr) copy_bytes(element_at(recv, displs[rank_], dtype), send, counts[rank_] * itemsize(dtype));
      for (int r = 0; r < size_; ++r) broadcast_pieces(element_at(recv, displs[r], dtype), counts[r], dtype, r);
    }
    // The algorithm's volume: this rank's block to each other rank, the others' blocks in.
    const WireVolume v = allgatherv_volume(counts, rank_, itemsize(dtype));
    wire().data(v.sent, v.received);
  }

  void broadcast(void* buf, size_t count, DType dtype, int root) override {
    broadcast_pieces(buf, count, dtype, root);
    const size_t item = itemsize(dtype);
    // The algorithm's volume: the root sends the buffer to each other rank, which receives it once.
    const WireVolume v = broadcast_volume(static_cast<uint64_t>(count) * item, size_, rank_, root);
    wire().data(v.sent, v.received);
  }

  void alltoallv(const void* send, const std::vector<size_t>& send_counts, void* recv,
                 const std::vector<size_t>& recv_counts, DType dtype, bool beyond_int) override {
    check_ranks(send_counts, "MPI_Alltoallv");
    check_ranks(recv_counts, "MPI_Alltoallv");
    if (!beyond_int) {
      const MPI_Datatype type = mpi_type(dtype);
      std::vector<int> sc, sd, rc, rd;
      to_counts(send_counts, "MPI_Alltoallv", "the send count", &sc, &sd);
      to_counts(recv_counts, "MPI_Alltoallv", "the receive count", &rc, &rd);
      check(MPI_Alltoallv(send, sc.data(), sd.data(), type, recv, rc.data(), rd.data(), type, data_),
            "MPI_Alltoallv");
    } else {
      alltoallv_pairwise(send, send_counts, recv, recv_counts, dtype);
    }
    // What must travel: the parts for (from) the other ranks.
    const WireVolume v = alltoallv_volume(send_counts, recv_counts, rank_, itemsize(dtype));
    wire().data(v.sent, v.received);
  }

  void reduce_scatter(const void* send, void* recv, const std::vector<size_t>& counts, DType dtype,
                      ReduceOp op) override {
    check_ranks(counts, "MPI_Reduce_scatter");
    if (fits_int(counts)) {
      const MPI_Datatype type = mpi_type(dtype);
      const MPI_Op mop = mpi_op(dtype, op);
      std::vector<int> c, d;
      to_counts(counts, "MPI_Reduce_scatter", "the count", &c, &d);
      const void* s = send == nullptr ? MPI_IN_PLACE : send;  // in place: the whole input is in recv
      check(MPI_Reduce_scatter(s, recv, c.data(), type, mop, data_), "MPI_Reduce_scatter");
    } else {
      reduce_scatter_pieces(send, recv, counts, dtype, op);
    }
    // The algorithm's volume: each other rank's part out, this rank's part in from each other rank.
    const WireVolume v = reduce_scatter_volume(counts, rank_, itemsize(dtype));
    wire().data(v.sent, v.received);
  }

  void sendrecv(const void* send, size_t send_bytes, int dest, void* recv, size_t recv_bytes,
                int source) override {
    exchange(send, send_bytes, dest, recv, recv_bytes, source);
    count_sendrecv(send_bytes, dest, recv_bytes, source);
  }

  void allgather_i64(const int64_t* mine, size_t n, int64_t* all) override {
    const int c = to_count(n, "MPI_Allgather", "the count");
    check(MPI_Allgather(mine, c, MPI_INT64_T, all, c, MPI_INT64_T, data_), "MPI_Allgather");
    count_allgather_i64(n);
  }

  void alltoall_i64(const int64_t* send, int64_t* recv) override {
    check(MPI_Alltoall(send, 1, MPI_INT64_T, recv, 1, MPI_INT64_T, data_), "MPI_Alltoall");
    const uint64_t others = 8 * static_cast<uint64_t>(size_ - 1);
    wire().control(others, others);
  }

  void barrier() override { check(MPI_Barrier(data_), "MPI_Barrier"); }

  std::unique_ptr<PendingOp> iallreduce_band(uint64_t* words, size_t n) override {
    const int c = to_count(n, "MPI_Iallreduce", "the count");
    auto op = std::make_unique<MpiPendingOp>();
    check(MPI_Iallreduce(MPI_IN_PLACE, words, c, MPI_UINT64_T, MPI_BAND, data_, &op->state().request),
          "MPI_Iallreduce");
    const WireVolume v = allreduce_volume(8 * static_cast<uint64_t>(n), size_);  // the algorithm's volume
    wire().control(v.sent, v.received);
    return op;
  }

  std::unique_ptr<PendingOp> iallgather_i64(const int64_t* mine, size_t n, int64_t* all) override {
    const int c = to_count(n, "MPI_Iallgather", "the count");
    auto op = std::make_unique<MpiPendingOp>();
    check(MPI_Iallgather(mine, c, MPI_INT64_T, all, c, MPI_INT64_T, data_, &op->state().request),
          "MPI_Iallgather");
    count_allgather_i64(n);
    return op;
  }

  std::unique_ptr<PendingOp> iallgatherv_bytes(const void* send, size_t n, void* recv,
                                               const std::vector<size_t>& counts) override {
    check_ranks(counts, "MPI_Iallgatherv");
    const int c = to_count(n, "MPI_Iallgatherv", "this rank's byte count");
    auto op = std::make_unique<MpiPendingOp>();
    MpiPendingOp::State& st = op->state();
    to_counts(counts, "MPI_Iallgatherv", "the byte count", &st.counts, &st.displs);
    check(MPI_Iallgatherv(send, c, MPI_BYTE, recv, st.counts.data(), st.displs.data(), MPI_BYTE, data_,
                          &st.request),
          "MPI_Iallgatherv");
    const WireVolume v = allgatherv_volume(counts, rank_, 1);  // the algorithm's volume
    wire().control(v.sent, v.received);
    return op;
  }

  void send_message(int dest, const std::string& bytes) override {
    reap_sends(/*throw_errors=*/true);
    const int n = to_count(bytes.size(), "MPI_Isend", "a control message");
    // A list, so that a buffer never moves while MPI may read it.
    outbox_.emplace_back();
    Outgoing& m = outbox_.back();
    m.bytes = bytes;
    const int rc = MPI_Isend(m.bytes.data(), n, MPI_BYTE, dest, kControlTag, control_, &m.request);
    if (rc != MPI_SUCCESS) {
      outbox_.pop_back();
      check(rc, "MPI_Isend");
    }
    if (dest != rank_) wire().control(static_cast<uint64_t>(n), 0);
  }

  bool poll_message(int* source, std::string* bytes) override {
    reap_sends(/*throw_errors=*/true);
    int flag = 0;
    MPI_Message message;
    MPI_Status status;
    check(MPI_Improbe(MPI_ANY_SOURCE, kControlTag, control_, &flag, &message, &status), "MPI_Improbe");
    if (!flag) return false;
    int n = 0;
    check(MPI_Get_count(&status, MPI_BYTE, &n), "MPI_Get_count");
    bytes->resize(static_cast<size_t>(n));
    check(MPI_Mrecv(&(*bytes)[0], n, MPI_BYTE, &message, MPI_STATUS_IGNORE), "MPI_Mrecv");
    *source = status.MPI_SOURCE;
    if (*source != rank_) wire().control(0, static_cast<uint64_t>(n));
    return true;
  }

  void flush_messages(double timeout_s) override {
    const auto deadline = Clock::now() + std::chrono::duration<double>(timeout_s);
    auto pause = std::chrono::microseconds(20);
    for (;;) {
      reap_sends(/*throw_errors=*/true);
      if (outbox_.empty() || Clock::now() >= deadline) return;
      // Test-then-sleep: a blocking wait would spin a core inside Open MPI.
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::microseconds(1000));
    }
  }

 private:
  struct Outgoing {
    std::string bytes;
    MPI_Request request = MPI_REQUEST_NULL;
  };

  // sendrecv without the wire counters.
  void exchange(const void* send, size_t send_bytes, int dest, void* recv, size_t recv_bytes, int source) {
    if (send_bytes <= kMaxPieceBytes && recv_bytes <= kMaxPieceBytes) {
      check(MPI_Sendrecv(send, static_cast<int>(send_bytes), MPI_BYTE, dest, kDataTag, recv,
                         static_cast<int>(recv_bytes), MPI_BYTE, source, kDataTag, data_, MPI_STATUS_IGNORE),
            "MPI_Sendrecv");
      return;
    }
    // Above 1 GiB: the same bytes in pieces of at most 1 GiB. Messages between two ranks on one tag
    // arrive in order, so the peer's pieces (cut by the same rule) match ours one by one.
    std::vector<MPI_Request> requests;
    try {
      for (size_t done = 0; done < recv_bytes;) {
        const size_t n = std::min(recv_bytes - done, kMaxPieceBytes);
        requests.push_back(MPI_REQUEST_NULL);
        check(MPI_Irecv(static_cast<char*>(recv) + done, static_cast<int>(n), MPI_BYTE, source, kDataTag, data_,
                        &requests.back()),
              "MPI_Irecv");
        done += n;
      }
      for (size_t done = 0; done < send_bytes;) {
        const size_t n = std::min(send_bytes - done, kMaxPieceBytes);
        requests.push_back(MPI_REQUEST_NULL);
        check(MPI_Isend(static_cast<const char*>(send) + done, static_cast<int>(n), MPI_BYTE, dest, kDataTag,
                        data_, &requests.back()),
              "MPI_Isend");
        done += n;
      }
    } catch (...) {
      // The buffers belong to the caller and die with this call: finish what was posted before throwing.
      MPI_Waitall(static_cast<int>(requests.size()), requests.data(), MPI_STATUSES_IGNORE);
      throw;
    }
    check(MPI_Waitall(static_cast<int>(requests.size()), requests.data(), MPI_STATUSES_IGNORE), "MPI_Waitall");
  }

  // MPI_Bcast of count elements in pieces that fit one call (every rank cuts the same pieces).
  void broadcast_pieces(void* buf, size_t count, DType dtype, int root) {
    const MPI_Datatype type = mpi_type(dtype);
    const size_t piece = piece_elements(dtype);
    for (size_t done = 0; done < count;) {
      const size_t n = std::min(count - done, piece);
      check(MPI_Bcast(element_at(buf, done, dtype), static_cast<int>(n), type, root, data_), "MPI_Bcast");
      done += n;
    }
  }

  // An alltoallv beyond MPI's int counts: in step k this rank sends its block for rank + k while it receives
  // the block of rank - k (exchange() cuts what is above 1 GiB), every rank in the same order.
  void alltoallv_pairwise(const void* send, const std::vector<size_t>& send_counts, void* recv,
                          const std::vector<size_t>& recv_counts, DType dtype) {
    const std::vector<size_t> sd = offsets_of(send_counts), rd = offsets_of(recv_counts);
    const size_t item = itemsize(dtype);
    copy_bytes(element_at(recv, rd[rank_], dtype), element_at(send, sd[rank_], dtype), send_counts[rank_] * item);
    for (int k = 1; k < size_; ++k) {
      const int dest = (rank_ + k) % size_, source = (rank_ - k + size_) % size_;
      exchange(element_at(send, sd[dest], dtype), send_counts[dest] * item, dest, element_at(recv, rd[source], dtype),
               recv_counts[source] * item, source);
    }
  }

  // A reduce-scatter beyond MPI's int counts (MPI_Reduce_scatter adds its counts up in an int): each rank's
  // part is reduced to it with MPI_Reduce, in pieces. In place (send null), each part is reduced where it
  // lies in recv, and this rank's moves to the front at the end (the parts of later roots are not touched
  // before their turn).
  void reduce_scatter_pieces(const void* send, void* recv, const std::vector<size_t>& counts, DType dtype,
                             ReduceOp op) {
    const MPI_Datatype type = mpi_type(dtype);
    const MPI_Op mop = mpi_op(dtype, op);
    const std::vector<size_t> displs = offsets_of(counts);
    const void* input = send != nullptr ? send : recv;
    const size_t piece = piece_elements(dtype);
    for (int r = 0; r < size_; ++r) {
      for (size_t done = 0; done < counts[r];) {
        const size_t n = std::min(counts[r] - done, piece);
        const void* s = element_at(input, displs[r] + done, dtype);
        void* dst = nullptr;
        if (r == rank_) {
          dst = element_at(recv, (send != nullptr ? 0 : displs[r]) + done, dtype);
          if (send == nullptr) s = MPI_IN_PLACE;
        }
        check(MPI_Reduce(s, dst, static_cast<int>(n), type, mop, r, data_), "MPI_Reduce");
        done += n;
      }
    }
    if (send == nullptr && displs[rank_] != 0) {
      std::memmove(recv, element_at(recv, displs[rank_], dtype), counts[rank_] * itemsize(dtype));
    }
  }

  // A point-to-point exchange moves what it says (a transfer to or from this rank itself stays in memory).
  void count_sendrecv(size_t send_bytes, int dest, size_t recv_bytes, int source) {
    wire().data(dest != rank_ ? send_bytes : 0, source != rank_ ? recv_bytes : 0);
  }

  // n words to each other rank, n from each (the algorithm's volume).
  void count_allgather_i64(size_t n) {
    const uint64_t others = 8 * static_cast<uint64_t>(n) * static_cast<uint64_t>(size_ - 1);
    wire().control(others, others);
  }

  void check_ranks(const std::vector<size_t>& counts, const char* call) const {
    if (counts.size() != static_cast<size_t>(size_)) {
      throw TransportError(std::string(call) + ": " + std::to_string(counts.size()) + " counts for " +
                           std::to_string(size_) + " ranks");
    }
  }

  // Drops the sends that have completed. A failed send is dropped too (and reported once).
  void reap_sends(bool throw_errors) {
    std::string error;
    for (auto it = outbox_.begin(); it != outbox_.end();) {
      int flag = 0;
      const int rc = MPI_Test(&it->request, &flag, MPI_STATUS_IGNORE);
      if (rc != MPI_SUCCESS && error.empty()) error = "MPI_Test failed: " + mpi_error_string(rc);
      it = (flag || rc != MPI_SUCCESS) ? outbox_.erase(it) : std::next(it);
    }
    if (!error.empty() && throw_errors) throw TransportError(error);
  }

  void free_comms() noexcept {
    if (control_ != MPI_COMM_NULL) MPI_Comm_free(&control_);
    if (data_ != MPI_COMM_NULL) MPI_Comm_free(&data_);
  }

  MPI_Comm data_ = MPI_COMM_NULL;
  MPI_Comm control_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 0;
  std::list<Outgoing> outbox_;
};

// mpi4py's Comm.handle is the MPI_Comm's value as a Python int: a pointer for Open MPI (and the MPI 5
// standard ABI), an int for MPICH. A template, so that only the matching branch is compiled.
template <typename C>
C comm_from_handle(intptr_t handle) {
  static_assert(sizeof(C) <= sizeof(intptr_t), "an MPI_Comm must fit in an intptr_t");
  if constexpr (std::is_pointer_v<C>) {
    return reinterpret_cast<C>(handle);
  } else if constexpr (std::is_integral_v<C>) {
    return static_cast<C>(handle);
  } else {
    C c;
    std::memcpy(&c, &handle, sizeof c);
    return c;
  }
}

}  // namespace

std::unique_ptr<Comm> make_mpi_comm(intptr_t handle) {
  check_library();
  const MPI_Comm comm = comm_from_handle<MPI_Comm>(handle);
  if (comm == MPI_COMM_NULL) throw TransportError("make_mpi_comm: the communicator is MPI_COMM_NULL");
  return std::make_unique<MpiComm>(comm);
}

std::string mpi_library_version() {
  char buf[MPI_MAX_LIBRARY_VERSION_STRING];
  int len = 0;
  check(MPI_Get_library_version(buf, &len), "MPI_Get_library_version");
  return std::string(buf, static_cast<size_t>(len > 0 ? len : 0));
}

}  // namespace perseus
