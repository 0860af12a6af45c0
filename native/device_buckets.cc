// Stage 3a: device buckets (see device_buckets.h).
#include "device_buckets.h"

#include <algorithm>

namespace perseus {

void DeviceBuckets::configure(int64_t budget_bytes) {
  budget_ = budget_bytes;
  seen_.clear();
  seen_names_.clear();
  buckets_.clear();
  where_.clear();
  open_ = 0;
  splits_ = 0;
  state_ = budget_ > 0 ? State::LEARNING : State::OFF;
}

DeviceBuckets::Key DeviceBuckets::key_of(const Request& r) const {
  return Key{r.sig.device, r.sig.dtype, r.sig.reduce_op, r.sig.prescale, r.sig.postscale};
}

bool DeviceBuckets::bucketable(const Request& r) const {
  // (An Adasum tensor never reaches the device path; kept out all the same: its reduction is per tensor.)
  return r.sig.device >= 0 && r.sig.op_type == OpType::ALLREDUCE &&
         r.sig.reduce_op != static_cast<int32_t>(ReduceOp::ADASUM) && static_cast<int64_t>(r.nbytes()) < budget_;
}

void DeviceBuckets::add_bucket(const Key& key, std::vector<std::string> members) {
  Bucket b;
  b.key = key;
  b.held.assign(members.size(), nullptr);
  for (size_t i = 0; i < members.size(); ++i) where_[members[i]] = {buckets_.size(), i};
  b.members = std::move(members);
  buckets_.push_back(std::move(b));
}

void DeviceBuckets::learn() {
  struct Open {
    Key key;
    std::vector<std::string> members;
    int64_t bytes;
    int64_t cap;
  };
  std::vector<Open> open;  // one per key (few keys: a linear search)
  std::vector<std::pair<Key, std::vector<std::string>>> closed;
  for (const Seen& s : seen_) {
    if (solo_.count(s.name)) continue;  // waited for on its own: passes through
    Open* o = nullptr;
    for (Open& c : open)
      if (c.key == s.key) o = &c;
    if (o == nullptr) {
      open.push_back({s.key, {}, 0, std::min(budget_, kFirstBucketBytes)});
      o = &open.back();
    }
    o->members.push_back(s.name);
    o->bytes += s.nbytes;
    if (o->bytes >= o->cap) {  // full: the next name of this key starts a bucket of the whole budget
      closed.emplace_back(o->key, std::move(o->members));
      o->members.clear();
      o->bytes = 0;
      o->cap = budget_;
    }
  }
  for (Open& o : open)
    if (!o.members.empty()) closed.emplace_back(o.key, std::move(o.members));
  // Buckets in the order of their first member in the step (the order in which they start to fill).
  std::unordered_map<std::string, size_t> position;
  for (size_t i = 0; i < seen_.size(); ++i) position[seen_[i].name] = i;
  std::stable_sort(closed.begin(), closed.end(), [&](const auto& a, const auto& b) {
    return position[a.second.front()] < position[b.second.front()];
  });
  buckets_.clear();
  where_.clear();
  for (auto& c : closed) add_bucket(c.first, std::move(c.second));
  learned_buckets_ = buckets_.size();
  splits_ = 0;
  seen_.clear();
  seen_names_.clear();
  state_ = State::PLANNED;
}

void DeviceBuckets::relearn() {
  buckets_.clear();
  where_.clear();
  open_ = 0;
  splits_ = 0;
  state_ = State::LEARNING;
}

void DeviceBuckets::release(Bucket* b, std::vector<std::vector<Request*>>* released) {
  std::vector<Request*> out;
  out.reserve(b->count);
  for (Request*& r : b->held)
    if (r != nullptr) {
      out.push_back(r);
      r = nullptr;
    }
  b->count = 0;
  --open_;
  released->push_back(std::move(out));
}

void DeviceBuckets::take(std::vector<Request*>* ready, std::vector<std::vector<Request*>>* released) {
  if (state_ == State::OFF) return;
  size_t kept = 0;
  for (Request* r : *ready) {
    if (!bucketable(*r)) {
      (*ready)[kept++] = r;
      continue;
    }
    if (state_ == State::LEARNING) {
      if (seen_names_.count(r->name) == 0) {
        seen_names_.insert(r->name);
        seen_.push_back({r->name, key_of(*r), static_cast<int64_t>(r->nbytes())});
        if (seen_.size() > kMaxLearned) {  // names that never come again: no steps to learn from
          seen_.clear();
          seen_names_.clear();
          state_ = State::OFF;
        }
        (*ready)[kept++] = r;
        continue;
      }
      learn();  // a name came again: the next step has begun
    }
    auto it = where_.find(r->name);
    if (it == where_.end()) {
      (*ready)[kept++] = r;  // not in the plan
      continue;
    }
    Bucket& b = buckets_[it->second.first];
    Request*& slot = b.held[it->second.second];
    if (slot != nullptr) {  // cannot happen (a name is in flight once); pass it through rather than lose it
      (*ready)[kept++] = r;
      continue;
    }
    slot = r;
    if (b.count++ == 0) ++open_;
    if (b.count == b.members.size()) release(&b, released);
  }
  ready->resize(kept);
}

void DeviceBuckets::flush(std::vector<std::vector<Request*>>* released) {
  if (open_ == 0) return;
  ++flushes_;
  const size_t n = buckets_.size();  // buckets split off below are appended, empty
  for (size_t i = 0; i < n; ++i) {
    Bucket& b = buckets_[i];
    if (b.count == 0) continue;
    if (b.count < b.members.size()) {
      // Split: what was held stays this bucket, what was missing becomes a new one.
      std::vector<std::string> kept_names, missing;
      std::vector<Request*> kept_held;
      for (size_t j = 0; j < b.members.size(); ++j) {
        if (b.held[j] != nullptr) {
          kept_names.push_back(b.members[j]);
          kept_held.push_back(b.held[j]);
        } else {
          missing.push_back(b.members[j]);
        }
      }
      if (kept_names.size() == 1) solo_.insert(kept_names.front());
      b.members = std::move(kept_names);
      b.held = std::move(kept_held);
      for (size_t j = 0; j < b.members.size(); ++j) where_[b.members[j]] = {i, j};
      const Key key = b.key;
      add_bucket(key, std::move(missing));  // (b may move: not used after this)
      ++splits_;
    }
    release(&buckets_[i], released);
  }
  if (splits_ > std::max<int64_t>(4, 2 * static_cast<int64_t>(learned_buckets_))) relearn();
}

bool DeviceBuckets::stuck(const std::function<bool(const std::string&)>& submitted_here) const {
  if (open_ == 0) return false;
  for (const Bucket& b : buckets_) {
    if (b.count == 0) continue;
    bool awaited = false;
    for (Request* r : b.held)
      if (r != nullptr && r->awaited.load(std::memory_order_acquire)) awaited = true;
    if (!awaited) continue;
    for (size_t j = 0; j < b.members.size(); ++j)
      if (b.held[j] == nullptr && !submitted_here(b.members[j])) return true;
  }
  return false;
}

void DeviceBuckets::take_all_held(std::vector<Request*>* out) {
  for (Bucket& b : buckets_) {
    for (Request*& r : b.held)
      if (r != nullptr) {
        out->push_back(r);
        r = nullptr;
      }
    b.count = 0;
  }
  open_ = 0;
}

}  // namespace perseus
