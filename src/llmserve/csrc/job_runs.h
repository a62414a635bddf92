// A matmul's jobs (its tiles, or pairs of tiles) shared by the threads of its parallel region.
//
// Each thread owns a contiguous run of the jobs, as `schedule(static)` gives it (its weights one
// stream), and takes it from the front a share at a time; a thread done with its own run takes
// what is left of the others' from their back ends. A batch-1 step is bound by memory, and one of
// the two threads often ends its half of a matrix well before the other (the host, the memory
// system): with a static split it then waits at the region's end (perf, 1B Q4_0 decode_1: 5% and
// 10% of the two threads' samples in libgomp's wait). A job's outputs do not depend on the thread
// that runs it, so the results are the same bits whoever takes which job.
//
// Measured against the static split (bench_step_gguf.py --builds, the 1B's Q4_0, Q4_K_M, Q8_0, two
// threads, Zen 5): quiet, the same time (0.99-1.00x; libgomp's share of the samples fell from 7.6%
// to 3.4%, but batch 1 is bound by the bandwidth either way); beside a process that keeps one core
// busy 2 ms in 8 (--busy 0.25; the server's own Python takes the cores so), decode of 16 sequences
// 0.94-0.97x and a 128-token prefill 0.90-0.91x (1 and 4 sequences 0.93-1.01x): the host's
// slowing of one thread no longer holds up the other.
//
// Made before the region (by the calling thread, for omp_get_max_threads() threads); `each` is
// called by every thread of the region. A team of another size (a region nested in another, whose
// team is one thread) takes a static split instead.
#pragma once

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

namespace llmserve {

class JobRuns {
 public:
  // `parts` sets of the same n jobs (one per chunk of tokens), each split the same way, for a
  // region of `threads` threads
  JobRuns(int64_t n, int64_t parts, int64_t threads = omp_get_max_threads()) : n_(n), threads_(threads) {
    const int64_t size = parts * threads_;
    if (size > capacity()) {
      slots() = std::make_unique<Slot[]>(size);
      capacity() = size;
    }
    base_ = slots().get();
    Slot* s = base_;
    for (int64_t p = 0; p < parts; ++p)
      for (int64_t i = 0; i < threads_; ++i)
        s[p * threads_ + i].run.store(pack(lo(i, threads_), lo(i + 1, threads_)), std::memory_order_relaxed);
  }

  // Calls f(job) for jobs of part `part`: this thread's own run, then from the others' back ends.
  template <class F>
  void each(int64_t part, F&& f) const {
    const int64_t team = omp_get_num_threads(), me = omp_get_thread_num();
    if (team != threads_) {
      for (int64_t j = lo(me, team); j < lo(me + 1, team); ++j) f(j);
      return;
    }
    Slot* s = base_ + part * threads_;
    for (int64_t v = 0; v < threads_; ++v) {  // itself first, then the next threads round
      std::atomic<uint64_t>& run = s[(me + v) % threads_].run;
      const bool own = v == 0;
      uint64_t cur = run.load(std::memory_order_relaxed);
      for (;;) {
        const int64_t front = static_cast<int64_t>(cur & 0xFFFFFFFFu), back = static_cast<int64_t>(cur >> 32);
        if (front >= back) break;
        // a quarter of what is left (at least one job): few claims, and a short last one
        const int64_t take = std::max<int64_t>(1, (back - front) / 4);
        const int64_t j0 = own ? front : back - take, j1 = own ? front + take : back;
        const uint64_t next = own ? pack(j1, back) : pack(front, j0);
        if (!run.compare_exchange_weak(cur, next, std::memory_order_relaxed)) continue;
        for (int64_t j = j0; j < j1; ++j) f(j);
        cur = run.load(std::memory_order_relaxed);
      }
    }
  }

 private:
  struct alignas(64) Slot {
    std::atomic<uint64_t> run{0};  // front in the low 32 bits, back (exclusive) in the high
  };
  static uint64_t pack(int64_t front, int64_t back) {
    return static_cast<uint64_t>(front) | (static_cast<uint64_t>(back) << 32);
  }
  int64_t lo(int64_t i, int64_t team) const { return n_ * i / team; }
  // the calling thread's slots, kept between calls
  static std::unique_ptr<Slot[]>& slots() {
    thread_local std::unique_ptr<Slot[]> s;
    return s;
  }
  static int64_t& capacity() {
    thread_local int64_t c = 0;
    return c;
  }

  int64_t n_, threads_;
  Slot* base_;  // the calling thread's slots (each() runs on the region's other threads too)
};

}  // namespace llmserve
