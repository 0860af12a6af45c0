// Tests for the engine's own message codec (codec.h): every control message (control.h) comes back as it
// was encoded, and every truncation of it, a message read as another type and an unknown type throw
// TransportError; a truncated negotiation payload makes Negotiator::apply_exchange throw. Exits 1 on any
// failure.
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "expect.h"
#include "../codec.h"
#include "../control.h"
#include "../negotiation.h"

using namespace perseus;

namespace {

bool throws(const std::function<void()>& f) {
  try {
    f();
  } catch (const TransportError&) {
    return true;
  }
  return false;
}

// Every proper prefix of `bytes` fails to decode as M.
template <typename M>
bool every_prefix_throws(const std::string& bytes) {
  for (size_t n = 0; n < bytes.size(); ++n) {
    M m;
    if (!throws([&] { decode(bytes.substr(0, n), &m); })) return false;
  }
  return true;
}

void test_round_trips() {
  WakeMessage wake;
  decode(encode(WakeMessage{42}), &wake);
  EXPECT(wake.round == 42);
  ProbeMessage probe;
  decode(encode(ProbeMessage{-7}), &probe);
  EXPECT(probe.id == -7);
  ProbeAnswer a{3, true, 99, {"a", "", "grad.w"}, "train.py:10"};
  ProbeAnswer b;
  decode(encode(a), &b);
  EXPECT(b.id == 3 && b.joined && b.round == 99 && b.pending == a.pending && b.where == a.where);
  AbortMessage abort;
  decode(encode(AbortMessage{5, "rank 5 failed"}), &abort);
  EXPECT(abort.origin == 5 && abort.text == "rank 5 failed");
  ShutdownMessage shutdown;
  decode(encode(ShutdownMessage{}), &shutdown);
  EXPECT(message_type(encode(ShutdownMessage{})) == MessageType::SHUTDOWN);
  EXPECT(message_type(encode(a)) == MessageType::ANSWER);
}

void test_truncated_and_foreign() {
  EXPECT(every_prefix_throws<WakeMessage>(encode(WakeMessage{1})));
  EXPECT(every_prefix_throws<ProbeMessage>(encode(ProbeMessage{1})));
  EXPECT(every_prefix_throws<ProbeAnswer>(encode(ProbeAnswer{1, false, 2, {"x", "yz"}, "here"})));
  EXPECT(every_prefix_throws<AbortMessage>(encode(AbortMessage{0, "why"})));
  WakeMessage wake;
  EXPECT(throws([&] { decode(encode(ProbeMessage{1}), &wake); }));
  EXPECT(throws([] { message_type(std::string("?")); }));
  EXPECT(throws([] { message_type(std::string()); }));
}

void test_truncated_negotiation_payload() {
  Request r;
  r.name = "grad";
  r.sig.shape = {2, 3};
  NameMap pending{{r.name, &r}};
  Negotiator mine(0, 2);
  std::string payload;
  mine.exchange_payload(pending, false, &payload);
  Negotiator whole(0, 2);
  RoundResult result;
  whole.apply_exchange(&result, {payload, payload}, {}, 0);
  EXPECT(result.ready.size() == 1 && result.errors.empty());
  bool all_throw = true;
  for (size_t n = 0; n < payload.size(); ++n) {
    Negotiator cut(0, 2);
    RoundResult partial;
    all_throw = all_throw && throws([&] { cut.apply_exchange(&partial, {payload, payload.substr(0, n)}, {}, 0); });
  }
  EXPECT(all_throw);
}

}  // namespace

int main() {
  test_round_trips();
  test_truncated_and_foreign();
  test_truncated_negotiation_payload();
  return perseus_test::expect_summary("test_codec");
}
