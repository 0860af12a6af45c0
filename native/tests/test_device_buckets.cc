// Tests for the device buckets (device_buckets.h) on their own: which buckets a step's negotiated order makes,
// holding and releasing, a flush that splits the buckets it empties early, learning again after too many
// splits, the stuck check, and failing held requests. Exits 1 on any failure.
#include <cstdio>
#include <deque>
#include <string>
#include <vector>

#include "expect.h"
#include "../device_buckets.h"

using namespace perseus;

namespace {

// Requests live here (a deque: pointers stay valid).
std::deque<Request> g_requests;

Request* device_request(const std::string& name, int64_t floats, DType dtype = DType::FLOAT32, int device = 0) {
  g_requests.emplace_back();
  Request* r = &g_requests.back();
  r->name = name;
  r->sig.op_type = OpType::ALLREDUCE;
  r->sig.dtype = dtype;
  r->sig.device = device;
  r->sig.shape = {floats};
  r->shape = {floats};
  return r;
}

// One round: the names (with their sizes) become ready in this order; returns the requests passed through and
// fills `released` with the names of each released bucket.
std::vector<std::string> round(DeviceBuckets* b, const std::vector<std::pair<std::string, int64_t>>& names,
                               std::vector<std::vector<std::string>>* released, bool flush = false) {
  std::vector<Request*> ready;
  for (auto& n : names) ready.push_back(device_request(n.first, n.second));
  std::vector<std::vector<Request*>> out;
  b->take(&ready, &out);
  if (flush) b->flush(&out);
  released->clear();
  for (auto& group : out) {
    released->emplace_back();
    for (Request* r : group) released->back().push_back(r->name);
  }
  std::vector<std::string> passed;
  for (Request* r : ready) passed.push_back(r->name);
  return passed;
}

using Names = std::vector<std::string>;
using Groups = std::vector<Names>;
constexpr int64_t MiB = 1 << 20;

void test_learned_buckets() {
  DeviceBuckets b;
  b.configure(4 * MiB);
  // Step 1, in three rounds: learned only; everything passes through.
  Groups rel;
  // Floats: a = 128 Ki floats (0.5 MiB), b = 0.5 MiB (first bucket full at 1 MiB), c..e 1.5 MiB each.
  EXPECT(round(&b, {{"a", 128 << 10}, {"b", 128 << 10}}, &rel) == (Names{"a", "b"}));
  EXPECT(round(&b, {{"c", 384 << 10}, {"d", 384 << 10}}, &rel) == (Names{"c", "d"}));
  EXPECT(round(&b, {{"e", 384 << 10}, {"big", 1 << 20}}, &rel) == (Names{"e", "big"}));  // big = 4 MiB
  EXPECT(rel.empty() && !b.planned());
  // Step 2: "a" again ends learning. Buckets: {a, b} (the first, 1 MiB), {c, d, e} (4.5 MiB >= 4 MiB).
  EXPECT(round(&b, {{"a", 128 << 10}}, &rel).empty() && rel.empty());
  EXPECT(b.planned() && b.bucket_count() == 2);
  EXPECT(b.bucket_members(0) == (Names{"a", "b"}) && b.bucket_members(1) == (Names{"c", "d", "e"}));
  EXPECT(b.any_open());
  // "big" (at least the budget) is not bucketed: it passes through; "b" fills the first bucket.
  EXPECT(round(&b, {{"big", 1 << 20}, {"b", 128 << 10}, {"d", 384 << 10}}, &rel) == (Names{"big"}));
  EXPECT(rel == (Groups{{"a", "b"}}));
  // Members come in any order; the bucket is released in plan order once complete.
  EXPECT(round(&b, {{"e", 384 << 10}, {"c", 384 << 10}}, &rel).empty());
  EXPECT(rel == (Groups{{"c", "d", "e"}}) && !b.any_open());
  // A name the plan does not know passes through.
  EXPECT(round(&b, {{"new", 10}}, &rel) == (Names{"new"}) && rel.empty());
}

void test_keys_are_separate() {
  DeviceBuckets b;
  b.configure(8 * MiB);
  std::vector<Request*> ready = {device_request("f1", 10), device_request("h1", 10, DType::FLOAT16),
                                 device_request("f2", 10), device_request("g1", 10, DType::FLOAT32, 1)};
  std::vector<std::vector<Request*>> out;
  b.take(&ready, &out);
  ready = {device_request("f1", 10)};
  b.take(&ready, &out);
  EXPECT(b.bucket_count() == 3);
  EXPECT(b.bucket_members(0) == (Names{"f1", "f2"}) && b.bucket_members(1) == (Names{"h1"}) &&
         b.bucket_members(2) == (Names{"g1"}));
  // A host request, or another collective, is never bucketed.
  Request* host = device_request("f2", 10, DType::FLOAT32, -1);
  Request* gather = device_request("h1", 10, DType::FLOAT16);
  gather->sig.op_type = OpType::ALLGATHER;
  ready = {host, gather};
  b.take(&ready, &out);
  EXPECT(ready.size() == 2 && out.empty());
}

void test_flush_splits() {
  DeviceBuckets b;
  b.configure(8 * MiB);
  Groups rel;
  round(&b, {{"a", 10}, {"b", 10}, {"c", 10}}, &rel);
  round(&b, {{"a", 10}}, &rel);  // learned: {a, b, c}; a held
  EXPECT(b.bucket_count() == 1 && b.any_open());
  // A flush releases a and splits the bucket into {a} and {b, c}.
  EXPECT(round(&b, {}, &rel, true).empty());
  EXPECT(rel == (Groups{{"a"}}) && !b.any_open() && b.flushes() == 1);
  EXPECT(b.bucket_count() == 2 && b.bucket_members(0) == (Names{"a"}) &&
         b.bucket_members(1) == (Names{"b", "c"}));
  // {a} alone is released at once; {b, c} fills as before.
  round(&b, {{"a", 10}, {"c", 10}}, &rel);
  EXPECT(rel == (Groups{{"a"}}) && b.any_open());
  round(&b, {{"b", 10}}, &rel);
  EXPECT(rel == (Groups{{"b", "c"}}));
}

void test_relearn_after_many_splits() {
  DeviceBuckets b;
  b.configure(8 * MiB);
  Groups rel;
  const Names names = {"n0", "n1", "n2", "n3", "n4", "n5", "n6", "n7"};
  std::vector<std::pair<std::string, int64_t>> step;
  for (auto& n : names) step.emplace_back(n, 10);
  round(&b, step, &rel);
  round(&b, {}, &rel);
  EXPECT(!b.planned());  // (no name came again yet)
  // Each round: one name, then a flush: the bucket that holds it splits.
  for (int i = 0; i < 5; ++i) {
    EXPECT(b.planned() || i == 0);
    round(&b, {{names[i], 10}}, &rel, true);
    EXPECT(rel == (Groups{{names[i]}}));
  }
  // 5 splits > max(4, 2 x 1 bucket learned): learned again from the next step; meanwhile names pass through.
  EXPECT(!b.planned() && !b.any_open());
  EXPECT(round(&b, {{"n0", 10}, {"n1", 10}}, &rel) == (Names{"n0", "n1"}) && rel.empty());
}

void test_names_waited_for_alone_leave_the_plan() {
  // s0..s7 are waited for one by one (SyncBatchNorm's statistics): each flush splits one off alone, and the plan
  // learned again (after more than 4 splits) leaves those out, so the splitting ends there.
  DeviceBuckets b;
  b.configure(8 * MiB);
  Groups rel;
  std::vector<std::pair<std::string, int64_t>> step;
  for (int i = 0; i < 8; ++i) step.emplace_back("s" + std::to_string(i), 10);
  step.emplace_back("g", 10);
  round(&b, step, &rel);  // learning
  for (int i = 0; i < 5; ++i) {
    const std::string name = "s" + std::to_string(i);
    round(&b, {{name, 10}}, &rel, true);  // (the first round learns the plan: one bucket of all nine)
    EXPECT(rel == (Groups{{name}}) && b.solo(name));
  }
  EXPECT(!b.solo("g") && !b.planned());  // 5 splits: learned again from the next step
  round(&b, step, &rel);  // learning again
  EXPECT(round(&b, {{"s0", 10}, {"s5", 10}}, &rel) == (Names{"s0"}));  // s0 passes through, s5 is held
  EXPECT(b.planned() && b.any_open() && b.bucket_count() == 1);
  EXPECT(b.bucket_members(0) == (Names{"s5", "s6", "s7", "g"}));
}

void test_stuck_and_take_all_held() {
  DeviceBuckets b;
  b.configure(8 * MiB);
  Groups rel;
  round(&b, {{"a", 10}, {"b", 10}}, &rel);
  Request* a = device_request("a", 10);
  std::vector<Request*> ready = {a};
  std::vector<std::vector<Request*>> out;
  b.take(&ready, &out);
  EXPECT(ready.empty() && out.empty() && b.any_open());  // a is held
  auto submitted_nothing = [](const std::string&) { return false; };
  auto submitted_all = [](const std::string&) { return true; };
  EXPECT(!b.stuck(submitted_nothing));  // nobody waits for a
  a->awaited.store(true);
  EXPECT(b.stuck(submitted_nothing));   // a is awaited, b not submitted here: a flush is needed
  EXPECT(!b.stuck(submitted_all));      // b was submitted here: the bucket fills once every rank has it
  std::vector<Request*> held;
  b.take_all_held(&held);
  EXPECT(held.size() == 1 && held[0] == a && !b.any_open());
}

void test_off() {
  DeviceBuckets b;
  b.configure(0);
  Groups rel;
  for (int i = 0; i < 3; ++i) EXPECT(round(&b, {{"a", 10}, {"b", 10}}, &rel) == (Names{"a", "b"}) && rel.empty());
  EXPECT(!b.planned());
}

}  // namespace

int main() {
  test_learned_buckets();
  test_keys_are_separate();
  test_flush_splits();
  test_relearn_after_many_splits();
  test_names_waited_for_alone_leave_the_plan();
  test_stuck_and_take_all_held();
  test_off();
  return perseus_test::expect_summary("test_device_buckets");
}
