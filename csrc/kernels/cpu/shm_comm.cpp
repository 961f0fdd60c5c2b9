// Shared-memory collectives of the ranks of one machine (see shm_comm.h).
#include "shm_comm.h"

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

namespace inflight::kernels::cpu {
namespace {

constexpr std::uint64_t kMagic = 0x696e666c74736d32ULL;  // "inflsm2"
constexpr std::size_t kHeaderBytes = 64 * 1024;          // the Header, padded to a page multiple
constexpr int kSpins = 4000;                             // pause loops before yielding the CPU
constexpr double kYieldSeconds = 0.005;                  // then yield for this long, then sleep-poll
constexpr long kSleepNanos = 50 * 1000;

[[noreturn]] void fail(std::string const& what) { throw std::runtime_error("shared-memory comm: " + what); }

[[noreturn]] void fail_errno(std::string const& what) { fail(what + ": " + std::strerror(errno)); }

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

template <class T>
void sum_slots(std::vector<unsigned char const*> const& slots, T* out, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) {
    float acc = to_float(reinterpret_cast<T const*>(slots[0])[i]);
    for (std::size_t r = 1; r < slots.size(); ++r) acc += to_float(reinterpret_cast<T const*>(slots[r])[i]);
    out[i] = from_float<T>(acc);
  }
}

}  // namespace

static_assert(sizeof(std::atomic<std::uint64_t>) == 8 && std::atomic<std::uint64_t>::is_always_lock_free,
              "the counters must be lock-free to work across processes");

ShmComm::ShmComm(std::string const& name, int rank, int world, std::int64_t slot_bytes, bool create)
    : name_(name), rank_(rank), world_(world), slot_bytes_(slot_bytes), owner_(create) {
  static_assert(sizeof(Header) <= kHeaderBytes, "header too large");
  if (world < 1 || world > kMaxRanks || rank < 0 || rank >= world) {
    fail("rank " + std::to_string(rank) + " of world " + std::to_string(world) + " (at most " +
         std::to_string(kMaxRanks) + " ranks)");
  }
  if (slot_bytes < 64 || slot_bytes % 64 != 0) fail("slot_bytes must be a positive multiple of 64");
  map_bytes_ = kHeaderBytes + std::size_t(2) * std::size_t(world) * std::size_t(slot_bytes);
  int const fd = create ? shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600) : shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) fail_errno("shm_open(" + name + ")");
  if (create && ftruncate(fd, off_t(map_bytes_)) != 0) {
    int const err = errno;
    close(fd);
    shm_unlink(name.c_str());
    errno = err;
    fail_errno("ftruncate(" + name + ")");
  }
  // Reserve the pages now: a /dev/shm too small for the segment (a container's default is 64 MiB)
  // fails here with a message, instead of a SIGBUS at the first write to a page it cannot back.
  if (create) {
    int const err = posix_fallocate(fd, 0, off_t(map_bytes_));
    if (err != 0) {
      close(fd);
      shm_unlink(name.c_str());
      fail("reserving " + std::to_string(map_bytes_) + " bytes for " + name +
           " in /dev/shm failed: " + std::strerror(err) + " (a larger /dev/shm, or INFLIGHT_TP_TRANSPORT=gloo)");
    }
  }
  struct stat st{};
  if (fstat(fd, &st) != 0 || std::size_t(st.st_size) < map_bytes_) {
    close(fd);
    fail("segment " + name + " is smaller than " + std::to_string(map_bytes_) + " bytes");
  }
  map_ = mmap(nullptr, map_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (map_ == MAP_FAILED) {
    map_ = nullptr;
    if (create) shm_unlink(name.c_str());
    fail_errno("mmap(" + name + ")");
  }
  header_ = static_cast<Header*>(map_);
  data_ = static_cast<unsigned char*>(map_) + kHeaderBytes;
  if (create) {  // the fresh mapping is zero-filled: counters at 0
    header_->world = world;
    header_->slot_bytes = slot_bytes;
    std::atomic_thread_fence(std::memory_order_release);
    reinterpret_cast<std::atomic<std::uint64_t>*>(&header_->magic)->store(kMagic, std::memory_order_release);
  } else {
    auto const magic = reinterpret_cast<std::atomic<std::uint64_t>*>(&header_->magic)->load(std::memory_order_acquire);
    if (magic != kMagic || header_->world != world || header_->slot_bytes != slot_bytes) {
      munmap(map_, map_bytes_);
      map_ = nullptr;
      fail("segment " + name + " does not match (world " + std::to_string(world) + ", slot_bytes " +
           std::to_string(slot_bytes) + ")");
    }
  }
  header_->pids[rank].store(std::int32_t(getpid()), std::memory_order_release);
}

ShmComm::~ShmComm() {
  if (map_ != nullptr) munmap(map_, map_bytes_);
  if (owner_) shm_unlink(name_.c_str());
}

void ShmComm::unlink() {
  if (owner_) {
    shm_unlink(name_.c_str());
    owner_ = false;
  }
}

unsigned char* ShmComm::slot(std::uint64_t round, int rank) const {
  std::size_t const buffer = std::size_t(round % 2);
  return data_ + (buffer * std::size_t(world_) + std::size_t(rank)) * std::size_t(slot_bytes_);
}

void ShmComm::abort() {
  std::int32_t expected = 0;
  header_->aborted.compare_exchange_strong(expected, std::int32_t(rank_ + 1), std::memory_order_acq_rel);
}

int ShmComm::aborted_by() const { return int(header_->aborted.load(std::memory_order_acquire)) - 1; }

std::uint64_t ShmComm::arrive() {
  header_->arrived[rank_].value.store(seq_, std::memory_order_release);
  return seq_;
}

void ShmComm::wait_all(std::uint64_t round, double timeout_s, char const* op) const {
  using Clock = std::chrono::steady_clock;
  Clock::time_point const start = Clock::now();
  double waited = 0;
  auto check_abort = [&] {
    int const by = aborted_by();
    if (by >= 0) fail(std::string(op) + ": aborted by rank " + std::to_string(by) + " (it failed)");
  };
  check_abort();
  for (long spins = 0;; ++spins) {
    int missing = -1;
    for (int r = 0; r < world_; ++r) {
      if (header_->arrived[r].value.load(std::memory_order_acquire) < round) {
        missing = r;
        break;
      }
    }
    if (missing < 0) return;
    if (spins < kSpins) {
      cpu_relax();
      continue;
    }
    if (spins % 256 == 0) {
      waited = std::chrono::duration<double>(Clock::now() - start).count();
    }
    if (waited < kYieldSeconds) {
      sched_yield();
    } else {  // a long wait (an idle follower waiting for the next step): poll at ~20 kHz, ~no CPU
      timespec const ts{0, kSleepNanos};
      nanosleep(&ts, nullptr);
    }
    if (spins % 256 != 0) continue;
    check_abort();
    std::int32_t const pid = header_->pids[missing].load(std::memory_order_acquire);
    if (pid > 0 && kill(pid, 0) != 0 && errno == ESRCH) {
      fail(std::string(op) + ": rank " + std::to_string(missing) + " (pid " + std::to_string(pid) + ") is gone");
    }
    if (waited > timeout_s) {
      fail(std::string(op) + ": rank " + std::to_string(missing) + " did not arrive within " +
           std::to_string(timeout_s) + " s");
    }
  }
}

// Adds a call's time to the totals, however it ends.
struct ShmComm::Timer {
  ShmComm& comm;
  std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
  ~Timer() {
    comm.seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    ++comm.calls_;
  }
};

void ShmComm::all_reduce(void* data, std::int64_t numel, ScalarType dtype, double timeout_s) {
  Timer const timer{*this};
  std::int64_t const elem = std::int64_t(scalar_type_size(dtype));
  std::int64_t const per_round = slot_bytes_ / elem;
  auto* bytes = static_cast<unsigned char*>(data);
  std::vector<unsigned char const*> slots(static_cast<std::size_t>(world_));
  for (std::int64_t off = 0; off < numel; off += per_round) {
    std::int64_t const n = std::min(per_round, numel - off);
    ++seq_;
    std::memcpy(slot(seq_, rank_), bytes + off * elem, std::size_t(n * elem));
    std::uint64_t const round = arrive();
    wait_all(round, timeout_s, "all_reduce");
    for (int r = 0; r < world_; ++r) slots[std::size_t(r)] = slot(round, r);
    bool const ok = dispatch_float_type(dtype, [&](auto t) {
      using T = decltype(t);
      sum_slots<T>(slots, reinterpret_cast<T*>(bytes + off * elem), n);
    });
    if (!ok) fail("all_reduce needs float32, bfloat16 or float16, got " + std::string(scalar_type_name(dtype)));
  }
}

void ShmComm::gather(void const* data, std::int64_t bytes, void* out, int root, double timeout_s) {
  Timer const timer{*this};
  auto const* src = static_cast<unsigned char const*>(data);
  auto* dst = static_cast<unsigned char*>(out);
  for (std::int64_t off = 0; off < bytes || (bytes == 0 && off == 0); off += slot_bytes_) {
    std::int64_t const n = std::min(slot_bytes_, bytes - off);
    ++seq_;
    if (n > 0) std::memcpy(slot(seq_, rank_), src + off, std::size_t(n));
    std::uint64_t const round = arrive();
    wait_all(round, timeout_s, "gather");
    if (rank_ == root && n > 0) {
      for (int r = 0; r < world_; ++r) std::memcpy(dst + r * bytes + off, slot(round, r), std::size_t(n));
    }
    if (bytes == 0) break;
  }
}

void ShmComm::broadcast(void* data, std::int64_t bytes, int root, double timeout_s) {
  Timer const timer{*this};
  auto* buf = static_cast<unsigned char*>(data);
  for (std::int64_t off = 0; off < bytes || (bytes == 0 && off == 0); off += slot_bytes_) {
    std::int64_t const n = std::min(slot_bytes_, bytes - off);
    ++seq_;
    if (rank_ == root && n > 0) std::memcpy(slot(seq_, root), buf + off, std::size_t(n));
    std::uint64_t const round = arrive();
    wait_all(round, timeout_s, "broadcast");
    if (rank_ != root && n > 0) std::memcpy(buf + off, slot(round, root), std::size_t(n));
    if (bytes == 0) break;
  }
}

}  // namespace inflight::kernels::cpu
