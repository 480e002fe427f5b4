// The Gloo transport's small pieces (gloo_transport_impl.h): slots and
// timeouts, the guards for SIGPIPE and the device thread's scheduling, Gloo's
// error texts and addresses, and the checks of a host name or interface
// before Gloo sees them.

#include <arpa/inet.h>
#include <gloo/transport/tcp/address.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <pthread.h>
#include <sched.h>
#include <sys/socket.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>

#include "allreduce/gloo_transport_impl.h"
#include "core/user_text.h"

namespace diststrat {
namespace gloo_impl {

uint64_t gloo_slot(int tag, size_t bytes) {
  const uint64_t b = bytes;
  const uint64_t folded = (b ^ (b >> 31) ^ (b >> 62)) & 0x7fffffffu;  // b itself below 2 GiB
  return (uint64_t{static_cast<uint32_t>(tag)} << 32) | folded;
}

std::chrono::milliseconds gloo_timeout(Clock::time_point until) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - Clock::now());
  left = std::max(left, std::chrono::milliseconds(0));
  return std::min<std::chrono::milliseconds>(left, kGlooMaxWait) + kGlooBackstop;
}

GlooDeviceThreadBatch::GlooDeviceThreadBatch() {
  if (sched_getscheduler(0) != SCHED_OTHER) return;
  sched_param p{};
  changed_ = sched_setscheduler(0, SCHED_BATCH, &p) == 0;
}

GlooDeviceThreadBatch::~GlooDeviceThreadBatch() {
  if (!changed_) return;
  sched_param p{};
  sched_setscheduler(0, SCHED_OTHER, &p);
}

GlooSigpipeBlock::GlooSigpipeBlock() {
  sigemptyset(&pipe_);
  sigaddset(&pipe_, SIGPIPE);
  pthread_sigmask(SIG_BLOCK, &pipe_, &old_);
  sigset_t pending;
  sigemptyset(&pending);
  sigpending(&pending);
  was_pending_ = sigismember(&pending, SIGPIPE) == 1;
}

GlooSigpipeBlock::~GlooSigpipeBlock() {
  const int saved = errno;
  if (!was_pending_) {
    sigset_t pending;
    sigemptyset(&pending);
    sigpending(&pending);
    if (sigismember(&pending, SIGPIPE) == 1) {
      const timespec zero{0, 0};
      while (sigtimedwait(&pipe_, nullptr, &zero) == -1 && errno == EINTR) {
      }
    }
  }
  pthread_sigmask(SIG_SETMASK, &old_, nullptr);
  errno = saved;
}

void gloo_destroy(std::unique_ptr<GlooBuffer>& buf, bool is_recv) {
  if (!buf) return;
  if (is_recv) {
    buf->abortWaitRecv();
  } else {
    buf->abortWaitSend();
  }
  buf.reset();
}

std::string gloo_text(const std::string& what) {
  std::string out;
  const size_t n = what.size();
  for (size_t i = 0; i < n;) {
    if (what[i] == ' ' && i + 1 < n && what[i + 1] == '[') {
      const size_t close = what.find(']', i + 2);
      if (close != std::string::npos && close + 2 < n && what[close + 1] == ':' &&
          std::isdigit(static_cast<unsigned char>(what[close + 2]))) {
        size_t j = close + 2;
        while (j < n && std::isdigit(static_cast<unsigned char>(what[j]))) ++j;
        i = j;
        continue;
      }
    }
    out += what[i++];
  }
  return echo(out.empty() ? "unknown Gloo error" : out);
}

bool gloo_address_parts(const std::vector<char>& bytes, std::string* host, int* port, bool* v6) {
  try {
    const gloo::transport::tcp::Address a(bytes);
    const sockaddr_storage& ss = a.getSockaddr();
    char text[INET6_ADDRSTRLEN] = "";
    if (ss.ss_family == AF_INET) {
      const auto* in = reinterpret_cast<const sockaddr_in*>(&ss);
      inet_ntop(AF_INET, &in->sin_addr, text, sizeof text);
      *port = ntohs(in->sin_port);
      *v6 = false;
    } else if (ss.ss_family == AF_INET6) {
      const auto* in6 = reinterpret_cast<const sockaddr_in6*>(&ss);
      inet_ntop(AF_INET6, &in6->sin6_addr, text, sizeof text);
      *port = ntohs(in6->sin6_port);
      *v6 = true;
    } else {
      return false;
    }
    *host = text;
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

std::string gloo_address_host(const std::vector<char>& bytes) {
  std::string host;
  int port = 0;
  bool v6 = false;
  return gloo_address_parts(bytes, &host, &port, &v6) ? host : "";
}

std::string gloo_address_text(const std::vector<char>& bytes) {
  std::string host;
  int port = 0;
  bool v6 = false;
  if (!gloo_address_parts(bytes, &host, &port, &v6)) return "unknown address";
  return (v6 ? "[" + host + "]" : host) + ":" + std::to_string(port);
}

std::vector<char> gloo_clean_address(const std::vector<char>& bytes) {
  const gloo::transport::tcp::Address a(bytes);
  const sockaddr_storage& ss = a.getSockaddr();
  sockaddr_storage clean;
  std::memset(&clean, 0, sizeof clean);
  if (ss.ss_family == AF_INET) {
    std::memcpy(&clean, &ss, sizeof(sockaddr_in));
    std::memset(reinterpret_cast<sockaddr_in*>(&clean)->sin_zero, 0,
                sizeof(reinterpret_cast<sockaddr_in*>(&clean)->sin_zero));
  } else if (ss.ss_family == AF_INET6) {
    std::memcpy(&clean, &ss, sizeof(sockaddr_in6));
  } else {
    return bytes;
  }
  return gloo::transport::tcp::Address(clean, a.getSeq()).bytes();
}

std::string gloo_hex(const std::vector<char>& bytes) {
  static const char* digits = "0123456789abcdef";
  std::string s;
  s.reserve(bytes.size() * 2);
  for (char c : bytes) {
    const auto u = static_cast<unsigned char>(c);
    s += digits[u >> 4];
    s += digits[u & 15];
  }
  return s;
}

bool gloo_unhex(const std::string& s, std::vector<char>* out) {
  if (s.size() % 2) return false;
  auto nibble = [](char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  out->clear();
  for (size_t i = 0; i < s.size(); i += 2) {
    const int hi = nibble(s[i]), lo = nibble(s[i + 1]);
    if (hi < 0 || lo < 0) return false;
    out->push_back(static_cast<char>(hi << 4 | lo));
  }
  return true;
}

std::vector<std::string> gloo_split(const std::string& s) {
  std::vector<std::string> words;
  size_t i = 0;
  while (i < s.size()) {
    const size_t j = std::min(s.find(' ', i), s.size());
    if (j > i) words.push_back(s.substr(i, j - i));
    i = j + 1;
  }
  return words;
}

std::string gloo_resolve_error(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* result = nullptr;
  const int rc = getaddrinfo(host.c_str(), nullptr, &hints, &result);
  if (rc != 0) return gai_strerror(rc);
  freeaddrinfo(result);
  return "";
}

std::string gloo_interface_error(const std::string& name) {
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return std::string("getifaddrs failed: ") + std::strerror(errno);
  bool found = false;
  std::vector<std::string> names;
  for (ifaddrs* i = list; i; i = i->ifa_next) {
    if (!i->ifa_addr) continue;
    const int family = i->ifa_addr->sa_family;
    if (family != AF_INET && family != AF_INET6) continue;
    if (name == i->ifa_name) found = true;
    if (std::find(names.begin(), names.end(), i->ifa_name) == names.end())
      names.push_back(i->ifa_name);
  }
  freeifaddrs(list);
  if (found) return "";
  std::string have;
  for (const auto& n : names) have += (have.empty() ? "" : ", ") + n;
  return "no network interface of that name has an IPv4 or IPv6 address (those that do: " + have +
         ")";
}

}  // namespace gloo_impl
}  // namespace diststrat
