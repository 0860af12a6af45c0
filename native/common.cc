// Names and Python-style repr helpers. Error messages built here must read exactly as the ones the Python
// side formats with repr(), so the rules below follow CPython's unicode_repr and float_repr.
#include "common.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace perseus {

const char* dtype_name(DType d) {
  static const char* const names[kNumDTypes] = {"uint8",    "int8",    "int16",   "int32",
                                                 "int64",    "float16", "bfloat16", "float32",
                                                 "float64",  "bool",    "uint16"};
  const int i = static_cast<int>(d);
  return i >= 0 && i < kNumDTypes ? names[i] : "unknown";
}

const char* op_name(OpType op) {
  static const char* const names[] = {"allreduce", "allgather",     "broadcast", "alltoall",
                                      "reducescatter", "barrier", "tune"};
  const int i = static_cast<int>(op);
  return i >= 0 && i < 7 ? names[i] : "unknown";
}

const char* reduce_op_title(ReduceOp op) {
  static const char* const names[] = {"Average", "Sum", "Adasum", "Min", "Max", "Product"};
  const int i = static_cast<int>(op);
  return i >= 0 && i < 6 ? names[i] : "Unknown";
}

namespace {

// Code points above U+007F that str.isprintable() rejects: categories Cc, Cf, Cs, Co, Zl, Zp and Zs,
// derived from Unicode 14 (Python 3.11). Unassigned code points (Cn), which Python also escapes, are
// treated as printable: that set changes with every Unicode version and never shows up in tensor names.
struct Range {
  uint32_t lo, hi;
};
constexpr Range kNonPrintable[] = {
    {0x80, 0xA0},       {0xAD, 0xAD},       {0x600, 0x605},     {0x61C, 0x61C},     {0x6DD, 0x6DD},
    {0x70F, 0x70F},     {0x890, 0x891},     {0x8E2, 0x8E2},     {0x1680, 0x1680},   {0x180E, 0x180E},
    {0x2000, 0x200F},   {0x2028, 0x202F},   {0x205F, 0x2064},   {0x2066, 0x206F},   {0x3000, 0x3000},
    {0xD800, 0xF8FF},   {0xFEFF, 0xFEFF},   {0xFFF9, 0xFFFB},   {0x110BD, 0x110BD}, {0x110CD, 0x110CD},
    {0x13430, 0x13438}, {0x1BCA0, 0x1BCA3}, {0x1D173, 0x1D17A}, {0xE0001, 0xE0001}, {0xE0020, 0xE007F},
    {0xF0000, 0xFFFFD}, {0x100000, 0x10FFFD},
};

bool printable_non_ascii(uint32_t cp) {
  for (const Range& r : kNonPrintable) {
    if (cp < r.lo) return true;  // the table is sorted
    if (cp <= r.hi) return false;
  }
  return true;
}

// Decodes one UTF-8 sequence at s[i]; returns its length, or 0 when the bytes are not valid UTF-8.
size_t decode_utf8(const std::string& s, size_t i, uint32_t* cp) {
  const auto byte = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char b0 = byte(i);
  size_t len;
  uint32_t v, min;
  if (b0 < 0x80) {
    *cp = b0;
    return 1;
  } else if ((b0 & 0xE0) == 0xC0) {
    len = 2, v = b0 & 0x1F, min = 0x80;
  } else if ((b0 & 0xF0) == 0xE0) {
    len = 3, v = b0 & 0x0F, min = 0x800;
  } else if ((b0 & 0xF8) == 0xF0) {
    len = 4, v = b0 & 0x07, min = 0x10000;
  } else {
    return 0;
  }
  if (i + len > s.size()) return 0;
  for (size_t k = 1; k < len; ++k) {
    if ((byte(i + k) & 0xC0) != 0x80) return 0;
    v = (v << 6) | (byte(i + k) & 0x3F);
  }
  if (v < min || v > 0x10FFFF || (v >= 0xD800 && v <= 0xDFFF)) return 0;  // overlong, too big, surrogate
  *cp = v;
  return len;
}

void append_hex_escape(std::string* out, uint32_t cp) {
  char buf[16];
  if (cp < 0x100) {
    std::snprintf(buf, sizeof buf, "\\x%02x", static_cast<unsigned>(cp));
  } else if (cp < 0x10000) {
    std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(cp));
  } else {
    std::snprintf(buf, sizeof buf, "\\U%08x", static_cast<unsigned>(cp));
  }
  *out += buf;
}

}  // namespace

std::string py_repr(const std::string& s) {
  // Python prefers single quotes and switches to double quotes only to avoid escaping a single quote.
  const bool has_single = s.find('\'') != std::string::npos;
  const bool has_double = s.find('"') != std::string::npos;
  const char quote = (has_single && !has_double) ? '"' : '\'';
  std::string out;
  out.reserve(s.size() + 2);
  out += quote;
  for (size_t i = 0; i < s.size();) {
    uint32_t cp;
    size_t len = decode_utf8(s, i, &cp);
    if (len == 0) {
      // A byte that is not UTF-8 reads in Python (surrogateescape) as a lone surrogate, escaped as \udcXX.
      append_hex_escape(&out, 0xDC00u + static_cast<unsigned char>(s[i]));
      i += 1;
      continue;
    }
    if (cp == static_cast<uint32_t>(quote) || cp == '\\') {
      out += '\\';
      out += static_cast<char>(cp);
    } else if (cp == '\t') {
      out += "\\t";
    } else if (cp == '\n') {
      out += "\\n";
    } else if (cp == '\r') {
      out += "\\r";
    } else if (cp < 0x20 || cp == 0x7F) {
      append_hex_escape(&out, cp);
    } else if (cp < 0x80 || printable_non_ascii(cp)) {
      out.append(s, i, len);
    } else {
      append_hex_escape(&out, cp);
    }
    i += len;
  }
  out += quote;
  return out;
}

namespace {

// "[-]d.ddde[+-]xx" -> the same number plus one unit in the last digit (magnitude up), in place. False when
// that carries into a new leading digit (9.99e+05 -> 1.00e+06), which snprintf would have produced already.
bool next_decimal(char* buf) {
  char* e = std::strchr(buf, 'e');
  if (e == nullptr) return false;
  for (char* p = e - 1; p >= buf; --p) {
    if (*p < '0' || *p > '9') continue;  // the decimal point (whatever the locale spells it) or the sign
    if (*p != '9') {
      ++*p;
      return true;
    }
    *p = '0';
  }
  return false;
}

}  // namespace

std::string py_repr(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  // The shortest decimal that reads back as v, as Python's repr() picks it. At each length the decimal
  // nearest v is tried first and, when it does not read back, its neighbour on the other side of v: below a
  // power of two the doubles are twice as dense, so the decimals that read back as v reach further above it
  // than below (2**-24 is 5.960464477539063e-08; ...062, as near and the one snprintf picks, reads back as
  // the double below).
  char buf[40];
  for (int precision = 0; precision < 17; ++precision) {
    std::snprintf(buf, sizeof buf, "%.*e", precision, v);
    const double back = std::strtod(buf, nullptr);
    if (back == v) break;
    if (std::fabs(back) < std::fabs(v) && next_decimal(buf) && std::strtod(buf, nullptr) == v)
      break;
  }
  // buf is "[-]d[.ddd]e[+-]xx": split it into sign, significant digits and decimal exponent.
  const char* p = buf;
  std::string out;
  if (*p == '-') {
    out += '-';
    ++p;
  }
  std::string digits;
  for (; *p && *p != 'e'; ++p) {
    if (*p >= '0' && *p <= '9') digits += *p;  // skips the decimal point, whatever the locale spells it
  }
  const int exp10 = std::atoi(p + 1);
  while (digits.size() > 1 && digits.back() == '0') digits.pop_back();

  // CPython's float_repr_style 'short': positional for 1e-4 <= |v| < 1e16, scientific otherwise.
  if (exp10 >= -4 && exp10 < 16) {
    if (exp10 >= 0) {
      const size_t int_digits = static_cast<size_t>(exp10) + 1;
      if (digits.size() <= int_digits) {
        out += digits;
        out.append(int_digits - digits.size(), '0');
        out += ".0";
      } else {
        out.append(digits, 0, int_digits);
        out += '.';
        out.append(digits, int_digits, std::string::npos);
      }
    } else {
      out += "0.";
      out.append(static_cast<size_t>(-exp10 - 1), '0');
      out += digits;
    }
    return out;
  }
  out += digits[0];
  if (digits.size() > 1) {
    out += '.';
    out.append(digits, 1, std::string::npos);
  }
  char exp_buf[16];
  std::snprintf(exp_buf, sizeof exp_buf, "e%c%02d", exp10 < 0 ? '-' : '+', exp10 < 0 ? -exp10 : exp10);
  out += exp_buf;
  return out;
}

std::string py_repr(const std::vector<int64_t>& t) {
  std::string out = "(";
  for (size_t i = 0; i < t.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(t[i]);
  }
  if (t.size() == 1) out += ',';
  out += ')';
  return out;
}

std::string py_list(const std::vector<int>& v) {
  std::string out = "[";
  for (size_t i = 0; i < v.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(v[i]);
  }
  out += ']';
  return out;
}

}  // namespace perseus
