// A channel's TCP links (links.h) against connections that are not the job's, on rank-threads of a loopback
// world: connections that send nothing, a byte at a time, part of a hello, a hello with a wrong session or
// random bytes must not delay the real peers, and a Links object must go away promptly while strangers are
// still connected. Built with ThreadSanitizer and AddressSanitizer by run_loopback_tests.sh.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "../links.h"
#include "../transport_loopback.h"

using namespace perseus;

namespace {

std::atomic<int> g_failures{0};
std::mutex g_print_mu;

void report(int line, const std::string& what) {
  std::lock_guard<std::mutex> g(g_print_mu);
  std::fprintf(stderr, "test_links_security.cc:%d: FAILED: %s\n", line, what.c_str());
  ++g_failures;
}

#define CHECK_MSG(cond, msg)                                   \
  do {                                                         \
    if (!(cond)) report(__LINE__, std::string(#cond) + ": " + (msg)); \
  } while (0)

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

int connect_to(uint16_t port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(port);
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (fd >= 0 && ::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) == 0) return fd;
  if (fd >= 0) ::close(fd);
  return -1;
}

// Connections to every port that are not the job's, kept open until close(); one of them drips a hello.
struct Strangers {
  std::vector<int> fds;
  std::atomic<bool> stop{false};
  std::thread drip;

  Strangers(const std::vector<uint16_t>& ports, int silent) {
    std::mt19937_64 rng(7);
    std::vector<int> drips;
    for (size_t to = 0; to < ports.size(); ++to) {
      for (int k = 0; k < silent; ++k) add(connect_to(ports[to]));
      struct {
        uint32_t magic;
        int32_t from, to;
        uint32_t pad;
        uint64_t session;
      } hello{0x7065726c, 0, static_cast<int32_t>(to), 0, rng()};  // the right magic, a wrong session
      send_to(ports[to], &hello, sizeof(hello));
      send_to(ports[to], &hello, 10);  // part of a hello
      std::vector<uint64_t> junk(1 << 13);
      for (auto& w : junk) w = rng();
      send_to(ports[to], junk.data(), sizeof(hello));
      send_to(ports[to], junk.data(), junk.size() * sizeof(uint64_t));
      const int d = connect_to(ports[to]);
      add(d);
      if (d >= 0) drips.push_back(d);
    }
    drip = std::thread([this, drips] {
      const char byte = 'x';
      while (!stop.load()) {
        for (int d : drips) (void)!::send(d, &byte, 1, MSG_NOSIGNAL | MSG_DONTWAIT);
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
    });
  }
  void add(int fd) {
    if (fd >= 0) fds.push_back(fd);
  }
  void send_to(uint16_t port, const void* data, size_t n) {
    const int fd = connect_to(port);
    if (fd < 0) return;
    (void)!::send(fd, data, n, MSG_NOSIGNAL | MSG_DONTWAIT);
    fds.push_back(fd);
  }
  ~Strangers() {
    stop.store(true);
    drip.join();
    for (int fd : fds) ::close(fd);
  }
};

// n rank-threads build Links over a loopback world; strangers connect to every listener; then every pair of
// ranks exchanges data (each pair connects: the listeners must all close), each rank within `bound_s`.
void test_pairs_through_strangers(int n, int silent) {
  auto world = make_loopback_world(n);
  std::vector<std::unique_ptr<Links>> links(n);
  std::vector<uint16_t> ports(n);
  std::atomic<int> built{0}, attacked{0};
  std::vector<double> took(n, 0);
  std::vector<std::thread> ranks;
  for (int r = 0; r < n; ++r) {
    ranks.emplace_back([&, r] {
      try {
        auto comm = make_loopback_comm(world, r);
        LinkOptions o;
        o.interfaces = {"lo"};
        o.timeout_s = 20.0;
        links[r] = std::make_unique<Links>(*comm, o);
        ports[r] = links[r]->port();
        ++built;
        while (attacked.load() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
        const auto t0 = std::chrono::steady_clock::now();
        for (int shift = 1; shift < n; ++shift) {
          const int dest = (r + shift) % n, source = (r + n - shift) % n;
          std::vector<int64_t> out(1000, r * 1000 + shift), in(1000, -1);
          links[r]->sendrecv(out.data(), out.size() * 8, dest, in.data(), in.size() * 8, source);
          CHECK_MSG(in[0] == source * 1000 + shift && in[999] == in[0], "rank " + std::to_string(r));
        }
        took[r] = seconds_since(t0);
        CHECK_MSG(links[r]->open_connections() == n - 1, std::to_string(links[r]->open_connections()));
      } catch (const std::exception& e) {
        report(__LINE__, "rank " + std::to_string(r) + " threw: " + e.what());
      }
    });
  }
  while (built.load() < n) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  {
    Strangers strangers(ports, silent);
    ++attacked;
    for (auto& t : ranks) t.join();
    double worst = 0;
    for (double t : took) worst = std::max(worst, t);
    CHECK_MSG(worst < 2.0, std::to_string(worst) + " s");
    std::printf("links n=%d: every pair exchanged data within %.0f ms (worst rank) with %zu stranger "
                "connections (%d silent per listener)\n", n, worst * 1e3, strangers.fds.size(), silent);
    // every lower rank has connected to every rank: no listener is left
    const auto t0 = std::chrono::steady_clock::now();
    for (int r = 0; r < n; ++r) {
      int fd = connect_to(ports[r]);
      while (fd >= 0 && seconds_since(t0) < 2.0) {
        ::close(fd);
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
        fd = connect_to(ports[r]);
      }
      CHECK_MSG(fd < 0, "rank " + std::to_string(r) + " still listens");
      if (fd >= 0) ::close(fd);
    }
  }
  links.clear();
}

// Links destroyed while their acceptors hold strangers' connections (no peer ever connected): promptly.
void test_destroyed_while_strangers_wait(int n) {
  auto world = make_loopback_world(n);
  std::vector<std::unique_ptr<Links>> links(n);
  std::vector<std::thread> ranks;
  for (int r = 0; r < n; ++r) {
    ranks.emplace_back([&, r] {
      auto comm = make_loopback_comm(world, r);
      LinkOptions o;
      o.interfaces = {"lo"};
      links[r] = std::make_unique<Links>(*comm, o);
    });
  }
  for (auto& t : ranks) t.join();
  std::vector<uint16_t> ports;
  for (auto& l : links) ports.push_back(l->port());
  Strangers strangers(ports, 100);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  const auto t0 = std::chrono::steady_clock::now();
  links.clear();
  const double s = seconds_since(t0);
  CHECK_MSG(s < 1.0, std::to_string(s) + " s");
  std::printf("links n=%d: destroyed in %.1f ms with %zu stranger connections waiting\n", n, s * 1e3,
              strangers.fds.size());
}

}  // namespace

int main() {
  for (int n : {2, 3, 4}) test_pairs_through_strangers(n, 100);
  for (int n : {2, 3}) test_destroyed_while_strangers_wait(n);
  if (g_failures.load()) {
    std::printf("%d check(s) failed\n", g_failures.load());
    return 1;
  }
  std::printf("all links security tests passed\n");
  return 0;
}
