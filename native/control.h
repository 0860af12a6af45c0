// The control protocol of a process set: the rare messages ranks send each other outside the negotiation
// rounds, over the set's control Comm (Comm::send_message / poll_message).
//
//   WAKE      a rank with new requests starts round `round` after a fruitless one: peers join it
//   PROBE     a rank's requests have waited long: peers answer with what they have pending (stall.h)
//   ANSWER    the answer to a PROBE
//   ABORT     a rank failed (set 0 only): every rank fails with its message
//   SHUTDOWN  the sender has shut the set down: requests not yet negotiated can no longer complete
//
// A message is its type's byte, then its fields in codec.h's encoding. Each message has one encode() and one
// decode(); decode() throws TransportError when the message is truncated or of another type.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace perseus {

enum class MessageType : uint8_t { WAKE = 'w', PROBE = 'p', ANSWER = 's', ABORT = 'a', SHUTDOWN = 'x' };

struct WakeMessage {
  static constexpr MessageType kType = MessageType::WAKE;
  int64_t round = 0;
};

struct ProbeMessage {
  static constexpr MessageType kType = MessageType::PROBE;
  int64_t id = 0;
};

struct ProbeAnswer {
  static constexpr MessageType kType = MessageType::ANSWER;
  int64_t id = 0;                    // the probe's
  bool joined = false;               // the answering rank has called join()
  int64_t round = 0;                 // its next negotiation round
  std::vector<std::string> pending;  // names it submitted that are not yet negotiated, sorted
  std::string where;                 // where its main thread is (empty when unknown)
};

struct AbortMessage {
  static constexpr MessageType kType = MessageType::ABORT;
  int32_t origin = 0;  // the world rank that failed
  std::string text;    // its message
};

struct ShutdownMessage {
  static constexpr MessageType kType = MessageType::SHUTDOWN;
};

std::string encode(const WakeMessage& m);
std::string encode(const ProbeMessage& m);
std::string encode(const ProbeAnswer& m);
std::string encode(const AbortMessage& m);
std::string encode(const ShutdownMessage& m);

// The type of a received message. Throws TransportError for an empty message or an unknown type.
MessageType message_type(const std::string& bytes);
void decode(const std::string& bytes, WakeMessage* m);
void decode(const std::string& bytes, ProbeMessage* m);
void decode(const std::string& bytes, ProbeAnswer* m);
void decode(const std::string& bytes, AbortMessage* m);
void decode(const std::string& bytes, ShutdownMessage* m);

}  // namespace perseus
