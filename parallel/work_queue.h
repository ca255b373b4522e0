#pragma once
// A communication thread: runs collectives one after another, in the order
// they were enqueued, while the caller goes on (backward keeps computing
// while buckets are all-reduced). Each task's outcome, value or exception,
// lands in its Work handle.
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>

#include "parallel/process_group.h"

namespace mpt::dist {

class QueuedWork : public Work {
 public:
  void wait() override;
  bool is_completed() override;
  void finish(std::exception_ptr error);

 private:
  std::mutex mutex_;
  std::condition_variable done_cv_;
  bool done_ = false;
  std::exception_ptr error_;
};

class WorkQueue {
 public:
  WorkQueue();
  // Finishes the queued tasks, then stops the thread.
  ~WorkQueue();
  WorkQueue(const WorkQueue&) = delete;
  WorkQueue& operator=(const WorkQueue&) = delete;

  WorkPtr enqueue(std::function<void()> task);

 private:
  void run();

  std::mutex mutex_;
  std::condition_variable ready_cv_;
  std::deque<std::pair<std::function<void()>, std::shared_ptr<QueuedWork>>> tasks_;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace mpt::dist
