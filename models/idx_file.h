#pragma once
// IDX files (the MNIST family's format), plain or gzipped:
//   bytes 0-1  zero
//   byte  2    element type (0x08: unsigned byte, the only one the data sets use)
//   byte  3    number of dimensions n (1..4 here)
//   n big-endian u32 sizes, then the elements, row-major, nothing after.
// Every departure from that is an IOError naming the file and what is wrong.
#include <cstdint>
#include <string>
#include <vector>

namespace mpt::data {

struct IdxArray {
  std::vector<int64_t> shape;
  std::vector<uint8_t> values;
};

// Reads a whole IDX file; a ".gz" file (or any gzip stream) is inflated.
IdxArray read_idx(const std::string& path);

}  // namespace mpt::data
