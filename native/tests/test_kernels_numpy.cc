// kernels.cc and common.cc against NumPy's and Python's own results, read from a file that gen_reference.py
// writes: scale_into (and in place), combine, the float16 and bfloat16 conversions, and repr of strings,
// floats, tuples and lists, word for word.
// Exits 1 on any failure; run_native_tests.sh runs it built as debug code (-O1) and as shipped (-O3).
//
// Usage: test_kernels_numpy [REFERENCE_FILE]   (without one, nothing is compared)
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernel_test.h"

using namespace perseus;
using namespace perseus::kernel_test;

namespace {

struct Reader {
  std::vector<char> data;
  size_t pos = 0;
  bool more() const { return pos < data.size(); }
  template <typename T>
  T read() {
    T v;
    std::memcpy(&v, take(sizeof v), sizeof v);
    return v;
  }
  const char* take(size_t n) {
    if (pos + n > data.size()) throw std::runtime_error("the reference file is truncated");
    const char* p = data.data() + pos;
    pos += n;
    return p;
  }
  std::string blob() {
    const uint64_t n = read<uint64_t>();
    return std::string(take(n), n);
  }
};

int compare_words(DType d, const char* got, const char* want, size_t n, const std::string& what, bool zero_sign_free) {
  int bad = 0;
  for (size_t i = 0; i < n; ++i) {
    const uint64_t g = word(d, got, i), w = word(d, want, i);
    bool ok = same(d, g, w);
    if (!ok && zero_sign_free && is_float(d) && get(d, got, i) == 0 && get(d, want, i) == 0) ok = true;
    if (!ok) {
      if (++bad <= 3) EXPECT(false, what << " [" << i << "]: " << hex(g) << ", NumPy says " << hex(w));
    } else {
      ++g_checks;
    }
  }
  return bad;
}

void test_against_numpy(const char* path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) {
    EXPECT(false, "cannot read " << path);
    return;
  }
  Reader r;
  r.data.assign(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
  int records = 0;
  while (r.more()) {
    const int32_t kind = r.read<int32_t>();
    const DType d = static_cast<DType>(r.read<int32_t>());
    const ReduceOp op = static_cast<ReduceOp>(r.read<int32_t>());
    r.read<int32_t>();
    const double factor = r.read<double>();
    const uint64_t n = r.read<uint64_t>();
    ++records;
    switch (kind) {
      case 1: {  // scale_into
        const size_t bytes = n * itemsize(d);
        const char* src = r.take(bytes);
        const char* want = r.take(bytes);
        std::vector<char> got(bytes + 1);
        scale_into(src, got.data(), n, d, factor);
        compare_words(d, got.data(), want, n,
                      std::string("scale_into ") + dtype_name(d) + " x" + py_repr(factor), false);
        std::vector<char> inplace(src, src + bytes);
        scale_into(inplace.data(), inplace.data(), n, d, factor);
        compare_words(d, inplace.data(), want, n,
                      std::string("in-place scale_into ") + dtype_name(d) + " x" + py_repr(factor), false);
        break;
      }
      case 2: {  // combine
        const size_t bytes = n * itemsize(d);
        const char* a = r.take(bytes);
        const char* b = r.take(bytes);
        const char* want = r.take(bytes);
        std::vector<char> got(bytes + 1);
        combine(a, b, got.data(), n, d, op);
        const bool minmax = op == ReduceOp::MIN || op == ReduceOp::MAX;  // NumPy's SIMD loops pick either zero
        compare_words(d, got.data(), want, n,
                      std::string("combine ") + dtype_name(d) + " " + reduce_op_title(op), minmax);
        break;
      }
      case 3: {  // half -> float
        const char* in = r.take(n * 2);
        const char* want = r.take(n * 4);
        std::vector<float> got(n);
        for (size_t i = 0; i < n; ++i) {
          uint16_t h;
          std::memcpy(&h, in + 2 * i, 2);
          got[i] = half_to_float(h);
        }
        compare_words(DType::FLOAT32, reinterpret_cast<const char*>(got.data()), want, n, "half_to_float", false);
        break;
      }
      case 4:    // float -> half
      case 5: {  // float -> bfloat16
        const char* in = r.take(n * 4);
        const char* want = r.take(n * 2);
        std::vector<uint16_t> got(n);
        for (size_t i = 0; i < n; ++i) {
          float v;
          std::memcpy(&v, in + 4 * i, 4);
          got[i] = kind == 4 ? float_to_half(v) : float_to_bf16(v);
        }
        compare_words(kind == 4 ? DType::FLOAT16 : DType::BFLOAT16, reinterpret_cast<const char*>(got.data()),
                      want, n, kind == 4 ? "float_to_half" : "float_to_bf16", false);
        break;
      }
      case 6: {  // repr(str)
        const std::string in(r.take(n), n);
        const std::string want = r.blob();
        const std::string got = py_repr(in);
        EXPECT(got == want, "py_repr(string) = " << got << ", Python says " << want);
        break;
      }
      case 7: {  // repr(float)
        const std::string want = r.blob();
        const std::string got = py_repr(factor);
        EXPECT(got == want, "py_repr(double) = " << got << ", Python says " << want);
        break;
      }
      case 8: {  // repr(tuple of int)
        std::vector<int64_t> t(n);
        for (auto& v : t) v = r.read<int64_t>();
        const std::string want = r.blob();
        EXPECT(py_repr(t) == want, "py_repr(tuple) = " << py_repr(t) << ", Python says " << want);
        break;
      }
      case 9: {  // repr(list of int)
        std::vector<int> v(n);
        for (auto& x : v) x = r.read<int32_t>();
        const std::string want = r.blob();
        EXPECT(py_list(v) == want, "py_list = " << py_list(v) << ", Python says " << want);
        break;
      }
      default:
        EXPECT(false, "unknown record kind " << kind << " in " << path);
        return;
    }
  }
  std::printf("test_kernels_numpy: %d NumPy/Python reference records compared\n", records);
}

}  // namespace

int main(int argc, char** argv) {
  return run_and_summarise("test_kernels_numpy", [&] {
    if (argc > 1) test_against_numpy(argv[1]);
  });
}
