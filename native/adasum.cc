// Adasum (see adasum.h).
#include "adasum.h"

#include <algorithm>
#include <string>

#include "buffers.h"
#include "kernels.h"

namespace perseus {

namespace {

// Element access in double for the four floating-point dtypes.
inline double load(const void* base, size_t i, DType dt) {
  switch (dt) {
    case DType::FLOAT64: return static_cast<const double*>(base)[i];
    case DType::FLOAT32: return static_cast<const float*>(base)[i];
    case DType::FLOAT16: return half_to_float(static_cast<const uint16_t*>(base)[i]);
    default: return bf16_to_float(static_cast<const uint16_t*>(base)[i]);  // BFLOAT16
  }
}

inline void store(void* base, size_t i, DType dt, double v) {
  switch (dt) {
    case DType::FLOAT64: static_cast<double*>(base)[i] = v; break;
    case DType::FLOAT32: static_cast<float*>(base)[i] = static_cast<float>(v); break;
    case DType::FLOAT16: static_cast<uint16_t*>(base)[i] = float_to_half(static_cast<float>(v)); break;
    default: static_cast<uint16_t*>(base)[i] = float_to_bf16(static_cast<float>(v)); break;
  }
}

template <typename T>
void dots_typed(const T* l, const T* r, size_t n, double* out) {
  double lr = 0, ll = 0, rr = 0;
  for (size_t i = 0; i < n; ++i) {
    const double a = l[i], b = r[i];
    lr += a * b, ll += a * a, rr += b * b;
  }
  out[0] += lr, out[1] += ll, out[2] += rr;
}

// out[0..2] += (l.r, l.l, r.r) over n elements.
void dots(const void* l, const void* r, size_t n, DType dt, double* out) {
  if (dt == DType::FLOAT32) return dots_typed(static_cast<const float*>(l), static_cast<const float*>(r), n, out);
  if (dt == DType::FLOAT64) return dots_typed(static_cast<const double*>(l), static_cast<const double*>(r), n, out);
  double lr = 0, ll = 0, rr = 0;
  for (size_t i = 0; i < n; ++i) {
    const double a = load(l, i, dt), b = load(r, i, dt);
    lr += a * b, ll += a * a, rr += b * b;
  }
  out[0] += lr, out[1] += ll, out[2] += rr;
}

// dst[i] = cl * l[i] + cr * r[i] (dst may be l or r).
void combine_into(const void* l, const void* r, void* dst, size_t n, DType dt, double cl, double cr) {
  if (dt == DType::FLOAT32) {
    const float* a = static_cast<const float*>(l);
    const float* b = static_cast<const float*>(r);
    float* d = static_cast<float*>(dst);
    for (size_t i = 0; i < n; ++i) d[i] = static_cast<float>(cl * a[i] + cr * b[i]);
    return;
  }
  if (dt == DType::FLOAT64) {
    const double* a = static_cast<const double*>(l);
    const double* b = static_cast<const double*>(r);
    double* d = static_cast<double*>(dst);
    for (size_t i = 0; i < n; ++i) d[i] = cl * a[i] + cr * b[i];
    return;
  }
  for (size_t i = 0; i < n; ++i) store(dst, i, dt, cl * load(l, i, dt) + cr * load(r, i, dt));
}

inline double coefficient(double lr, double self_sq) { return self_sq > 0 ? 1.0 - lr / (2.0 * self_sq) : 1.0; }

// The tensors (segments) overlapping [lo, lo + len): for each, the overlap's start and length.
template <typename F>
void for_each_overlap(const std::vector<size_t>& segments, size_t lo, size_t len, F f) {
  size_t start = 0;
  for (size_t s = 0; s < segments.size(); ++s) {
    const size_t end = start + segments[s];
    const size_t a = std::max(start, lo), b = std::min(end, lo + len);
    if (a < b) f(s, a, b - a);
    start = end;
    if (start >= lo + len) break;
  }
}

// left/right hold the same region [lo, lo + len) of two vectors; sums[3 s + k] are tensor s's dot products
// over the whole vectors. Writes the combination into dst (region-relative).
void combine_region(const void* left, const void* right, void* dst, size_t lo, size_t len, DType dt,
                    const std::vector<size_t>& segments, const std::vector<double>& sums) {
  for_each_overlap(segments, lo, len, [&](size_t s, size_t a, size_t n) {
    const double lr = sums[3 * s], ll = sums[3 * s + 1], rr = sums[3 * s + 2];
    const size_t off = a - lo;
    combine_into(element_at(left, off, dt), element_at(right, off, dt),
                 element_at(dst, off, dt), n, dt, coefficient(lr, ll), coefficient(lr, rr));
  });
}

void region_dots(const void* left, const void* right, size_t lo, size_t len, DType dt,
                 const std::vector<size_t>& segments, std::vector<double>* sums) {
  for_each_overlap(segments, lo, len, [&](size_t s, size_t a, size_t n) {
    const size_t off = a - lo;
    dots(element_at(left, off, dt), element_at(right, off, dt), n, dt,
         sums->data() + 3 * s);
  });
}

}  // namespace

bool adasum_supports(DType dt) {
  return dt == DType::FLOAT16 || dt == DType::BFLOAT16 || dt == DType::FLOAT32 || dt == DType::FLOAT64;
}

void adasum_allreduce(PointToPoint& path, void* buf, size_t count, DType dt, const std::vector<size_t>& segments,
                      Scratch& scratch) {
  if (!adasum_supports(dt))
    throw TransportError(std::string("Adasum needs floating-point tensors, not ") + dtype_name(dt));
  const int n = path.size(), rank = path.rank();
  if (n == 1) return;
  const size_t item = itemsize(dt);
  int p2 = 1;
  while (p2 * 2 <= n) p2 *= 2;
  const int extra = n - p2;
  std::vector<double> sums(3 * segments.size());
  // Ranks beyond the largest power of two hand their vector to a partner and wait for the result.
  if (rank >= p2) {
    path.sendrecv(buf, count * item, rank - p2, nullptr, 0, rank - p2);
    path.sendrecv(nullptr, 0, rank - p2, buf, count * item, rank - p2);
    return;
  }
  if (rank < extra) {
    uint8_t* other = scratch.get(count * item, 1);
    path.sendrecv(nullptr, 0, rank + p2, other, count * item, rank + p2);
    region_dots(buf, other, 0, count, dt, segments, &sums);
    combine_region(buf, other, buf, 0, count, dt, segments, sums);
  }
  // Vector halving, distance doubling.
  struct Region { size_t lo, len; };
  std::vector<Region> stack;
  size_t lo = 0, len = count;
  for (int d = 1; d < p2; d *= 2) {
    const int partner = rank ^ d;
    const bool lower = (rank & d) == 0;
    const size_t first = len / 2, second = len - first;
    const size_t keep_lo = lower ? lo : lo + first, keep_len = lower ? first : second;
    const size_t give_lo = lower ? lo + first : lo, give_len = lower ? second : first;
    uint8_t* theirs = scratch.get(std::max<size_t>(keep_len * item, 1), 0);
    path.sendrecv(element_at(buf, give_lo, dt), give_len * item, partner, theirs, keep_len * item, partner);
    void* mine = element_at(buf, keep_lo, dt);
    const void* left = lower ? mine : theirs;
    const void* right = lower ? static_cast<const void*>(theirs) : mine;
    std::fill(sums.begin(), sums.end(), 0.0);
    region_dots(left, right, keep_lo, keep_len, dt, segments, &sums);
    // Sum the partial dot products over the 2d ranks that hold the two vectors' pieces (recursive doubling:
    // both partners add the same two numbers, so every rank of the group ends with the same sums).
    std::vector<double> incoming(sums.size());
    for (int k = 1; k <= d; k *= 2) {
      path.sendrecv(sums.data(), sums.size() * sizeof(double), rank ^ k, incoming.data(),
                    incoming.size() * sizeof(double), rank ^ k);
      for (size_t i = 0; i < sums.size(); ++i) sums[i] += incoming[i];
    }
    combine_region(left, right, mine, keep_lo, keep_len, dt, segments, sums);
    stack.push_back({lo, len});
    lo = keep_lo, len = keep_len;
  }
  // Vector doubling: give back the regions in the reverse order.
  for (int d = p2 / 2; d >= 1; d /= 2) {
    const Region parent = stack.back();
    stack.pop_back();
    const int partner = rank ^ d;
    const size_t other_lo = lo == parent.lo ? parent.lo + len : parent.lo;
    const size_t other_len = parent.len - len;
    path.sendrecv(element_at(buf, lo, dt), len * item, partner, element_at(buf, other_lo, dt), other_len * item, partner);
    lo = parent.lo, len = parent.len;
  }
  if (rank < extra) path.sendrecv(buf, count * item, rank + p2, nullptr, 0, rank + p2);
}

void adasum_unit(PointToPoint& path, Unit* u, std::vector<uint8_t>& fusion, Scratch& scratch) {
  const DType dt = u->dtype;
  const size_t item = itemsize(dt);
  std::vector<size_t> segments;
  segments.reserve(u->pieces.size());
  if (u->kind == UnitKind::INPLACE && u->pieces.size() == 1) {
    const Piece& p = u->pieces[0];
    Request* r = p.request;
    void* dst = element_at(r->output, static_cast<size_t>(p.offset), dt);
    const void* src = r->input == nullptr ? dst : element_at(r->input, static_cast<size_t>(p.offset), dt);
    const size_t count = static_cast<size_t>(p.count);
    if (u->prescale != 1.0) scale_into(src, dst, count, dt, u->prescale);
    else if (src != dst) copy_bytes(dst, src, count * item);
    segments.push_back(count);
    adasum_allreduce(path, dst, count, dt, segments, scratch);
    if (u->postscale != 1.0) scale_into(dst, dst, count, dt, u->postscale);
    return;
  }
  const size_t total = static_cast<size_t>(u->numel);
  if (fusion.size() < total * item) fusion.resize(total * item);
  uint8_t* buf = fusion.data();
  for (const Piece& p : u->pieces) {
    const void* src = p.request->input != nullptr ? p.request->input : p.request->output;
    uint8_t* part = element_at(buf, static_cast<size_t>(p.buf_offset), dt);
    if (u->prescale != 1.0) scale_into(src, part, static_cast<size_t>(p.count), dt, u->prescale);
    else copy_bytes(part, src, static_cast<size_t>(p.count) * item);
    segments.push_back(static_cast<size_t>(p.count));
  }
  adasum_allreduce(path, buf, total, dt, segments, scratch);
  for (const Piece& p : u->pieces) {
    const uint8_t* part = element_at(buf, static_cast<size_t>(p.buf_offset), dt);
    if (u->postscale != 1.0) scale_into(part, p.request->output, static_cast<size_t>(p.count), dt, u->postscale);
    else copy_bytes(p.request->output, part, static_cast<size_t>(p.count) * item);
  }
}

}  // namespace perseus
