// The stall inspector (see stall.h).
#include "stall.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <set>

namespace perseus {

namespace {

constexpr double kCheckEveryS = 0.05;
constexpr double kAnswerWithinS = 5.0;

std::string format_s(double v) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.0f", v);
  return buf;
}

}  // namespace

StallInspector::StallInspector(StallSettings settings, int rank, std::vector<int> world_ranks, int me)
    : settings_(settings), rank_(rank), world_ranks_(std::move(world_ranks)), me_(me) {}

StallInspector::Action StallInspector::check(double now, const NameMap& pending) {
  if (settings_.disable || now - last_check_ < kCheckEveryS) return {};
  last_check_ = now;
  if (pending.empty()) {
    probe_.reset();
    return {};
  }
  double oldest = 1e300;
  for (auto& kv : pending) oldest = std::min(oldest, kv.second->submit_time);
  const double waited = now - oldest;
  const double shutdown_s = settings_.shutdown_time_s;
  if (!probe_) {
    const double warn_every = shutdown_s > 0 ? std::min(settings_.check_time_s, shutdown_s) : settings_.check_time_s;
    if (waited < warn_every || now - last_warn_ < warn_every) return {};
    return start_probe(now);
  }
  if (!(probe_->waiting_for.empty() || now >= probe_->deadline)) return {};
  std::unique_ptr<Probe> done = std::move(probe_);
  last_warn_ = now;
  Action action;
  action.report = report(*done, now, pending, waited);
  action.shutdown = !action.report.empty() && shutdown_s > 0 && waited >= shutdown_s;
  if (action.shutdown)
    action.report += "\nShutting down: the stall lasted longer than the stall shutdown time.";
  return action;
}

StallInspector::Action StallInspector::start_probe(double now) {
  probe_.reset(new Probe());
  probe_->id = ++probe_counter_;
  for (int r = 0; r < static_cast<int>(world_ranks_.size()); ++r)
    if (r != rank_) probe_->waiting_for.push_back(world_ranks_[r]);
  probe_->deadline = now + kAnswerWithinS;
  Action action;
  action.probe = probe_->id;
  return action;
}

void StallInspector::answer(int world_rank, ProbeAnswer a) {
  if (!probe_ || probe_->id != a.id) return;
  probe_->answers[world_rank] = std::move(a);
  auto& w = probe_->waiting_for;
  w.erase(std::remove(w.begin(), w.end(), world_rank), w.end());
}

// The report: the stalled names (empty when no name is missing anywhere), where the peers are, who did not
// answer, the usual cause, and when every rank will fail.
std::string StallInspector::report(const Probe& probe, double now, const NameMap& pending, double waited) const {
  std::vector<std::string> lines = stalled_lines(probe, now, pending);
  if (lines.empty()) return std::string();
  lines.insert(lines.begin(), "perseus stall: requests have waited for other ranks:");
  std::map<int, const ProbeAnswer*> answers;
  for (auto& kv : probe.answers) answers[kv.first] = &kv.second;
  for (auto& kv : answers)
    if (!kv.second->where.empty()) lines.push_back("  rank " + std::to_string(kv.first) + " is at " + kv.second->where);
  std::vector<int> silent(probe.waiting_for.begin(), probe.waiting_for.end());
  std::sort(silent.begin(), silent.end());
  for (int r : silent)
    lines.push_back("  rank " + std::to_string(r) +
                    " did not answer the stall probe (busy outside perseus, hung, or dead)");
  lines.push_back("The usual cause is ranks taking different code paths: a condition on rank(), uneven data "
                  "without hvd.join(), or a tensor name that differs between ranks.");
  const double shutdown_s = settings_.shutdown_time_s;
  if (shutdown_s > 0)
    lines.push_back("Every rank will fail in " + format_s(std::max(shutdown_s - waited, 0.0)) +
                    " s (PERSEUS_STALL_SHUTDOWN_TIME_SECONDS).");
  std::string message;
  for (size_t i = 0; i < lines.size(); ++i) message += (i ? "\n" : "") + lines[i];
  return message;
}

// One line per pending name that some rank has not submitted: the ranks that have and those that have not
// (a joined rank counts as having submitted everything), oldest first.
std::vector<std::string> StallInspector::stalled_lines(const Probe& probe, double now, const NameMap& pending) const {
  std::set<int> all_ranks(probe.waiting_for.begin(), probe.waiting_for.end());
  all_ranks.insert(me_);
  for (auto& kv : probe.answers) all_ranks.insert(kv.first);
  std::vector<std::pair<double, std::string>> stalled;
  for (auto& kv : pending) stalled.emplace_back(kv.second->submit_time, kv.second->name);
  std::sort(stalled.begin(), stalled.end());
  std::vector<std::string> lines;
  for (auto& st : stalled) {
    std::vector<int> have{me_};
    for (auto& kv : probe.answers) {
      auto& p = kv.second.pending;
      if (kv.second.joined || std::find(p.begin(), p.end(), st.second) != p.end()) have.push_back(kv.first);
    }
    std::vector<int> missing;
    for (int r : all_ranks)
      if (std::find(have.begin(), have.end(), r) == have.end()) missing.push_back(r);
    if (missing.empty()) continue;
    std::sort(have.begin(), have.end());
    lines.push_back("  " + st.second + ": waited " + format_s(now - st.first) + " s; submitted by ranks " +
                    py_list(have) + ", missing on ranks " + py_list(missing));
  }
  return lines;
}

}  // namespace perseus
