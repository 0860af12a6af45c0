// The MPI transport's own declarations, shared by its files (nothing outside the transport includes this;
// the rest of the core reaches it through transport.h's make_mpi_comm):
//   transport_mpi.cc              the library check, errors, the communicator's lifetime, make_mpi_comm
//   transport_mpi_p2p.cc          point-to-point: sendrecv (ring steps) and control messages
//   transport_mpi_collectives.cc  the collectives, blocking and non-blocking, and their fallbacks past 2^31
//   transport_mpi_types.cc        the MPI datatype and reduction of every dtype, float16/bfloat16 included
//
// Every MPI call checks its return code and throws TransportError (check() below).
#pragma once

#include <mpi.h>

#include <climits>
#include <cstddef>
#include <list>
#include <memory>
#include <string>
#include <vector>

#include "transport.h"

namespace perseus {
namespace mpi_transport {

constexpr int kDataTag = 17;     // sendrecv on the data communicator (ring steps)
constexpr int kControlTag = 7;   // control messages on the control communicator
constexpr size_t kMaxCount = INT_MAX;
// The most one MPI call moves: an int count of elements, and at most 1 GiB, so that no byte count inside the
// library (an int in places) can overflow either.
constexpr size_t kMaxPieceBytes = size_t(1) << 30;

// -- errors (transport_mpi.cc) -------------------------------------------------------------------------

std::string mpi_error_string(int code);

inline void check(int rc, const char* call) {
  if (rc != MPI_SUCCESS) throw TransportError(std::string(call) + " failed: " + mpi_error_string(rc));
}

// MPI counts and displacements are C ints.
inline int to_count(size_t n, const char* call, const std::string& what) {
  if (n > kMaxCount) {
    throw TransportError(std::string(call) + ": " + what + " is " + std::to_string(n) +
                         " elements, above MPI's 2^31-1 element limit");
  }
  return static_cast<int>(n);
}

// Counts (and their running offsets) for a v-collective, checked against the int limit.
void to_counts(const std::vector<size_t>& counts, const char* call, const char* what, std::vector<int>* out,
               std::vector<int>* displs);

// Whether MPI_Finalize has run (or cannot be asked): nothing may be called or freed then.
bool mpi_finalized();

// Keeps `item` alive for the rest of the process: what MPI may still read, or a request of a non-blocking
// collective, dropped before it completed (abnormal shutdown only, so the leak is bounded).
void abandon(std::shared_ptr<void> item);

// -- datatypes and reductions (transport_mpi_types.cc) -------------------------------------------------

// The MPI datatype of a dtype; float16 and bfloat16 are types of the transport's own.
MPI_Datatype mpi_type(DType dtype);
// The MPI reduction of op on dtype: bool with OR (SUM/MAX/AVERAGE) or AND (MIN/PRODUCT), the 16-bit floats
// with user-defined ops over the native kernels. Throws TransportError for ADASUM.
MPI_Op mpi_op(DType dtype, ReduceOp op);

// -- the communicator ----------------------------------------------------------------------------------

// Owns two duplicates of the communicator it was built from: one for collectives and ring traffic, one for
// control messages, so that a control message can never match a data receive.
class MpiComm final : public Comm {
 public:
  explicit MpiComm(MPI_Comm parent);
  ~MpiComm() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::unique_ptr<Comm> dup() override;
  std::unique_ptr<Comm> split(int color, int key) override;

  // transport_mpi_collectives.cc
  void allreduce(const void* send, void* recv, size_t count, DType dtype, ReduceOp op) override;
  std::unique_ptr<PendingOp> iallreduce(const void* send, void* recv, size_t count, DType dtype,
                                        ReduceOp op) override;
  void allgatherv(const void* send, void* recv, const std::vector<size_t>& counts, DType dtype) override;
  void broadcast(void* buf, size_t count, DType dtype, int root) override;
  void alltoallv(const void* send, const std::vector<size_t>& send_counts, void* recv,
                 const std::vector<size_t>& recv_counts, DType dtype, bool beyond_int) override;
  void reduce_scatter(const void* send, void* recv, const std::vector<size_t>& counts, DType dtype,
                      ReduceOp op) override;
  void allgather_i64(const int64_t* mine, size_t n, int64_t* all) override;
  void alltoall_i64(const int64_t* send, int64_t* recv) override;
  void barrier() override;
  std::unique_ptr<PendingOp> iallreduce_band(uint64_t* words, size_t n) override;
  std::unique_ptr<PendingOp> iallgather_i64(const int64_t* mine, size_t n, int64_t* all) override;
  std::unique_ptr<PendingOp> iallgatherv_bytes(const void* send, size_t n, void* recv,
                                               const std::vector<size_t>& counts) override;

  // transport_mpi_p2p.cc
  void sendrecv(const void* send, size_t send_bytes, int dest, void* recv, size_t recv_bytes,
                int source) override;
  void send_message(int dest, const std::string& bytes) override;
  bool poll_message(int* source, std::string* bytes) override;
  void flush_messages(double timeout_s) override;

 private:
  struct Outgoing {
    std::string bytes;
    MPI_Request request = MPI_REQUEST_NULL;
  };

  // transport_mpi_p2p.cc
  // sendrecv without the wire counters.
  void exchange(const void* send, size_t send_bytes, int dest, void* recv, size_t recv_bytes, int source);
  // A point-to-point exchange moves what it says (a transfer to or from this rank itself stays in memory).
  void count_sendrecv(size_t send_bytes, int dest, size_t recv_bytes, int source);
  // Drops the sends that have completed. A failed send is dropped too (and reported once).
  void reap_sends(bool throw_errors);

  // transport_mpi_collectives.cc
  void broadcast_pieces(void* buf, size_t count, DType dtype, int root);
  void alltoallv_pairwise(const void* send, const std::vector<size_t>& send_counts, void* recv,
                          const std::vector<size_t>& recv_counts, DType dtype);
  void reduce_scatter_pieces(const void* send, void* recv, const std::vector<size_t>& counts, DType dtype,
                             ReduceOp op);
  void count_allgather_i64(size_t n);
  void check_ranks(const std::vector<size_t>& counts, const char* call) const;

  // transport_mpi.cc
  void free_comms() noexcept;

  MPI_Comm data_ = MPI_COMM_NULL;
  MPI_Comm control_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 0;
  std::list<Outgoing> outbox_;
};

}  // namespace mpi_transport
}  // namespace perseus
