// Stage 4b: a channel's own TCP connections between hosts (see links.h).
#include "links.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <system_error>

namespace perseus {

namespace {

constexpr int kMaxAddrs = 8;
constexpr int kWords = 3 + kMaxAddrs;  // port, address count, session, addresses
constexpr uint32_t kMagic = 0x7065726c;
constexpr int kSliceMs = 100;           // how often a waiting transfer looks at `cancel`
constexpr double kAttemptS = 5.0;       // one connection attempt to one address
constexpr double kHelloS = 5.0;         // how long an accepted connection may take to send its whole hello
constexpr size_t kMaxPending = 64;      // connections in their handshake at once (one more closes the oldest)

struct Hello {
  uint32_t magic;
  int32_t from, to;
  uint32_t pad;
  uint64_t session;
};


std::string errno_text(int e) { return std::generic_category().message(e); }

std::string dotted(uint32_t addr) {
  char buf[INET_ADDRSTRLEN] = {0};
  inet_ntop(AF_INET, &addr, buf, sizeof(buf));
  return buf;
}

void close_fd(int* fd) {
  if (*fd >= 0) ::close(*fd);
  *fd = -1;
}

// Wait for `events` on fd until `deadline` (absolute, now_s clock); false on timeout.
bool wait_for(int fd, short events, double deadline) {
  for (;;) {
    const double left = deadline - now_s();
    if (left <= 0) return false;
    pollfd p{fd, events, 0};
    const int ms = static_cast<int>(std::min(left * 1000.0 + 1.0, 1000.0));
    const int n = ::poll(&p, 1, ms);
    if (n > 0) return true;
    if (n < 0 && errno != EINTR) return true;  // let the following call report the error
  }
}

// Move exactly n bytes (blocking with a deadline) on a non-blocking socket; false on timeout, EOF or error.
bool send_all(int fd, const void* data, size_t n, double deadline) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t k = ::send(fd, p, n, MSG_NOSIGNAL);
    if (k > 0) { p += k; n -= static_cast<size_t>(k); continue; }
    if (k < 0 && errno == EINTR) continue;
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK) && wait_for(fd, POLLOUT, deadline)) continue;
    return false;
  }
  return true;
}

bool recv_all(int fd, void* data, size_t n, double deadline) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    const ssize_t k = ::recv(fd, p, n, 0);
    if (k > 0) { p += k; n -= static_cast<size_t>(k); continue; }
    if (k < 0 && errno == EINTR) continue;
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK) && wait_for(fd, POLLIN, deadline)) continue;
    return false;
  }
  return true;
}

void tune(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

}  // namespace

std::vector<std::string> local_ipv4_addresses(const std::vector<std::string>& interfaces) {
  std::vector<std::string> out;
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return out;
  for (ifaddrs* i = list; i != nullptr; i = i->ifa_next) {
    if (i->ifa_addr == nullptr || i->ifa_addr->sa_family != AF_INET || !(i->ifa_flags & IFF_UP)) continue;
    const std::string name = i->ifa_name;
    if (interfaces.empty() ? (i->ifa_flags & IFF_LOOPBACK) != 0
                           : std::find(interfaces.begin(), interfaces.end(), name) == interfaces.end())
      continue;
    out.push_back(dotted(reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr.s_addr));
  }
  ::freeifaddrs(list);
  return out;
}

Links::Links(Comm& comm, LinkOptions options)
    : rank_(comm.rank()), size_(comm.size()), options_(std::move(options)), fds_(size_, -1), addrs_(size_),
      ports_(size_, 0), wire_(comm.wire_counters()) {
  if (options_.world_ranks.size() != static_cast<size_t>(size_)) {
    options_.world_ranks.resize(size_);
    for (int r = 0; r < size_; ++r) options_.world_ranks[r] = r;
  }
  std::vector<std::string> mine = local_ipv4_addresses(options_.interfaces);
  std::string problem;
  if (mine.empty() && !options_.interfaces.empty()) {
    std::string names;
    for (const auto& n : options_.interfaces) names += (names.empty() ? "" : ",") + n;
    problem = "perseus: no network interface named in PERSEUS_NETWORK_INTERFACE (" + names +
              ") has an IPv4 address that is up on this host; name an interface that connects the hosts "
              "(see 'ip -br addr')";
  }
  if (mine.empty()) mine.push_back("127.0.0.1");  // a host without a network: only local peers
  if (mine.size() > static_cast<size_t>(kMaxAddrs)) mine.resize(kMaxAddrs);

  listener_ = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  // Peers connect only to the addresses advertised below: with one, the socket listens on it alone (a
  // socket has one address, so several advertised addresses need every interface).
  sa.sin_addr.s_addr = htonl(INADDR_ANY);
  if (mine.size() == 1) inet_pton(AF_INET, mine[0].c_str(), &sa.sin_addr);
  sa.sin_port = 0;
  socklen_t len = sizeof(sa);
  if (problem.empty() &&
      (listener_ < 0 || ::bind(listener_, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0 ||
       ::listen(listener_, 256) != 0 || ::getsockname(listener_, reinterpret_cast<sockaddr*>(&sa), &len) != 0 ||
       ::pipe2(wake_, O_CLOEXEC | O_NONBLOCK) != 0))
    problem = "perseus: cannot open a listening TCP socket for a channel: " + errno_text(errno);

  // Every rank takes part in the exchange even when it failed, so that no peer waits for it; a failed rank
  // advertises no address and port 0, and every rank then reports the first failure it sees.
  std::vector<int64_t> words(kWords, 0), all(static_cast<size_t>(kWords) * size_);
  std::random_device rd;
  words[0] = problem.empty() ? ntohs(sa.sin_port) : 0;
  words[1] = problem.empty() ? static_cast<int64_t>(mine.size()) : 0;
  words[2] = static_cast<int64_t>((static_cast<uint64_t>(rd()) << 32) ^ rd());
  for (size_t i = 0; i < mine.size(); ++i) {
    in_addr a{};
    inet_pton(AF_INET, mine[i].c_str(), &a);
    words[3 + i] = a.s_addr;
  }
  comm.allgather_i64(words.data(), kWords, all.data());
  session_ = static_cast<uint64_t>(all[2]);  // rank 0's
  for (int r = 0; r < size_; ++r) {
    const int64_t* w = &all[static_cast<size_t>(kWords) * r];
    ports_[r] = static_cast<uint16_t>(w[0]);
    for (int64_t i = 0; i < w[1]; ++i) addrs_[r].push_back(static_cast<uint32_t>(w[3 + i]));
    if (problem.empty() && ports_[r] == 0)
      problem = "perseus: rank " + std::to_string(options_.world_ranks[r]) +
                " could not set up its channel connections (see its error)";
  }
  if (!problem.empty()) {
    close_fd(&listener_);
    close_fd(&wake_[0]);
    close_fd(&wake_[1]);
    throw TransportError(problem);
  }
  accepted_.assign(size_, -1);
  handed_.assign(size_, 0);
  if (rank_ == 0) close_fd(&listener_);  // the lower rank of a pair connects: rank 0 accepts from nobody
  else acceptor_ = std::thread([this] { accept_loop(); });
}

Links::~Links() {
  if (acceptor_.joinable()) {
    const char wake = 1;
    if (::write(wake_[1], &wake, 1) < 0) std::perror("perseus: waking a channel's acceptor");
    acceptor_.join();
  }
  for (int& fd : accepted_) close_fd(&fd);
  for (int& fd : fds_) close_fd(&fd);
  close_fd(&listener_);
  close_fd(&wake_[0]);
  close_fd(&wake_[1]);
}

int Links::open_connections() const {
  return static_cast<int>(std::count_if(fds_.begin(), fds_.end(), [](int fd) { return fd >= 0; }));
}

std::string Links::who(int peer) const {
  std::string where = addrs_[peer].empty() ? "?" : dotted(addrs_[peer][0]);
  return "rank " + std::to_string(options_.world_ranks[peer]) + " (" + where + ":" + std::to_string(ports_[peer]) + ")";
}

void Links::fail(int peer, const std::string& what) const {
  throw TransportError("perseus: the channel connection between rank " +
                       std::to_string(options_.world_ranks[rank_]) + " and " + who(peer) + " failed: " + what +
                       ". The peer process may have died or its host may be unreachable; check that rank's "
                       "output, and that PERSEUS_NETWORK_INTERFACE names an interface that connects the hosts.");
}

void Links::check_cancel(int peer) const {
  if (options_.cancel != nullptr && options_.cancel->load(std::memory_order_acquire))
    throw TransportError("perseus: a transfer with " + who(peer) + " was cancelled because the process set failed");
}

int Links::connection(int peer) {
  if (fds_[peer] < 0) {
    if (peer > rank_) fds_[peer] = connect_to(peer);
    else accept_from(peer);
  }
  return fds_[peer];
}

// The lower rank of a pair connects. Each advertised address of the peer is tried in turn until one
// answers with the peer's acknowledgement (an address may reach another process on some other machine).
int Links::connect_to(int peer) {
  const double deadline = now_s() + options_.timeout_s;
  std::string last = "no address";
  while (now_s() < deadline) {
    for (uint32_t addr : addrs_[peer]) {
      check_cancel(peer);
      int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
      if (fd < 0) fail(peer, "cannot create a socket: " + errno_text(errno));
      sockaddr_in sa{};
      sa.sin_family = AF_INET;
      sa.sin_addr.s_addr = addr;
      sa.sin_port = htons(ports_[peer]);
      const double attempt_end = std::min(deadline, now_s() + kAttemptS);
      int err = 0;
      if (::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0) {
        err = errno;
        if (err == EINPROGRESS) {
          if (wait_for(fd, POLLOUT, attempt_end)) {
            socklen_t len = sizeof(err);
            ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
          } else {
            err = ETIMEDOUT;
          }
        }
      }
      if (err == 0) {
        Hello h{kMagic, rank_, peer, 0, session_};
        uint8_t ack = 0;
        if (send_all(fd, &h, sizeof(h), attempt_end) && recv_all(fd, &ack, 1, attempt_end) && ack == 1) {
          tune(fd);
          wire_->control(sizeof(h), sizeof(ack));
          return fd;
        }
        last = "no answer from " + dotted(addr) + ":" + std::to_string(ports_[peer]);
      } else {
        last = dotted(addr) + ":" + std::to_string(ports_[peer]) + ": " + errno_text(err);
      }
      close_fd(&fd);
    }
    ::usleep(20000);
  }
  fail(peer, "cannot connect within " + std::to_string(static_cast<int>(options_.timeout_s)) + " s (" + last + ")");
}

// The higher rank waits until the acceptor has handed over `peer`'s connection; connections from other lower
// ranks that arrive first are kept for later.
void Links::accept_from(int peer) {
  const double deadline = now_s() + options_.timeout_s;
  std::unique_lock<std::mutex> lock(mu_);
  while (accepted_[peer] < 0) {
    if (!acceptor_error_.empty()) fail(peer, "accepting its connection failed: " + acceptor_error_);
    check_cancel(peer);
    if (now_s() > deadline)
      fail(peer, "it did not connect within " + std::to_string(static_cast<int>(options_.timeout_s)) + " s");
    accepted_cv_.wait_for(lock, std::chrono::milliseconds(kSliceMs));
  }
  fds_[peer] = accepted_[peer];
  accepted_[peer] = -1;
}

struct Links::Pending {
  int fd;
  double deadline;
  Hello hello;
  size_t got;
};

// The acceptor thread: accepts connections and reads their hellos, all at once and without blocking (see
// links.h), until every lower rank has connected or the destructor wakes it.
void Links::accept_loop() {
  std::vector<Pending> pending;
  std::vector<pollfd> polls;
  std::string error;
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (std::count(handed_.begin(), handed_.begin() + rank_, 1) == rank_) break;
    }
    // Sleep until something arrives (the destructor writes to the pipe), or the next handshake deadline.
    int wait_ms = -1;
    if (!pending.empty()) {
      double first = pending.front().deadline;
      for (const Pending& p : pending) first = std::min(first, p.deadline);
      wait_ms = std::max(0, static_cast<int>((first - now_s()) * 1000.0) + 1);
    }
    polls.assign({pollfd{wake_[0], POLLIN, 0}, pollfd{listener_, POLLIN, 0}});
    for (const Pending& p : pending) polls.push_back(pollfd{p.fd, POLLIN, 0});
    const int n = ::poll(polls.data(), polls.size(), wait_ms);
    if (n < 0 && errno != EINTR) {
      error = "poll failed: " + errno_text(errno);
      break;
    }
    if (n > 0 && polls[0].revents != 0) break;  // the destructor
    // The hellos first, so that a flood of new connections cannot close a real peer's before it is read.
    size_t kept = 0;
    for (size_t i = 0; i < pending.size(); ++i) {
      Pending& p = pending[i];
      bool done = n > 0 && polls[i + 2].revents != 0 && read_hello(&p);
      if (!done && now_s() >= p.deadline) {
        close_fd(&p.fd);  // no whole hello in time: a stray client, or one that hangs
        done = true;
      }
      if (!done) pending[kept++] = p;
    }
    pending.resize(kept);
    if (n <= 0 || (polls[1].revents & POLLIN) == 0) continue;
    for (size_t k = 0; k < kMaxPending; ++k) {
      const int fd = ::accept4(listener_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) {
        if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) ::usleep(10000);
        break;  // none left, or no descriptor now: the backlog keeps them for the next round
      }
      if (pending.size() >= kMaxPending) {
        close_fd(&pending.front().fd);
        pending.erase(pending.begin());
      }
      pending.push_back(Pending{fd, now_s() + kHelloS, Hello{}, 0});
    }
  }
  for (Pending& p : pending) close_fd(&p.fd);
  close_fd(&listener_);  // every lower rank has connected: nothing more to accept
  std::lock_guard<std::mutex> lock(mu_);
  acceptor_error_ = error;
  accepted_cv_.notify_all();
}

// Read what has arrived of a pending connection's hello; true when the connection is finished with: handed
// over (a right hello, acknowledged) or closed (a wrong hello, or the client went away).
bool Links::read_hello(Pending* p) {
  const ssize_t k = ::recv(p->fd, reinterpret_cast<char*>(&p->hello) + p->got, sizeof(Hello) - p->got, 0);
  if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return false;
  if (k <= 0) {
    close_fd(&p->fd);
    return true;
  }
  p->got += static_cast<size_t>(k);
  if (p->got < sizeof(Hello)) return false;
  const Hello& h = p->hello;
  // All fields compared at once: how long the check takes says nothing about which one was wrong.
  const uint64_t wrong = (static_cast<uint64_t>(h.magic ^ kMagic)) | (h.session ^ session_) |
                         static_cast<uint64_t>(h.to != rank_) | static_cast<uint64_t>(h.from < 0 || h.from >= rank_);
  bool ok = wrong == 0;
  if (ok) {
    std::lock_guard<std::mutex> lock(mu_);
    ok = !(handed_[h.from] && accepted_[h.from] < 0);  // not a second connection of a peer already in use
  }
  const uint8_t ack = 1;
  if (ok && ::send(p->fd, &ack, 1, MSG_NOSIGNAL | MSG_DONTWAIT) == 1) {
    tune(p->fd);
    wire_->control(sizeof(ack), sizeof(h));
    hand_over(p->fd, h.from);
    p->fd = -1;
  } else {
    close_fd(&p->fd);  // a stray connection (another job, or an address that reached the wrong process)
  }
  return true;
}

// Give the channel thread `from`'s connection (replacing one it has not taken: the peer gave up on that one
// and connected again).
void Links::hand_over(int fd, int from) {
  std::lock_guard<std::mutex> lock(mu_);
  if (handed_[from] && accepted_[from] < 0) {
    ::close(fd);  // taken meanwhile: the channel thread uses the earlier connection
    return;
  }
  if (accepted_[from] >= 0) ::close(accepted_[from]);
  accepted_[from] = fd;
  handed_[from] = 1;
  accepted_cv_.notify_all();
}

void Links::sendrecv(const void* send, size_t send_bytes, int dest, void* recv, size_t recv_bytes, int source) {
  if (dest < 0 || dest >= size_ || source < 0 || source >= size_ || dest == rank_ || source == rank_)
    throw TransportError("links: bad peers dest=" + std::to_string(dest) + " source=" + std::to_string(source));
  // Connect before accepting: connecting never waits for the peer's code, so no two ranks wait on each other.
  if (dest > rank_) connection(dest);
  if (source > rank_) connection(source);
  const int out = connection(dest), in = connection(source);
  Transfer t{send, send_bytes, dest, recv, recv_bytes, source};
  t.out_hdr = send_bytes;
  double last_progress = now_s();
  while (t.out_done < t.out_total() || t.in_done < t.in_total()) {
    pollfd p[2];
    int n = 0, out_i = -1, in_i = -1;
    if (t.out_done < t.out_total()) { p[n] = {out, POLLOUT, 0}; out_i = n++; }
    if (t.in_done < t.in_total()) {
      if (out_i >= 0 && in == out) { p[out_i].events |= POLLIN; in_i = out_i; }
      else { p[n] = {in, POLLIN, 0}; in_i = n++; }
    }
    const int ready = ::poll(p, n, kSliceMs);
    if (ready < 0 && errno != EINTR) fail(dest, "poll failed: " + errno_text(errno));
    if (ready <= 0) {
      check_stuck(t, last_progress);
      continue;
    }
    if (out_i >= 0 && (p[out_i].revents & (POLLOUT | POLLERR | POLLHUP)) && send_some(out, &t)) last_progress = now_s();
    if (in_i >= 0 && (p[in_i].revents & (POLLIN | POLLERR | POLLHUP)) && recv_some(in, &t)) last_progress = now_s();
  }
}

// Nothing moved in the last slice: fail when the set is cancelled or nothing has moved for timeout_s.
void Links::check_stuck(const Transfer& t, double last_progress) const {
  check_cancel(t.out_done < t.out_total() ? t.dest : t.source);
  if (now_s() - last_progress <= options_.timeout_s) return;
  const int stuck = t.in_done < t.in_total() ? t.source : t.dest;
  fail(stuck, "no data moved for " + std::to_string(static_cast<int>(options_.timeout_s)) + " s (" +
                  std::to_string(t.in_done) + " of " + std::to_string(t.in_total()) + " bytes received, " +
                  std::to_string(t.out_done) + " of " + std::to_string(t.out_total()) + " sent)");
}

// Send what the socket takes now of the length header and the body; true when some bytes left.
bool Links::send_some(int fd, Transfer* t) {
  iovec iov[2];
  int k = 0;
  if (t->out_done < sizeof(t->out_hdr))
    iov[k++] = {reinterpret_cast<char*>(&t->out_hdr) + t->out_done, sizeof(t->out_hdr) - t->out_done};
  const size_t body = t->out_done > sizeof(t->out_hdr) ? t->out_done - sizeof(t->out_hdr) : 0;
  if (t->send_bytes > body)
    iov[k++] = {const_cast<char*>(static_cast<const char*>(t->send)) + body, t->send_bytes - body};
  msghdr m{};
  m.msg_iov = iov;
  m.msg_iovlen = k;
  const ssize_t sent = ::sendmsg(fd, &m, MSG_NOSIGNAL | MSG_DONTWAIT);
  if (sent < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
    fail(t->dest, "sending failed: " + errno_text(errno));
  if (sent <= 0) return false;
  const size_t moved = static_cast<size_t>(sent);
  const size_t header = t->out_done < sizeof(t->out_hdr) ? std::min(moved, sizeof(t->out_hdr) - t->out_done) : 0;
  wire_->control(header, 0);
  wire_->data(moved - header, 0);
  t->out_done += moved;
  return true;
}

// Receive what has arrived of the length header and the body; true when some bytes came. The body is read
// only once the length is known to match, so a disagreeing peer cannot overrun it.
bool Links::recv_some(int fd, Transfer* t) {
  iovec iov[2];
  int k = 0;
  if (t->in_done < sizeof(t->in_hdr))
    iov[k++] = {reinterpret_cast<char*>(&t->in_hdr) + t->in_done, sizeof(t->in_hdr) - t->in_done};
  const size_t body = t->in_done > sizeof(t->in_hdr) ? t->in_done - sizeof(t->in_hdr) : 0;
  if (t->in_done >= sizeof(t->in_hdr) && t->recv_bytes > body)
    iov[k++] = {static_cast<char*>(t->recv) + body, t->recv_bytes - body};
  msghdr m{};
  m.msg_iov = iov;
  m.msg_iovlen = k;
  const ssize_t got = ::recvmsg(fd, &m, MSG_DONTWAIT);
  if (got == 0) fail(t->source, "the connection was closed");
  if (got < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
    fail(t->source, "receiving failed: " + errno_text(errno));
  if (got <= 0) return false;
  const bool had_header = t->in_done >= sizeof(t->in_hdr);
  const size_t moved = static_cast<size_t>(got);
  const size_t header = had_header ? 0 : std::min(moved, sizeof(t->in_hdr) - t->in_done);
  wire_->control(0, header);
  wire_->data(0, moved - header);
  t->in_done += moved;
  if (!had_header && t->in_done >= sizeof(t->in_hdr) && t->in_hdr != t->recv_bytes)
    fail(t->source, "it sent " + std::to_string(t->in_hdr) + " bytes where " + std::to_string(t->recv_bytes) +
                        " were expected (the ranks disagree about a collective; this is a bug in perseus)");
  return true;
}

}  // namespace perseus
