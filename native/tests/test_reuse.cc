// Tests for what a steady step reuses instead of allocating: the Fifo queue (fifo.h), the map node pool
// (node_pool.h), recycled object memory (recycled.h), and the core's allocation counter (alloc_count.h),
// linked in as the core links it. Exits 1 on any failure.
#include <cstdio>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "expect.h"
#include "../alloc_count.h"
#include "../fifo.h"
#include "../node_pool.h"
#include "../recycled.h"

using namespace perseus;

namespace {

void fifo_keeps_order_across_compaction() {
  Fifo<int> q;
  EXPECT(q.empty() && q.size() == 0);
  int next_in = 0, next_out = 0;
  bool in_order = true;
  // A backlog that never empties: the consumed front is dropped now and then, the order must hold.
  for (int round = 0; round < 1000; ++round) {
    for (int i = 0; i < 3; ++i) q.push_back(next_in++);
    for (int i = 0; i < 2; ++i) {
      in_order = in_order && q.front() == next_out++;
      q.pop_front();
    }
  }
  EXPECT(in_order);
  EXPECT(q.size() == static_cast<size_t>(next_in - next_out));
  q.push_back(-1);
  EXPECT(q.back() == -1);
  q.pop_back();
  while (!q.empty()) {
    in_order = in_order && q.front() == next_out++;
    q.pop_front();
  }
  EXPECT(in_order && next_out == next_in);
  // Emptied, then used as a steady queue: no allocation once it has held its backlog.
  for (int i = 0; i < 100; ++i) q.push_back(i);
  while (!q.empty()) q.pop_front();
  const uint64_t before = native_allocations();
  for (int step = 0; step < 1000; ++step) {
    for (int i = 0; i < 100; ++i) q.push_back(i);
    while (!q.empty()) q.pop_front();
  }
  EXPECT(native_allocations() == before);
}

void node_pool_reuses_nodes() {
  using Map = std::unordered_map<std::string_view, int>;
  Map map;
  NodePool<Map> pool;
  const std::vector<std::string> names = {"a", "b", "c", "d", "e", "f", "g", "h"};
  for (size_t i = 0; i < names.size(); ++i) pool.put(map, names[i], static_cast<int>(i));
  pool.put(map, "a", 42);  // an existing key: the value changes, no second entry
  EXPECT(map.size() == names.size() && map.at("a") == 42);
  for (auto it = map.begin(); it != map.end();) it = pool.erase(map, it);
  EXPECT(map.empty());
  const uint64_t before = native_allocations();
  for (int step = 0; step < 1000; ++step) {
    for (size_t i = 0; i < names.size(); ++i) pool.put(map, names[i], step);
    for (const auto& n : names) pool.erase(map, n);
  }
  EXPECT(native_allocations() == before);
  pool.put(map, "x", 1);
  pool.put(map, "x", 2);  // from a kept node, onto a present key: the value changes, the node is kept
  pool.erase(map, "missing");  // absent: nothing happens
  EXPECT(map.size() == 1 && map.at("x") == 2);
}

struct Thing : Recycled<Thing, 4> {
  int value = 7;
  std::vector<int> data;
};

void recycled_objects_reuse_memory() {
  Thing* first = new Thing();
  void* where = first;
  delete first;
  Thing* second = new Thing();  // constructed afresh in the memory kept
  EXPECT(static_cast<void*>(second) == where && second->value == 7 && second->data.empty());
  delete second;
  std::vector<Thing*> many;
  for (int i = 0; i < 10; ++i) many.push_back(new Thing());  // more than kept: the rest from the heap
  for (Thing* t : many) delete t;
  const uint64_t before = native_allocations();
  for (int i = 0; i < 1000; ++i) delete new Thing();
  EXPECT(native_allocations() == before);
}

int* volatile g_sink;  // the compiler may drop a new/delete pair whose pointer goes nowhere

void the_counter_counts() {
  const uint64_t before = native_allocations();
  auto* p = new int(3);
  g_sink = p;
  auto* a = new int[4];
  g_sink = a;
  delete p;
  delete[] a;
  EXPECT(native_allocations() == before + 2);
}

}  // namespace

int main() {
  fifo_keeps_order_across_compaction();
  node_pool_reuses_nodes();
  recycled_objects_reuse_memory();
  the_counter_counts();
  return perseus_test::expect_summary("reuse");
}
