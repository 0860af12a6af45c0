// Stage 4b: a channel's own TCP connections to the other ranks of a process set that spans hosts.
//
// MPI's TCP transport keeps one connection per pair of processes and shares it between all communicators,
// so channels on duplicated communicators would all travel in one TCP flow. A network that caps each flow
// (most public clouds do) is then used at a fraction of its capacity. Links give each channel its own
// connections: N channels are N flows between every pair of hosts, and units on different channels travel
// at once.
//
// Construction is collective over the channel's Comm: every rank opens a listening socket and the ranks
// exchange addresses and a 64-bit session number (rank 0's, drawn from std::random_device). A connection is
// made on first use: the lower rank of a pair connects, the higher one accepts, and the first bytes (a hello)
// name the connecting rank, the accepting rank and the session. Each transfer carries an 8-byte length, so
// two ranks that disagree on a size fail instead of mixing messages.
//
// The listening socket takes the one address a rank advertises (every interface when it advertises several),
// and is reachable by anything on that network, so the handshakes run on a thread of their
// own (the acceptor), never on the channel thread: it polls every connection still in its handshake at once,
// closes one that has not sent its whole hello within kHelloS, keeps at most kMaxPending of them (one more
// closes the oldest), and acknowledges only a hello with the right magic, session and ranks. A connection that
// sends nothing, a byte at a time or garbage thus delays no peer, and costs a few bytes until its deadline.
// Once every lower rank has connected, the acceptor closes the listening socket and ends (rank 0, which
// accepts from nobody, closes it right after the exchange).
//
// A transfer fails with TransportError (naming both ranks and the peer's address) when the peer closes the
// connection or dies, on a socket error, when no byte moves for `timeout_s`, or when `cancel` becomes true
// (the process set is failing). The owning channel thread is the only user of a Links object.
//
// Links count what they move into the wire counters of the Comm they were built over (wire.h), as the
// bytes leave and arrive: transfer bodies as data, the length headers and the handshakes as control.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "transport.h"

namespace perseus {

struct LinkOptions {
  std::vector<std::string> interfaces;  // IPv4 addresses of these interfaces only; empty: all but loopback
  double timeout_s = 30.0;
  const std::atomic<bool>* cancel = nullptr;
  std::vector<int> world_ranks;  // for messages: the world rank of each rank of the Comm
};

class Links : public PointToPoint {
 public:
  // Collective over `comm` (used only here, for the address exchange). Throws TransportError when no
  // listening socket can be opened or the named interfaces have no IPv4 address.
  Links(Comm& comm, LinkOptions options);
  ~Links() override;
  Links(const Links&) = delete;
  Links& operator=(const Links&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  // Send send_bytes to dest while receiving recv_bytes from source; either may be this rank's peer on the
  // same host (the connection then stays on this machine).
  void sendrecv(const void* send, size_t send_bytes, int dest, void* recv, size_t recv_bytes,
                int source) override;
  // Connections open now (for tests and diagnostics).
  int open_connections() const;
  // The port this rank listens on (for tests: the listener closes once every lower rank has connected).
  uint16_t port() const { return ports_[rank_]; }

 private:
  // One sendrecv in progress: each direction is an 8-byte length, then the body.
  struct Transfer {
    const void* send;
    size_t send_bytes;
    int dest;
    void* recv;
    size_t recv_bytes;
    int source;
    uint64_t out_hdr = 0, in_hdr = 0;
    size_t out_done = 0, in_done = 0;  // bytes moved, header included
    size_t out_total() const { return sizeof(out_hdr) + send_bytes; }
    size_t in_total() const { return sizeof(in_hdr) + recv_bytes; }
  };
  bool send_some(int fd, Transfer* t);
  bool recv_some(int fd, Transfer* t);
  void check_stuck(const Transfer& t, double last_progress) const;
  int connection(int peer);
  int connect_to(int peer);
  void accept_from(int peer);
  void accept_loop();  // the acceptor thread
  struct Pending;
  bool read_hello(Pending* p);
  void hand_over(int fd, int from);
  std::string who(int peer) const;
  [[noreturn]] void fail(int peer, const std::string& what) const;
  void check_cancel(int peer) const;

  int rank_, size_;
  LinkOptions options_;
  int listener_ = -1;
  uint64_t session_ = 0;
  std::vector<int> fds_;  // per peer; -1 until connected (the channel thread's own)
  // Shared with the acceptor thread, under mu_: per lower peer, the connection it accepted and the channel
  // thread has not taken yet (-1: none), whether one was ever handed over; why the acceptor stopped early.
  std::mutex mu_;
  std::condition_variable accepted_cv_;
  std::vector<int> accepted_;
  std::vector<char> handed_;
  std::string acceptor_error_;
  int wake_[2] = {-1, -1};  // a pipe: the destructor wakes the acceptor
  std::thread acceptor_;
  std::vector<std::vector<uint32_t>> addrs_;  // per peer, network byte order
  std::vector<uint16_t> ports_;
  std::shared_ptr<WireCounters> wire_;
};

// This machine's IPv4 addresses (dotted) on `interfaces` (all up, non-loopback ones when empty).
std::vector<std::string> local_ipv4_addresses(const std::vector<std::string>& interfaces);

}  // namespace perseus
