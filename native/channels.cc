// Stage 4: channel threads and how each unit runs on the transport (see channels.h).
#include "channels.h"

#include <pthread.h>
#include <sched.h>

#include <chrono>
#include <limits>
#include <numeric>

#include "adasum.h"
#include "buffers.h"
#include "huge_pages.h"
#include "kernels.h"
#include "ring.h"

namespace perseus {

namespace {

constexpr size_t kRingMinBytes = 64 << 10;  // below this MPI's latency-optimised algorithms win over a ring
constexpr int kSpinUs = 100;  // how long an idle channel thread spins (yielding) before it sleeps

}  // namespace

Channel::Channel(std::unique_ptr<Comm> comm, ChannelConfig config, ChannelHooks hooks)
    : comm_(std::move(comm)), config_(std::move(config)), hooks_(std::move(hooks)) {
  scratch_.set_huge_pages(config_.huge_pages);
  const HostLayout* h = config_.layout.get();
  if (h != nullptr && h->hosts > 1) {
    const int r = comm_->rank();
    links_ = std::make_unique<Links>(*comm_, config_.links);
    if (h->homogeneous && h->local_size(r) > 1) {
      local_ = comm_->split(h->host_of[r], r);
      cross_ = comm_->split(h->local_rank[r], r);
      LinkOptions cross_options = config_.links;
      cross_options.world_ranks.clear();
      for (int host = 0; host < h->hosts; ++host) {
        const int peer = h->ranks_on[host][h->local_rank[r]];
        cross_options.world_ranks.push_back(peer < static_cast<int>(config_.links.world_ranks.size())
                                                ? config_.links.world_ranks[peer] : peer);
      }
      cross_links_ = std::make_unique<Links>(*cross_, cross_options);
    }
  }
  thread_ = std::thread([this] { run(); });
  pthread_setname_np(thread_.native_handle(), "perseus-channel");  // as profilers and /proc show it
}

Channel::~Channel() {
  if (thread_.joinable()) {
    if (exited_.load()) thread_.join(); else thread_.detach();
  }
}

void Channel::submit(Unit* u) {
  bool wake;
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(u);
    queued_.fetch_add(1, std::memory_order_release);
    wake = sleeping_;
  }
  if (wake) cv_.notify_one();
}

bool Channel::stop(double timeout_s) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_one();
  auto deadline = Clock::now() + std::chrono::duration<double>(timeout_s);
  while (!exited_.load(std::memory_order_acquire) && Clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  if (exited_.load(std::memory_order_acquire)) {
    if (thread_.joinable()) thread_.join();
    return true;
  }
  thread_.detach();  // stuck inside a collective that peers will never finish
  return false;
}

void Channel::run() {
  for (;;) {
    Unit* u = nullptr;
    // Stay awake (yielding the core) for a while after a unit: the next unit of a step, or of a loop of
    // small synchronous collectives, usually follows within tens of microseconds, and waking a sleeping
    // thread costs about as much as the whole collective.
    const auto spin_until = Clock::now() + std::chrono::microseconds(kSpinUs);
    while (queued_.load(std::memory_order_acquire) == 0 && Clock::now() < spin_until) sched_yield();
    {
      std::unique_lock<std::mutex> lock(mu_);
      while (queue_.empty() && !stop_) {
        sleeping_ = true;
        cv_.wait(lock);
        sleeping_ = false;
      }
      if (queue_.empty()) break;  // stopping, and everything queued has run
      u = queue_.front();
      queue_.pop_front();
      queued_.fetch_sub(1, std::memory_order_release);
    }
    run_unit(u);
  }
  exited_.store(true, std::memory_order_release);
}

void Channel::run_unit(Unit* u) {
  try {
    execute(u);
  } catch (const TransportError& e) {
    hooks_.unit_failed(u, e.what(), ErrorKind::INTERNAL);
    hooks_.recycle(u);
    return;
  } catch (const std::exception& e) {  // reported: the unit fails on every rank with the cause
    hooks_.unit_failed(u, std::string("internal error: ") + e.what(), ErrorKind::INTERNAL);
    hooks_.recycle(u);
    return;
  }
  for (const Piece& p : u->pieces) hooks_.piece_done(p.request);
  hooks_.recycle(u);
}

void Channel::execute(Unit* u) {
  if (hooks_.faults != nullptr && hooks_.faults->armed.exchange(false)) {
    std::lock_guard<std::mutex> lock(hooks_.faults->mu);
    throw TransportError(hooks_.faults->message);
  }
  switch (u->op_type) {
    case OpType::ALLREDUCE: allreduce(u); break;
    case OpType::ALLGATHER: allgather(u); break;
    case OpType::BROADCAST: broadcast(u->pieces[0].request); break;
    case OpType::ALLTOALL: alltoall(u->pieces[0].request); break;
    case OpType::REDUCESCATTER: reducescatter(u); break;
    case OpType::BARRIER: comm_->barrier(); break;
    case OpType::TUNE: break;  // never a unit: ProcessSet::dispatch applies TUNE requests itself
  }
}

// -- allreduce -----------------------------------------------------------------------------------------
void Channel::activity(Unit* u, const char* label) {
  TimelineRecorder* tl = hooks_.timeline;
  if (tl == nullptr || !tl->on()) return;
  for (const Piece& p : u->pieces)
    if (!p.request->phantom) tl->record(TimelineKind::ACTIVITY, u->op_type, p.request->name, label);
}

void Channel::allreduce(Unit* u) {
  if (u->reduce_op == ReduceOp::ADASUM) {
    activity(u, "ADASUM_ALLREDUCE");
    adasum_unit(flat(), u, fusion_, scratch_);
    return;
  }
  const DType dt = u->dtype;
  const double pre = u->prescale, post = u->postscale;
  if (u->kind == UnitKind::INPLACE) {
    const Piece& p = u->pieces[0];
    Request* r = p.request;
    void* dst = element_at(r->output, p.offset, dt);
    const void* src = r->input == nullptr ? nullptr : element_at(r->input, p.offset, dt);
    if (config_.huge_pages) {  // the caller's memory: collapsed once it is seen again and again
      advise_huge_pages(dst, p.count * itemsize(dt));
      if (src != nullptr && src != dst) advise_huge_pages(src, p.count * itemsize(dt));
    }
    if (pre != 1.0) {
      scale_into(src != nullptr ? src : dst, dst, p.count, dt, pre);
      src = nullptr;
    } else if (src == dst) {
      src = nullptr;
    }
    activity(u, "MPI_ALLREDUCE");
    allreduce_buffer(src, dst, p.count, dt, u->reduce_op, post, u->algorithm);
    return;
  }
  if (fusion_.size() < u->nbytes()) fusion_.resize(u->nbytes());
  uint8_t* buf = fusion_.data();
  if (config_.huge_pages) advise_huge_pages(buf, fusion_.size());
  activity(u, "MEMCPY_IN_FUSION_BUFFER");
  for (const Piece& p : u->pieces) {
    const void* src = p.request->input != nullptr ? p.request->input : p.request->output;
    uint8_t* part = element_at(buf, p.buf_offset, dt);
    if (pre != 1.0) scale_into(src, part, p.count, dt, pre);
    else copy_bytes(part, src, p.count * itemsize(dt));
  }
  activity(u, "MPI_ALLREDUCE");
  allreduce_buffer(nullptr, buf, u->numel, dt, u->reduce_op, 1.0, u->algorithm);  // postscale on copy-out
  activity(u, "MEMCPY_OUT_FUSION_BUFFER");
  for (const Piece& p : u->pieces) {
    const uint8_t* part = element_at(buf, p.buf_offset, dt);
    if (post != 1.0) scale_into(part, p.request->output, p.count, dt, post);
    else copy_bytes(p.request->output, part, p.count * itemsize(dt));
  }
}

// Reduce `send` (or `recv` in place when send is null) into `recv`, times postscale. `auto`: a small buffer
// takes MPI's all-reduce (latency-optimised); within one host a large one takes the ring only where it
// saves the scaling pass of Average; across hosts a large one takes the hierarchical algorithm when every
// host has the same number (>1) of ranks, else the flat ring, both over the channel's own connections (MPI
// would put every channel into one TCP flow).
void Channel::allreduce_buffer(const void* send, void* recv, size_t count, DType dt, ReduceOp op,
                               double postscale, Algorithm a) {
  const int n = comm_->size();
  const bool large = count * itemsize(dt) >= kRingMinBytes && n > 1;
  if (a == Algorithm::HIERARCHICAL && local_ == nullptr) a = Algorithm::RING;  // one host, or uneven hosts
  if (a == Algorithm::AUTO) {
    // Across hosts with several ranks on each, the hierarchical algorithm sends a host's share across the
    // network once (a flat ring sends it 2 (n-1)/n times per rank pair that spans hosts).
    if (!large) a = Algorithm::MPI;
    else if (local_ != nullptr) a = Algorithm::HIERARCHICAL;
    else a = links_ != nullptr || postscale != 1.0 ? Algorithm::RING : Algorithm::MPI;
  }
  switch (a) {
    case Algorithm::HIERARCHICAL:
      hierarchical_allreduce(*local_, cross_links_ != nullptr ? static_cast<PointToPoint&>(*cross_links_) : *cross_,
                             send, recv, count, dt, op, postscale, scratch_);
      return;
    case Algorithm::RING:
      ring_allreduce(flat(), send, recv, count, dt, op, postscale, scratch_);
      return;
    default:
      comm_->allreduce(send, recv, count, dt, op);
      if (postscale != 1.0) scale_into(recv, recv, count, dt, postscale);
  }
}

// -- reduce-scatter and allgather ------------------------------------------------------------------------
// The same choice as allreduce's, by the bytes the collective moves. `auto` runs a large reduce-scatter as
// our ring (over the channel's links across hosts, over the Comm's messages inside one: MPI_Reduce_scatter
// is slower than MPI's own all-reduce), and a large allgather as a ring across hosts only (inside one host
// MPI_Allgatherv, a plain copy through shared memory, was as fast or faster); small ones as MPI's. A forced
// ring runs every size as a ring, forced mpi none. There is no hierarchical reduce-scatter: a hierarchical
// choice runs the flat ring (HOROVOD_HIERARCHICAL_ALLGATHER still picks the hierarchical allgather, see
// allgather()).
bool Channel::use_ring(Algorithm a, size_t bytes, bool ring_within_host) const {
  if (comm_->size() == 1 || bytes == 0) return false;
  switch (a) {
    case Algorithm::AUTO: return bytes >= kRingMinBytes && (links_ != nullptr || ring_within_host);
    case Algorithm::RING: case Algorithm::HIERARCHICAL: return true;
    default: return false;
  }
}

void Channel::allgather(Unit* u) {
  Request* r = u->pieces[0].request;
  const int n = comm_->size();
  const int64_t rows = r->shape.empty() ? 1 : r->shape[0];
  std::vector<int64_t> all(n);
  comm_->allgather_i64(&rows, 1, all.data());
  const int64_t row = row_elements(r->shape);
  std::vector<size_t> counts(n);
  int64_t total_rows = 0;
  for (int i = 0; i < n; ++i) counts[i] = static_cast<size_t>(all[i] * row), total_rows += all[i];
  r->result_shape.assign(r->shape.begin(), r->shape.end());
  if (r->result_shape.empty()) r->result_shape.push_back(1);
  r->result_shape[0] = total_rows;
  r->result_bytes = static_cast<size_t>(total_rows * row) * itemsize(r->sig.dtype);
  r->result.reset(new uint8_t[std::max<size_t>(r->result_bytes, 1)]);
  const int me = comm_->rank();
  // The hierarchical allgather where asked for (HOROVOD_HIERARCHICAL_ALLGATHER, whatever the algorithm) and
  // possible (the same number, >1, of ranks on every host).
  if (config_.hierarchical_allgather && local_ != nullptr) {
    hierarchical_allgatherv(*local_, config_.layout->local_rank[me] == 0 ? cross_.get() : nullptr,
                            *config_.layout, me, r->input, r->result.get(), counts, r->sig.dtype, scratch_);
  } else if (use_ring(u->algorithm, r->result_bytes, false)) {
    const size_t start = std::accumulate(counts.begin(), counts.begin() + me, size_t(0));
    copy_bytes(element_at(r->result.get(), start, r->sig.dtype), r->input, counts[me] * itemsize(r->sig.dtype));
    ring_allgather(flat(), r->result.get(), counts, r->sig.dtype, scratch_);
  } else {
    comm_->allgatherv(r->input, r->result.get(), counts, r->sig.dtype);
  }
  r->received_splits = std::move(all);
}

// -- other collectives ---------------------------------------------------------------------------------
void Channel::broadcast(Request* r) {
  const int root = r->sig.root_rank;
  if (comm_->rank() == root && r->input != nullptr && r->input != r->output)
    copy_bytes(r->output, r->input, r->nbytes());
  comm_->broadcast(r->output, static_cast<size_t>(r->numel()), r->sig.dtype, root);
}

// Whether some rank sends or receives more than 2^31 - 1 elements in all: `rows` holds every rank's splits
// (rows[s * n + d]: the rows rank s sends to rank d), `row` elements each. The same answer on every rank.
static bool beyond_int(const std::vector<int64_t>& rows, int n, int64_t row) {
  const auto limit = static_cast<int64_t>(std::numeric_limits<int>::max());
  for (int q = 0; q < n; ++q) {
    int64_t sent = 0, received = 0;
    for (int p = 0; p < n; ++p) sent += rows[q * n + p], received += rows[p * n + q];
    if (sent * row > limit || received * row > limit) return true;
  }
  return false;
}

void Channel::alltoall(Request* r) {
  const int n = comm_->size(), me = comm_->rank();
  // Every rank's splits, not only the counts sent to this rank: then every rank sees whether any count is
  // beyond MPI's int and all take the same path, with no second exchange.
  std::vector<int64_t> rows(static_cast<size_t>(n) * n);
  comm_->allgather_i64(r->splits.data(), n, rows.data());
  const int64_t row = row_elements(r->shape);
  std::vector<int64_t> recv_rows(n);
  std::vector<size_t> send_counts(n), recv_counts(n);
  int64_t total_rows = 0;
  for (int i = 0; i < n; ++i) {
    recv_rows[i] = rows[static_cast<size_t>(i) * n + me];
    send_counts[i] = static_cast<size_t>(r->splits[i] * row);
    recv_counts[i] = static_cast<size_t>(recv_rows[i] * row);
    total_rows += recv_rows[i];
  }
  r->result_shape.assign(r->shape.begin(), r->shape.end());
  r->result_shape[0] = total_rows;
  r->result_bytes = static_cast<size_t>(total_rows * row) * itemsize(r->sig.dtype);
  r->result.reset(new uint8_t[std::max<size_t>(r->result_bytes, 1)]);
  comm_->alltoallv(r->input, send_counts, r->result.get(), recv_counts, r->sig.dtype, beyond_int(rows, n, row));
  r->received_splits = std::move(recv_rows);
}

void Channel::reducescatter(Unit* u) {
  Request* r = u->pieces[0].request;
  const int n = comm_->size();
  const DType dt = r->sig.dtype;
  std::vector<size_t> rows;
  even_counts(static_cast<size_t>(r->shape.empty() ? 1 : r->shape[0]), n, &rows);
  const int64_t row = row_elements(r->shape);
  std::vector<size_t> counts(n);
  for (int i = 0; i < n; ++i) counts[i] = rows[i] * static_cast<size_t>(row);
  const void* src = r->input;
  const size_t total = static_cast<size_t>(r->numel());
  if (u->prescale != 1.0) {
    uint8_t* scaled = scratch_.get(total * itemsize(dt), 1);
    scale_into(src, scaled, total, dt, u->prescale);
    src = scaled;
  }
  ReduceOp op = u->reduce_op == ReduceOp::AVERAGE ? ReduceOp::SUM : u->reduce_op;
  if (use_ring(u->algorithm, total * itemsize(dt), true))
    ring_reduce_scatter_to(flat(), src, r->output, counts, dt, op, scratch_);
  else
    comm_->reduce_scatter(src, r->output, counts, dt, op);
  if (u->postscale != 1.0) scale_into(r->output, r->output, counts[comm_->rank()], dt, u->postscale);
}

}  // namespace perseus
