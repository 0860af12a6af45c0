// The MPI transport's point-to-point traffic (see transport_mpi.h): sendrecv, the step of the ring,
// hierarchical and Adasum algorithms on the data communicator, and the control messages (wake, stall probe
// and answer, abort, shutdown) on the control communicator.
//
// sendrecv is blocking and pairs with the peer's matching call; above 1 GiB it moves in pieces, cut the
// same way on both sides. Control messages never block the sender: each is an MPI_Isend whose buffer stays
// in the outbox until MPI is done with it. Every failure throws TransportError.
#include "transport_mpi.h"

#include <algorithm>
#include <chrono>
#include <thread>

namespace perseus {
namespace mpi_transport {

void MpiComm::sendrecv(const void* send, size_t send_bytes, int dest, void* recv, size_t recv_bytes,
                       int source) {
  exchange(send, send_bytes, dest, recv, recv_bytes, source);
  count_sendrecv(send_bytes, dest, recv_bytes, source);
}

void MpiComm::send_message(int dest, const std::string& bytes) {
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

bool MpiComm::poll_message(int* source, std::string* bytes) {
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

void MpiComm::flush_messages(double timeout_s) {
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

void MpiComm::exchange(const void* send, size_t send_bytes, int dest, void* recv, size_t recv_bytes,
                       int source) {
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

void MpiComm::count_sendrecv(size_t send_bytes, int dest, size_t recv_bytes, int source) {
  wire().data(dest != rank_ ? send_bytes : 0, source != rank_ ? recv_bytes : 0);
}

void MpiComm::reap_sends(bool throw_errors) {
  std::string error;
  for (auto it = outbox_.begin(); it != outbox_.end();) {
    int flag = 0;
    const int rc = MPI_Test(&it->request, &flag, MPI_STATUS_IGNORE);
    if (rc != MPI_SUCCESS && error.empty()) error = "MPI_Test failed: " + mpi_error_string(rc);
    it = (flag || rc != MPI_SUCCESS) ? outbox_.erase(it) : std::next(it);
  }
  if (!error.empty() && throw_errors) throw TransportError(error);
}

}  // namespace mpi_transport
}  // namespace perseus
