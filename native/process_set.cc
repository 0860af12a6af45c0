// Stage 1-2 driver: queue and negotiation state machine of one process set (see process_set.h).
#include "process_set.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <set>

#include "engine.h"

namespace perseus {

namespace {

constexpr double kControlPollS = 100e-6;  // control messages are rare: look for them at most this often
constexpr double kStallCheckS = 0.05;
constexpr size_t kStepsKept = 1024;
constexpr size_t kStepNamesMax = 1 << 16;  // unique names each call (unnamed ops) must not grow it forever

template <typename T>
void put(std::string* out, T v) {
  out->append(reinterpret_cast<const char*>(&v), sizeof(T));
}
void put_str(std::string* out, const std::string& s) {
  put<uint32_t>(out, static_cast<uint32_t>(s.size()));
  out->append(s);
}

struct In {
  const char* p;
  const char* end;
  template <typename T>
  T get() {
    T v{};
    if (p + sizeof(T) <= end) std::memcpy(&v, p, sizeof(T));
    p += sizeof(T);
    return v;
  }
  std::string str() {
    uint32_t n = get<uint32_t>();
    if (p + n > end) return std::string();
    std::string s(p, n);
    p += n;
    return s;
  }
};

std::string format_s(double v) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.0f", v);
  return buf;
}

}  // namespace

ProcessSet::ProcessSet(Engine* engine, int id, std::unique_ptr<Comm> control, std::vector<int> world_ranks)
    : engine_(engine), id_(id), rank_(control->rank()), size_(control->size()),
      world_ranks_(std::move(world_ranks)), control_(std::move(control)), wire_(control_->wire_counters()),
      negotiator_(rank_, size_) {
  const Settings& s = engine->settings();
  ChannelHooks hooks;
  hooks.piece_done = [this](Request* r) { piece_done(r); };
  hooks.unit_failed = [this](Unit* u, const std::string& what, ErrorKind kind) { unit_failed(u, what, kind); };
  hooks.recycle = [this](Unit* u) { unit_pool_.put(u); };
  hooks.timeline = &engine->timeline();
  hooks.faults = &engine->faults();
  ChannelConfig config;
  config.hierarchical_allgather = s.hierarchical_allgather;
  // One allgather of host keys at creation: a set on one host keeps MPI's shared-memory paths only.
  HostLayout layout = HostLayout::exchange(*control_, s.host_key);
  if (layout.hosts > 1) config.layout = std::make_shared<const HostLayout>(std::move(layout));
  config.links.interfaces = s.network_interfaces;
  config.links.timeout_s = s.link_timeout_s;
  config.links.cancel = &is_dead_;
  config.links.world_ranks = world_ranks_;
  // Channels beyond num_channels (up to max_channels) wait idle until a TUNE request activates them: they
  // are created now because creating one is collective.
  for (int i = 0; i < std::max({1, s.num_channels, s.max_channels}); ++i)
    channels_.emplace_back(new Channel(control_->dup(), config, hooks));
  device_channel_ = std::make_shared<DeviceChannel>(&engine->device_queue(), hooks, id);
  params_.fusion_threshold_bytes = s.fusion_threshold_bytes;
  params_.inplace_threshold_bytes = s.inplace_threshold_bytes;
  params_.channels = std::max(1, s.num_channels);
  params_.cycle_time_ms = s.cycle_time_ms;
  params_.algorithm = s.algorithm;
  track_steps_ = s.track_steps;
  if (track_steps_) steps_.reserve(kStepsKept);
}

ProcessSet::~ProcessSet() = default;

// -- user threads ------------------------------------------------------------------------------------------
Error ProcessSet::submit(const std::vector<Request*>& requests) {
  std::lock_guard<std::mutex> lock(mu_);
  if (is_dead_.load()) return {ErrorKind::INTERNAL, dead_};
  for (Request* r : requests)
    if (inflight_.count(r->name))
      return {ErrorKind::VALUE, "perseus: a request named " + py_repr(r->name) +
                                    " is already in flight on this rank; wait for it (synchronize) before "
                                    "submitting the name again, or give the new request another name."};
  if (requests.size() > 1) {
    std::set<std::string> names;
    for (Request* r : requests) names.insert(r->name);
    if (names.size() != requests.size())
      return {ErrorKind::VALUE, "perseus: a grouped request names the same tensor twice"};
  }
  if (track_steps_) {
    const int64_t now = now_ns();
    for (Request* r : requests) track_step(r, now);
  }
  for (Request* r : requests) {
    r->dispatched = false;
    inflight_.emplace(r->name, r);
    incoming_.push_back(r);
    if (r->sig.device < 0) host_dirty_.store(true, std::memory_order_relaxed);
  }
  incoming_count_.store(static_cast<int>(incoming_.size()), std::memory_order_release);
  if (first_dirty_ns_.load(std::memory_order_relaxed) == 0) first_dirty_ns_.store(now_ns());
  return Error();
}

Error ProcessSet::submit_join(Handle* h) {
  std::lock_guard<std::mutex> lock(mu_);
  if (is_dead_.load()) return {ErrorKind::INTERNAL, dead_};
  if (join_handle_ != nullptr)
    return {ErrorKind::VALUE, "perseus.join(): this rank has already joined; wait for the join to complete"};
  join_handle_ = h;
  join_waiting_.store(true);
  host_dirty_.store(true, std::memory_order_relaxed);
  if (first_dirty_ns_.load(std::memory_order_relaxed) == 0) first_dirty_ns_.store(now_ns());
  return Error();
}

// -- engine thread: the round state machine ------------------------------------------------------------------
bool ProcessSet::has_work() {
  return !pending_.empty() || incoming_count_.load(std::memory_order_acquire) != 0 ||
         join_waiting_.load(std::memory_order_acquire);
}

StepResult ProcessSet::step(double now) {
  if (now - last_poll_ >= kControlPollS) {
    last_poll_ = now;
    poll_control(now);
  }
  if (is_dead_.load()) {
    // Requests this thread still holds can never run: release them (their handles already failed).
    std::vector<Request*> drop;
    {
      std::lock_guard<std::mutex> lock(mu_);
      drop.swap(incoming_);
      incoming_count_.store(0);
    }
    for (auto& kv : pending_) drop.push_back(kv.second);
    pending_.clear();
    Error err{ErrorKind::INTERNAL, dead_};
    for (Request* r : drop) {
      engine_->handles().finish_request(r, &err);
      engine_->handles().release_engine(r);
    }
    return {false, false, 1e300};
  }
  switch (state_) {
    case State::IDLE:
      return maybe_start(now);
    case State::BAND:
      if (!op_->test()) {
        check_stall(now);
        return {false, true, 1e300};
      }
      finish_band();
      return {true, state_ != State::IDLE, now};
    case State::EXCHANGE: {
      if (!op_->test()) {
        check_stall(now);
        return {false, true, 1e300};
      }
      if (exchange_phase_ == 0) {  // sizes known: gather the lists
        std::vector<size_t> counts(size_);
        size_t total = 0;
        for (int r = 0; r < size_; ++r) counts[r] = static_cast<size_t>(sizes_all_[r]), total += counts[r];
        gathered_.resize(std::max<size_t>(total, 1));
        exchange_phase_ = 1;
        op_ = control_->iallgatherv_bytes(payload_.data(), payload_.size(), gathered_.data(), counts);
        return {true, true, now};
      }
      std::vector<std::string> payloads(size_);
      size_t off = 0;
      for (int r = 0; r < size_; ++r) {
        payloads[r].assign(reinterpret_cast<const char*>(gathered_.data()) + off, sizes_all_[r]);
        off += sizes_all_[r];
      }
      negotiator_.apply_exchange(&result_, payloads, world_ranks_, round_);
      finish_round();
      return {true, false, now};
    }
    case State::JOINGATHER:
      if (!op_->test()) return {false, true, 1e300};
      finish_join();
      return {true, false, now};
  }
  return {};
}

StepResult ProcessSet::maybe_start(double now) {
  if (draining_) return {false, false, 1e300};
  const int64_t first_dirty = first_dirty_ns_.load();
  const bool dirty = first_dirty != 0;
  const bool woken = woken_round_ >= round_;
  if (dirty && !woken) {
    // Only device requests new while a burst is under way (the last round found work and earlier requests
    // are still in flight): wait the device cycle (an NCCL launch costs more than a round), so that the
    // gradients of a backward pass travel in few units. A device request reaching an idle set (a loop of
    // synchronous calls) is negotiated at once, like any other.
    bool device_burst = continue_mode_ && !host_dirty_.load(std::memory_order_relaxed);
    if (device_burst) {
      std::lock_guard<std::mutex> lock(mu_);
      device_burst = inflight_.size() > incoming_.size();
    }
    const double cycle_ms = device_burst ? std::max(params_.cycle_time_ms, engine_->settings().device_cycle_time_ms)
                                         : params_.cycle_time_ms;
    const double start_at = first_dirty * 1e-9 + cycle_ms * 1e-3;
    if (now < start_at) return {false, false, start_at};
    if (!continue_mode_) {
      std::string msg("w");
      put<int64_t>(&msg, round_);
      send_to_all(msg);
    }
  } else if (!(woken || (continue_mode_ && has_work()))) {
    double deadline = 1e300;
    if (has_work()) {
      check_stall(now);
      if (probe_) deadline = now + 1e-3;
    }
    return {false, false, deadline};
  }
  start_round();
  return {true, true, now};
}

void ProcessSet::start_round() {
  bool joined;
  {
    std::lock_guard<std::mutex> lock(mu_);
    round_dirty_ = first_dirty_ns_.load() != 0;
    first_dirty_ns_.store(0);
    host_dirty_.store(false, std::memory_order_relaxed);
    for (Request* r : incoming_) pending_[r->name] = r;
    incoming_.clear();
    incoming_count_.store(0, std::memory_order_release);
    joined = join_handle_ != nullptr;
  }
  round_joined_ = joined;
  negotiator_.build_words(pending_, round_dirty_, joined);
  if (joined && join_round_ < 0) join_round_ = round_;
  engine_->timeline().record(TimelineKind::CYCLE, OpType::ALLREDUCE, std::string());
  auto& words = negotiator_.words();
  op_ = control_->iallreduce_band(words.data(), words.size());
  state_ = State::BAND;
}

void ProcessSet::finish_band() {
  const bool exchange = negotiator_.decode(&result_);
  if (exchange) {
    // Joined as this round's band said (not as now: join() may have been called since), or ranks would
    // disagree with the band's flags and run a non-allreduce op against a rank that joined meanwhile.
    negotiator_.exchange_payload(pending_, round_joined_, &payload_);
    sizes_mine_.assign(1, static_cast<int64_t>(payload_.size()));
    sizes_all_.assign(size_, 0);
    exchange_phase_ = 0;
    op_ = control_->iallgather_i64(sizes_mine_.data(), 1, sizes_all_.data());
    state_ = State::EXCHANGE;
    return;
  }
  finish_round();
}

void ProcessSet::finish_round() {
  Registry& reg = negotiator_.registry();
  negotiator_.reject_while_joined(&result_);
  for (int idx : result_.ready) reg.touch(idx, round_);
  ++round_;
  continue_mode_ = result_.any_dirty || !result_.ready.empty() || !result_.errors.empty();
  for (auto& e : result_.errors) {
    auto it = pending_.find(e.first);
    if (it == pending_.end()) continue;
    Request* r = it->second;
    pending_.erase(it);
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto f = inflight_.find(r->name);
      if (f != inflight_.end() && f->second == r) inflight_.erase(f);
    }
    Error err{ErrorKind::MISMATCH, e.second};
    engine_->handles().finish_request(r, &err);
    engine_->handles().release_engine(r);
  }
  negotiator_.order(&result_);
  ready_.clear();
  for (int idx : result_.ready) {
    auto it = pending_.find(reg.name(idx));
    if (it != pending_.end()) {
      ready_.push_back(it->second);
      pending_.erase(it);
    } else {
      ready_.push_back(phantom(idx));
    }
  }
  state_ = State::IDLE;
  if (!ready_.empty()) dispatch(ready_);
  // Same names on every rank (use is counted in agreed rounds); after dispatch, which still reads them.
  reg.evict(engine_->settings().cache_capacity);
  if (result_.all_joined) {
    join_mine_[0] = join_round_;
    join_mine_[1] = rank_;
    join_all_.assign(2 * size_, 0);
    op_ = control_->iallgather_i64(join_mine_, 2, join_all_.data());
    state_ = State::JOINGATHER;
  }
}

void ProcessSet::finish_join() {
  int last = 0;
  for (int r = 1; r < size_; ++r)
    if (join_all_[2 * r] >= join_all_[2 * last]) last = r;
  Handle* h;
  {
    std::lock_guard<std::mutex> lock(mu_);
    h = join_handle_;
    join_handle_ = nullptr;
    join_waiting_.store(false);
  }
  join_round_ = -1;
  state_ = State::IDLE;
  if (h != nullptr) engine_->handles().set_join_result(h, id_ == 0 ? world_ranks_[last] : last, nullptr);
}

// Stand-in for an allreduce this joined rank did not submit: it contributes zeros, results are discarded.
// (While a rank is joined only allreduce runs: see Negotiator::reject_while_joined.)
Request* ProcessSet::phantom(int idx) {
  const Signature& sig = negotiator_.registry().signature(idx);
  Request* r = new Request();
  r->name = negotiator_.registry().name(idx);
  r->sig = sig;
  r->shape = sig.shape;
  r->phantom = true;
  r->ps_id = id_;
  r->phantom_data.assign(r->nbytes(), 0);
  r->output = r->phantom_data.data();
  return r;
}

void ProcessSet::dispatch(std::vector<Request*>& ready) {
  TimelineRecorder& tl = engine_->timeline();
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (Request* r : ready) r->dispatched = true;
  }
  if (tl.on())
    for (Request* r : ready)
      if (!r->phantom) tl.record(TimelineKind::OP_START, r->sig.op_type, r->name);
  // TUNE requests take effect after this round's other requests are planned: the same point of the
  // negotiated sequence on every rank.
  tunes_.clear();
  size_t kept = 0;
  for (Request* r : ready) {
    if (r->sig.op_type == OpType::TUNE) tunes_.push_back(r);
    else ready[kept++] = r;
  }
  ready.resize(kept);
  units_.clear();
  plan_units(ready, params_.fusion_threshold_bytes, params_.inplace_threshold_bytes, size_, &unit_pool_, &units_,
             engine_->settings().device_fusion_threshold_bytes);
  const size_t n = static_cast<size_t>(params_.channels);
  for (Unit* u : units_) {
    u->index = unit_counter_++;
    u->algorithm = params_.algorithm;
    // Always on the channel's thread, never here: a collective blocks until every peer joins it, and an
    // engine thread blocked in one could not receive the abort of a peer that failed before joining.
    if (u->device >= 0)
      device_channel_->submit(u);  // the framework's launcher moves device memory, in this same order
    else
      channels_[u->index % n]->submit(u);
  }
  for (Request* r : tunes_) apply_tune(r);
}

// shape = (fusion_threshold_bytes, inplace_threshold_bytes, channels, cycle_time_us, algorithm). Every
// rank got the same values (negotiation compares shapes), so every rank accepts or rejects them alike.
void ProcessSet::apply_tune(Request* r) {
  const std::vector<int64_t>& v = r->shape;
  Error error;
  const int64_t max_channels = static_cast<int64_t>(channels_.size());
  if (v.size() != 5 || v[0] < 0 || v[1] < 0 || v[2] < 1 || v[2] > max_channels || v[3] < 0 || v[4] < 0 || v[4] > 3) {
    error = {ErrorKind::VALUE, "perseus: invalid run-time parameters " + py_repr(r->name) + ": expected (fusion "
             "bytes >= 0, in-place bytes >= 0, channels 1.." + std::to_string(max_channels) +
             ", cycle time us >= 0, algorithm 0..3)"};
  } else {
    std::lock_guard<std::mutex> lock(mu_);
    params_.fusion_threshold_bytes = v[0];
    params_.inplace_threshold_bytes = v[1];
    params_.channels = static_cast<int>(v[2]);
    params_.cycle_time_ms = static_cast<double>(v[3]) * 1e-3;
    params_.algorithm = static_cast<Algorithm>(v[4]);
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto f = inflight_.find(r->name);
    if (f != inflight_.end() && f->second == r) inflight_.erase(f);
  }
  engine_->timeline().record(TimelineKind::OP_END, r->sig.op_type, r->name);
  engine_->handles().finish_request(r, error ? &error : nullptr);
  engine_->handles().release_engine(r);
}

TuneParams ProcessSet::params() {
  std::lock_guard<std::mutex> lock(mu_);
  return params_;
}

int ProcessSet::max_channels() const { return static_cast<int>(channels_.size()); }

// -- step timing (user threads, under mu_) ------------------------------------------------------------------
void ProcessSet::track_step(Request* r, int64_t now) {
  // The tuner's own requests come at irregular times: they belong to no step.
  if (r->sig.op_type == OpType::TUNE || r->name.compare(0, 17, "perseus.autotune.") == 0) return;
  auto it = step_of_.find(r->name);
  if (it != step_of_.end() && it->second == step_) {
    StepSample s{step_begin_ns_, std::max(last_done_ns_.load(std::memory_order_acquire), step_begin_ns_),
                 step_bytes_, step_digest_};
    if (steps_.size() < kStepsKept) steps_.push_back(s);
    else steps_[static_cast<size_t>(step_) % kStepsKept] = s;
    ++step_;
    step_begin_ns_ = 0;
    step_bytes_ = 0;
    step_digest_ = 0;
  }
  if (it != step_of_.end()) {
    it->second = step_;
  } else {
    if (step_of_.size() >= kStepNamesMax) step_of_.clear();
    step_of_.emplace(r->name, step_);
  }
  if (step_begin_ns_ == 0) step_begin_ns_ = now;
  step_bytes_ += static_cast<int64_t>(r->nbytes());
  // The sparse path's collectives depend on the algorithm chosen and on each step's rows: they are left out
  // of the digest (the tuner adds the sparse tensors' own signature, perseus.sparse._runtime.signature()), as
  // are perseus's own one-time collectives (perseus.sparse.seed, ...), which fall into whichever step runs them.
  if (r->name.compare(0, 7, "sparse.") == 0 || r->name.compare(0, 8, "perseus.") == 0) return;
  // FNV-1a over the name, op, dtype and shape; summed, so that the order of submission does not matter.
  // An all-gather's or all-to-all's first dimension is this rank's data of this step: not part of it.
  uint64_t h = 1469598103934665603ull;
  auto mix = [&h](const void* p, size_t n) {
    for (size_t i = 0; i < n; ++i) h = (h ^ static_cast<const uint8_t*>(p)[i]) * 1099511628211ull;
  };
  mix(r->name.data(), r->name.size());
  const int32_t codes[2] = {static_cast<int32_t>(r->sig.op_type), static_cast<int32_t>(r->sig.dtype)};
  mix(codes, sizeof(codes));
  const bool variable_rows = r->sig.op_type == OpType::ALLGATHER || r->sig.op_type == OpType::ALLTOALL;
  const size_t skip = variable_rows && !r->shape.empty() ? 1 : 0;
  mix(r->shape.data() + skip, (r->shape.size() - skip) * sizeof(int64_t));
  step_digest_ += h;
}

void ProcessSet::steps(int64_t since, int64_t* first, std::vector<StepSample>* out) {
  std::lock_guard<std::mutex> lock(mu_);
  out->clear();
  const int64_t oldest = std::max<int64_t>(0, step_ - static_cast<int64_t>(steps_.size()));
  *first = std::max(since, oldest);
  for (int64_t i = *first; i < step_; ++i) out->push_back(steps_[static_cast<size_t>(i) % kStepsKept]);
}

// -- completion (channel threads) -------------------------------------------------------------------------
void ProcessSet::piece_done(Request* r) {
  if (r->remaining.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
  if (track_steps_) last_done_ns_.store(now_ns(), std::memory_order_release);
  if (r->phantom) {
    delete r;
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto f = inflight_.find(r->name);
    if (f != inflight_.end() && f->second == r) inflight_.erase(f);
  }
  engine_->timeline().record(TimelineKind::OP_END, r->sig.op_type, r->name);
  engine_->handles().finish_request(r, nullptr);
  engine_->handles().release_engine(r);
}

void ProcessSet::unit_failed(Unit* u, const std::string& what, ErrorKind kind) {
  std::string names;
  for (const Piece& p : u->pieces) {
    if (!names.empty()) names += ", ";
    names += p.request->name;
  }
  std::string message = std::string("perseus.") + op_name(u->op_type) + "(" + names + ") failed in the transport: " +
                        what;
  engine_->abort(message, engine_->world_rank(), true, kind);
  // The channel is done with these requests: they already carry the abort's error.
  for (const Piece& p : u->pieces) piece_done(p.request);
}

// -- control messages, stalls, failure -----------------------------------------------------------------------
void ProcessSet::send_to_all(const std::string& message) {
  for (int r = 0; r < size_; ++r)
    if (r != rank_) control_->send_message(r, message);
}

void ProcessSet::poll_control(double now) {
  int source;
  std::string msg;
  while (control_->poll_message(&source, &msg)) {
    if (msg.empty()) continue;
    In in{msg.data() + 1, msg.data() + msg.size()};
    switch (msg[0]) {
      case 'w':
        woken_round_ = std::max(woken_round_, in.get<int64_t>());
        break;
      case 'p': {
        int64_t id = in.get<int64_t>();
        std::vector<std::string> names;
        bool joined;
        {
          std::lock_guard<std::mutex> lock(mu_);
          for (auto& kv : inflight_)
            if (!kv.second->dispatched) names.push_back(kv.second->name);
          joined = join_handle_ != nullptr;
        }
        std::sort(names.begin(), names.end());
        std::string where = engine_->hooks().where ? engine_->hooks().where() : std::string();
        std::string answer("s");
        put<int64_t>(&answer, id);
        put<uint8_t>(&answer, joined ? 1 : 0);
        put<int64_t>(&answer, round_);
        put<uint32_t>(&answer, static_cast<uint32_t>(names.size()));
        for (auto& n : names) put_str(&answer, n);
        put_str(&answer, where);
        control_->send_message(source, answer);
        break;
      }
      case 's': {
        int64_t id = in.get<int64_t>();
        if (!probe_ || probe_->id != id) break;
        Probe::Answer a;
        a.joined = in.get<uint8_t>() != 0;
        in.get<int64_t>();
        uint32_t n = in.get<uint32_t>();
        for (uint32_t i = 0; i < n; ++i) a.pending.push_back(in.str());
        a.where = in.str();
        int who = world_ranks_[source];
        probe_->answers[who] = std::move(a);
        auto& w = probe_->waiting_for;
        w.erase(std::remove(w.begin(), w.end(), who), w.end());
        break;
      }
      case 'a': {
        int origin = in.get<int32_t>();
        std::string text(in.p, in.end > in.p ? static_cast<size_t>(in.end - in.p) : 0);
        engine_->abort(text, origin, false, ErrorKind::INTERNAL);
        break;
      }
      case 'x':
        peer_shutdown(world_ranks_[source]);
        break;
      default:
        break;
    }
  }
  (void)now;
}

void ProcessSet::check_stall(double now) {
  const Settings& s = engine_->settings();
  if (s.stall_check_disable || now - last_stall_check_ < kStallCheckS) return;
  last_stall_check_ = now;
  if (pending_.empty()) {
    probe_.reset();
    return;
  }
  double oldest = 1e300;
  for (auto& kv : pending_) oldest = std::min(oldest, kv.second->submit_time);
  const double waited = now - oldest;
  const double shutdown_s = s.stall_shutdown_time_s;
  const bool due_shutdown = shutdown_s > 0 && waited >= shutdown_s;
  if (!probe_) {
    const double warn_every = shutdown_s > 0 ? std::min(s.stall_check_time_s, shutdown_s) : s.stall_check_time_s;
    if (waited < warn_every || now - last_warn_ < warn_every) return;
    probe_.reset(new Probe());
    probe_->id = ++probe_counter_;
    for (int r = 0; r < size_; ++r)
      if (r != rank_) probe_->waiting_for.push_back(world_ranks_[r]);
    probe_->deadline = now + 5.0;
    std::string msg("p");
    put<int64_t>(&msg, probe_->id);
    send_to_all(msg);
    return;
  }
  if (!(probe_->waiting_for.empty() || now >= probe_->deadline)) return;
  std::unique_ptr<Probe> report = std::move(probe_);
  last_warn_ = now;
  // The message: each stalled name with the ranks that have and have not submitted it.
  const int me = engine_->world_rank();
  std::set<int> all_ranks(report->waiting_for.begin(), report->waiting_for.end());
  all_ranks.insert(me);
  for (auto& kv : report->answers) all_ranks.insert(kv.first);
  std::vector<std::pair<double, std::string>> stalled;
  for (auto& kv : pending_) stalled.emplace_back(kv.second->submit_time, kv.second->name);
  std::sort(stalled.begin(), stalled.end());
  std::vector<std::string> lines{"perseus stall: requests have waited for other ranks:"};
  for (auto& st : stalled) {
    std::vector<int> have{me};
    for (auto& kv : report->answers) {
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
  if (lines.size() == 1) return;
  std::map<int, Probe::Answer*> answers;
  for (auto& kv : report->answers) answers[kv.first] = &kv.second;
  for (auto& kv : answers)
    if (!kv.second->where.empty()) lines.push_back("  rank " + std::to_string(kv.first) + " is at " + kv.second->where);
  std::vector<int> silent(report->waiting_for.begin(), report->waiting_for.end());
  std::sort(silent.begin(), silent.end());
  for (int r : silent)
    lines.push_back("  rank " + std::to_string(r) +
                    " did not answer the stall probe (busy outside perseus, hung, or dead)");
  lines.push_back("The usual cause is ranks taking different code paths: a condition on rank(), uneven data "
                  "without hvd.join(), or a tensor name that differs between ranks.");
  if (shutdown_s > 0)
    lines.push_back("Every rank will fail in " + format_s(std::max(shutdown_s - waited, 0.0)) +
                    " s (PERSEUS_STALL_SHUTDOWN_TIME_SECONDS).");
  std::string message;
  for (size_t i = 0; i < lines.size(); ++i) message += (i ? "\n" : "") + lines[i];
  if (due_shutdown) {
    engine_->abort(message + "\nShutting down: the stall lasted longer than the stall shutdown time.", me, true,
                   ErrorKind::STALL);
  } else if (engine_->hooks().log) {
    engine_->hooks().log(30, message);
  }
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

void ProcessSet::mark_dead(const std::string& message) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!is_dead_.load()) {
    dead_ = message;
    is_dead_.store(true);
  }
}

void ProcessSet::fail_all(const Error& error, bool dispatched) {
  std::vector<Request*> failed;
  Handle* join = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = inflight_.begin(); it != inflight_.end();) {
      if (dispatched || !it->second->dispatched) {
        failed.push_back(it->second);
        it = inflight_.erase(it);
      } else {
        ++it;
      }
    }
    std::swap(join, join_handle_);
    join_waiting_.store(false);
  }
  // Only the error is set here; whoever holds a request (engine thread, channel) releases it.
  for (Request* r : failed) engine_->handles().finish_request(r, &error);
  if (join != nullptr) engine_->handles().set_join_result(join, -1, &error);
}

bool ProcessSet::close(bool notify_peers) {
  const double timeout = is_dead_.load() ? 0.5 : 5.0;
  // Drain the channels first: by the time peers hear of the shutdown, this rank has taken part in every
  // collective it had agreed to.
  bool clean = true;
  for (auto& ch : channels_) clean = ch->stop(timeout) && clean;
  clean = device_channel_->stop(timeout) && clean;
  // A broken transport cannot carry the notice; closing must still finish (this runs outside the engine
  // thread's try block, where an exception would terminate the process). The flush also sends an abort
  // queued just before.
  try {
    if (notify_peers) send_to_all("x");
    control_->flush_messages(2.0);
  } catch (const std::exception&) {
  }
  // Whatever this thread still holds will never run.
  std::vector<Request*> drop;
  {
    std::lock_guard<std::mutex> lock(mu_);
    drop.swap(incoming_);
    incoming_count_.store(0);
  }
  for (auto& kv : pending_) drop.push_back(kv.second);
  pending_.clear();
  Error err{ErrorKind::INTERNAL, "perseus has been shut down"};
  for (Request* r : drop) {
    engine_->handles().finish_request(r, &err);
    engine_->handles().release_engine(r);
  }
  return clean;
}

}  // namespace perseus
