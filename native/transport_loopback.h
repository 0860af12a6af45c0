// An in-process transport for unit tests: the ranks of a "world" are threads of one process, so the
// engine's negotiation, fusion and channels can be exercised without mpirun. Semantics follow MPI: every
// communicator (the original and each dup()) has its own message space, collectives on a communicator
// match by call order, sendrecv is FIFO per (communicator, source, destination).
//
// It is stricter than MPI where that finds bugs sooner: a collective completes only once every rank has
// entered it, and ranks that call different collectives (or the same one with different counts, dtype,
// op or root) at the same position all get a TransportError instead of undefined behaviour.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "transport.h"

namespace perseus {

class LoopbackWorld;  // shared state of n in-process ranks

std::shared_ptr<LoopbackWorld> make_loopback_world(int size);

// The Comm of `rank` in `world`. Each rank-thread creates its own; the k-th call for rank r pairs with the
// k-th call for rank s. dup() is a blocking collective on its parent, as MPI_Comm_dup, and dup number k of
// rank r's comm X pairs with dup number k of rank s's comm X.
std::unique_ptr<Comm> make_loopback_comm(const std::shared_ptr<LoopbackWorld>& world, int rank);

// Fail every blocked and future operation of the world with TransportError(message): tests use it to
// simulate a dead peer. The first message wins.
void loopback_world_fail(const std::shared_ptr<LoopbackWorld>& world, const std::string& message);

// Debug counters, so tests can check that nothing grows without bound.
struct LoopbackStats {
  size_t comms = 0;     // communicators some rank still holds (or has not created yet)
  size_t slots = 0;     // collectives that some rank has not finished with
  size_t messages = 0;  // queued sendrecv payloads and control messages
};
LoopbackStats loopback_world_stats(const std::shared_ptr<LoopbackWorld>& world);

}  // namespace perseus
