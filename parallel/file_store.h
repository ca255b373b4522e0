#pragma once
// A store in a shared folder (file:///path): one file per key, written to a
// temporary name and renamed, so a reader never sees half a value. For
// clusters with a shared filesystem and no reachable TCP port.
#include <string>

#include "parallel/store.h"

namespace mpt::dist {

class FileStore : public Store {
 public:
  // Creates the folder if needed. Use a fresh folder per job: keys of an
  // earlier job left behind would be taken as this job's.
  explicit FileStore(std::string folder, Millis timeout = kDefaultTimeout);

  void set(const std::string& key, const Bytes& value) override;
  Bytes get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t delta) override;
  bool check(const std::vector<std::string>& keys) override;
  std::string describe() const override { return "file://" + folder_; }

 private:
  std::string path_of(const std::string& key) const;
  std::string folder_;
};

}  // namespace mpt::dist
