// The loopback transport's own declarations, shared by its files (tests and the binding reach it through
// transport_loopback.h, which this header does not include):
//   transport_loopback_world.cc        the world: its registry of communicators, failure, the debug counters,
//                                      and what completes a collective
//   transport_loopback.cc              the rank side: a LoopbackComm's lifetime, how it enters a collective,
//                                      sendrecv and control messages
//   transport_loopback_collectives.cc  the collectives, blocking and non-blocking
//
// Every communicator is a CommState shared by the n rank-side LoopbackComm objects, found in the world's
// registry by an id path ("0" for the first make_loopback_comm of each rank, "0.1" for that comm's second
// dup, ...). A collective is a Slot keyed by its sequence number on the communicator: each rank deposits a
// copy of its contribution, the last one to arrive combines them, and each rank copies its result out and
// "finishes" the slot; the slot is erased when every rank has finished, so the table holds only the
// collectives some rank is still inside.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "transport.h"

namespace perseus {

struct LoopbackStats;  // transport_loopback.h

namespace loopback_transport {

enum class Kind {
  ALLREDUCE, ALLGATHERV, BROADCAST, ALLTOALLV, REDUCE_SCATTER, ALLGATHER_I64, ALLTOALL_I64, BARRIER, DUP, SPLIT,
  IALLREDUCE_BAND, IALLGATHER_I64, IALLGATHERV_BYTES,
};

// One rank's entry into a collective.
struct Contribution {
  Kind kind = Kind::BARRIER;
  std::string call;  // the call as text: what every rank must agree on, and how a mismatch is reported
  std::vector<char> data;
  std::vector<size_t> counts;  // alltoallv: send counts then recv counts
  size_t count = 0;            // reductions: elements
  DType dtype = DType::UINT8;
  ReduceOp op = ReduceOp::SUM;
  std::string error;  // local misuse: still deposited, so the other ranks fail instead of hanging
};

struct Slot {
  Kind kind = Kind::BARRIER;
  std::string call;
  int first_rank = -1;
  int arrived = 0;
  int finished = 0;  // ranks done with it: result taken, error thrown or op abandoned
  std::vector<std::vector<char>> data;
  std::vector<std::vector<size_t>> counts;
  std::vector<char> result;
  size_t count = 0;
  DType dtype = DType::UINT8;
  ReduceOp op = ReduceOp::SUM;
  std::string error;
};

struct CommState {
  CommState(int n, std::string id) : size(n), path(std::move(id)), p2p(n * n), inbox(n) {}
  const int size;
  const std::string path;
  std::mutex mu;
  std::condition_variable cv;
  std::unordered_map<uint64_t, Slot> slots;  // node-based: a Slot& stays valid while others come and go
  std::vector<std::deque<std::vector<char>>> p2p;              // [src * size + dst]
  std::vector<std::deque<std::pair<int, std::string>>> inbox;  // [dst]: (source, bytes)
};

// -- helpers (transport_loopback_world.cc) ------------------------------------------------------------

bool valid_dtype(DType d);
// A copy of n bytes at p; a null p with n > 0 sets *error instead.
std::vector<char> bytes_of(const void* p, size_t n, std::string* error);
std::string counts_text(const std::vector<size_t>& v);
size_t sum_of(const std::vector<size_t>& v, size_t end);

// Runs once, by the last rank to arrive, under the communicator's lock.
void complete(Slot& s, int size);
// Called with st.mu held, by a rank that has arrived at slot `seq` and will not touch it again.
void finish_slot(CommState& st, uint64_t seq);

}  // namespace loopback_transport

// Shared state of n in-process ranks (transport_loopback_world.cc).
class LoopbackWorld {
 public:
  explicit LoopbackWorld(int n) : size(n), roots_created(n, 0) {}

  const int size;
  std::atomic<bool> failed{false};

  [[noreturn]] void throw_failed() const { throw TransportError(fail_message_); }

  void fail(const std::string& message);
  std::string next_root_path(int rank);
  // `n`: the communicator's size (the world's, or a split's).
  std::shared_ptr<loopback_transport::CommState> attach(const std::string& path, int n);
  // Forget a communicator once every rank has dropped its side (each rank attaches to a path once).
  void detach(const std::string& path);
  LoopbackStats stats();

 private:
  struct Entry {
    std::shared_ptr<loopback_transport::CommState> state;
    int detached = 0;
  };
  std::mutex fail_mu_;
  std::string fail_message_;
  std::mutex registry_mu_;
  std::map<std::string, Entry> registry_;
  std::vector<int> roots_created;
};

namespace loopback_transport {

using Take = std::function<void(const Slot&)>;

// One rank's side of a communicator.
class LoopbackComm final : public Comm {
 public:
  // transport_loopback.cc
  LoopbackComm(std::shared_ptr<LoopbackWorld> world, int rank, int size, std::string path);
  ~LoopbackComm() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }

  std::unique_ptr<Comm> dup() override;
  std::unique_ptr<Comm> split(int color, int key) override;

  // transport_loopback_collectives.cc
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

  // transport_loopback.cc
  void sendrecv(const void* send, size_t send_bytes, int dest, void* recv, size_t recv_bytes,
                int source) override;
  void send_message(int dest, const std::string& bytes) override;
  bool poll_message(int* source, std::string* bytes) override;
  // Delivery is immediate: nothing is ever left to flush.
  void flush_messages(double) override;

 private:
  // transport_loopback_collectives.cc
  static std::string dtype_text(DType d);
  Contribution reduction(Kind kind, DType dtype, ReduceOp op) const;
  bool check_counts(const std::vector<size_t>& counts, std::string* error) const;
  void count_allgather_i64(size_t n);
  static void gather(const Slot& s, char* out);

  // transport_loopback.cc
  // Enter the next collective on this communicator (st_->mu held) and return its sequence number.
  uint64_t arrive(Contribution c);

  template <class F>
  void run(Contribution c, F take) {
    std::unique_lock<std::mutex> lk(st_->mu);
    if (world_->failed.load()) world_->throw_failed();
    const uint64_t seq = arrive(std::move(c));
    Slot& s = st_->slots.at(seq);  // stays put until this rank finishes it
    st_->cv.wait(lk, [&] { return world_->failed.load() || s.arrived == size() || !s.error.empty(); });
    if (world_->failed.load()) world_->throw_failed();
    if (!s.error.empty()) {
      std::string error = s.error;
      finish_slot(*st_, seq);
      throw TransportError(error);
    }
    take(s);
    finish_slot(*st_, seq);
  }

  std::unique_ptr<PendingOp> start(Contribution c, Take take);

  std::shared_ptr<LoopbackWorld> world_;
  const int rank_;
  const int size_;
  const std::string path_;
  std::shared_ptr<CommState> st_;
  uint64_t next_seq_ = 0;  // this rank's position in the communicator's collective sequence
  int dups_ = 0;
};

}  // namespace loopback_transport
}  // namespace perseus
