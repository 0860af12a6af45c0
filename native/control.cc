// The control protocol's messages (see control.h).
#include "control.h"

#include "codec.h"

namespace perseus {

namespace {

constexpr const char* kWhat = "control message";

std::string start(MessageType type) { return std::string(1, static_cast<char>(type)); }

// A reader over the fields of `bytes`, after checking that it is a message of `type`.
Reader fields(const std::string& bytes, MessageType type) {
  if (message_type(bytes) != type)
    throw TransportError("perseus: a control message of type '" + std::string(1, bytes[0]) + "' was read as '" +
                         std::string(1, static_cast<char>(type)) + "'");
  return Reader(bytes.data() + 1, bytes.data() + bytes.size(), kWhat);
}

}  // namespace

MessageType message_type(const std::string& bytes) {
  if (bytes.empty()) throw TransportError("perseus: an empty control message");
  switch (static_cast<MessageType>(bytes[0])) {
    case MessageType::WAKE: case MessageType::PROBE: case MessageType::ANSWER: case MessageType::ABORT:
    case MessageType::SHUTDOWN:
      return static_cast<MessageType>(bytes[0]);
  }
  throw TransportError("perseus: a control message of unknown type " +
                       std::to_string(static_cast<int>(static_cast<uint8_t>(bytes[0]))) +
                       " (the ranks run different perseus versions)");
}

std::string encode(const WakeMessage& m) {
  std::string out = start(m.kType);
  Writer(&out).put<int64_t>(m.round);
  return out;
}

void decode(const std::string& bytes, WakeMessage* m) {
  Reader in = fields(bytes, WakeMessage::kType);
  m->round = in.get<int64_t>();
}

std::string encode(const ProbeMessage& m) {
  std::string out = start(m.kType);
  Writer(&out).put<int64_t>(m.id);
  return out;
}

void decode(const std::string& bytes, ProbeMessage* m) {
  Reader in = fields(bytes, ProbeMessage::kType);
  m->id = in.get<int64_t>();
}

std::string encode(const ProbeAnswer& m) {
  std::string out = start(m.kType);
  Writer w(&out);
  w.put<int64_t>(m.id);
  w.put<uint8_t>(m.joined ? 1 : 0);
  w.put<int64_t>(m.round);
  w.put<uint32_t>(static_cast<uint32_t>(m.pending.size()));
  for (const std::string& name : m.pending) w.put_str(name);
  w.put_str(m.where);
  return out;
}

void decode(const std::string& bytes, ProbeAnswer* m) {
  Reader in = fields(bytes, ProbeAnswer::kType);
  m->id = in.get<int64_t>();
  m->joined = in.get<uint8_t>() != 0;
  m->round = in.get<int64_t>();
  const uint32_t n = in.count(sizeof(uint32_t));  // each name: at least its length
  m->pending.clear();
  for (uint32_t i = 0; i < n; ++i) m->pending.push_back(in.str());
  m->where = in.str();
}

std::string encode(const AbortMessage& m) {
  std::string out = start(m.kType);
  Writer w(&out);
  w.put<int32_t>(m.origin);
  w.put_str(m.text);
  return out;
}

void decode(const std::string& bytes, AbortMessage* m) {
  Reader in = fields(bytes, AbortMessage::kType);
  m->origin = in.get<int32_t>();
  m->text = in.str();
}

std::string encode(const ShutdownMessage& m) { return start(m.kType); }

void decode(const std::string& bytes, ShutdownMessage*) { fields(bytes, ShutdownMessage::kType); }

}  // namespace perseus
