#include "parallel/work_queue.h"

namespace mpt::dist {

void QueuedWork::wait() {
  std::unique_lock lock(mutex_);
  // Each task bounds itself (the backend's timeout), so this wait ends.
  done_cv_.wait(lock, [&] { return done_; });
  if (error_) std::rethrow_exception(error_);
}

bool QueuedWork::is_completed() {
  std::lock_guard lock(mutex_);
  return done_;
}

void QueuedWork::finish(std::exception_ptr error) {
  {
    std::lock_guard lock(mutex_);
    done_ = true;
    error_ = std::move(error);
  }
  done_cv_.notify_all();
}

WorkQueue::WorkQueue() : thread_([this] { run(); }) {}

WorkQueue::~WorkQueue() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  ready_cv_.notify_all();
  thread_.join();
}

WorkPtr WorkQueue::enqueue(std::function<void()> task) {
  auto work = std::make_shared<QueuedWork>();
  {
    std::lock_guard lock(mutex_);
    tasks_.emplace_back(std::move(task), work);
  }
  ready_cv_.notify_one();
  return work;
}

void WorkQueue::run() {
  for (;;) {
    std::pair<std::function<void()>, std::shared_ptr<QueuedWork>> next;
    {
      std::unique_lock lock(mutex_);
      ready_cv_.wait(lock, [&] { return stopping_ || !tasks_.empty(); });
      if (tasks_.empty()) return;
      next = std::move(tasks_.front());
      tasks_.pop_front();
    }
    std::exception_ptr error;
    try {
      next.first();
    } catch (...) {
      error = std::current_exception();
    }
    next.second->finish(error);
  }
}

}  // namespace mpt::dist
