// The control protocol as one process set speaks it (control.h): wake messages, stall probes and their
// answers, aborts and shutdown notices; and the stall inspector's checks (stall.h). Engine thread only.
#include <algorithm>

#include "control.h"
#include "process_set.h"

namespace perseus {

void ProcessSet::send_to_all(const std::string& message) {
  for (int r = 0; r < size_; ++r)
    if (r != rank_) control_->send_message(r, message);
}

// Handle every control message that has arrived. A malformed one throws TransportError (the engine thread
// then fails every rank).
void ProcessSet::poll_control() {
  int source;
  std::string msg;
  while (control_->poll_message(&source, &msg)) {
    switch (message_type(msg)) {
      case MessageType::WAKE: {
        WakeMessage m;
        decode(msg, &m);
        woken_round_ = std::max(woken_round_, m.round);
        break;
      }
      case MessageType::PROBE: {
        ProbeMessage m;
        decode(msg, &m);
        answer_probe(source, m);
        break;
      }
      case MessageType::ANSWER: {
        ProbeAnswer m;
        decode(msg, &m);
        stall_.answer(world_ranks_[source], std::move(m));
        break;
      }
      case MessageType::ABORT: {
        AbortMessage m;
        decode(msg, &m);
        ctx_.abort(m.text, m.origin, false, ErrorKind::INTERNAL);
        break;
      }
      case MessageType::SHUTDOWN:
        peer_shutdown(world_ranks_[source]);
        break;
    }
  }
}

// Tell the prober what this rank has submitted and not yet negotiated, and where its main thread is.
void ProcessSet::answer_probe(int source, const ProbeMessage& probe) {
  ProbeAnswer answer;
  answer.id = probe.id;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& kv : inflight_)
      if (!kv.second->dispatched) answer.pending.push_back(kv.second->name);
    answer.joined = join_handle_ != nullptr;
  }
  std::sort(answer.pending.begin(), answer.pending.end());
  answer.round = round_;
  if (ctx_.hooks.where) answer.where = ctx_.hooks.where();
  control_->send_message(source, encode(answer));
}

void ProcessSet::check_stall(double now) {
  StallInspector::Action action = stall_.check(now, pending_);
  if (action.probe != 0) send_to_all(encode(ProbeMessage{action.probe}));
  if (action.report.empty()) return;
  if (action.shutdown)
    ctx_.abort(action.report, ctx_.world_rank, true, ErrorKind::STALL);
  else if (ctx_.hooks.log)
    ctx_.hooks.log(30, action.report);
}

void ProcessSet::peer_shutdown(int world_rank) {
  std::string reason = "perseus: rank " + std::to_string(world_rank) +
                       " shut down (perseus.shutdown() or process exit) while this rank still used process set " +
                       std::to_string(id_) + "; every rank must call the same collectives before exiting.";
  mark_dead(reason);
  // Requests already in channels stay: the peer drained its channels, so it took part in those
  // collectives before it said so. Only what was never negotiated can no longer complete.
  fail_all({ErrorKind::INTERNAL, reason}, false);
}

}  // namespace perseus
