#include "tensor/cpu/cpu_threads.h"

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

#include "tensor/environment.h"
#include "tensor/error.h"

namespace mpt::cpu {

int usable_cpus() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

namespace {

int threads_from_environment() {
  if (const auto n = whole_number_from_environment("MPT_CPU_THREADS", 1, 1024)) return static_cast<int>(*n);
  return usable_cpus();
}

// Threads that wait for pieces of work, made once: starting a thread costs
// tens of microseconds (a thousand with many of them on few CPUs), which
// small products would pay at every call. One caller's pieces at a time;
// a caller that finds the pool busy (another thread's product, or a piece
// that splits its own work) runs its pieces itself.
class WorkerPool {
 public:
  explicit WorkerPool(int workers) {
    for (int i = 0; i < workers; ++i) {
      try {
        std::thread(&WorkerPool::work, this).detach();
      } catch (const std::system_error&) {
        break;  // fewer threads than asked for: the callers do more pieces
      }
    }
  }

  // run(piece) for every piece of [0, pieces), on the workers and the
  // calling thread; false, with nothing run, while the pool is busy, or in
  // a child forked from the process that made it (which has none of its
  // threads, and maybe a mutex a worker held at the fork).
  bool try_run(int64_t pieces, const std::function<void(int64_t)>& run) {
    if (::getpid() != owner_) return false;
    auto job = std::make_shared<Job>(run, pieces);
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      if (job_) return false;
      job_ = job;
    }
    wake_.notify_all();
    take_pieces(*job);
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [&] { return job->finished == pieces; });
    job_.reset();
    return true;
  }

 private:
  // One caller's pieces. Workers hold it by shared_ptr: a worker that wakes
  // late still counts against this job's pieces, never the next one's.
  struct Job {
    Job(const std::function<void(int64_t)>& r, int64_t p) : run(r), pieces(p) {}
    const std::function<void(int64_t)>& run;
    const int64_t pieces;
    std::atomic<int64_t> next{0};
    int64_t finished = 0;  // under the pool's mutex
  };

  void take_pieces(Job& job) {
    for (int64_t piece; (piece = job.next.fetch_add(1)) < job.pieces;) {
      job.run(piece);
      const std::lock_guard<std::mutex> lock(mutex_);
      if (++job.finished == job.pieces) done_.notify_all();
    }
  }

  void work() {
    std::shared_ptr<Job> last;
    for (;;) {
      std::shared_ptr<Job> job;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return job_ && job_ != last; });
        job = job_;
      }
      take_pieces(*job);
      last = std::move(job);
    }
  }

  const pid_t owner_ = ::getpid();
  std::mutex mutex_;
  std::condition_variable wake_, done_;
  std::shared_ptr<Job> job_;  // the pieces being run, if any
};

WorkerPool& pool() {
  // Never destroyed: its threads wait until the process ends.
  static WorkerPool* const instance = new WorkerPool(cpu_threads() - 1);
  return *instance;
}

}  // namespace

int cpu_threads() {
  static const int count = threads_from_environment();
  return count;
}

void parallel_for(int64_t count, int64_t grain, int64_t min_grains_per_piece,
                  const std::function<void(int64_t begin, int64_t end)>& f) {
  if (count <= 0) return;
  const int64_t grains = (count + grain - 1) / grain;
  const int64_t pieces = std::clamp<int64_t>(grains / std::max<int64_t>(min_grains_per_piece, 1), 1, cpu_threads());
  if (pieces == 1) {
    f(0, count);
    return;
  }
  // The pieces depend only on the count and cpu_threads(), not on which
  // thread runs them: a kernel that splits by them gives the same bits.
  const int64_t per_piece = (grains + pieces - 1) / pieces * grain;
  std::vector<std::exception_ptr> errors(static_cast<size_t>(pieces));
  const std::function<void(int64_t)> run = [&](int64_t piece) {
    const int64_t begin = piece * per_piece, end = std::min(count, begin + per_piece);
    if (begin >= end) return;
    try {
      f(begin, end);
    } catch (...) {
      errors[static_cast<size_t>(piece)] = std::current_exception();
    }
  };
  if (!pool().try_run(pieces, run))
    for (int64_t piece = 0; piece < pieces; ++piece) run(piece);
  for (const std::exception_ptr& e : errors)
    if (e) std::rethrow_exception(e);
}

}  // namespace mpt::cpu
