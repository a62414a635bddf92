// Shared-memory collectives for the ranks of one machine (shm_comm.h). The segment:
//
//   line 0                  abort flag
//   line 1 + r (r < world)  rank r's words: arrive (exchanges it has published), ack (broadcast
//                           chunks it has read), pid                     one 64-byte line each:
//   line 1 + world          the broadcast: seq (chunks sent), total bytes, this chunk's bytes
//   [page]                  broadcast area [bcast_bytes]
//   [page]                  slots [2 sets][world][slot_bytes]
//
// An exchange (the step under all-reduce and all-gather) copies this rank's part into its slot of
// set gen % 2, publishes arrive = gen (release) and waits until every rank's arrive >= gen
// (acquire); each rank then reads every slot. Two sets make one wait per exchange enough: a rank
// writes set s again at gen + 2 only after seeing every arrive >= gen + 1, which each peer
// publishes after it finished reading gen's slots. The all-reduce sums the slots in rank order on
// every rank, so all ranks hold the same bits (the same float additions in the same order).
//
// Waits spin (a peer a few microseconds behind), then yield the core (one a layer behind, or
// descheduled by other work), then sleep in growing steps (an idle engine); a peer's death (its pid gone or a zombie), an abort, or
// the timeout end them with CommError. On a 2-core machine a step of a 30-layer model makes 61
// exchanges; gloo's loopback TCP cost ~0.3 ms each, these a few microseconds (benchmarks/bench_tp.py).
#include "shm_comm.h"

#include <sched.h>
#include <signal.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>

namespace llmserve {
namespace {

constexpr int64_t kLine = 64, kPage = 4096;
constexpr int kSpins = 2000;             // ~50 us of pause instructions before yielding
constexpr double kYieldSeconds = 0.1;    // then sched_yield for this long (a collective), then sleep:
                                         // a sleeping rank wakes up to 1 ms late, 61 times a step
constexpr double kIdleYieldSeconds = 2e-3;  // a receiver's wait for the next command (an idle engine)
constexpr double kCheckSeconds = 10e-3;  // how often a waiting rank looks for dead peers

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

int64_t header_bytes(int64_t world) { return (kLine * (2 + world) + kPage - 1) / kPage * kPage; }

uint64_t* word(char* base, int64_t line, int i) { return reinterpret_cast<uint64_t*>(base + line * kLine) + i; }

uint64_t load(const uint64_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
void store(uint64_t* p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

bool pid_dead(pid_t pid) {
  if (pid <= 0) return false;  // not published yet
  if (kill(pid, 0) != 0 && errno == ESRCH) return true;
  char path[64], buf[512];
  std::snprintf(path, sizeof path, "/proc/%d/stat", static_cast<int>(pid));
  FILE* f = std::fopen(path, "r");
  if (!f) return false;  // no procfs: only kill() tells
  const size_t n = std::fread(buf, 1, sizeof buf - 1, f);
  std::fclose(f);
  buf[n] = 0;
  const char* close = std::strrchr(buf, ')');  // "pid (comm) S ...": the state follows the name
  return close && close[1] == ' ' && (close[2] == 'Z' || close[2] == 'X');
}

}  // namespace

int64_t ShmComm::segment_bytes(int64_t world, int64_t slot_bytes, int64_t bcast_bytes) {
  return header_bytes(world) + bcast_bytes + 2 * world * slot_bytes;
}

ShmComm::ShmComm(char* base_, int64_t rank_, int64_t world_, int64_t slot_bytes_, int64_t bcast_bytes_,
                 double timeout_s_)
    : rank(rank_), world(world_), base(base_), slot_bytes(slot_bytes_), bcast_bytes(bcast_bytes_),
      timeout_s(timeout_s_) {
  store(word(base, 1 + rank, 2), static_cast<uint64_t>(getpid()));
}

const char* ShmComm::slot(int64_t set, int64_t r) const {
  return base + header_bytes(world) + bcast_bytes + (set * world + r) * slot_bytes;
}

bool ShmComm::peer_dead(int64_t r) const {
  return pid_dead(static_cast<pid_t>(load(word(base, 1 + r, 2))));
}

bool ShmComm::all_reached(int i, int64_t first, uint64_t value) const {
  for (int64_t r = first; r < world; ++r)
    if (load(word(base, 1 + r, i)) < value) return false;
  return true;
}

void ShmComm::abort() { store(word(base, 0, 0), 1); }

template <typename Cond>
void ShmComm::wait(Cond cond, const char* what, int64_t peer, bool timed) {
  for (int i = 0; i < kSpins; ++i) {
    if (cond()) return;
    cpu_relax();
  }
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  auto next_check = start;
  long sleep_ns = 20000;
  for (;;) {
    if (cond()) return;
    if (load(word(base, 0, 0))) throw CommError(std::string(what) + ": the tensor-parallel group was aborted");
    const auto now = clock::now();
    const double waited = std::chrono::duration<double>(now - start).count();
    if (now >= next_check) {
      next_check = now + std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(kCheckSeconds));
      for (int64_t r = 0; r < world; ++r) {
        if (r == rank || (peer >= 0 && r != peer) || !peer_dead(r)) continue;
        throw CommError(std::string(what) + ": tensor-parallel rank " + std::to_string(r) + " (pid " +
                        std::to_string(load(word(base, 1 + r, 2))) + ") exited");
      }
      if (timed && timeout_s > 0 && waited > timeout_s)
        throw CommError(std::string(what) + ": no answer from the other ranks within " +
                        std::to_string(static_cast<int>(timeout_s)) + " s");
    }
    if (waited < (timed ? kYieldSeconds : kIdleYieldSeconds)) {
      sched_yield();
    } else {  // 20 us, doubling up to 1 ms: an idle rank costs next to nothing
      const timespec ts{0, sleep_ns};
      nanosleep(&ts, nullptr);
      sleep_ns = std::min(sleep_ns * 2, 1000000L);
    }
  }
}

void ShmComm::exchange(const void* src, int64_t bytes) {
  ++gen;
  std::memcpy(const_cast<char*>(slot(gen % 2, rank)), src, bytes);
  store(word(base, 1 + rank, 0), gen);
  const uint64_t g = gen;
  wait([&] { return all_reached(0, 0, g); }, "all-reduce", -1, true);
}

void ShmComm::all_reduce(float* x, int64_t n) {
  const int64_t chunk = slot_bytes / 4;
  for (int64_t off = 0; off < n; off += chunk) {
    const int64_t len = std::min(chunk, n - off);
    exchange(x + off, len * 4);
    float* out = x + off;
    const int64_t set = gen % 2;
    std::memcpy(out, slot(set, 0), len * 4);
    for (int64_t r = 1; r < world; ++r) {
      const float* s = reinterpret_cast<const float*>(slot(set, r));
#pragma omp simd
      for (int64_t i = 0; i < len; ++i) out[i] += s[i];
    }
  }
}

void ShmComm::all_gather(const void* src, int64_t bytes, void* dst) {
  for (int64_t off = 0; off < bytes; off += slot_bytes) {
    const int64_t len = std::min(slot_bytes, bytes - off);
    exchange(static_cast<const char*>(src) + off, len);
    for (int64_t r = 0; r < world; ++r) std::memcpy(static_cast<char*>(dst) + r * bytes + off, slot(gen % 2, r), len);
  }
}

// The broadcast area holds one chunk at a time: rank 0 writes the next chunk once every receiver
// has acknowledged the previous one.
void ShmComm::broadcast_send(const void* data, int64_t bytes) {
  char* area = base + header_bytes(world);
  int64_t off = 0;
  do {
    const int64_t len = std::min(bcast_bytes, bytes - off);
    const uint64_t sent = bcast_seen;
    wait([&] { return all_reached(1, 1, sent); }, "broadcast", -1, true);  // the receivers' acks
    std::memcpy(area, static_cast<const char*>(data) + off, len);
    store(word(base, 1 + world, 1), static_cast<uint64_t>(bytes));
    store(word(base, 1 + world, 2), static_cast<uint64_t>(len));
    store(word(base, 1 + world, 0), ++bcast_seen);
    off += len;
  } while (off < bytes);
}

std::string ShmComm::broadcast_recv() {
  const char* area = base + header_bytes(world);
  std::string out;
  int64_t total = -1;
  do {
    const uint64_t want = bcast_seen + 1;
    wait([&] { return load(word(base, 1 + world, 0)) >= want; }, "broadcast", 0, false);
    if (total < 0) {
      total = static_cast<int64_t>(load(word(base, 1 + world, 1)));
      out.reserve(total);
    }
    out.append(area, load(word(base, 1 + world, 2)));
    store(word(base, 1 + rank, 1), ++bcast_seen);
  } while (static_cast<int64_t>(out.size()) < total);
  return out;
}

}  // namespace llmserve
