// The transport boundary. Negotiation, fusion and channels talk to other ranks only through `Comm` (and
// the algorithms of a channel through `PointToPoint`, which a channel's own TCP Links implement too: links.h);
// MPI (transport_mpi.cc) and an in-process loopback for tests (transport_loopback.cc) implement Comm. Device
// memory never passes here: the framework's launcher moves it (device_channel.h).
//
// One Comm is one communicator among the ranks of a process set. Each instance is used by one thread at
// a time (the engine thread owns the negotiation Comm of a set, each channel thread its own dup).
// Blocking calls return when this rank's part is done; every failure throws TransportError.
//
// Every implementation counts the bytes it moves into wire_counters() (see wire.h): the data-plane calls
// as data, the rest (negotiation, control messages, allgather_i64 / alltoall_i64 exchanges) as control.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "common.h"
#include "wire.h"

namespace perseus {

// A non-blocking operation in flight. test() returns true once it has completed (and keeps returning true).
class PendingOp {
 public:
  virtual ~PendingOp() = default;
  virtual bool test() = 0;
};

// Point-to-point transfers between the ranks of a group: what the ring, hierarchical and Adasum algorithms
// (ring.h, hierarchical.h, adasum.h) are built from. A Comm's own messages (MPI: shared memory on one host)
// and a channel's Links (its own TCP connections between hosts: links.h) both provide them.
class PointToPoint {
 public:
  virtual ~PointToPoint() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Send send_bytes to dest while receiving recv_bytes from source (blocking; throws TransportError).
  virtual void sendrecv(const void* send, size_t send_bytes, int dest, void* recv, size_t recv_bytes,
                        int source) = 0;
};

class Comm : public PointToPoint {
 public:
  // A new communicator over the same ranks with its own message space. Collective.
  virtual std::unique_ptr<Comm> dup() = 0;
  // A new communicator over the ranks that pass the same color, ranked by (key, rank). Collective.
  virtual std::unique_ptr<Comm> split(int color, int key) = 0;

  // Where this communicator counts its traffic. Every Comm starts with counters of its own; dup() and
  // split() give the new communicator the same object, so a process set's Comm and everything made from it
  // count together. Not thread-safe to replace while another thread uses the Comm.
  const std::shared_ptr<WireCounters>& wire_counters() const { return wire_; }
  void set_wire_counters(std::shared_ptr<WireCounters> counters) {
    if (counters) wire_ = std::move(counters);
  }

  // -- data plane (blocking; counts are in elements of `dtype`) --------------------------------------
  // send == nullptr: in place on recv. Reduces every dtype, float16/bfloat16 included (in float32, rounded
  // once per combine), bool with OR for SUM/MAX/AVERAGE and AND for MIN/PRODUCT. op is never AVERAGE/ADASUM.
  virtual void allreduce(const void* send, void* recv, size_t count, DType dtype, ReduceOp op) = 0;
  // The same all-reduce, non-blocking, for a buffer of at most 2^31 - 1 elements (the engine thread moves
  // small units with it: engine_lane.h). Both buffers stay valid and untouched until test() is true.
  virtual std::unique_ptr<PendingOp> iallreduce(const void* send, void* recv, size_t count, DType dtype,
                                                ReduceOp op) = 0;
  // recv gets counts[r] elements from rank r, concatenated in rank order.
  virtual void allgatherv(const void* send, void* recv, const std::vector<size_t>& counts, DType dtype) = 0;
  virtual void broadcast(void* buf, size_t count, DType dtype, int root) = 0;
  // beyond_int: whether any rank's send or receive counts add up past 2^31 - 1 elements (the caller knows
  // every rank's counts); every rank passes the same value, so all take the same path.
  virtual void alltoallv(const void* send, const std::vector<size_t>& send_counts, void* recv,
                         const std::vector<size_t>& recv_counts, DType dtype, bool beyond_int) = 0;
  // Reduce send (sum of counts elements) across ranks; this rank receives counts[rank] elements.
  virtual void reduce_scatter(const void* send, void* recv, const std::vector<size_t>& counts, DType dtype,
                              ReduceOp op) = 0;
  // all[r * n + i] = rank r's mine[i].
  virtual void allgather_i64(const int64_t* mine, size_t n, int64_t* all) = 0;
  // One value to and from every rank.
  virtual void alltoall_i64(const int64_t* send, int64_t* recv) = 0;
  virtual void barrier() = 0;

  // -- negotiation (non-blocking, engine thread) ------------------------------------------------------
  // Bitwise AND of n words across ranks, in place. `words` must stay valid until test() is true.
  virtual std::unique_ptr<PendingOp> iallreduce_band(uint64_t* words, size_t n) = 0;
  // all[r * n + i] = rank r's mine[i]; both must stay valid until test() is true.
  virtual std::unique_ptr<PendingOp> iallgather_i64(const int64_t* mine, size_t n, int64_t* all) = 0;
  // recv gets counts[r] bytes from rank r, concatenated; buffers stay valid until test() is true.
  virtual std::unique_ptr<PendingOp> iallgatherv_bytes(const void* send, size_t n, void* recv,
                                                       const std::vector<size_t>& counts) = 0;

  // -- control messages (engine thread; rare: wake, stall probe and answer, abort, shutdown) ----------
  virtual void send_message(int dest, const std::string& bytes) = 0;  // never blocks
  virtual bool poll_message(int* source, std::string* bytes) = 0;     // false when nothing has arrived
  // Wait up to timeout_s for sent messages to leave this rank.
  virtual void flush_messages(double timeout_s) = 0;

 protected:
  WireCounters& wire() const { return *wire_; }

 private:
  std::shared_ptr<WireCounters> wire_ = std::make_shared<WireCounters>();
};

// Build a Comm over an MPI communicator given as its handle value (mpi4py's Comm.handle). The Comm owns a
// duplicate of it; the given communicator is not freed.
std::unique_ptr<Comm> make_mpi_comm(intptr_t handle);
// The MPI library's version string (to check at import that it matches the one this core was built with).
std::string mpi_library_version();

}  // namespace perseus
