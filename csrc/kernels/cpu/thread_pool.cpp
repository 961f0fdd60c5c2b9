// The kernels' thread pool (see thread_pool.h).
//
// Each worker has its own mailbox (a job pointer, the thread count and a generation counter on its
// own cache line); a job writes only the mailboxes of the workers it uses and waits for exactly
// those, so a worker never sees another job's fields and idle workers are never woken.
#include "thread_pool.h"

#include <pthread.h>

#include <chrono>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define INFLIGHT_CPU_RELAX() _mm_pause()
#else
#define INFLIGHT_CPU_RELAX() std::this_thread::yield()
#endif

namespace inflight::kernels::cpu {
namespace {

// How long an idle worker spins before it sleeps: long enough to bridge the gaps between the kernels
// of one step (microseconds), short enough not to steal a core from the host code between steps.
constexpr auto kSpin = std::chrono::microseconds(200);

thread_local bool tl_in_task = false;

// A seqlock: the caller makes generation odd, writes the fields, makes it even again; a worker reads
// the fields between two equal even generations, so it never mixes two jobs' fields.
struct alignas(64) Mailbox {
  std::atomic<std::uint32_t> generation{0};
  std::atomic<bool> sleeping{false};
  std::atomic<void*> obj{nullptr};  // the task (its target is called only after a successful claim)
  std::atomic<TaskRef::Call> call{nullptr};
  std::atomic<int> n{0};
  std::atomic<std::uint64_t> job{0};
};

}  // namespace

class ThreadPool::Workers {
 public:
  void run(int n, TaskRef task) {
    std::unique_lock<std::mutex> lock(use_, std::try_to_lock);
    if (!lock.owns_lock() || tl_in_task) {  // busy, or nested: this caller does it all
      task(0, 1);
      return;
    }
    grow(n - 1);
    std::uint64_t const job = ++job_;
    remaining_.store(n - 1, std::memory_order_relaxed);
    claim_.store(job << 32 | 1u, std::memory_order_seq_cst);
    for (int w = 0; w < n - 1; ++w) {
      Mailbox& m = *boxes_[w];
      m.generation.fetch_add(1, std::memory_order_seq_cst);  // odd: being written
      m.obj.store(task.obj(), std::memory_order_relaxed);
      m.call.store(task.call(), std::memory_order_relaxed);
      m.n.store(n, std::memory_order_relaxed);
      m.job.store(job, std::memory_order_relaxed);
      m.generation.fetch_add(1, std::memory_order_seq_cst);  // even: published
      if (m.sleeping.load(std::memory_order_seq_cst)) m.generation.notify_one();
    }
    tl_in_task = true;
    task(0, n);
    // Shares no worker has started yet are the caller's: a worker that is descheduled (more runnable
    // threads than cores) then costs nothing instead of a scheduler time slice.
    run_claims(job, n, task);
    tl_in_task = false;
    // Whatever is left is running on a worker: spin (yield if it takes long).
    for (unsigned spins = 0; remaining_.load(std::memory_order_acquire) != 0; ++spins) {
      if (spins < (1u << 14)) {
        INFLIGHT_CPU_RELAX();
      } else {
        std::this_thread::yield();
      }
    }
  }

  int size() {
    std::lock_guard<std::mutex> lock(use_);
    return int(boxes_.size());
  }

 private:
  void grow(int want) {
    while (int(boxes_.size()) < want) {
      boxes_.emplace_back(std::make_unique<Mailbox>());
      Mailbox* box = boxes_.back().get();
      std::thread([this, box] { work(*box); }).detach();
    }
  }

  void work(Mailbox& box) {
    tl_in_task = true;  // a kernel called from inside a task runs inline
    // Mailboxes start at generation 0 and the first job may be posted before this thread runs: wait
    // for a change from 0, not from whatever is there now.
    std::uint32_t seen = 0;
    for (;;) {
      auto start = std::chrono::steady_clock::now();
      std::uint32_t gen = seen;
      for (unsigned spins = 1;; ++spins) {
        gen = box.generation.load(std::memory_order_acquire);
        if (gen != seen && (gen & 1u) == 0) {
          // Read the fields, then check no newer job was posted meanwhile.
          void* const obj = box.obj.load(std::memory_order_relaxed);
          TaskRef::Call const call = box.call.load(std::memory_order_relaxed);
          int const n = box.n.load(std::memory_order_relaxed);
          std::uint64_t const job = box.job.load(std::memory_order_relaxed);
          std::atomic_thread_fence(std::memory_order_acquire);
          if (box.generation.load(std::memory_order_relaxed) == gen) {
            seen = gen;
            run_claims(job, n, TaskRef(obj, call));
            break;
          }
          continue;
        }
        if (gen != seen) continue;  // odd: being written
        if ((spins & 63u) == 0 && std::chrono::steady_clock::now() - start > kSpin) {
          box.sleeping.store(true, std::memory_order_seq_cst);
          // Re-check after announcing: a dispatcher that read sleeping == false bumped generation first.
          if (box.generation.load(std::memory_order_seq_cst) == seen)
            box.generation.wait(seen, std::memory_order_acquire);
          box.sleeping.store(false, std::memory_order_relaxed);
          start = std::chrono::steady_clock::now();
        }
        INFLIGHT_CPU_RELAX();
      }
    }
  }

  // Claims shares (thread indices) of job `job` until none is left, running each.
  void run_claims(std::uint64_t job, int n, TaskRef const& task) {
    for (;;) {
      std::uint64_t c = claim_.load(std::memory_order_acquire);
      if ((c >> 32) != job || int(c & 0xffffffffu) >= n) return;
      if (!claim_.compare_exchange_weak(c, c + 1, std::memory_order_acq_rel)) continue;
      task(int(c & 0xffffffffu), n);
      remaining_.fetch_sub(1, std::memory_order_acq_rel);
    }
  }

  std::mutex use_;  // held by the caller for the duration of a job
  std::deque<std::unique_ptr<Mailbox>> boxes_;
  std::atomic<int> remaining_{0};
  std::uint64_t job_ = 0;                // jobs posted so far (under use_)
  std::atomic<std::uint64_t> claim_{0};  // (job << 32) | next unclaimed share
};

ThreadPool::ThreadPool() : workers_(new Workers()) {}

ThreadPool& ThreadPool::global() {
  static ThreadPool* pool = nullptr;
  static std::once_flag once;
  // Never destroyed: the workers are detached and park in their mailboxes until the process exits.
  // A forked child has none of the parent's threads: it starts over with an empty pool.
  std::call_once(once, [] {
    pool = new ThreadPool();
    pthread_atfork(nullptr, nullptr, [] { pool = new ThreadPool(); });
  });
  return *pool;
}

void ThreadPool::run(int num_threads, TaskRef task) {
  if (num_threads <= 1) {
    task(0, 1);
    return;
  }
  workers_->run(num_threads, task);
}

int ThreadPool::size() { return workers_->size(); }

}  // namespace inflight::kernels::cpu
