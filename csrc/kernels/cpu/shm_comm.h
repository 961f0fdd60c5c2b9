// Collectives between the tensor-parallel ranks of one machine, over a shared-memory segment.
//
// Why: gloo's all-reduce between two processes of a 2-vCPU machine costs ~0.6 ms (a TCP round trip
// through its worker threads), and a decode step of a 12-layer model needs 24 of them: the
// communication would cost more than the compute. Ranks on one host can instead meet in memory they
// all map: each writes its part into its own slot, publishes a sequence number, waits for the others'
// and reads theirs (a few microseconds). torch.distributed still sets everything up (the store that
// passes the segment's name, the groups, the barrier, the control messages) and carries the
// collectives of ranks on different hosts; this only replaces the data path inside one host.
//
// Protocol. Every call is one or more rounds (a tensor larger than a slot is cut into slot-sized
// rounds). Round s uses buffer s % 2: rank r writes its slot there, stores s into arrived[r]
// (release), and waits until every rank's arrived >= s (acquire); then it reads. Because every rank
// waits for every other in every round, a rank writing round s + 2 (the same buffer) knows that all
// ranks have arrived at s + 1, so all of them have finished reading round s: two buffers suffice.
//
// All-reduce sums in fp32 in rank order 0, 1, ... on every rank, so every rank gets the same bits.
//
// Waiting spins (pause), then yields the CPU (more ranks than cores must still progress), and after
// 5 ms sleep-polls every 50 us (an idle follower waiting for its next step costs ~no CPU). It checks
// regularly whether a rank that has not arrived is still alive (its pid is in the header) and whether
// the timeout (may be infinite) has passed: a dead rank or a timeout is a std::runtime_error naming
// the rank. A rank that fails while alive (an exception between collectives, its process still tearing
// down) calls abort(): every rank waiting in a collective, then or later, raises at once naming it,
// instead of waiting for its process to end or for the timeout.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>

#include "inflight/kernels/scalar_type.h"

namespace inflight::kernels::cpu {

class ShmComm {
 public:
  static constexpr int kMaxRanks = 64;

  // Rank 0 creates the segment `name` (a POSIX shared-memory name, "/..."): slots of `slot_bytes`
  // bytes for `world` ranks; the others attach to it (create = false) once it exists. Throws
  // std::runtime_error on a system error or a mismatching segment.
  ShmComm(std::string const& name, int rank, int world, std::int64_t slot_bytes, bool create);
  ~ShmComm();
  ShmComm(ShmComm const&) = delete;
  ShmComm& operator=(ShmComm const&) = delete;

  // Removes the name (the memory stays mapped by every rank); call once every rank has attached.
  void unlink();

  // In place: data[0 .. numel) becomes the sum over the ranks (float types only).
  void all_reduce(void* data, std::int64_t numel, ScalarType dtype, double timeout_s);
  // out[r * bytes .. (r + 1) * bytes) = rank r's data, on `root` only (out is not read elsewhere).
  void gather(void const* data, std::int64_t bytes, void* out, int root, double timeout_s);
  // data on every rank = root's data.
  void broadcast(void* data, std::int64_t bytes, int root, double timeout_s);
  // Marks the segment aborted by this rank (the first abort wins; idempotent; any thread): every
  // collective of every rank raises from now on.
  void abort();
  // The rank that aborted the segment, or -1.
  int aborted_by() const;

  int rank() const { return rank_; }
  int world() const { return world_; }
  std::int64_t slot_bytes() const { return slot_bytes_; }
  std::uint64_t rounds() const { return seq_; }
  // Seconds spent in the collectives (copying and waiting) and how many calls, on this rank.
  double seconds() const { return seconds_; }
  std::uint64_t calls() const { return calls_; }

 private:
  struct alignas(64) Counter {
    std::atomic<std::uint64_t> value;
  };
  struct Header {
    std::uint64_t magic;
    std::int32_t world;
    std::int64_t slot_bytes;
    std::atomic<std::int32_t> pids[kMaxRanks];
    std::atomic<std::int32_t> aborted;  // 0, or the aborting rank + 1
    Counter arrived[kMaxRanks];
  };

  struct Timer;
  unsigned char* slot(std::uint64_t round, int rank) const;
  std::uint64_t arrive();  // writes done: publish, returns the round
  void wait_all(std::uint64_t round, double timeout_s, char const* op) const;

  std::string name_;
  int rank_ = 0, world_ = 1;
  std::int64_t slot_bytes_ = 0;
  std::size_t map_bytes_ = 0;
  void* map_ = nullptr;
  Header* header_ = nullptr;
  unsigned char* data_ = nullptr;
  std::uint64_t seq_ = 0;
  bool owner_ = false;
  double seconds_ = 0;
  std::uint64_t calls_ = 0;
};

}  // namespace inflight::kernels::cpu
