// A first-in first-out queue of pointers over one vector whose capacity is kept: unlike std::deque, which
// allocates and frees a block every few dozen pushes, it allocates nothing once it has held its largest
// backlog. Not thread-safe.
#pragma once

#include <cstddef>
#include <vector>

namespace perseus {

template <class T>
class Fifo {
 public:
  bool empty() const { return head_ == items_.size(); }
  size_t size() const { return items_.size() - head_; }
  T& front() { return items_[head_]; }
  T& back() { return items_.back(); }
  void push_back(T x) {
    if (empty()) {
      items_.clear();
      head_ = 0;
    } else if (head_ >= 64 && head_ * 2 >= items_.size()) {  // the consumed half: drop it, keep capacity
      items_.erase(items_.begin(), items_.begin() + static_cast<std::ptrdiff_t>(head_));
      head_ = 0;
    }
    items_.push_back(x);
  }
  void pop_front() { ++head_; }
  void pop_back() { items_.pop_back(); }

 private:
  std::vector<T> items_;
  size_t head_ = 0;
};

}  // namespace perseus
