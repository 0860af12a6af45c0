// Objects made and destroyed on every training step (a pending MPI operation, a handle's Python extras) keep
// their memory for the next one: derive from Recycled<T> and `new T` / `delete` reuse up to kKept blocks.
// Construction and destruction run as usual; only the heap allocation is saved.
#pragma once

#include <cstddef>
#include <mutex>
#include <new>
#include <vector>

namespace perseus {

template <class T, size_t kKept = 64>
class Recycled {
 public:
  static void* operator new(size_t size) {
    Blocks& b = blocks();
    if (size == sizeof(T)) {
      std::lock_guard<std::mutex> lock(b.mu);
      if (!b.free.empty()) {
        void* p = b.free.back();
        b.free.pop_back();
        return p;
      }
    }
    return ::operator new(size);
  }
  static void operator delete(void* p, size_t size) {
    Blocks& b = blocks();
    if (size == sizeof(T)) {
      std::lock_guard<std::mutex> lock(b.mu);
      if (b.free.size() < kKept) {
        b.free.push_back(p);
        return;
      }
    }
    ::operator delete(p);
  }

 private:
  struct Blocks {
    std::mutex mu;
    std::vector<void*> free;
    Blocks() { free.reserve(kKept); }
  };
  static Blocks& blocks() {
    static Blocks* b = new Blocks();  // never destroyed: objects may die during exit
    return *b;
  }
};

}  // namespace perseus
