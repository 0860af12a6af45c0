// Stage 3a: size-based buckets for all-reduces of device memory, decided from negotiated data only.
//
// A round hands the engine the device all-reduces that became ready in it; left alone, each round's would be one
// unit (one NCCL launch), so a backward pass would cost one launch per round however small its gradients. The
// buckets regroup them by size instead:
//  * Learning: the names of device all-reduces are recorded in negotiated order (within a round, the registry's
//    order, which may differ from the order in which they arrived) until a name comes again (the
//    next step has begun). Every rank records the same names in the same order, so every rank learns the same
//    plan: consecutive names with the same key (device, dtype, reduction, scales) grouped in that order, a bucket
//    closing once it holds at least the byte budget (the first bucket of each key: kFirstBucketBytes, so the first
//    launch of a step comes early). A tensor of at least the budget is not bucketed.
//  * Planned: a ready request whose name is in a bucket is held there; a bucket whose every member is held is
//    released whole, its members in plan order (one unit). Names outside the plan pass through unchanged.
//  * Flush: when a rank waits for a held request whose bucket misses a name this rank has not submitted, the
//    bucket cannot fill (the program's order differs from the plan): that rank asks for a flush in the next
//    round's flags, and at the end of that round every rank releases every open bucket's held requests as
//    they are, and splits each such bucket into what was held and what was missing. A name split off alone this
//    way (a collective the program waits for at once, e.g. SyncBatchNorm's statistics) is never bucketed again.
//    A plan split too often is learned again.
// Everything here is decided by the negotiated ready lists and the negotiated flush flag, so every rank holds
// and releases the same requests at the same point. Engine thread only, except awaited-flag reads.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "handles.h"

namespace perseus {

class DeviceBuckets {
 public:
  static constexpr int64_t kFirstBucketBytes = 1 << 20;
  static constexpr size_t kMaxLearned = 1 << 16;  // names recorded before learning gives up

  // budget_bytes <= 0: no buckets (every request passes through). Forgets the plan (not the names left out of plans).
  void configure(int64_t budget_bytes);
  int64_t budget() const { return budget_; }

  // Take the round's ready requests (negotiated order): device all-reduces of planned names are held and removed
  // from *ready; every bucket that became full is appended to *released (its members in plan order).
  void take(std::vector<Request*>* ready, std::vector<std::vector<Request*>>* released);
  // Release every open bucket's held requests (plan order), splitting those buckets (see above).
  void flush(std::vector<std::vector<Request*>>* released);
  // Whether some open bucket holds a request a user waits for (Request::awaited) and misses a name for which
  // `submitted_here` is false: this rank needs a flush.
  bool stuck(const std::function<bool(const std::string&)>& submitted_here) const;
  bool any_open() const { return open_ > 0; }
  // Every held request, for failing them (the buckets are emptied).
  void take_all_held(std::vector<Request*>* out);

  // For tests and counters.
  bool planned() const { return state_ == State::PLANNED; }
  size_t bucket_count() const { return buckets_.size(); }
  const std::vector<std::string>& bucket_members(size_t i) const { return buckets_[i].members; }
  int64_t flushes() const { return flushes_; }
  bool solo(const std::string& name) const { return solo_.count(name) != 0; }

 private:
  struct Key {
    int32_t device;
    DType dtype;
    int32_t op;  // the request's reduce_op (Average and Sum are different keys)
    double pre, post;
    bool operator==(const Key& o) const {
      return device == o.device && dtype == o.dtype && op == o.op && pre == o.pre && post == o.post;
    }
  };
  struct Bucket {
    Key key;
    std::vector<std::string> members;
    std::vector<Request*> held;  // parallel to members; nullptr: not yet ready
    size_t count = 0;            // non-null entries of held
  };
  struct Seen {
    std::string name;
    Key key;
    int64_t nbytes;
  };
  enum class State { OFF, LEARNING, PLANNED };

  Key key_of(const Request& r) const;
  bool bucketable(const Request& r) const;
  void learn();  // from seen_ to buckets_
  void relearn();
  void add_bucket(const Key& key, std::vector<std::string> members);
  void release(Bucket* b, std::vector<std::vector<Request*>>* released);

  State state_ = State::OFF;
  int64_t budget_ = 0;
  std::vector<Seen> seen_;
  std::unordered_set<std::string> seen_names_;
  std::vector<Bucket> buckets_;
  std::unordered_map<std::string, std::pair<size_t, size_t>> where_;  // name -> (bucket, position)
  std::unordered_set<std::string> solo_;  // names a flush split off alone: left out of every later plan
  size_t open_ = 0;  // buckets with count > 0
  size_t learned_buckets_ = 0;  // buckets when last learned
  int64_t splits_ = 0, flushes_ = 0;
};

}  // namespace perseus
