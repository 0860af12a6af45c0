// The Python-style repr helpers of common.cc against known answers: py_repr of strings (quotes, escapes,
// printable and unprintable code points, invalid UTF-8 as surrogateescape decodes it), of doubles (shortest
// round-trip form, exponents, infinities, NaN) and of integer tuples, py_list, and the dtype, operation and
// reduction names.
// Exits 1 on any failure; run_native_tests.sh runs it built as debug code (-O1) and as shipped (-O3).
#include <string>
#include <utility>
#include <vector>

#include "kernel_test.h"

using namespace perseus;
using namespace perseus::kernel_test;

namespace {

void test_repr_known() {
  const std::pair<std::string, std::string> strings[] = {
      {"", "''"},
      {"abc", "'abc'"},
      {"it's", "\"it's\""},
      {"say \"hi\"", "'say \"hi\"'"},
      {"both ' and \"", "'both \\' and \"'"},
      {"back\\slash", "'back\\\\slash'"},
      {"t\tn\nr\r", "'t\\tn\\nr\\r'"},
      {std::string("\x00\x01\x1f\x7f", 4), "'\\x00\\x01\\x1f\\x7f'"},
      {"\xc3\xa9\xe4\xb8\xad\xf0\x9f\x99\x82", "'\xc3\xa9\xe4\xb8\xad\xf0\x9f\x99\x82'"},  // é中🙂 kept
      {"\xc2\x80\xc2\xa0\xc2\xad", "'\\x80\\xa0\\xad'"},
      {"\xe2\x80\xa8\xef\xbb\xbf", "'\\u2028\\ufeff'"},
      {"\xf3\xa0\x80\x81", "'\\U000e0001'"},
      {"bad\xff", "'bad\\udcff'"},  // invalid UTF-8, as surrogateescape decodes it
  };
  for (const auto& c : strings) {
    const std::string got = py_repr(c.first);
    EXPECT(got == c.second, "py_repr(string) = " << got << ", want " << c.second);
  }
  const std::pair<double, const char*> doubles[] = {
      {1.0, "1.0"},       {0.5, "0.5"},         {0.1, "0.1"},        {-0.0, "-0.0"},
      {0.0, "0.0"},       {1e16, "1e+16"},      {1e15, "1000000000000000.0"},
      {1e-5, "1e-05"},    {1e-4, "0.0001"},     {123.456, "123.456"}, {1.5e300, "1.5e+300"},
      {5e-324, "5e-324"}, {INFINITY, "inf"},    {-INFINITY, "-inf"},  {NAN, "nan"},
      {0.1 + 0.2, "0.30000000000000004"},      {1.0 / 3.0, "0.3333333333333333"},
      {-2.5e-7, "-2.5e-07"},
      // powers of two, where the nearest decimal of a length may not read back but its upper neighbour does
      {0x1p-24, "5.960464477539063e-08"}, {-0x1p-1017, "-7.120236347223045e-307"},
      {0x1p976, "6.386688990511104e+293"},
  };
  for (const auto& c : doubles) {
    const std::string got = py_repr(c.first);
    EXPECT(got == c.second, "py_repr(double) = " << got << ", want " << c.second);
  }
  EXPECT(py_repr(std::vector<int64_t>{}) == "()", py_repr(std::vector<int64_t>{}));
  EXPECT(py_repr(std::vector<int64_t>{5}) == "(5,)", py_repr(std::vector<int64_t>{5}));
  EXPECT(py_repr(std::vector<int64_t>{2, 3}) == "(2, 3)", py_repr(std::vector<int64_t>{2, 3}));
  EXPECT(py_list({}) == "[]", py_list({}));
  EXPECT(py_list({0, 2}) == "[0, 2]", py_list({0, 2}));

  EXPECT(std::string(dtype_name(DType::BFLOAT16)) == "bfloat16", dtype_name(DType::BFLOAT16));
  EXPECT(std::string(dtype_name(DType::BOOL)) == "bool", dtype_name(DType::BOOL));
  EXPECT(std::string(dtype_name(DType::UINT16)) == "uint16", dtype_name(DType::UINT16));
  EXPECT(std::string(op_name(OpType::REDUCESCATTER)) == "reducescatter", op_name(OpType::REDUCESCATTER));
  EXPECT(std::string(op_name(OpType::BARRIER)) == "barrier", op_name(OpType::BARRIER));
  EXPECT(std::string(reduce_op_title(ReduceOp::AVERAGE)) == "Average", reduce_op_title(ReduceOp::AVERAGE));
  EXPECT(std::string(reduce_op_title(ReduceOp::PRODUCT)) == "Product", reduce_op_title(ReduceOp::PRODUCT));
}

}  // namespace

int main() {
  return run_and_summarise("test_kernels_repr", [] {
    test_repr_known();
  });
}
