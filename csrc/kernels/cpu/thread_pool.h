// The CPU kernels' thread pool. Every CPU launcher takes a ThreadPool, as every CUDA launcher takes a
// stream: params.num_threads is the most threads a call may use, the launcher decides how many it is
// worth, and pool.run(n, task) runs task(i, n) for i = 0 .. n-1 on n threads (the caller is thread 0)
// and returns when all are done.
//
// Why not OpenMP: libgomp keeps one worker pool per master thread, and once the process holds more
// OpenMP threads than CPUs (torch's pool on the main thread + a pool for the executor's worker
// thread is already 4 on a 2-core machine) it stops spinning between parallel regions and parks
// every worker in a futex: each region then costs a wake-up (~40 us) instead of ~1 us. A decode step
// of the fused layer stack opens ~150 regions, so the engine, whose forward runs on a worker thread,
// ran at half speed. ThreadPool::global() is one process-wide set of workers that spin for a short
// while after each job (back-to-back kernels find them awake) and then sleep on a futex.
//
// A job's n shares (thread indices) are claimed, not assigned: the caller runs share 0, then any
// share no worker has claimed yet, so a worker that is descheduled (more runnable threads than
// cores, e.g. a busy server) delays nothing. One job at a time: a caller that finds the pool busy
// (another thread's job, or a call from inside a task) runs its task inline as task(0, 1), so every
// task must split its work by (i, n) alone.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace inflight::kernels::cpu {

// A non-owning reference to a callable void(int thread, int num_threads).
class TaskRef {
 public:
  using Call = void (*)(void*, int, int);
  TaskRef() = default;
  TaskRef(void* obj, Call call) : obj_(obj), call_(call) {}
  template <class F>
  TaskRef(F& f) : obj_(&f), call_([](void* o, int i, int n) { (*static_cast<F*>(o))(i, n); }) {}  // NOLINT
  void operator()(int i, int n) const { call_(obj_, i, n); }
  void* obj() const { return obj_; }
  Call call() const { return call_; }

 private:
  void* obj_ = nullptr;
  Call call_ = nullptr;
};

class ThreadPool {
 public:
  // The process-wide pool (the bindings pass it). A forked child gets a new, empty one, since the
  // parent's workers do not exist there: look it up per call rather than keeping it across a fork.
  static ThreadPool& global();

  // task(i, n) for i = 0 .. n-1 with n = num_threads; n <= 1, a busy pool or a call from inside a task
  // runs task(0, 1) on the caller.
  void run(int num_threads, TaskRef task);

  // Worker threads started so far (for tests and logs).
  int size();

  ThreadPool(ThreadPool const&) = delete;
  ThreadPool& operator=(ThreadPool const&) = delete;

 private:
  ThreadPool();
  class Workers;      // thread_pool.cpp
  Workers* workers_;  // never freed: detached workers park in it until the process exits
};

// Internal linkage: the ISA files include this with their own -m flags (see scalar_type.h).
namespace pool_detail {
namespace {

// body(item, thread) for item in [0, count) on up to num_threads threads of `pool`: contiguous equal
// shares (static) or items handed out one at a time (dynamic: uneven items, e.g. attention tiles).
template <class F>
void parallel_for(ThreadPool& pool, std::int64_t count, int num_threads, bool dynamic, F&& body) {
  int const threads =
      static_cast<int>(std::min<std::int64_t>(std::max(num_threads, 1), std::max<std::int64_t>(count, 1)));
  if (threads <= 1) {
    for (std::int64_t i = 0; i < count; ++i) body(i, 0);
    return;
  }
  std::atomic<std::int64_t> next{0};
  auto task = [&](int t, int n) {
    if (dynamic) {
      for (std::int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < count;
           i = next.fetch_add(1, std::memory_order_relaxed))
        body(i, t);
    } else {
      for (std::int64_t i = count * t / n, end = count * (t + 1) / n; i < end; ++i) body(i, t);
    }
  };
  pool.run(threads, TaskRef(task));
}

}  // namespace
}  // namespace pool_detail
}  // namespace inflight::kernels::cpu
