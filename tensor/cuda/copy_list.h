#pragma once
// Internal: the multi-tensor scaled copy (tensor/cuda/copy_list.cu), on
// plain pointers (the .cu file stays free of Tensor, and so of fmt, which
// nvcc's C++20 mode cannot compile).
#include <cuda_runtime.h>

#include <cstdint>

#include "tensor/dtype.h"

namespace mpt::cuda {

// dsts[i][j] = srcs[i][j] * scale for j < sizes[i], computed in f32:
// contiguous tensors, every source of `src_dtype` and every destination of
// `dst_dtype` (f32, f16 or bf16), in as few launches as the kernel's
// parameter space allows.
void launch_scaled_copy_list(DType src_dtype, DType dst_dtype, const void* const* srcs, void* const* dsts,
                             const int64_t* sizes, size_t count, float scale, cudaStream_t stream);

}  // namespace mpt::cuda
