#include "models/data_loader.h"

#include "tensor/error.h"
#include "tensor/pinned.h"

namespace mpt::data {

DataLoader::DataLoader(std::shared_ptr<const Dataset> dataset, std::shared_ptr<const Sampler> sampler,
                       const DataLoaderOptions& options)
    : dataset_(std::move(dataset)), sampler_(std::move(sampler)), options_(options) {
  check(dataset_ && sampler_, "DataLoader: dataset and sampler must not be null");
  check(options.batch_size >= 1, "DataLoader: batch_size {} must be at least 1", options.batch_size);
  check(options.num_workers >= 0, "DataLoader: num_workers {} must not be negative", options.num_workers);
  check(options.prefetch >= 1, "DataLoader: prefetch {} must be at least 1", options.prefetch);
  epoch_length_ = static_cast<int64_t>(sampler_->indices(0).size());
  const int64_t n = epoch_length_;
  // (n + batch_size - 1) / batch_size would overflow for a batch size near the int64 limit.
  batches_per_epoch_ = n / options.batch_size + (!options.drop_last && n % options.batch_size != 0 ? 1 : 0);
  start_epoch(0);
}

DataLoader::~DataLoader() { stop_workers(); }

void DataLoader::stop_workers() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  work_ready_.notify_all();
  for (std::thread& t : workers_) t.join();
  workers_.clear();
}

void DataLoader::start_epoch(int64_t epoch, int64_t first_batch) {
  check(epoch >= 0, "DataLoader::start_epoch: epoch {} must not be negative", epoch);
  check(first_batch >= 0 && first_batch <= batches_per_epoch_,
        "DataLoader::start_epoch: batch {} out of range [0, {}] for epoch {}", first_batch, batches_per_epoch_, epoch);
  std::vector<int64_t> order = sampler_->indices(epoch);
  // The batch count was taken from epoch 0; a sampler must keep its length.
  // Checked before anything changes: a refused epoch leaves the current one
  // running.
  check(static_cast<int64_t>(order.size()) == epoch_length_,
        "DataLoader::start_epoch: the sampler gives {} indices for epoch {} but {} for epoch 0; every epoch must be "
        "as long", order.size(), epoch, epoch_length_);
  stop_workers();
  epoch_ = epoch;
  order_ = std::move(order);
  next_batch_ = first_batch;
  next_to_claim_ = first_batch;
  ready_.clear();
  failure_ = nullptr;
  failed_batch_ = -1;
  stopping_ = false;
  for (int w = 0; w < options_.num_workers; ++w) workers_.emplace_back([this] { worker_loop(); });
}

Batch DataLoader::load(int64_t batch) const {
  const int64_t begin = batch * options_.batch_size;
  const int64_t end = std::min<int64_t>(begin + options_.batch_size, static_cast<int64_t>(order_.size()));
  Batch b = dataset_->get_batch(std::vector<int64_t>(order_.begin() + begin, order_.begin() + end));
  if (options_.pin_memory) {
    // In the worker thread: the extra host copy stays off the training loop.
    b.input = pin_memory(b.input);
    b.target = pin_memory(b.target);
  }
  return b;
}

void DataLoader::worker_loop() {
  std::unique_lock lock(mutex_);
  for (;;) {
    // Claim the next batch only while fewer than `prefetch` are ahead of the consumer.
    work_ready_.wait(lock, [&] {
      return stopping_ || (next_to_claim_ < batches_per_epoch_ && next_to_claim_ < next_batch_ + options_.prefetch);
    });
    if (stopping_) return;
    const int64_t batch = next_to_claim_++;
    lock.unlock();
    Batch b;
    std::exception_ptr error;
    try {
      b = load(batch);
    } catch (...) {
      error = std::current_exception();
    }
    lock.lock();
    if (error && (!failure_ || batch < failed_batch_)) {
      failure_ = error;
      failed_batch_ = batch;
    } else if (!error) {
      ready_.emplace(batch, std::move(b));
    }
    batch_ready_.notify_all();
  }
}

std::optional<Batch> DataLoader::next() {
  if (next_batch_ >= batches_per_epoch_) return std::nullopt;
  if (workers_.empty()) {
    Batch b = load(next_batch_);  // a batch that fails to load is not counted as consumed
    ++next_batch_;
    return b;
  }
  std::unique_lock lock(mutex_);
  batch_ready_.wait(lock, [&] { return ready_.count(next_batch_) || (failure_ && failed_batch_ == next_batch_); });
  auto it = ready_.find(next_batch_);
  if (it == ready_.end()) std::rethrow_exception(failure_);
  Batch b = std::move(it->second);
  ready_.erase(it);
  ++next_batch_;
  lock.unlock();
  work_ready_.notify_all();
  return b;
}

}  // namespace mpt::data
