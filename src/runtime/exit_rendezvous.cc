#include "runtime/exit_rendezvous.h"

#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <thread>
#include <vector>

#include "allreduce/mpi_util.h"

namespace diststrat {
namespace mpi {
namespace {

using Clock = std::chrono::steady_clock;
constexpr int kArrivedTag = 1;  // "I am at the exit"
constexpr int kAliveTag = 2;    // "I am still working"
constexpr std::chrono::milliseconds kPoll{10};

struct State {
  MPI_Comm comm = MPI_COMM_NULL;
  int rank = 0, size = 1;
  std::thread listener;
  std::atomic<bool> arrive{false};  // the exit handler asks the listener to announce this rank
  std::atomic<bool> stop{false};
  std::mutex mu;                         // guards the two vectors below
  std::vector<char> arrived;             // per rank: its arrival came
  std::vector<Clock::time_point> heard;  // per rank: when its last message came
  // Listener thread only:
  std::vector<char> waiting;  // per rank: at the exit, waiting for this one
  bool announced = false;
  std::vector<MPI_Request> sends;
  const int token = 0;  // what every message carries (the sends read it)
};

// Never freed: the exit handler uses it after static destructors may have run.
State* state = nullptr;

void post(State& s, int peer, int tag) {
  MPI_Request r = MPI_REQUEST_NULL;
  if (MPI_Isend(&s.token, 1, MPI_INT, peer, tag, s.comm, &r) == MPI_SUCCESS) s.sends.push_back(r);
}

void reap_sends(State& s) {
  auto done = [](MPI_Request& r) {
    int flag = 0;
    return MPI_Test(&r, &flag, MPI_STATUS_IGNORE) != MPI_SUCCESS || flag;
  };
  s.sends.erase(std::remove_if(s.sends.begin(), s.sends.end(), done), s.sends.end());
}

void receive_all(State& s) {
  for (;;) {
    int flag = 0;
    MPI_Status st;
    if (MPI_Iprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, s.comm, &flag, &st) != MPI_SUCCESS || !flag) return;
    int v = 0;
    // The message is there (probed), so this receive returns at once.
    MPI_Recv(&v, 1, MPI_INT, st.MPI_SOURCE, st.MPI_TAG, s.comm, MPI_STATUS_IGNORE);
    if (st.MPI_SOURCE < 0 || st.MPI_SOURCE >= s.size) continue;
    if (st.MPI_TAG == kArrivedTag) {
      s.waiting[st.MPI_SOURCE] = 1;
      note_peer_at_exit(st.MPI_SOURCE);  // (the comm is MPI_COMM_WORLD's duplicate)
    }
    std::lock_guard<std::mutex> lock(s.mu);
    s.heard[st.MPI_SOURCE] = Clock::now();
    if (st.MPI_TAG == kArrivedTag) s.arrived[st.MPI_SOURCE] = 1;
  }
}

void listen(State& s) {
  Clock::time_point last_beat{};
  while (!s.stop.load()) {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) return;  // the program finalized MPI itself (see mpi_env.h)
    receive_all(s);
    if (!s.announced && s.arrive.load()) {
      // After this rank's arrival, no more heartbeats: a peer that has every
      // arrival has every message sent to it before (MPI keeps the order of
      // one sender's messages).
      for (int r = 0; r < s.size; ++r) {
        if (r != s.rank) post(s, r, kArrivedTag);
      }
      s.announced = true;
    } else if (!s.announced && Clock::now() - last_beat >= kHeartbeatPeriod) {
      for (int r = 0; r < s.size; ++r) {
        if (s.waiting[r]) post(s, r, kAliveTag);
      }
      last_beat = Clock::now();
    }
    reap_sends(s);
    std::this_thread::sleep_for(kPoll);
  }
}

std::string ms_text(Clock::duration d) {
  return std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(d).count()) + " ms";
}

}  // namespace

bool start_exit_rendezvous(std::chrono::milliseconds timeout) {
  if (state) return true;
  int provided = 0;
  MPI_Query_thread(&provided);
  if (provided < MPI_THREAD_MULTIPLE) return false;  // the listener is a thread of its own
  auto* s = new State;
  s->comm = dup(MPI_COMM_WORLD, "exit rendezvous set-up", timeout);
  MPI_Comm_rank(s->comm, &s->rank);
  MPI_Comm_size(s->comm, &s->size);
  s->arrived.assign(static_cast<size_t>(s->size), 0);
  s->waiting.assign(static_cast<size_t>(s->size), 0);
  s->heard.assign(static_cast<size_t>(s->size), Clock::time_point{});
  s->arrived[static_cast<size_t>(s->rank)] = 1;
  s->listener = std::thread([s] { listen(*s); });
  state = s;
  return true;
}

bool exit_rendezvous_running() { return state != nullptr; }

bool meet_at_exit(std::chrono::milliseconds silence, std::chrono::milliseconds bound,
                  std::string* why) {
  State& s = *state;
  silence = std::max(silence, kMinSilence);
  const auto start = Clock::now();
  note_exiting();
  s.arrive.store(true);
  bool met = false;
  for (;;) {
    std::this_thread::sleep_for(kPoll);
    const auto now = Clock::now();
    std::vector<int> missing;
    int silent = -1;
    Clock::duration silent_for{};
    {
      std::lock_guard<std::mutex> lock(s.mu);
      for (int r = 0; r < s.size; ++r) {
        if (s.arrived[static_cast<size_t>(r)]) continue;
        missing.push_back(r);
        const auto quiet = now - std::max(s.heard[static_cast<size_t>(r)], start);
        if (silent < 0 && quiet > silence) {
          silent = r;
          silent_for = quiet;
        }
      }
    }
    if (missing.empty()) {
      met = true;
      break;
    }
    if (silent >= 0) {
      *why = "rank " + std::to_string(silent) + " sent nothing for " + ms_text(silent_for) +
             " while this rank waited for it at the exit (it is stopped, gone, or its host is "
             "unreachable)";
      break;
    }
    if (bound.count() > 0 && now - start > bound) {
      std::string list;
      for (int r : missing) list += (list.empty() ? "" : ", ") + std::to_string(r);
      *why = "rank(s) " + list + " did not reach the exit within " + ms_text(bound);
      break;
    }
  }
  s.stop.store(true);
  if (!met) {
    // The caller ends the process. The listener may be inside an MPI call
    // that does not return (a send to a peer whose host is unreachable can
    // block in the transport's connect): it is not waited for.
    s.listener.detach();
    return false;
  }
  {
    // Every peer is here, so the listener's calls complete; bounded all the same.
    Watchdog dog("exit meeting: stopping the listener thread", silence);
    s.listener.join();
  }
  {
    // Every peer has received what this rank sent (each had to take its
    // arrival); the sends complete at once, or are given up.
    const auto until = Clock::now() + std::chrono::seconds(1);
    while (!s.sends.empty() && Clock::now() < until) {
      reap_sends(s);
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    for (MPI_Request& r : s.sends) {
      MPI_Cancel(&r);
      MPI_Request_free(&r);
    }
    s.sends.clear();
  }
  return met;
}

}  // namespace mpi
}  // namespace diststrat
