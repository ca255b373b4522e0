// The IDX reader (plain or gzipped) on arbitrary bytes: it returns an array
// whose values match its shape, or throws IOError. Anything else is a finding.
#include <functional>
#include <numeric>

#include "fuzz_file.h"
#include "models/idx_file.h"
#include "tensor/error.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = mpt::fuzz::input_file(data, size, ".idx");
  try {
    const mpt::data::IdxArray a = mpt::data::read_idx(path);
    const int64_t count = std::accumulate(a.shape.begin(), a.shape.end(), int64_t{1}, std::multiplies<>());
    if (a.shape.empty() || a.shape.size() > 4 || static_cast<int64_t>(a.values.size()) != count) __builtin_trap();
  } catch (const mpt::IOError&) {
  }
  return 0;
}
