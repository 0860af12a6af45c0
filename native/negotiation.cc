// Stage 2: negotiation rounds (see negotiation.h for the protocol).
#include "negotiation.h"

#include <algorithm>
#include <cstring>
#include <map>

#include "codec.h"

namespace perseus {

// -- registry ------------------------------------------------------------------------------------------
int Registry::add(const std::string& name, const Signature& sig, int64_t round) {
  int idx;
  if (!free_.empty()) {
    idx = free_.top();
    free_.pop();
    names_[idx] = name;
    sigs_[idx] = sig;
    last_used_[idx] = round;
    used_[idx] = 1;
  } else {
    idx = static_cast<int>(names_.size());
    names_.push_back(name);
    sigs_.push_back(sig);
    last_used_.push_back(round);
    used_.push_back(1);
  }
  index_[name] = idx;
  return idx;
}

void Registry::evict(int64_t capacity) {
  int64_t excess = static_cast<int64_t>(index_.size()) - std::max<int64_t>(capacity, 0);
  if (excess <= 0) return;
  std::vector<std::pair<int64_t, int>> order;
  order.reserve(index_.size());
  for (auto& kv : index_) order.emplace_back(last_used_[kv.second], kv.second);
  std::sort(order.begin(), order.end());
  for (int64_t i = 0; i < excess; ++i) {
    int idx = order[i].second;
    index_.erase(names_[idx]);
    names_[idx].clear();
    used_[idx] = 0;
    free_.push(idx);
  }
}

// -- words ---------------------------------------------------------------------------------------------
bool Negotiator::build_words(const NameMap& pending, bool dirty, bool joined, bool flush) {
  const size_t n = registry_.num_words(), nb = registry_.bit_words();
  words_.assign(n, 0);
  uint64_t* ready = words_.data() + 1;
  uint64_t* mine = words_.data() + 1 + nb;
  bool needs_exchange = false;
  for (auto& kv : pending) {
    int idx = registry_.lookup(kv.second->name);
    if (idx < 0 || registry_.signature(idx) != kv.second->sig) {
      needs_exchange = true;
    } else {
      ready[idx >> 6] |= uint64_t(1) << (idx & 63);
    }
  }
  for (size_t i = 0; i < nb; ++i) mine[i] = ~ready[i];
  if (joined)
    for (size_t i = 0; i < nb; ++i) ready[i] = ~uint64_t(0);
  uint64_t flags = 0;
  if (!needs_exchange) flags |= FLAG_NO_EXCHANGE;
  if (!dirty) flags |= FLAG_NOT_DIRTY;
  if (!flush) flags |= FLAG_NO_FLUSH;
  flags |= joined ? FLAG_JOINED : FLAG_NONE_JOINED;
  words_[0] = flags;
  return needs_exchange;
}

bool Negotiator::decode(RoundResult* result) {
  result->clear();
  const uint64_t flags = words_[0];
  result->any_dirty = !(flags & FLAG_NOT_DIRTY);
  result->all_joined = flags & FLAG_JOINED;
  result->any_joined = !(flags & FLAG_NONE_JOINED);
  result->any_flush = !(flags & FLAG_NO_FLUSH);
  const size_t nb = (words_.size() - 1) / 2;
  for (size_t w = 0; w < nb; ++w) {
    uint64_t bits = words_[1 + w] & ~words_[1 + nb + w];
    while (bits) {
      int idx = static_cast<int>(w * 64 + __builtin_ctzll(bits));
      if (registry_.valid(idx)) result->ready.push_back(idx);
      bits &= bits - 1;
    }
  }
  return !(flags & FLAG_NO_EXCHANGE);
}

// -- exchange ------------------------------------------------------------------------------------------
namespace {

constexpr const char* kWhat = "negotiation message";

void put_signature(Writer* w, const Signature& s) {
  w->put<int32_t>(static_cast<int32_t>(s.op_type));
  w->put<int32_t>(static_cast<int32_t>(s.dtype));
  w->put<uint32_t>(static_cast<uint32_t>(s.shape.size()));
  for (int64_t d : s.shape) w->put<int64_t>(d);
  w->put<int32_t>(s.reduce_op);
  w->put<int32_t>(s.root_rank);
  w->put<double>(s.prescale);
  w->put<double>(s.postscale);
  w->put<int32_t>(s.priority);
  w->put<int32_t>(s.device);
}

// Bytes of a pending entry without its name's bytes and its shape: the name's length and the fixed fields.
constexpr size_t kMinEntryBytes = 4 + 4 + 4 + 4 + 4 + 4 + 8 + 8 + 4 + 4;

// Throws TransportError for an op type or dtype this build does not know: they index tables later.
Signature get_signature(Reader* in) {
  Signature s;
  const int32_t op = in->get<int32_t>(), dt = in->get<int32_t>();
  if (op < 0 || op > static_cast<int32_t>(OpType::TUNE) || dt < 0 || dt >= kNumDTypes)
    throw TransportError("perseus: a " + std::string(kWhat) + " with an unknown collective (" + std::to_string(op) +
                         ") or dtype (" + std::to_string(dt) + ") (the ranks run different perseus versions)");
  s.op_type = static_cast<OpType>(op);
  s.dtype = static_cast<DType>(dt);
  const uint32_t nd = in->count(sizeof(int64_t));
  s.shape.resize(nd);
  for (uint32_t d = 0; d < nd; ++d) s.shape[d] = in->get<int64_t>();
  s.reduce_op = in->get<int32_t>();
  s.root_rank = in->get<int32_t>();
  s.prescale = in->get<double>();
  s.postscale = in->get<double>();
  s.priority = in->get<int32_t>();
  s.device = in->get<int32_t>();
  return s;
}

// The ranks that sent a name, grouped by the signature they sent, groups in order of first appearance.
using SignatureGroups = std::vector<std::pair<const Signature*, std::vector<int>>>;

SignatureGroups group_by_signature(const std::vector<std::pair<int, Signature>>& by_rank) {
  SignatureGroups groups;
  for (auto& rs : by_rank) {
    bool placed = false;
    for (auto& g : groups)
      if (*g.first == rs.second) {
        g.second.push_back(rs.first);
        placed = true;
        break;
      }
    if (!placed) groups.push_back({&rs.second, {rs.first}});
  }
  return groups;
}

// The error for a name sent with different signatures: the first two groups, with ranks as `rank_names`
// shows them (positions in the set when empty).
std::string mismatch(const std::string& name, const SignatureGroups& groups, const std::vector<int>& rank_names) {
  auto show = [&](const std::vector<int>& rs) {
    std::vector<int> out;
    for (int r : rs) out.push_back(rank_names.empty() ? r : rank_names[r]);
    return out;
  };
  return mismatch_message(name, *groups[0].first, show(groups[0].second), *groups[1].first, show(groups[1].second));
}

}  // namespace

void Negotiator::exchange_payload(const NameMap& pending, bool joined, std::string* out) const {
  out->clear();
  Writer w(out);
  w.put<uint8_t>(joined ? 1 : 0);
  w.put<uint32_t>(static_cast<uint32_t>(pending.size()));
  for (auto& kv : pending) {
    w.put_str(kv.first);
    put_signature(&w, kv.second->sig);
  }
}

// Every rank's pending list read into `exchange`: names in order of first appearance (rank 0's list
// first), which is the same on every rank. Throws TransportError on a truncated list.
void Negotiator::read_payloads(const std::vector<std::string>& payloads, Exchange* exchange) const {
  exchange->active.assign(payloads.size(), 0);
  for (size_t r = 0; r < payloads.size(); ++r) {
    Reader in(payloads[r], kWhat);
    exchange->active[r] = in.get<uint8_t>() == 0;  // a joined rank submits nothing of its own
    const uint32_t n = in.count(kMinEntryBytes);
    for (uint32_t i = 0; i < n; ++i) {
      std::string name = in.str();
      Signature s = get_signature(&in);
      auto it = exchange->seen.find(name);
      if (it == exchange->seen.end()) {
        exchange->order.push_back(name);
        it = exchange->seen.emplace(name, std::vector<std::pair<int, Signature>>()).first;
      }
      it->second.emplace_back(static_cast<int>(r), std::move(s));
    }
  }
}

void Negotiator::apply_exchange(RoundResult* result, const std::vector<std::string>& payloads,
                                const std::vector<int>& rank_names, int64_t round) {
  result->exchanged = true;
  Exchange exchange;
  read_payloads(payloads, &exchange);
  std::vector<char> already(registry_.slots(), 0);
  for (int idx : result->ready) already[idx] = 1;
  std::vector<char> has;
  for (const std::string& name : exchange.order) {
    const auto& by_rank = exchange.seen[name];
    has.assign(payloads.size(), 0);
    for (auto& rs : by_rank) has[rs.first] = 1;
    bool complete = true;  // every active rank has submitted the name
    for (size_t r = 0; r < payloads.size(); ++r)
      if (exchange.active[r] && !has[r]) complete = false;
    const SignatureGroups groups = group_by_signature(by_rank);
    if (groups.size() > 1) {
      // Raised once every rank has submitted, so that every rank raises together.
      if (complete) result->errors.emplace_back(name, mismatch(name, groups, rank_names));
      continue;
    }
    admit(name, *groups[0].first, complete, round, result, &already);
  }
  if (!result->errors.empty()) {
    auto& ready = result->ready;
    ready.erase(std::remove_if(ready.begin(), ready.end(),
                               [&](int idx) { return result->has_error(registry_.name(idx)); }),
                ready.end());
  }
}

// A name every rank that sent it sent with one signature: record it (a new index, or the signature of a
// known one when every rank agrees on a new signature), and once every active rank has it, it is ready.
void Negotiator::admit(const std::string& name, const Signature& sig, bool complete, int64_t round,
                       RoundResult* result, std::vector<char>* already) {
  int idx = registry_.lookup(name);
  if (!complete) {
    if (idx < 0) registry_.add(name, sig, round);
    return;
  }
  if (idx < 0) idx = registry_.add(name, sig, round);
  else registry_.set_signature(idx, sig);
  if (static_cast<size_t>(idx) >= already->size()) already->resize(idx + 1, 0);
  if (!(*already)[idx]) {
    result->ready.push_back(idx);
    (*already)[idx] = 1;
  }
}

void Negotiator::reject_while_joined(RoundResult* result) {
  if (!result->any_joined) return;
  std::vector<int> keep;
  for (int idx : result->ready) {
    const Signature& s = registry_.signature(idx);
    if (s.op_type == OpType::ALLREDUCE) {
      keep.push_back(idx);
      continue;
    }
    std::string op = op_name(s.op_type);
    result->errors.emplace_back(
        registry_.name(idx),
        "perseus." + op + "(" + py_repr(registry_.name(idx)) + "): one or more ranks have called join(); only " +
            "allreduce can run until every rank has joined. Call " + op + " before join() on every rank.");
  }
  result->ready.swap(keep);
}

void Negotiator::order(RoundResult* result) {
  std::sort(result->ready.begin(), result->ready.end(), [this](int a, int b) {
    int pa = registry_.signature(a).priority, pb = registry_.signature(b).priority;
    if (pa != pb) return pa > pb;
    return a < b;
  });
}

// -- messages ------------------------------------------------------------------------------------------
std::string mismatch_message(const std::string& name, const Signature& a, const std::vector<int>& ranks_a,
                             const Signature& b, const std::vector<int>& ranks_b) {
  std::string field, va, vb;
  if (a.op_type != b.op_type) {
    field = "op_type", va = op_name(a.op_type), vb = op_name(b.op_type);
  } else if (a.dtype != b.dtype) {
    field = "dtype", va = dtype_name(a.dtype), vb = dtype_name(b.dtype);
  } else if (a.shape != b.shape) {
    field = "shape", va = py_repr(a.shape), vb = py_repr(b.shape);
  } else if (a.reduce_op != b.reduce_op) {
    field = "reduce_op", va = reduce_op_title(static_cast<ReduceOp>(a.reduce_op));
    vb = reduce_op_title(static_cast<ReduceOp>(b.reduce_op));
  } else if (a.root_rank != b.root_rank) {
    field = "root_rank", va = std::to_string(a.root_rank), vb = std::to_string(b.root_rank);
  } else if (a.prescale != b.prescale) {
    field = "prescale", va = py_repr(a.prescale), vb = py_repr(b.prescale);
  } else if (a.postscale != b.postscale) {
    field = "postscale", va = py_repr(a.postscale), vb = py_repr(b.postscale);
  } else if (a.priority != b.priority) {
    field = "priority", va = std::to_string(a.priority), vb = std::to_string(b.priority);
  } else {
    auto where = [](int32_t d) {
      return std::string(d < 0 ? "the CPU path" : d == 0 ? "the GPU (NCCL) path" : "the launcher on CPU memory");
    };
    field = "device", va = where(a.device), vb = where(b.device);
  }
  static const std::map<std::string, std::string> fixes = {
      {"shape", "every rank must submit the same shape for a name"},
      {"dtype", "every rank must submit the same dtype for a name"},
      {"op_type", "every rank must call the same collective for a name"},
      {"reduce_op", "every rank must use the same op for a name"},
      {"root_rank", "every rank must pass the same root_rank"},
      {"prescale", "every rank must pass the same prescale_factor"},
      {"postscale", "every rank must pass the same postscale_factor"},
      {"priority", "every rank must pass the same priority"},
      {"device", "every rank must pass the tensor on the same kind of device (all CPU or all GPU) and set the "
                 "same PERSEUS_DEVICE_BACKEND"},
  };
  std::string fix = fixes.at(field);
  std::string label = field == "prescale" ? "prescale_factor" : field == "postscale" ? "postscale_factor" : field;
  if (field == "device") label = "it through";
  if (field == "shape" && (a.op_type == OpType::ALLGATHER || a.op_type == OpType::ALLTOALL)) {
    label = "shape after the first dimension";
    fix = "only the first dimension may differ between ranks";
  }
  std::string op = field != "op_type" ? op_name(a.op_type) : "collective";
  return "perseus." + op + "(" + py_repr(name) + "): ranks " + py_list(ranks_b) + " sent " + label + " " + vb +
         " but ranks " + py_list(ranks_a) + " sent " + va + "; " + fix + ".";
}

}  // namespace perseus
