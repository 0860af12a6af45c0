// Stage 2: decentralised negotiation. No rank coordinates; every rank computes the same answer.
//
// Each tensor name gets an index agreed by all ranks of a process set, together with its Signature. One
// round is a bitwise-AND all-reduce of a word vector:
//  * word 0 carries flags. NO_EXCHANGE, NOT_DIRTY and NO_FLUSH are active-low (after the AND they are clear if
//    ANY rank cleared them); JOINED is active-high (set only if EVERY rank has joined), NONE_JOINED active-low.
//  * then one readiness bit per index: set when this rank has the tensor pending with the recorded
//    signature (a joined rank sets every bit: it contributes zeros to anything);
//  * then the complement of this rank's real submissions, so the AND yields NOT(any rank submitted it).
//    A tensor is ready iff its bit survives and some rank really submitted it.
// When any rank has a name without an index, or a signature that differs from the record, every rank
// follows the AND with an all-gather of its whole pending list; from those lists every rank assigns new
// indices in the same order, finds the names now ready and the names whose signatures disagree (the same
// error is raised on every rank). In steady state a step costs one small AND per round.
#pragma once

#include <cstdint>
#include <queue>
#include <string>
#include <unordered_map>
#include <vector>

#include "common.h"
#include "handles.h"

namespace perseus {

constexpr uint64_t FLAG_NO_EXCHANGE = 1u << 0;
constexpr uint64_t FLAG_NOT_DIRTY = 1u << 1;
constexpr uint64_t FLAG_JOINED = 1u << 2;
constexpr uint64_t FLAG_NONE_JOINED = 1u << 3;
constexpr uint64_t FLAG_NO_FLUSH = 1u << 4;  // active-low: some rank asks every rank to flush its device buckets

// Name <-> index <-> signature, identical on every rank of a set. Bounded: evict() drops the least recently
// used names beyond a capacity; every rank drops the same ones (use is counted in agreed rounds) and reuses
// the lowest freed index first, so indices stay identical everywhere.
class Registry {
 public:
  int lookup(const std::string& name) const {
    auto it = index_.find(name);
    return it == index_.end() ? -1 : it->second;
  }
  int add(const std::string& name, const Signature& sig, int64_t round);
  void touch(int idx, int64_t round) { last_used_[idx] = round; }
  void evict(int64_t capacity);
  size_t slots() const { return names_.size(); }
  size_t live() const { return index_.size(); }
  size_t bit_words() const { return (names_.size() + 63) / 64; }
  size_t num_words() const { return 1 + 2 * bit_words(); }
  const std::string& name(int idx) const { return names_[idx]; }
  const Signature& signature(int idx) const { return sigs_[idx]; }
  void set_signature(int idx, const Signature& s) { sigs_[idx] = s; }
  bool valid(int idx) const { return idx >= 0 && static_cast<size_t>(idx) < names_.size() && used_[idx]; }

 private:
  std::unordered_map<std::string, int> index_;
  std::vector<std::string> names_;
  std::vector<Signature> sigs_;
  std::vector<int64_t> last_used_;
  std::vector<char> used_;
  std::priority_queue<int, std::vector<int>, std::greater<int>> free_;
};

// What one round decided, identically on every rank.
struct RoundResult {
  std::vector<int> ready;                                  // indices, in execution order after order()
  std::vector<std::pair<std::string, std::string>> errors;  // name -> message (every rank raises it)
  bool any_dirty = false, all_joined = false, any_joined = false, exchanged = false;
  bool any_flush = false;  // some rank asked for its device buckets to be flushed (device_buckets.h)
  void clear() {
    ready.clear();
    errors.clear();
    any_dirty = all_joined = any_joined = exchanged = any_flush = false;
  }
  bool has_error(const std::string& name) const {
    for (auto& e : errors)
      if (e.first == name) return true;
    return false;
  }
};

class Negotiator {
 public:
  Negotiator(int rank, int size) : rank_(rank), size_(size) {}
  Registry& registry() { return registry_; }

  // This rank's words for a round (reused storage). Returns whether this rank needs an exchange.
  bool build_words(const NameMap& pending, bool dirty, bool joined, bool flush = false);
  std::vector<uint64_t>& words() { return words_; }
  // Interpret the reduced words into `result`; returns whether an exchange follows.
  bool decode(RoundResult* result);
  // This rank's pending list for the exchange.
  void exchange_payload(const NameMap& pending, bool joined,
                        std::string* out) const;
  // Merge every rank's list: new indices, newly ready names, mismatches. `rank_names` maps a position in
  // the set to the job rank shown in messages. Throws TransportError when a list is truncated.
  void apply_exchange(RoundResult* result, const std::vector<std::string>& payloads,
                      const std::vector<int>& rank_names, int64_t round);
  // While any rank has joined, only allreduce runs; other ready collectives fail on every rank.
  void reject_while_joined(RoundResult* result);
  // Execution order: higher priority first, then by index.
  void order(RoundResult* result);

 private:
  // Every rank's pending list, as read from the exchange.
  struct Exchange {
    std::vector<std::string> order;  // names in order of first appearance
    std::unordered_map<std::string, std::vector<std::pair<int, Signature>>> seen;  // name -> (rank, signature)
    std::vector<char> active;  // per rank: not joined
  };
  void read_payloads(const std::vector<std::string>& payloads, Exchange* exchange) const;
  void admit(const std::string& name, const Signature& sig, bool complete, int64_t round, RoundResult* result,
             std::vector<char>* already);

  int rank_, size_;
  Registry registry_;
  std::vector<uint64_t> words_;
};

std::string mismatch_message(const std::string& name, const Signature& a, const std::vector<int>& ranks_a,
                             const Signature& b, const std::vector<int>& ranks_b);

}  // namespace perseus
