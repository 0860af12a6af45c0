// The MPI transport's collectives (see transport_mpi.h): the data plane (allreduce, allgatherv, broadcast,
// alltoallv, reduce-scatter, the int64 exchanges, barrier) and the engine's non-blocking negotiation
// collectives. Every rank of the communicator must call each one, in the same order and with matching
// counts; each throws TransportError when MPI fails.
//
// MPI's own collectives run wherever the counts fit its ints. Past that, each takes a path every rank
// chooses alike: allreduce and broadcast in pieces, allgatherv as a broadcast per rank, alltoallv as
// pairwise exchanges, reduce-scatter as a reduce per rank. They count the textbook algorithm's volume on
// the wire (wire.h), since MPI does not say what it sent.
#include "transport_mpi.h"

#include <algorithm>
#include <cstring>

#include "buffers.h"
#include "recycled.h"

namespace perseus {
namespace mpi_transport {
namespace {

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

}  // namespace

// -- data plane ----------------------------------------------------------------------------------------

void MpiComm::allreduce(const void* send, void* recv, size_t count, DType dtype, ReduceOp op) {
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

std::unique_ptr<PendingOp> MpiComm::iallreduce(const void* send, void* recv, size_t count, DType dtype,
                                               ReduceOp op) {
  const int c = to_count(count, "MPI_Iallreduce", "the count");
  auto pending = std::make_unique<MpiPendingOp>();
  const void* s = send == nullptr || send == recv ? MPI_IN_PLACE : send;
  check(MPI_Iallreduce(s, recv, c, mpi_type(dtype), mpi_op(dtype, op), data_, &pending->state().request),
        "MPI_Iallreduce");
  const WireVolume v = allreduce_volume(static_cast<uint64_t>(count) * itemsize(dtype), size_);
  wire().data(v.sent, v.received);
  return pending;
}

void MpiComm::allgatherv(const void* send, void* recv, const std::vector<size_t>& counts, DType dtype) {
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

void MpiComm::broadcast(void* buf, size_t count, DType dtype, int root) {
  broadcast_pieces(buf, count, dtype, root);
  const size_t item = itemsize(dtype);
  // The algorithm's volume: the root sends the buffer to each other rank, which receives it once.
  const WireVolume v = broadcast_volume(static_cast<uint64_t>(count) * item, size_, rank_, root);
  wire().data(v.sent, v.received);
}

void MpiComm::alltoallv(const void* send, const std::vector<size_t>& send_counts, void* recv,
                        const std::vector<size_t>& recv_counts, DType dtype, bool beyond_int) {
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

void MpiComm::reduce_scatter(const void* send, void* recv, const std::vector<size_t>& counts, DType dtype,
                             ReduceOp op) {
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

void MpiComm::allgather_i64(const int64_t* mine, size_t n, int64_t* all) {
  const int c = to_count(n, "MPI_Allgather", "the count");
  check(MPI_Allgather(mine, c, MPI_INT64_T, all, c, MPI_INT64_T, data_), "MPI_Allgather");
  count_allgather_i64(n);
}

void MpiComm::alltoall_i64(const int64_t* send, int64_t* recv) {
  check(MPI_Alltoall(send, 1, MPI_INT64_T, recv, 1, MPI_INT64_T, data_), "MPI_Alltoall");
  const uint64_t others = 8 * static_cast<uint64_t>(size_ - 1);
  wire().control(others, others);
}

void MpiComm::barrier() { check(MPI_Barrier(data_), "MPI_Barrier"); }

// -- negotiation (non-blocking) ------------------------------------------------------------------------

std::unique_ptr<PendingOp> MpiComm::iallreduce_band(uint64_t* words, size_t n) {
  const int c = to_count(n, "MPI_Iallreduce", "the count");
  auto op = std::make_unique<MpiPendingOp>();
  check(MPI_Iallreduce(MPI_IN_PLACE, words, c, MPI_UINT64_T, MPI_BAND, data_, &op->state().request),
        "MPI_Iallreduce");
  const WireVolume v = allreduce_volume(8 * static_cast<uint64_t>(n), size_);  // the algorithm's volume
  wire().control(v.sent, v.received);
  return op;
}

std::unique_ptr<PendingOp> MpiComm::iallgather_i64(const int64_t* mine, size_t n, int64_t* all) {
  const int c = to_count(n, "MPI_Iallgather", "the count");
  auto op = std::make_unique<MpiPendingOp>();
  check(MPI_Iallgather(mine, c, MPI_INT64_T, all, c, MPI_INT64_T, data_, &op->state().request),
        "MPI_Iallgather");
  count_allgather_i64(n);
  return op;
}

std::unique_ptr<PendingOp> MpiComm::iallgatherv_bytes(const void* send, size_t n, void* recv,
                                                      const std::vector<size_t>& counts) {
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

// -- beyond MPI's int counts ---------------------------------------------------------------------------

// MPI_Bcast of count elements in pieces that fit one call (every rank cuts the same pieces).
void MpiComm::broadcast_pieces(void* buf, size_t count, DType dtype, int root) {
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
void MpiComm::alltoallv_pairwise(const void* send, const std::vector<size_t>& send_counts, void* recv,
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
void MpiComm::reduce_scatter_pieces(const void* send, void* recv, const std::vector<size_t>& counts, DType dtype,
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

// n words to each other rank, n from each (the algorithm's volume).
void MpiComm::count_allgather_i64(size_t n) {
  const uint64_t others = 8 * static_cast<uint64_t>(n) * static_cast<uint64_t>(size_ - 1);
  wire().control(others, others);
}

void MpiComm::check_ranks(const std::vector<size_t>& counts, const char* call) const {
  if (counts.size() != static_cast<size_t>(size_)) {
    throw TransportError(std::string(call) + ": " + std::to_string(counts.size()) + " counts for " +
                         std::to_string(size_) + " ranks");
  }
}

}  // namespace mpi_transport
}  // namespace perseus
