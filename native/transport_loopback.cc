// In-process loopback transport: see transport_loopback.h.
//
// Every communicator is a CommState shared by the n rank-side LoopbackComm objects, found in the world's
// registry by an id path ("0" for the first make_loopback_comm of each rank, "0.1" for that comm's second
// dup, ...). A collective is a Slot keyed by its sequence number on the communicator: each rank deposits a
// copy of its contribution, the last one to arrive combines them, and each rank copies its result out and
// "finishes" the slot; the slot is erased when every rank has finished, so the table holds only the
// collectives some rank is still inside.
//
// Nothing here crosses a wire, but each call counts (wire.h) what the MPI transport counts for it: the
// bytes sendrecv and control messages move, and the textbook algorithm's volume for a collective, so that
// engine tests see the same figures as a real job.
#include "transport_loopback.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <numeric>
#include <stdexcept>
#include <unordered_map>
#include <utility>

#include "buffers.h"
#include "kernels.h"

namespace perseus {
namespace {

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

bool valid_dtype(DType d) {
  int v = static_cast<int>(d);
  return v >= 0 && v < kNumDTypes;
}

std::vector<char> bytes_of(const void* p, size_t n, std::string* error) {
  if (n == 0) return {};
  if (!p) {
    *error = "null buffer for " + std::to_string(n) + " bytes";
    return {};
  }
  const char* c = static_cast<const char*>(p);
  return std::vector<char>(c, c + n);
}

std::string counts_text(const std::vector<size_t>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

size_t sum_of(const std::vector<size_t>& v, size_t end) {
  return std::accumulate(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(end), size_t{0});
}

// Runs once, by the last rank to arrive, under the communicator's lock.
void complete(Slot& s, int size) {
  try {
    switch (s.kind) {
      case Kind::ALLREDUCE:
      case Kind::REDUCE_SCATTER: {
        // Rank order, once for everybody: every rank gets bit-identical results.
        s.result = std::move(s.data[0]);
        for (int r = 1; r < size && s.count; ++r)
          combine(s.result.data(), s.data[r].data(), s.result.data(), s.count, s.dtype, s.op);
        std::vector<std::vector<char>>(size).swap(s.data);  // only the result is needed from here on
        break;
      }
      case Kind::IALLREDUCE_BAND: {
        s.result = std::move(s.data[0]);
        for (int r = 1; r < size; ++r) {
          for (size_t i = 0; i < s.count; ++i) {
            uint64_t a, b;
            std::memcpy(&a, s.result.data() + 8 * i, 8);
            std::memcpy(&b, s.data[r].data() + 8 * i, 8);
            a &= b;
            std::memcpy(s.result.data() + 8 * i, &a, 8);
          }
        }
        std::vector<std::vector<char>>(size).swap(s.data);
        break;
      }
      case Kind::ALLTOALLV:
        // counts[r] = rank r's send counts then its recv counts: what s sends to r must be what r expects.
        for (int src = 0; src < size; ++src)
          for (int dst = 0; dst < size; ++dst)
            if (s.counts[src][dst] != s.counts[dst][size + src])
              s.error = "alltoallv: rank " + std::to_string(src) + " sends " +
                        std::to_string(s.counts[src][dst]) + " elements to rank " + std::to_string(dst) +
                        ", which expects " + std::to_string(s.counts[dst][size + src]);
        break;
      default:
        break;
    }
  } catch (const std::exception& e) {  // handed to every rank of the exchange, which raises it
    s.error = e.what();
  }
}

}  // namespace

class LoopbackWorld {
 public:
  explicit LoopbackWorld(int n) : size(n), roots_created(n, 0) {}

  const int size;
  std::atomic<bool> failed{false};

  [[noreturn]] void throw_failed() const { throw TransportError(fail_message_); }

  void fail(const std::string& message) {
    {
      std::lock_guard<std::mutex> g(fail_mu_);
      if (failed.load()) return;
      fail_message_ = message;  // written before the flag, never again: readers need no lock
      failed.store(true);
    }
    // Wake every waiter. Taking each lock after setting the flag means a waiter either already sleeps
    // (and is notified) or checks the flag after this point. Never holds the registry and a comm lock at
    // once, so no lock order to get wrong.
    std::vector<std::shared_ptr<CommState>> states;
    {
      std::lock_guard<std::mutex> g(registry_mu_);
      for (auto& kv : registry_) states.push_back(kv.second.state);
    }
    for (auto& st : states) {
      { std::lock_guard<std::mutex> g(st->mu); }
      st->cv.notify_all();
    }
  }

  std::string next_root_path(int rank) {
    std::lock_guard<std::mutex> g(registry_mu_);
    return std::to_string(roots_created[rank]++);
  }

  // `n`: the communicator's size (the world's, or a split's).
  std::shared_ptr<CommState> attach(const std::string& path, int n) {
    std::lock_guard<std::mutex> g(registry_mu_);
    Entry& e = registry_[path];
    if (!e.state) e.state = std::make_shared<CommState>(n, path);
    return e.state;
  }

  // Forget a communicator once every rank has dropped its side (each rank attaches to a path once).
  void detach(const std::string& path) {
    std::lock_guard<std::mutex> g(registry_mu_);
    auto it = registry_.find(path);
    if (it != registry_.end() && ++it->second.detached == it->second.state->size) registry_.erase(it);
  }

  LoopbackStats stats() {
    std::vector<std::shared_ptr<CommState>> states;
    {
      std::lock_guard<std::mutex> g(registry_mu_);
      for (auto& kv : registry_) states.push_back(kv.second.state);
    }
    LoopbackStats out;
    out.comms = states.size();
    for (auto& st : states) {
      std::lock_guard<std::mutex> g(st->mu);
      out.slots += st->slots.size();
      for (auto& q : st->p2p) out.messages += q.size();
      for (auto& q : st->inbox) out.messages += q.size();
    }
    return out;
  }

 private:
  struct Entry {
    std::shared_ptr<CommState> state;
    int detached = 0;
  };
  std::mutex fail_mu_;
  std::string fail_message_;
  std::mutex registry_mu_;
  std::map<std::string, Entry> registry_;
  std::vector<int> roots_created;
};

namespace {

// Called with st.mu held, by a rank that has arrived at slot `seq` and will not touch it again.
void finish_slot(CommState& st, uint64_t seq) {
  auto it = st.slots.find(seq);
  if (it != st.slots.end() && ++it->second.finished == st.size) st.slots.erase(it);
}

using Take = std::function<void(const Slot&)>;

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

class LoopbackComm final : public Comm {
 public:
  LoopbackComm(std::shared_ptr<LoopbackWorld> world, int rank, int size, std::string path)
      : world_(std::move(world)), rank_(rank), size_(size), path_(std::move(path)),
        st_(world_->attach(path_, size_)) {}
  ~LoopbackComm() override { world_->detach(path_); }

  int rank() const override { return rank_; }
  int size() const override { return size_; }

  std::unique_ptr<Comm> dup() override {
    Contribution c;
    c.kind = Kind::DUP;
    c.call = "dup()";
    run(std::move(c), [](const Slot&) {});
    auto out = std::make_unique<LoopbackComm>(world_, rank_, size_, path_ + "." + std::to_string(dups_++));
    out->set_wire_counters(wire_counters());
    return out;
  }

  std::unique_ptr<Comm> split(int color, int key) override {
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

  void allreduce(const void* send, void* recv, size_t count, DType dtype, ReduceOp op) override {
    Contribution c = reduction(Kind::ALLREDUCE, dtype, op);
    c.count = count;
    c.call = "allreduce(count=" + std::to_string(count) + ", " + c.call + ")";
    if (c.error.empty()) c.data = bytes_of(send ? send : recv, count * itemsize(dtype), &c.error);
    run(std::move(c), [recv](const Slot& s) { copy_bytes(recv, s.result.data(), s.result.size()); });
    const WireVolume v = allreduce_volume(static_cast<uint64_t>(count) * itemsize(dtype), size_);
    wire().data(v.sent, v.received);
  }

  std::unique_ptr<PendingOp> iallreduce(const void* send, void* recv, size_t count, DType dtype,
                                        ReduceOp op) override {
    Contribution c = reduction(Kind::ALLREDUCE, dtype, op);
    c.count = count;
    c.call = "iallreduce(count=" + std::to_string(count) + ", " + c.call + ")";
    if (c.error.empty()) c.data = bytes_of(send ? send : recv, count * itemsize(dtype), &c.error);
    auto pending = start(std::move(c), [recv](const Slot& s) { copy_bytes(recv, s.result.data(), s.result.size()); });
    const WireVolume v = allreduce_volume(static_cast<uint64_t>(count) * itemsize(dtype), size_);
    wire().data(v.sent, v.received);
    return pending;
  }

  void allgatherv(const void* send, void* recv, const std::vector<size_t>& counts, DType dtype) override {
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

  void broadcast(void* buf, size_t count, DType dtype, int root) override {
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

  void alltoallv(const void* send, const std::vector<size_t>& send_counts, void* recv,
                 const std::vector<size_t>& recv_counts, DType dtype, bool /*beyond_int*/) override {
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

  void reduce_scatter(const void* send, void* recv, const std::vector<size_t>& counts, DType dtype,
                      ReduceOp op) override {
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

  void sendrecv(const void* send, size_t send_bytes, int dest, void* recv, size_t recv_bytes,
                int source) override {
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

  void allgather_i64(const int64_t* mine, size_t n, int64_t* all) override {
    Contribution c;
    c.kind = Kind::ALLGATHER_I64;
    c.call = "allgather_i64(n=" + std::to_string(n) + ")";
    c.data = bytes_of(mine, n * 8, &c.error);
    run(std::move(c), [all](const Slot& s) { gather(s, reinterpret_cast<char*>(all)); });
    count_allgather_i64(n);
  }

  void alltoall_i64(const int64_t* send, int64_t* recv) override {
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

  void barrier() override {
    Contribution c;
    c.kind = Kind::BARRIER;
    c.call = "barrier()";
    run(std::move(c), [](const Slot&) {});
  }

  std::unique_ptr<PendingOp> iallreduce_band(uint64_t* words, size_t n) override {
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

  std::unique_ptr<PendingOp> iallgather_i64(const int64_t* mine, size_t n, int64_t* all) override {
    Contribution c;
    c.kind = Kind::IALLGATHER_I64;
    c.call = "iallgather_i64(n=" + std::to_string(n) + ")";
    c.data = bytes_of(mine, n * 8, &c.error);
    auto op = start(std::move(c), [all](const Slot& s) { gather(s, reinterpret_cast<char*>(all)); });
    count_allgather_i64(n);
    return op;
  }

  std::unique_ptr<PendingOp> iallgatherv_bytes(const void* send, size_t n, void* recv,
                                               const std::vector<size_t>& counts) override {
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

  void send_message(int dest, const std::string& bytes) override {
    if (dest < 0 || dest >= size())
      throw TransportError("send_message: dest " + std::to_string(dest) + " out of range");
    std::lock_guard<std::mutex> g(st_->mu);
    if (world_->failed.load()) world_->throw_failed();
    st_->inbox[dest].emplace_back(rank_, bytes);
    if (dest != rank_) wire().control(bytes.size(), 0);
  }

  bool poll_message(int* source, std::string* bytes) override {
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

  // Delivery is immediate: nothing is ever left to flush.
  void flush_messages(double) override {
    if (world_->failed.load()) world_->throw_failed();
  }

 private:
  static std::string dtype_text(DType d) {
    return valid_dtype(d) ? dtype_name(d) : "dtype#" + std::to_string(static_cast<int>(d));
  }

  Contribution reduction(Kind kind, DType dtype, ReduceOp op) const {
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

  bool check_counts(const std::vector<size_t>& counts, std::string* error) const {
    if (counts.size() == static_cast<size_t>(size())) return true;
    *error = std::to_string(counts.size()) + " counts for " + std::to_string(size()) + " ranks";
    return false;
  }

  void count_allgather_i64(size_t n) {
    const uint64_t others = 8 * static_cast<uint64_t>(n) * static_cast<uint64_t>(size_ - 1);
    wire().control(others, others);
  }

  static void gather(const Slot& s, char* out) {
    for (const auto& d : s.data) {
      copy_bytes(out, d.data(), d.size());
      out += d.size();
    }
  }

  // Enter the next collective on this communicator (st_->mu held) and return its sequence number.
  uint64_t arrive(Contribution c) {
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

  std::unique_ptr<PendingOp> start(Contribution c, Take take) {
    uint64_t seq;
    {
      std::lock_guard<std::mutex> g(st_->mu);
      if (world_->failed.load()) world_->throw_failed();
      seq = arrive(std::move(c));
    }
    return std::make_unique<LoopbackPendingOp>(world_, st_, seq, std::move(take));
  }

  std::shared_ptr<LoopbackWorld> world_;
  const int rank_;
  const int size_;
  const std::string path_;
  std::shared_ptr<CommState> st_;
  uint64_t next_seq_ = 0;  // this rank's position in the communicator's collective sequence
  int dups_ = 0;
};

}  // namespace

std::shared_ptr<LoopbackWorld> make_loopback_world(int size) {
  if (size < 1) throw std::invalid_argument("loopback world needs at least one rank");
  return std::make_shared<LoopbackWorld>(size);
}

std::unique_ptr<Comm> make_loopback_comm(const std::shared_ptr<LoopbackWorld>& world, int rank) {
  if (!world) throw std::invalid_argument("no loopback world");
  if (rank < 0 || rank >= world->size)
    throw std::invalid_argument("rank " + std::to_string(rank) + " out of range for " +
                                std::to_string(world->size) + " ranks");
  return std::make_unique<LoopbackComm>(world, rank, world->size, world->next_root_path(rank));
}

void loopback_world_fail(const std::shared_ptr<LoopbackWorld>& world, const std::string& message) {
  world->fail(message);
}

LoopbackStats loopback_world_stats(const std::shared_ptr<LoopbackWorld>& world) { return world->stats(); }

}  // namespace perseus
