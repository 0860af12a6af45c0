// The loopback transport's world (see transport_loopback_state.h): the registry of the communicators its
// ranks share, failing every rank at once, the debug counters, and what the last rank to enter a collective
// does to complete it. A collective's error (a mismatch between ranks, a rank's misuse, a failed combine)
// is stored in its slot and raised as TransportError on every rank of it.
#include "transport_loopback_state.h"

#include <cstring>
#include <numeric>
#include <stdexcept>

#include "kernels.h"
#include "transport_loopback.h"

namespace perseus {
namespace loopback_transport {

bool valid_dtype(DType d) {
  int v = static_cast<int>(d);
  return v >= 0 && v < kNumDTypes;
}

std::vector<char> bytes_of(const void* p, size_t n, std::string* error) {
  if (n == 0) return {};
  if (!p) {
    *error = "null buffer for " + std::to_string(n) + " bytes";
    return {};
  }
  const char* c = static_cast<const char*>(p);
  return std::vector<char>(c, c + n);
}

std::string counts_text(const std::vector<size_t>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

size_t sum_of(const std::vector<size_t>& v, size_t end) {
  return std::accumulate(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(end), size_t{0});
}

void complete(Slot& s, int size) {
  try {
    switch (s.kind) {
      case Kind::ALLREDUCE:
      case Kind::REDUCE_SCATTER: {
        // Rank order, once for everybody: every rank gets bit-identical results.
        s.result = std::move(s.data[0]);
        for (int r = 1; r < size && s.count; ++r)
          combine(s.result.data(), s.data[r].data(), s.result.data(), s.count, s.dtype, s.op);
        std::vector<std::vector<char>>(size).swap(s.data);  // only the result is needed from here on
        break;
      }
      case Kind::IALLREDUCE_BAND: {
        s.result = std::move(s.data[0]);
        for (int r = 1; r < size; ++r) {
          for (size_t i = 0; i < s.count; ++i) {
            uint64_t a, b;
            std::memcpy(&a, s.result.data() + 8 * i, 8);
            std::memcpy(&b, s.data[r].data() + 8 * i, 8);
            a &= b;
            std::memcpy(s.result.data() + 8 * i, &a, 8);
          }
        }
        std::vector<std::vector<char>>(size).swap(s.data);
        break;
      }
      case Kind::ALLTOALLV:
        // counts[r] = rank r's send counts then its recv counts: what s sends to r must be what r expects.
        for (int src = 0; src < size; ++src)
          for (int dst = 0; dst < size; ++dst)
            if (s.counts[src][dst] != s.counts[dst][size + src])
              s.error = "alltoallv: rank " + std::to_string(src) + " sends " +
                        std::to_string(s.counts[src][dst]) + " elements to rank " + std::to_string(dst) +
                        ", which expects " + std::to_string(s.counts[dst][size + src]);
        break;
      default:
        break;
    }
  } catch (const std::exception& e) {  // handed to every rank of the exchange, which raises it
    s.error = e.what();
  }
}

void finish_slot(CommState& st, uint64_t seq) {
  auto it = st.slots.find(seq);
  if (it != st.slots.end() && ++it->second.finished == st.size) st.slots.erase(it);
}

}  // namespace loopback_transport

using loopback_transport::CommState;

void LoopbackWorld::fail(const std::string& message) {
  {
    std::lock_guard<std::mutex> g(fail_mu_);
    if (failed.load()) return;
    fail_message_ = message;  // written before the flag, never again: readers need no lock
    failed.store(true);
  }
  // Wake every waiter. Taking each lock after setting the flag means a waiter either already sleeps
  // (and is notified) or checks the flag after this point. Never holds the registry and a comm lock at
  // once, so no lock order to get wrong.
  std::vector<std::shared_ptr<CommState>> states;
  {
    std::lock_guard<std::mutex> g(registry_mu_);
    for (auto& kv : registry_) states.push_back(kv.second.state);
  }
  for (auto& st : states) {
    { std::lock_guard<std::mutex> g(st->mu); }
    st->cv.notify_all();
  }
}

std::string LoopbackWorld::next_root_path(int rank) {
  std::lock_guard<std::mutex> g(registry_mu_);
  return std::to_string(roots_created[rank]++);
}

std::shared_ptr<CommState> LoopbackWorld::attach(const std::string& path, int n) {
  std::lock_guard<std::mutex> g(registry_mu_);
  Entry& e = registry_[path];
  if (!e.state) e.state = std::make_shared<CommState>(n, path);
  return e.state;
}

void LoopbackWorld::detach(const std::string& path) {
  std::lock_guard<std::mutex> g(registry_mu_);
  auto it = registry_.find(path);
  if (it != registry_.end() && ++it->second.detached == it->second.state->size) registry_.erase(it);
}

LoopbackStats LoopbackWorld::stats() {
  std::vector<std::shared_ptr<CommState>> states;
  {
    std::lock_guard<std::mutex> g(registry_mu_);
    for (auto& kv : registry_) states.push_back(kv.second.state);
  }
  LoopbackStats out;
  out.comms = states.size();
  for (auto& st : states) {
    std::lock_guard<std::mutex> g(st->mu);
    out.slots += st->slots.size();
    for (auto& q : st->p2p) out.messages += q.size();
    for (auto& q : st->inbox) out.messages += q.size();
  }
  return out;
}

std::shared_ptr<LoopbackWorld> make_loopback_world(int size) {
  if (size < 1) throw std::invalid_argument("loopback world needs at least one rank");
  return std::make_shared<LoopbackWorld>(size);
}

void loopback_world_fail(const std::shared_ptr<LoopbackWorld>& world, const std::string& message) {
  world->fail(message);
}

LoopbackStats loopback_world_stats(const std::shared_ptr<LoopbackWorld>& world) { return world->stats(); }

}  // namespace perseus
