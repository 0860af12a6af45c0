// The loopback transport's collectives (see transport_loopback_state.h): the data plane and the engine's
// non-blocking negotiation collectives, each a contribution of this rank to the communicator's next slot.
// Every rank of the communicator must call the same collective, in the same order, with the same counts,
// dtype, op and root: a mismatch, or a rank's misuse (a bad dtype or op, wrong counts, a null buffer),
// raises TransportError on every rank instead of hanging. Each counts the volume the MPI transport counts
// for it (wire.h).
#include "transport_loopback_state.h"

#include <cstring>

#include "buffers.h"
#include "kernels.h"

namespace perseus {
namespace loopback_transport {

void LoopbackComm::allreduce(const void* send, void* recv, size_t count, DType dtype, ReduceOp op) {
  Contribution c = reduction(Kind::ALLREDUCE, dtype, op);
  c.count = count;
  c.call = "allreduce(count=" + std::to_string(count) + ", " + c.call + ")";
  if (c.error.empty()) c.data = bytes_of(send ? send : recv, count * itemsize(dtype), &c.error);
  run(std::move(c), [recv](const Slot& s) { copy_bytes(recv, s.result.data(), s.result.size()); });
  const WireVolume v = allreduce_volume(static_cast<uint64_t>(count) * itemsize(dtype), size_);
  wire().data(v.sent, v.received);
}

std::unique_ptr<PendingOp> LoopbackComm::iallreduce(const void* send, void* recv, size_t count, DType dtype,
                                                    ReduceOp op) {
  Contribution c = reduction(Kind::ALLREDUCE, dtype, op);
  c.count = count;
  c.call = "iallreduce(count=" + std::to_string(count) + ", " + c.call + ")";
  if (c.error.empty()) c.data = bytes_of(send ? send : recv, count * itemsize(dtype), &c.error);
  auto pending = start(std::move(c), [recv](const Slot& s) { copy_bytes(recv, s.result.data(), s.result.size()); });
  const WireVolume v = allreduce_volume(static_cast<uint64_t>(count) * itemsize(dtype), size_);
  wire().data(v.sent, v.received);
  return pending;
}

void LoopbackComm::allgatherv(const void* send, void* recv, const std::vector<size_t>& counts, DType dtype) {
  Contribution c;
  c.kind = Kind::ALLGATHERV;
  c.call = "allgatherv(counts=" + counts_text(counts) + ", dtype=" + dtype_text(dtype) + ")";
  if (!valid_dtype(dtype)) c.error = "invalid dtype";
  else if (!check_counts(counts, &c.error)) {}
  else c.data = bytes_of(send, counts[rank_] * itemsize(dtype), &c.error);
  run(std::move(c), [recv](const Slot& s) { gather(s, static_cast<char*>(recv)); });
  const WireVolume v = allgatherv_volume(counts, rank_, itemsize(dtype));
  wire().data(v.sent, v.received);
}

void LoopbackComm::broadcast(void* buf, size_t count, DType dtype, int root) {
  Contribution c;
  c.kind = Kind::BROADCAST;
  c.call = "broadcast(count=" + std::to_string(count) + ", dtype=" + dtype_text(dtype) +
           ", root=" + std::to_string(root) + ")";
  if (!valid_dtype(dtype)) c.error = "invalid dtype";
  else if (root < 0 || root >= size()) c.error = "root " + std::to_string(root) + " out of range";
  else if (root == rank_) c.data = bytes_of(buf, count * itemsize(dtype), &c.error);
  const int me = rank_;
  run(std::move(c), [buf, root, me](const Slot& s) {
    if (me != root) copy_bytes(buf, s.data[root].data(), s.data[root].size());
  });
  const WireVolume v = broadcast_volume(static_cast<uint64_t>(count) * itemsize(dtype), size_, rank_, root);
  wire().data(v.sent, v.received);
}

void LoopbackComm::alltoallv(const void* send, const std::vector<size_t>& send_counts, void* recv,
                             const std::vector<size_t>& recv_counts, DType dtype, bool /*beyond_int*/) {
  Contribution c;
  c.kind = Kind::ALLTOALLV;
  c.call = "alltoallv(dtype=" + dtype_text(dtype) + ")";  // counts are checked pairwise on completion
  if (!valid_dtype(dtype)) c.error = "invalid dtype";
  else if (!check_counts(send_counts, &c.error) || !check_counts(recv_counts, &c.error)) {}
  else {
    c.data = bytes_of(send, sum_of(send_counts, send_counts.size()) * itemsize(dtype), &c.error);
    c.counts = send_counts;
    c.counts.insert(c.counts.end(), recv_counts.begin(), recv_counts.end());
  }
  const int me = rank_;
  run(std::move(c), [recv, dtype, me](const Slot& s) {
    const size_t isz = itemsize(dtype);
    const int n = static_cast<int>(s.data.size());
    char* out = static_cast<char*>(recv);
    for (int src = 0; src < n; ++src) {
      const std::vector<size_t>& sc = s.counts[src];
      size_t n_bytes = sc[me] * isz;
      copy_bytes(out, s.data[src].data() + sum_of(sc, me) * isz, n_bytes);
      out += n_bytes;
    }
  });
  const WireVolume v = alltoallv_volume(send_counts, recv_counts, rank_, itemsize(dtype));
  wire().data(v.sent, v.received);
}

void LoopbackComm::reduce_scatter(const void* send, void* recv, const std::vector<size_t>& counts, DType dtype,
                                  ReduceOp op) {
  Contribution c = reduction(Kind::REDUCE_SCATTER, dtype, op);
  c.call = "reduce_scatter(counts=" + counts_text(counts) + ", " + c.call + ")";
  if (c.error.empty() && check_counts(counts, &c.error)) {
    c.count = sum_of(counts, counts.size());
    c.data = bytes_of(send, c.count * itemsize(dtype), &c.error);
  }
  const int me = rank_;
  run(std::move(c), [recv, counts, dtype, me](const Slot& s) {
    const size_t isz = itemsize(dtype);
    copy_bytes(recv, s.result.data() + sum_of(counts, me) * isz, counts[me] * isz);
  });
  const WireVolume v = reduce_scatter_volume(counts, rank_, itemsize(dtype));
  wire().data(v.sent, v.received);
}

void LoopbackComm::allgather_i64(const int64_t* mine, size_t n, int64_t* all) {
  Contribution c;
  c.kind = Kind::ALLGATHER_I64;
  c.call = "allgather_i64(n=" + std::to_string(n) + ")";
  c.data = bytes_of(mine, n * 8, &c.error);
  run(std::move(c), [all](const Slot& s) { gather(s, reinterpret_cast<char*>(all)); });
  count_allgather_i64(n);
}

void LoopbackComm::alltoall_i64(const int64_t* send, int64_t* recv) {
  Contribution c;
  c.kind = Kind::ALLTOALL_I64;
  c.call = "alltoall_i64()";
  c.data = bytes_of(send, size() * 8, &c.error);
  const int me = rank_;
  run(std::move(c), [recv, me](const Slot& s) {
    for (size_t src = 0; src < s.data.size(); ++src) std::memcpy(&recv[src], s.data[src].data() + 8 * me, 8);
  });
  const uint64_t others = 8 * static_cast<uint64_t>(size_ - 1);
  wire().control(others, others);
}

void LoopbackComm::barrier() {
  Contribution c;
  c.kind = Kind::BARRIER;
  c.call = "barrier()";
  run(std::move(c), [](const Slot&) {});
}

std::unique_ptr<PendingOp> LoopbackComm::iallreduce_band(uint64_t* words, size_t n) {
  Contribution c;
  c.kind = Kind::IALLREDUCE_BAND;
  c.call = "iallreduce_band(n=" + std::to_string(n) + ")";
  c.count = n;
  c.data = bytes_of(words, n * 8, &c.error);
  auto op = start(std::move(c), [words](const Slot& s) { copy_bytes(words, s.result.data(), s.result.size()); });
  const WireVolume v = allreduce_volume(8 * static_cast<uint64_t>(n), size_);
  wire().control(v.sent, v.received);
  return op;
}

std::unique_ptr<PendingOp> LoopbackComm::iallgather_i64(const int64_t* mine, size_t n, int64_t* all) {
  Contribution c;
  c.kind = Kind::IALLGATHER_I64;
  c.call = "iallgather_i64(n=" + std::to_string(n) + ")";
  c.data = bytes_of(mine, n * 8, &c.error);
  auto op = start(std::move(c), [all](const Slot& s) { gather(s, reinterpret_cast<char*>(all)); });
  count_allgather_i64(n);
  return op;
}

std::unique_ptr<PendingOp> LoopbackComm::iallgatherv_bytes(const void* send, size_t n, void* recv,
                                                           const std::vector<size_t>& counts) {
  Contribution c;
  c.kind = Kind::IALLGATHERV_BYTES;
  c.call = "iallgatherv_bytes(counts=" + counts_text(counts) + ")";
  if (check_counts(counts, &c.error)) {
    if (counts[rank_] != n)
      c.error = "sends " + std::to_string(n) + " bytes but counts[" + std::to_string(rank_) +
                "] is " + std::to_string(counts[rank_]);
    else
      c.data = bytes_of(send, n, &c.error);
  }
  auto op = start(std::move(c), [recv](const Slot& s) { gather(s, static_cast<char*>(recv)); });
  if (counts.size() == static_cast<size_t>(size_)) {
    const WireVolume v = allgatherv_volume(counts, rank_, 1);
    wire().control(v.sent, v.received);
  }
  return op;
}

// -- what the collectives share ------------------------------------------------------------------------

std::string LoopbackComm::dtype_text(DType d) {
  return valid_dtype(d) ? dtype_name(d) : "dtype#" + std::to_string(static_cast<int>(d));
}

Contribution LoopbackComm::reduction(Kind kind, DType dtype, ReduceOp op) const {
  Contribution c;
  c.kind = kind;
  c.dtype = dtype;
  c.op = op;
  const int o = static_cast<int>(op);
  const bool op_ok = op == ReduceOp::SUM || op == ReduceOp::MIN || op == ReduceOp::MAX ||
                     op == ReduceOp::PRODUCT || op == ReduceOp::AVERAGE;  // combine() reads AVERAGE as SUM
  c.call = "dtype=" + dtype_text(dtype) + ", op=" +
           (o >= 0 && o <= 5 ? std::string(reduce_op_title(op)) : "op#" + std::to_string(o));
  if (!valid_dtype(dtype)) c.error = "invalid dtype";
  else if (!op_ok) c.error = "op " + c.call.substr(c.call.find("op=") + 3) + " is not an element-wise reduction";
  return c;
}

bool LoopbackComm::check_counts(const std::vector<size_t>& counts, std::string* error) const {
  if (counts.size() == static_cast<size_t>(size())) return true;
  *error = std::to_string(counts.size()) + " counts for " + std::to_string(size()) + " ranks";
  return false;
}

void LoopbackComm::count_allgather_i64(size_t n) {
  const uint64_t others = 8 * static_cast<uint64_t>(n) * static_cast<uint64_t>(size_ - 1);
  wire().control(others, others);
}

void LoopbackComm::gather(const Slot& s, char* out) {
  for (const auto& d : s.data) {
    copy_bytes(out, d.data(), d.size());
    out += d.size();
  }
}

}  // namespace loopback_transport
}  // namespace perseus
