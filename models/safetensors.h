#pragma once
// The safetensors file format (the one Hugging Face's `safetensors`
// package reads): an 8-byte little-endian header length N, N bytes of JSON
// {"<name>": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]},
//  ..., "__metadata__": {"key": "value", ...}}, then the tensors' bytes,
// little-endian and row-major, back to back with no gaps.
//
// Writing keeps a CRC-32 of the header and the data in the metadata
// ("mpt.crc32"), so a later read detects a flipped bit anywhere. Files from
// elsewhere, without it, are read after the structural checks alone.
#include <functional>
#include <map>
#include <string>

#include "models/ordered_dict.h"
#include "tensor/tensor.h"

namespace mpt::io {

using Metadata = std::map<std::string, std::string>;

struct TensorFile {
  OrderedDict<Tensor> tensors;  // in file order, on the CPU
  Metadata metadata;            // without mpt.crc32
  bool had_checksum = false;    // whether mpt.crc32 was present (and matched)
};

inline constexpr const char* kChecksumKey = "mpt.crc32";

// Test hook: called once the temporary file holds part of the data; a
// throw from it simulates a crash in the middle of writing.
using PartialWriteHook = std::function<void(const std::string& temp_path)>;

// Writes tensors (any device and dtype the format knows: f32, f16, bf16,
// f64, i32, i64, u8) atomically: into a temporary file in the same folder,
// fsync, rename over `path`, fsync the folder. A failure at any point
// leaves an existing file at `path` as it was and removes the temporary;
// temporaries of earlier writers that were killed mid-write are removed.
void save_safetensors(const std::string& path, const OrderedDict<Tensor>& tensors, const Metadata& metadata = {},
                      const PartialWriteHook& hook = {});

// Reads and validates the whole file before returning anything: header
// length within the file, well-formed JSON, known dtypes, shapes matching
// byte counts, offsets in range, ordered and without gaps or overlaps,
// nothing after the data, and the checksum when there is one. Every fault
// is an IOError naming the file and the tensor or field at fault.
TensorFile load_safetensors(const std::string& path);

}  // namespace mpt::io
