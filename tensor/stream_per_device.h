#pragma once
// One library stream per device, made when first asked for. Streams the
// library creates live as long as the process (tensor/stream.h), so the
// handles handed out never dangle. Each user keeps a set of its own, so that
// unrelated work does not queue on one stream.
#include <map>
#include <mutex>

#include "tensor/stream.h"

namespace mpt {

class StreamPerDevice {
 public:
  Stream get(const Device& device) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = streams_.find(device.index);
    if (it == streams_.end()) it = streams_.emplace(device.index, Stream::create(device)).first;
    return it->second;
  }

 private:
  std::mutex mutex_;
  std::map<int, Stream> streams_;
};

}  // namespace mpt
