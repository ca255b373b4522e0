#pragma once
// A non-owning description of tensor memory, passed by value to kernels on
// every backend (a CUDA kernel can take it as a parameter as it is).
#include <cstdint>

#include "tensor/dtype.h"
#include "tensor/shape.h"

namespace mpt {

// Whether sizes and strides lay elements out densely in row-major order
// (a dimension of size 1 may have any stride).
inline bool dense_row_major(const int64_t* shape, const int64_t* strides, int ndim) {
  int64_t expect = 1;
  for (int i = ndim - 1; i >= 0; --i) {
    if (shape[i] != 1 && strides[i] != expect) return false;
    expect *= shape[i];
  }
  return true;
}

struct TensorView {
  void* data = nullptr;  // element 0, offset already applied
  DType dtype = DType::f32;
  int ndim = 0;
  int64_t shape[kMaxDims] = {};
  int64_t strides[kMaxDims] = {};

  int64_t numel() const {
    int64_t n = 1;
    for (int i = 0; i < ndim; ++i) n *= shape[i];
    return n;
  }
  bool is_contiguous() const { return dense_row_major(shape, strides, ndim); }
};

}  // namespace mpt
