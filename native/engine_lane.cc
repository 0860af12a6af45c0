// Stage 4 on the engine thread: small host all-reduces (see engine_lane.h).
#include "engine_lane.h"

#include "buffers.h"
#include "kernels.h"

namespace perseus {

namespace {

// A timeline activity for each piece of u, the labels a channel records for the unit's kind (the copies of an
// in-place unit through the lane's buffer are not shown: they are at most engine_lane_bytes).
void activity(const ChannelHooks& hooks, const Unit* u, const char* label) {
  TimelineRecorder* tl = hooks.timeline;
  if (tl == nullptr || !tl->on()) return;
  for (const Piece& p : u->pieces)
    if (!p.request->phantom) tl->record(TimelineKind::ACTIVITY, u->op_type, p.request->name, label);
}

}  // namespace

EngineLane::EngineLane(std::unique_ptr<Comm> comm, ChannelHooks hooks, int64_t max_bytes)
    : comm_(std::move(comm)), hooks_(std::move(hooks)), max_bytes_(std::max<int64_t>(max_bytes, 0)),
      buffer_(new std::vector<uint8_t>(static_cast<size_t>(std::max<int64_t>(max_bytes_, 1)))) {}

EngineLane::~EngineLane() {
  // A collective still in flight may write into the buffer later: leave both behind.
  if (op_ != nullptr && !queue_.empty()) {
    op_.release();
    return;
  }
  delete buffer_;
}

bool EngineLane::takes(const Unit& u) const {
  return max_bytes_ > 0 && u.device < 0 && u.op_type == OpType::ALLREDUCE && u.reduce_op != ReduceOp::ADASUM &&
         u.numel > 0 && static_cast<int64_t>(u.nbytes()) <= max_bytes_ &&
         (u.algorithm == Algorithm::AUTO || u.algorithm == Algorithm::MPI) && comm_->size() > 1;
}

void EngineLane::submit(Unit* u) {
  queue_.push_back(u);
  if (queue_.size() == 1) start_next();
}

bool EngineLane::step() {
  if (queue_.empty()) return false;
  try {
    if (!op_->test()) return false;
  } catch (const TransportError& e) {
    fail_front(e.what());
    start_next();
    return true;
  }
  finish_front();
  start_next();
  return true;
}

// Start the collectives of the queue's front, in order; a unit that fails to start fails, and the next
// starts.
void EngineLane::start_next() {
  while (!queue_.empty() && op_ == nullptr) {
    Unit* u = queue_.front();
    try {
      if (hooks_.faults != nullptr && hooks_.faults->armed.exchange(false)) {
        std::lock_guard<std::mutex> lock(hooks_.faults->mu);
        throw TransportError(hooks_.faults->message);
      }
      uint8_t* buf = buffer_->data();
      const DType dt = u->dtype;
      if (u->kind != UnitKind::INPLACE) activity(hooks_, u, "MEMCPY_IN_FUSION_BUFFER");
      for (const Piece& p : u->pieces) {
        const Request* r = p.request;
        const void* src = element_at(r->input != nullptr ? r->input : r->output, p.offset, dt);
        uint8_t* part = element_at(buf, p.buf_offset, dt);
        if (u->prescale != 1.0) scale_into(src, part, p.count, dt, u->prescale);
        else copy_bytes(part, src, p.count * itemsize(dt));
      }
      activity(hooks_, u, "MPI_ALLREDUCE");
      op_ = comm_->iallreduce(nullptr, buf, static_cast<size_t>(u->numel), dt, u->reduce_op);
    } catch (const TransportError& e) {
      fail_front(e.what());
    }
  }
}

// The front's collective completed: copy the result out (with the postscale) and finish its pieces.
void EngineLane::finish_front() {
  Unit* u = queue_.front();
  queue_.pop_front();
  op_.reset();
  const uint8_t* buf = buffer_->data();
  const DType dt = u->dtype;
  if (u->kind != UnitKind::INPLACE) activity(hooks_, u, "MEMCPY_OUT_FUSION_BUFFER");
  for (const Piece& p : u->pieces) {
    uint8_t* dst = element_at(p.request->output, p.offset, dt);
    const uint8_t* part = element_at(buf, p.buf_offset, dt);
    if (u->postscale != 1.0) scale_into(part, dst, p.count, dt, u->postscale);
    else copy_bytes(dst, part, p.count * itemsize(dt));
  }
  for (const Piece& p : u->pieces) hooks_.piece_done(p.request);
  hooks_.recycle(u);
}

void EngineLane::fail_front(const std::string& what) {
  Unit* u = queue_.front();
  queue_.pop_front();
  op_.reset();
  hooks_.unit_failed(u, what, ErrorKind::INTERNAL);  // also finishes its pieces
  hooks_.recycle(u);
}

void EngineLane::drop(Unit* u) {
  for (const Piece& p : u->pieces) hooks_.piece_done(p.request);
  hooks_.recycle(u);
}

void EngineLane::release() {
  if (queue_.empty()) return;
  if (op_ != nullptr) {
    bool done = false;
    try {
      done = op_->test();
    } catch (const TransportError&) {
      done = true;  // failed: it will not write any more
    }
    if (!done) {  // keep the front (and the buffer) until its collective is over; drop the rest
      while (queue_.size() > 1) {
        drop(queue_.back());
        queue_.pop_back();
      }
      return;
    }
    op_.reset();
  }
  while (!queue_.empty()) {
    Unit* u = queue_.front();
    queue_.pop_front();
    drop(u);
  }
}

}  // namespace perseus
