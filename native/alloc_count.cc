// Counting replacements of the global operator new / delete for the core (alloc_count.h). Each one counts and
// then forwards to the process's own operator new / delete (found with dlsym: libstdc++'s, or a memory
// checker's such as AddressSanitizer's), so that memory allocated inside libstdc++'s compiled code and freed by
// the core's inline code, or the other way round, always meets the same allocator. Where the process has no
// global operator new (nothing loaded libstdc++ globally), malloc, aligned_alloc and free serve, as they do
// for libstdc++ itself.
#include "alloc_count.h"

#include <dlfcn.h>

#include <atomic>
#include <cstdlib>
#include <new>

namespace {

std::atomic<uint64_t> g_allocations{0};

using NewFn = void* (*)(std::size_t);
using NewAlignedFn = void* (*)(std::size_t, std::align_val_t);
using DeleteFn = void (*)(void*);
using DeleteAlignedFn = void (*)(void*, std::align_val_t);

struct Next {
  NewFn new_one, new_array;
  NewAlignedFn new_one_aligned, new_array_aligned;
  DeleteFn delete_one, delete_array;
  DeleteAlignedFn delete_one_aligned, delete_array_aligned;
};

// The process's definition of `symbol`, or nullptr when there is none or it is this file's own (the core does
// not export its own, core.map, but a program linked with this file directly does).
template <class F>
F find(const char* symbol, F own) {
  F f = reinterpret_cast<F>(dlsym(RTLD_DEFAULT, symbol));
  return f == own ? nullptr : f;
}

const Next& next() {
  static const Next n{
      find<NewFn>("_Znwm", &::operator new), find<NewFn>("_Znam", &::operator new[]),
      find<NewAlignedFn>("_ZnwmSt11align_val_t", &::operator new),
      find<NewAlignedFn>("_ZnamSt11align_val_t", &::operator new[]),
      find<DeleteFn>("_ZdlPv", &::operator delete), find<DeleteFn>("_ZdaPv", &::operator delete[]),
      find<DeleteAlignedFn>("_ZdlPvSt11align_val_t", &::operator delete),
      find<DeleteAlignedFn>("_ZdaPvSt11align_val_t", &::operator delete[])};
  return n;
}

void* allocate(std::size_t size, NewFn fn) {
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  if (fn != nullptr) return fn(size);  // throws std::bad_alloc itself
  if (void* p = std::malloc(size == 0 ? 1 : size)) return p;
  throw std::bad_alloc();
}

void* allocate_aligned(std::size_t size, std::align_val_t align, NewAlignedFn fn) {
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  if (fn != nullptr) return fn(size, align);
  const std::size_t a = static_cast<std::size_t>(align);
  const std::size_t rounded = ((size == 0 ? 1 : size) + a - 1) / a * a;  // aligned_alloc wants a multiple
  if (void* p = std::aligned_alloc(a, rounded)) return p;
  throw std::bad_alloc();
}

void release(void* p, DeleteFn fn) {
  if (fn != nullptr) fn(p);
  else std::free(p);
}

void release_aligned(void* p, std::align_val_t align, DeleteAlignedFn fn) {
  if (fn != nullptr) fn(p, align);
  else std::free(p);
}

}  // namespace

namespace perseus {
uint64_t native_allocations() { return g_allocations.load(std::memory_order_relaxed); }
}  // namespace perseus

void* operator new(std::size_t size) { return allocate(size, next().new_one); }
void* operator new[](std::size_t size) { return allocate(size, next().new_array); }
void* operator new(std::size_t size, const std::nothrow_t&) noexcept {
  try {
    return allocate(size, next().new_one);
  } catch (const std::bad_alloc&) {
    return nullptr;
  }
}
void* operator new[](std::size_t size, const std::nothrow_t&) noexcept {
  try {
    return allocate(size, next().new_array);
  } catch (const std::bad_alloc&) {
    return nullptr;
  }
}
void* operator new(std::size_t size, std::align_val_t align) {
  return allocate_aligned(size, align, next().new_one_aligned);
}
void* operator new[](std::size_t size, std::align_val_t align) {
  return allocate_aligned(size, align, next().new_array_aligned);
}
void* operator new(std::size_t size, std::align_val_t align, const std::nothrow_t&) noexcept {
  try {
    return allocate_aligned(size, align, next().new_one_aligned);
  } catch (const std::bad_alloc&) {
    return nullptr;
  }
}
void* operator new[](std::size_t size, std::align_val_t align, const std::nothrow_t&) noexcept {
  try {
    return allocate_aligned(size, align, next().new_array_aligned);
  } catch (const std::bad_alloc&) {
    return nullptr;
  }
}

void operator delete(void* p) noexcept { release(p, next().delete_one); }
void operator delete[](void* p) noexcept { release(p, next().delete_array); }
void operator delete(void* p, std::size_t) noexcept { release(p, next().delete_one); }
void operator delete[](void* p, std::size_t) noexcept { release(p, next().delete_array); }
void operator delete(void* p, const std::nothrow_t&) noexcept { release(p, next().delete_one); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { release(p, next().delete_array); }
void operator delete(void* p, std::align_val_t a) noexcept { release_aligned(p, a, next().delete_one_aligned); }
void operator delete[](void* p, std::align_val_t a) noexcept { release_aligned(p, a, next().delete_array_aligned); }
void operator delete(void* p, std::size_t, std::align_val_t a) noexcept {
  release_aligned(p, a, next().delete_one_aligned);
}
void operator delete[](void* p, std::size_t, std::align_val_t a) noexcept {
  release_aligned(p, a, next().delete_array_aligned);
}
void operator delete(void* p, std::align_val_t a, const std::nothrow_t&) noexcept {
  release_aligned(p, a, next().delete_one_aligned);
}
void operator delete[](void* p, std::align_val_t a, const std::nothrow_t&) noexcept {
  release_aligned(p, a, next().delete_array_aligned);
}
