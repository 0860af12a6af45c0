// Nodes of a node-based map (std::unordered_map) kept for reuse: a key inserted and erased every training
// step (a request's name, a handle's id) would otherwise cost a heap allocation per insert. The pool is not
// thread-safe: use it under the same lock as the map it serves.
#pragma once

#include <iterator>
#include <utility>
#include <vector>

namespace perseus {

template <class Map>
class NodePool {
 public:
  using Key = typename Map::key_type;
  using Mapped = typename Map::mapped_type;

  // map[key] = value, in a node released earlier when there is one.
  // One hash lookup: the insert itself tells whether the key was there.
  void put(Map& map, const Key& key, const Mapped& value) {
    if (free_.empty()) {
      auto placed = map.emplace(key, value);
      if (!placed.second) placed.first->second = value;
      return;
    }
    typename Map::node_type node = std::move(free_.back());
    free_.pop_back();
    node.key() = key;
    node.mapped() = value;
    auto placed = map.insert(std::move(node));
    if (!placed.inserted) {  // the key was there: update it, keep the node
      placed.position->second = value;
      free_.push_back(std::move(placed.node));
    }
  }

  // Erase *it, keeping its node; the iterator after it.
  typename Map::iterator erase(Map& map, typename Map::iterator it) {
    auto next = std::next(it);
    free_.push_back(map.extract(it));
    return next;
  }

  // Erase `key` if present, keeping its node.
  void erase(Map& map, const Key& key) {
    typename Map::node_type node = map.extract(key);
    if (!node.empty()) free_.push_back(std::move(node));
  }

 private:
  std::vector<typename Map::node_type> free_;
};

}  // namespace perseus
