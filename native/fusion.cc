// Stage 3: fusion planning (see fusion.h).
#include "fusion.h"

#include <algorithm>

namespace perseus {

UnitPool::~UnitPool() {
  for (Unit* u : free_) delete u;
}

Unit* UnitPool::get() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!free_.empty()) {
      Unit* u = free_.back();
      free_.pop_back();
      return u;
    }
  }
  return new Unit();
}

// Every unit kept grows to the most pieces any unit has had, so that the next plan, whichever units it gets,
// appends its pieces without allocating.
void UnitPool::put(Unit* u) {
  const size_t pieces = u->pieces.size();
  u->pieces.clear();
  std::lock_guard<std::mutex> lock(mu_);
  if (free_.size() >= 4096) {
    delete u;
    return;
  }
  most_pieces_ = std::max(most_pieces_, pieces);
  if (u->pieces.capacity() < most_pieces_) u->pieces.reserve(most_pieces_);
  free_.push_back(u);
}

namespace {

double postscale_of(const Signature& s, int divisor) {
  if (s.reduce_op == static_cast<int>(ReduceOp::AVERAGE) &&
      (s.op_type == OpType::ALLREDUCE || s.op_type == OpType::REDUCESCATTER))
    return s.postscale / divisor;
  return s.postscale;
}

Unit* make_unit(UnitPool* pool, UnitKind kind, OpType op, DType dtype, ReduceOp rop, double pre, double post,
                int32_t device) {
  Unit* u = pool->get();
  u->device = device;
  u->kind = kind;
  u->op_type = op;
  u->dtype = dtype;
  u->reduce_op = rop;
  u->prescale = pre;
  u->postscale = post;
  u->numel = 0;
  u->pieces.clear();
  return u;
}

}  // namespace

void plan_units(const std::vector<Request*>& requests, int64_t host_fusion_threshold_bytes,
                int64_t host_inplace_threshold_bytes, int average_divisor, UnitPool* pool, std::vector<Unit*>* units,
                int64_t device_fusion_threshold_bytes) {
  // A packed unit stays open while in-place units and other ops are emitted, so small tensors scattered
  // between large ones (biases between weights) still travel together: one open unit per
  // (device, dtype, reduction, scales), emitted at the position of its first tensor. Few keys exist at once, so a
  // short vector beats a map.
  struct Open {
    int32_t device;
    DType dtype;
    ReduceOp op;
    double pre, post;
    Unit* unit;
  };
  Open open[16];
  int n_open = 0;
  for (Request* r : requests) {
    const Signature& s = r->sig;
    const int64_t numel = r->numel();
    const double post = postscale_of(s, average_divisor);
    if (s.op_type != OpType::ALLREDUCE) {
      r->remaining.store(1, std::memory_order_relaxed);
      Unit* u = make_unit(pool, UnitKind::SINGLE, s.op_type, s.dtype, static_cast<ReduceOp>(s.reduce_op),
                          s.prescale, post, s.device);
      u->pieces.push_back({r, 0, numel, 0});
      u->numel = numel;
      units->push_back(u);
      continue;
    }
    const bool on_device = s.device >= 0;
    const int64_t fusion_threshold_bytes = on_device ? device_fusion_threshold_bytes : host_fusion_threshold_bytes;
    const int64_t inplace_threshold_bytes = on_device ? device_fusion_threshold_bytes : host_inplace_threshold_bytes;
    const int64_t item = static_cast<int64_t>(itemsize(s.dtype));
    const ReduceOp rop = s.reduce_op == static_cast<int>(ReduceOp::AVERAGE) ? ReduceOp::SUM
                                                                             : static_cast<ReduceOp>(s.reduce_op);
    const int64_t nbytes = numel * item;
    if (nbytes >= std::max<int64_t>(inplace_threshold_bytes, 1) || nbytes > fusion_threshold_bytes) {
      // An Adasum tensor stays whole: its coefficients come from dot products over all of it.
      const int64_t step = fusion_threshold_bytes > 0 && rop != ReduceOp::ADASUM
                               ? std::max<int64_t>(fusion_threshold_bytes / item, 1)
                               : std::max<int64_t>(numel, 1);
      int parts = 0;
      for (int64_t start = 0; start < numel || (numel == 0 && start == 0); start += step) {
        Unit* u = make_unit(pool, UnitKind::INPLACE, OpType::ALLREDUCE, s.dtype, rop, s.prescale, post, s.device);
        const int64_t count = std::min(step, numel - start);
        u->pieces.push_back({r, start, count, 0});
        u->numel = count;
        units->push_back(u);
        ++parts;
        if (numel == 0) break;
      }
      r->remaining.store(parts, std::memory_order_relaxed);
      continue;
    }
    r->remaining.store(1, std::memory_order_relaxed);
    Open* slot = nullptr;
    for (int i = 0; i < n_open; ++i)
      if (open[i].device == s.device && open[i].dtype == s.dtype && open[i].op == rop && open[i].pre == s.prescale &&
          open[i].post == post) {
        slot = &open[i];
        break;
      }
    if (slot == nullptr || (slot->unit->numel + numel) * item > fusion_threshold_bytes) {
      Unit* u = make_unit(pool, UnitKind::PACKED, OpType::ALLREDUCE, s.dtype, rop, s.prescale, post, s.device);
      units->push_back(u);
      if (slot == nullptr) {
        if (n_open == 16) n_open = 0;  // more keys than slots: forget the oldest (only costs packing)
        slot = &open[n_open++];
        slot->device = s.device, slot->dtype = s.dtype, slot->op = rop, slot->pre = s.prescale, slot->post = post;
      }
      slot->unit = u;
    }
    Unit* u = slot->unit;
    u->pieces.push_back({r, 0, numel, u->numel});
    u->numel += numel;
  }
}

}  // namespace perseus
