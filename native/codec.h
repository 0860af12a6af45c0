// The byte codec of every message the engine builds itself: negotiation payloads (negotiation.cc) and
// control messages (control.h). Values are written in this machine's byte order (every rank of a job runs
// the same build on the same kind of host); strings as a uint32 length and their bytes.
//
// Reading past the end throws TransportError naming what was being read: a truncated message means the
// ranks disagree about the protocol, and no field is ever made up in its place.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

#include "common.h"

namespace perseus {

class Writer {
 public:
  explicit Writer(std::string* out) : out_(out) {}
  template <typename T>
  void put(T v) {
    out_->append(reinterpret_cast<const char*>(&v), sizeof(T));
  }
  void put_str(std::string_view s) {
    put<uint32_t>(static_cast<uint32_t>(s.size()));
    out_->append(s.data(), s.size());
  }

 private:
  std::string* out_;
};

class Reader {
 public:
  // `what` names the message in the error a truncated one raises ("negotiation message").
  Reader(const std::string& bytes, const char* what)
      : p_(bytes.data()), end_(bytes.data() + bytes.size()), what_(what) {}
  Reader(const char* begin, const char* end, const char* what) : p_(begin), end_(end), what_(what) {}

  template <typename T>
  T get() {
    need(sizeof(T));
    T v;
    std::memcpy(&v, p_, sizeof(T));
    p_ += sizeof(T);
    return v;
  }
  std::string str(size_t n) {
    need(n);
    std::string s(p_, n);
    p_ += n;
    return s;
  }
  std::string str() { return str(get<uint32_t>()); }  // as Writer::put_str wrote it
  // A uint32 count of the items that follow, each at least `min_bytes` long. Throws when the rest of the
  // message cannot hold that many, so that a count read off the wire never sizes an allocation by itself.
  uint32_t count(size_t min_bytes) {
    const uint32_t n = get<uint32_t>();
    if (min_bytes > 0 && n > static_cast<size_t>(end_ - p_) / min_bytes)
      throw TransportError(std::string("perseus: truncated ") + what_ + " (a count of " + std::to_string(n) +
                           " items that the message cannot hold)");
    return n;
  }

 private:
  void need(size_t n) const {
    if (static_cast<size_t>(end_ - p_) < n) throw TransportError(std::string("perseus: truncated ") + what_);
  }

  const char* p_;
  const char* end_;
  const char* what_;
};

}  // namespace perseus
