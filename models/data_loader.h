#pragma once
// DataLoader: batches of a Dataset in a Sampler's order, assembled by
// background worker threads with bounded prefetch. Batches come out in
// order whatever the number of workers, so a run is the same with 0 or 8.
//
// Position: (epoch, batch) names the next batch to be delivered. Saving it
// in a checkpoint and calling start_epoch(epoch, batch) on resume continues
// with exactly the batch an uninterrupted run would have seen next.
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "models/dataset.h"
#include "models/sampler.h"

namespace mpt::data {

struct DataLoaderOptions {
  int64_t batch_size = 64;
  bool drop_last = false;  // drop a last, smaller batch
  int num_workers = 2;     // 0: batches are assembled by the caller, on demand
  int prefetch = 4;        // batches ready or in progress ahead of the consumer
  // Batches in page-locked host memory (tensor/pinned.h), so their copies
  // to a GPU are asynchronous and overlap compute. Plain memory without a GPU.
  bool pin_memory = false;
};

struct DataPosition {
  int64_t epoch = 0;
  int64_t batch = 0;  // index of the next batch within the epoch
};

class DataLoader {
 public:
  DataLoader(std::shared_ptr<const Dataset> dataset, std::shared_ptr<const Sampler> sampler,
             const DataLoaderOptions& options);
  ~DataLoader();
  DataLoader(const DataLoader&) = delete;
  DataLoader& operator=(const DataLoader&) = delete;

  // Begins (or resumes) `epoch` at batch `first_batch`; stops any batches
  // still being prepared for the previous epoch.
  void start_epoch(int64_t epoch, int64_t first_batch = 0);
  // The next batch of the current epoch, or nullopt at its end. A worker's
  // failure (e.g. an IOError) is rethrown here.
  std::optional<Batch> next();

  int64_t batches_per_epoch() const { return batches_per_epoch_; }
  DataPosition position() const { return {epoch_, next_batch_}; }
  const Dataset& dataset() const { return *dataset_; }

 private:
  Batch load(int64_t batch) const;
  void worker_loop();
  void stop_workers();

  std::shared_ptr<const Dataset> dataset_;
  std::shared_ptr<const Sampler> sampler_;
  DataLoaderOptions options_;
  int64_t epoch_length_ = 0;  // indices per epoch (the sampler's length at epoch 0)
  int64_t batches_per_epoch_ = 0;

  int64_t epoch_ = 0;
  std::vector<int64_t> order_;  // this epoch's sample indices
  int64_t next_batch_ = 0;      // next to hand to the consumer

  // Shared with the workers (under mutex_).
  std::mutex mutex_;
  std::condition_variable work_ready_, batch_ready_;
  int64_t next_to_claim_ = 0;
  std::map<int64_t, Batch> ready_;
  std::exception_ptr failure_;
  int64_t failed_batch_ = -1;
  bool stopping_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace mpt::data
