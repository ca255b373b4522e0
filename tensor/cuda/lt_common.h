#pragma once
// What the two cuBLASLt GEMM files (gemm.cpp, gemm_fp8.cpp) share; CUDA
// builds only.
#include <cublasLt.h>

#include <cstddef>
#include <cstdint>

namespace mpt::cuda {

// cuBLASLt's descriptors of one problem, destroyed together.
struct LtDescriptors {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;

  LtDescriptors() = default;
  LtDescriptors(const LtDescriptors&) = delete;
  LtDescriptors& operator=(const LtDescriptors&) = delete;
  ~LtDescriptors();
};

// FNV-1a over a plan key's bytes: keys are zero-initialised (memset), so
// their padding is deterministic.
template <typename Key>
struct KeyBytesHash {
  size_t operator()(const Key& k) const {
    const auto* p = reinterpret_cast<const unsigned char*>(&k);
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < sizeof(Key); ++i) h = (h ^ p[i]) * 1099511628211ull;
    return static_cast<size_t>(h);
  }
};

// The cuBLASLt handle of a device (made at first use, kept until exit).
cublasLtHandle_t lt_handle(int device);
// What NVIDIA recommends for Hopper; most algorithms need far less.
inline constexpr uint64_t kMaxWorkspace = uint64_t(32) << 20;

}  // namespace mpt::cuda
