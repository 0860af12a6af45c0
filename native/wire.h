// Bytes on the wire: what this rank sends to and receives from the other ranks of a process set.
//
// Every Comm (transport.h) counts its traffic into a WireCounters that its dup() and split() communicators
// share, and a channel's Links count into the counters of the Comm they were built over: the control Comm
// of a process set, the channels' duplicates, their local and cross splits and their TCP links all add to
// one object per set. Two kinds are kept apart:
//  * data: the payload of collectives (tensor bytes of allreduce, allgather, broadcast, alltoall,
//    reducescatter, and the point-to-point steps of the ring and hierarchical algorithms);
//  * control: everything else the engine sends: negotiation rounds, control messages (wake, stall probe,
//    abort, shutdown), the size exchanges that precede allgather and alltoall, host layout and link
//    address exchanges, the links' length headers and handshakes.
//
// Point-to-point transfers (sendrecv over MPI or over links, control messages) are counted as they are
// moved. A collective that the transport hands to the MPI library whole (MPI_Allreduce, MPI_Allgatherv, ...)
// does not say what each rank sent; it is counted as the volume of the textbook algorithm for it (the
// functions below), which the loopback transport uses too. Bytes MPI adds of its own (headers, its
// communicator management) and TCP/IP overhead are not counted.
//
// Counting is one relaxed atomic add per transfer or collective: no lock, no allocation.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace perseus {

// A reading of the counters (cumulative since the set was created).
struct WireBytes {
  uint64_t sent = 0, received = 0, control_sent = 0, control_received = 0;
};

class WireCounters {
 public:
  void data(uint64_t sent, uint64_t received) noexcept {
    if (sent != 0) sent_.fetch_add(sent, std::memory_order_relaxed);
    if (received != 0) received_.fetch_add(received, std::memory_order_relaxed);
  }
  void control(uint64_t sent, uint64_t received) noexcept {
    if (sent != 0) control_sent_.fetch_add(sent, std::memory_order_relaxed);
    if (received != 0) control_received_.fetch_add(received, std::memory_order_relaxed);
  }
  WireBytes read() const noexcept {
    WireBytes w;
    w.sent = sent_.load(std::memory_order_relaxed);
    w.received = received_.load(std::memory_order_relaxed);
    w.control_sent = control_sent_.load(std::memory_order_relaxed);
    w.control_received = control_received_.load(std::memory_order_relaxed);
    return w;
  }

 private:
  // Channel threads add data, the engine thread adds control: kept on different cache lines.
  std::atomic<uint64_t> sent_{0}, received_{0};
  char pad_[64] = {};
  std::atomic<uint64_t> control_sent_{0}, control_received_{0};
};

// -- the volume of a collective for one rank, as the textbook algorithm moves it ---------------------------
// (For collectives whose per-peer traffic the transport does not see; counts in bytes.)
struct WireVolume {
  uint64_t sent = 0, received = 0;
};

// Ring all-reduce (reduce-scatter then allgather): 2 (P-1)/P of the buffer out of every rank, and as much in.
inline WireVolume allreduce_volume(uint64_t bytes, int size) {
  if (size <= 1) return {};
  const uint64_t p = static_cast<uint64_t>(size), k = 2 * (p - 1);
  const uint64_t v = bytes / p * k + bytes % p * k / p;  // 2 (P-1) bytes / P without overflow
  return {v, v};
}

// Allgather: this rank's block to each of the P-1 others; every other rank's block in. `counts` in elements.
inline WireVolume allgatherv_volume(const std::vector<size_t>& counts, int rank, size_t item) {
  WireVolume w;
  if (counts.size() <= 1 || rank < 0 || static_cast<size_t>(rank) >= counts.size()) return w;
  w.sent = static_cast<uint64_t>(counts[rank]) * item * (counts.size() - 1);
  for (size_t r = 0; r < counts.size(); ++r)
    if (r != static_cast<size_t>(rank)) w.received += static_cast<uint64_t>(counts[r]) * item;
  return w;
}

// Broadcast: the root sends the buffer to each of the P-1 others; every other rank receives it once.
inline WireVolume broadcast_volume(uint64_t bytes, int size, int rank, int root) {
  if (size <= 1) return {};
  if (rank == root) return {bytes * static_cast<uint64_t>(size - 1), 0};
  return {0, bytes};
}

// Alltoall: what goes to (comes from) the other ranks; this rank's own part stays in memory.
inline WireVolume alltoallv_volume(const std::vector<size_t>& send_counts, const std::vector<size_t>& recv_counts,
                                   int rank, size_t item) {
  WireVolume w;
  for (size_t r = 0; r < send_counts.size(); ++r)
    if (r != static_cast<size_t>(rank)) w.sent += static_cast<uint64_t>(send_counts[r]) * item;
  for (size_t r = 0; r < recv_counts.size(); ++r)
    if (r != static_cast<size_t>(rank)) w.received += static_cast<uint64_t>(recv_counts[r]) * item;
  return w;
}

// Reduce-scatter: each other rank's part of this rank's input goes to it; this rank's part comes in from
// each of the P-1 others.
inline WireVolume reduce_scatter_volume(const std::vector<size_t>& counts, int rank, size_t item) {
  WireVolume w;
  if (counts.size() <= 1 || rank < 0 || static_cast<size_t>(rank) >= counts.size()) return w;
  for (size_t r = 0; r < counts.size(); ++r)
    if (r != static_cast<size_t>(rank)) w.sent += static_cast<uint64_t>(counts[r]) * item;
  w.received = static_cast<uint64_t>(counts[rank]) * item * (counts.size() - 1);
  return w;
}

}  // namespace perseus
