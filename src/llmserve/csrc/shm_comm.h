// Collectives between the ranks of a tensor-parallel engine on one machine, over a shared-memory
// segment (shm_comm.cpp): a float32 all-reduce, an all-gather and the driver's broadcast of bytes.
// The Python side (llmserve/distributed/shm.py) creates the segment as a file under /dev/shm,
// maps it in every rank and hands its address here; nothing is sent through the kernel.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace llmserve {

// A collective that cannot complete: a peer died, the group was aborted, or the wait timed out.
struct CommError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct ShmComm {
  // base: the mapped segment (`segment_bytes(world, slot_bytes, bcast_bytes)` bytes, zeroed by its
  // creator); this rank's pid is published in it.
  ShmComm(char* base, int64_t rank, int64_t world, int64_t slot_bytes, int64_t bcast_bytes, double timeout_s);

  static int64_t segment_bytes(int64_t world, int64_t slot_bytes, int64_t bcast_bytes);

  // x [n] summed over the ranks in place; every rank gets the same bits (ranks added in rank order).
  void all_reduce(float* x, int64_t n);
  // every rank's `bytes` bytes of src, concatenated in rank order into dst [world * bytes].
  void all_gather(const void* src, int64_t bytes, void* dst);
  // rank 0: send `bytes` bytes; the other ranks: receive them (`broadcast_recv`). A receiver waits
  // without a time limit (an idle engine sends nothing for hours), only the sender's death ends it.
  void broadcast_send(const void* data, int64_t bytes);
  std::string broadcast_recv();
  // Fail every rank's current and later collectives (a peer that failed, or the group closing).
  void abort();

  int64_t rank, world;

 private:
  void exchange(const void* src, int64_t bytes);  // this rank's part into the next slot; wait for all
  const char* slot(int64_t set, int64_t r) const;
  // Wait until cond() holds: spin, then yield, then sleep; a dead peer among `peers` (or any, -1),
  // abort or the deadline (timeout_s > 0) raise CommError naming `what`.
  template <typename Cond>
  void wait(Cond cond, const char* what, int64_t peer, bool timed);
  bool peer_dead(int64_t r) const;
  // whether word i (0: arrive, 1: ack) of every rank from `first` on is >= value
  bool all_reached(int i, int64_t first, uint64_t value) const;

  char* base;
  int64_t slot_bytes, bcast_bytes;
  double timeout_s;
  uint64_t gen = 0;        // exchanges this rank has made (each in slot set gen % 2)
  uint64_t bcast_seen = 0; // broadcast chunks received (receivers) or sent (rank 0)
};

}  // namespace llmserve
