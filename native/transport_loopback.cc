// In-process loopback transport: see transport_loopback.h. This file holds the rank side of a
// communicator: a LoopbackComm's lifetime (make_loopback_comm, dup, split), how it enters a collective and
// waits for the others (arrive, run, start), sendrecv and the control messages; transport_loopback_state.h
// says where the rest lives.
//
// Nothing here crosses a wire, but each call counts (wire.h) what the MPI transport counts for it: the
// bytes sendrecv and control messages move, and the textbook algorithm's volume for a collective, so that
// engine tests see the same figures as a real job.
#include "transport_loopback.h"

#include <algorithm>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <utility>

#include "buffers.h"
#include "transport_loopback_state.h"

namespace perseus {
namespace loopback_transport {
namespace {

class LoopbackPendingOp final : public PendingOp {
 public:
  LoopbackPendingOp(std::shared_ptr<LoopbackWorld> world, std::shared_ptr<CommState> st, uint64_t seq,
                    Take take)
      : world_(std::move(world)), st_(std::move(st)), seq_(seq), take_(std::move(take)) {}

  ~LoopbackPendingOp() override {
    if (finished_) return;
    // Abandoned in flight: never write to the caller's buffers, but let the slot be freed.
    std::lock_guard<std::mutex> g(st_->mu);
    finish_slot(*st_, seq_);
  }

  bool test() override {
    if (done_) return true;
    if (finished_) throw TransportError(error_);  // failed earlier: keep failing
    if (world_->failed.load()) world_->throw_failed();
    std::lock_guard<std::mutex> g(st_->mu);
    const Slot& s = st_->slots.at(seq_);
    if (!s.error.empty()) {
      error_ = s.error;
      finished_ = true;
      finish_slot(*st_, seq_);
      throw TransportError(error_);
    }
    if (s.arrived < st_->size) return false;
    take_(s);
    finished_ = done_ = true;
    finish_slot(*st_, seq_);
    return true;
  }

 private:
  std::shared_ptr<LoopbackWorld> world_;
  std::shared_ptr<CommState> st_;
  const uint64_t seq_;
  Take take_;
  bool finished_ = false;
  bool done_ = false;
  std::string error_;
};

}  // namespace

LoopbackComm::LoopbackComm(std::shared_ptr<LoopbackWorld> world, int rank, int size, std::string path)
    : world_(std::move(world)), rank_(rank), size_(size), path_(std::move(path)),
      st_(world_->attach(path_, size_)) {}

LoopbackComm::~LoopbackComm() { world_->detach(path_); }

std::unique_ptr<Comm> LoopbackComm::dup() {
  Contribution c;
  c.kind = Kind::DUP;
  c.call = "dup()";
  run(std::move(c), [](const Slot&) {});
  auto out = std::make_unique<LoopbackComm>(world_, rank_, size_, path_ + "." + std::to_string(dups_++));
  out->set_wire_counters(wire_counters());
  return out;
}

std::unique_ptr<Comm> LoopbackComm::split(int color, int key) {
  Contribution c;
  c.kind = Kind::SPLIT;
  c.call = "split()";
  const int64_t mine[2] = {color, key};
  c.data.assign(reinterpret_cast<const char*>(mine), reinterpret_cast<const char*>(mine) + sizeof(mine));
  int new_rank = 0, new_size = 0;
  const int me = rank_;
  run(std::move(c), [&](const Slot& s) {
    std::vector<std::pair<int64_t, int>> members;  // (key, rank) of the ranks with my color
    for (int r = 0; r < static_cast<int>(s.data.size()); ++r) {
      int64_t v[2];
      std::memcpy(v, s.data[r].data(), sizeof(v));
      if (v[0] == color) members.emplace_back(v[1], r);
    }
    std::sort(members.begin(), members.end());
    new_size = static_cast<int>(members.size());
    for (int i = 0; i < new_size; ++i)
      if (members[i].second == me) new_rank = i;
  });
  auto out = std::make_unique<LoopbackComm>(world_, new_rank, new_size,
                                            path_ + ".s" + std::to_string(dups_++) + "c" + std::to_string(color));
  out->set_wire_counters(wire_counters());
  return out;
}

// -- point-to-point and control messages ---------------------------------------------------------------

void LoopbackComm::sendrecv(const void* send, size_t send_bytes, int dest, void* recv, size_t recv_bytes,
                            int source) {
  if (dest < 0 || dest >= size() || source < 0 || source >= size())
    throw TransportError("sendrecv: dest " + std::to_string(dest) + " or source " + std::to_string(source) +
                         " out of range for " + std::to_string(size()) + " ranks");
  std::string error;
  std::vector<char> payload = bytes_of(send, send_bytes, &error);
  if (!error.empty()) throw TransportError("sendrecv: " + error);
  std::unique_lock<std::mutex> lk(st_->mu);
  if (world_->failed.load()) world_->throw_failed();
  st_->p2p[rank_ * size() + dest].push_back(std::move(payload));
  st_->cv.notify_all();
  auto& q = st_->p2p[source * size() + rank_];
  st_->cv.wait(lk, [&] { return world_->failed.load() || !q.empty(); });
  if (world_->failed.load()) world_->throw_failed();
  std::vector<char> got = std::move(q.front());
  q.pop_front();
  if (got.size() != recv_bytes)
    throw TransportError("sendrecv: rank " + std::to_string(rank_) + " expected " + std::to_string(recv_bytes) +
                         " bytes from rank " + std::to_string(source) + ", got " + std::to_string(got.size()));
  copy_bytes(recv, got.data(), got.size());
  lk.unlock();
  wire().data(dest != rank_ ? send_bytes : 0, source != rank_ ? recv_bytes : 0);
}

void LoopbackComm::send_message(int dest, const std::string& bytes) {
  if (dest < 0 || dest >= size())
    throw TransportError("send_message: dest " + std::to_string(dest) + " out of range");
  std::lock_guard<std::mutex> g(st_->mu);
  if (world_->failed.load()) world_->throw_failed();
  st_->inbox[dest].emplace_back(rank_, bytes);
  if (dest != rank_) wire().control(bytes.size(), 0);
}

bool LoopbackComm::poll_message(int* source, std::string* bytes) {
  std::lock_guard<std::mutex> g(st_->mu);
  if (world_->failed.load()) world_->throw_failed();
  auto& q = st_->inbox[rank_];
  if (q.empty()) return false;
  *source = q.front().first;
  *bytes = std::move(q.front().second);
  q.pop_front();
  if (*source != rank_) wire().control(0, bytes->size());
  return true;
}

void LoopbackComm::flush_messages(double) {
  if (world_->failed.load()) world_->throw_failed();
}

// -- entering a collective -----------------------------------------------------------------------------

uint64_t LoopbackComm::arrive(Contribution c) {
  const uint64_t seq = next_seq_++;
  Slot& s = st_->slots[seq];
  const int n = size();
  if (s.arrived == 0) {
    s.kind = c.kind;
    s.call = c.call;
    s.first_rank = rank_;
    s.data.resize(n);
    s.counts.resize(n);
    s.count = c.count;
    s.dtype = c.dtype;
    s.op = c.op;
  } else if (s.call != c.call && s.error.empty()) {
    s.error = "loopback comm " + st_->path + ", collective #" + std::to_string(seq) + ": rank " +
              std::to_string(s.first_rank) + " called " + s.call + ", rank " + std::to_string(rank_) +
              " called " + c.call;
  }
  if (!c.error.empty() && s.error.empty()) s.error = c.call + " on rank " + std::to_string(rank_) + ": " + c.error;
  s.data[rank_] = std::move(c.data);
  s.counts[rank_] = std::move(c.counts);
  if (++s.arrived == n && s.error.empty()) complete(s, n);
  st_->cv.notify_all();
  return seq;
}

std::unique_ptr<PendingOp> LoopbackComm::start(Contribution c, Take take) {
  uint64_t seq;
  {
    std::lock_guard<std::mutex> g(st_->mu);
    if (world_->failed.load()) world_->throw_failed();
    seq = arrive(std::move(c));
  }
  return std::make_unique<LoopbackPendingOp>(world_, st_, seq, std::move(take));
}

}  // namespace loopback_transport

std::unique_ptr<Comm> make_loopback_comm(const std::shared_ptr<LoopbackWorld>& world, int rank) {
  if (!world) throw std::invalid_argument("no loopback world");
  if (rank < 0 || rank >= world->size)
    throw std::invalid_argument("rank " + std::to_string(rank) + " out of range for " +
                                std::to_string(world->size) + " ranks");
  return std::make_unique<loopback_transport::LoopbackComm>(world, rank, world->size, world->next_root_path(rank));
}

}  // namespace perseus
