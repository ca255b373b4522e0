#pragma once
// Shapes and strides, counted in elements.
#include <algorithm>
#include <cstdint>
#include <iosfwd>
#include <string>
#include <vector>

#include "tensor/inline_vector.h"

// Kernels' sources include this header too, and nvcc cannot compile fmt's
// header-only build: they get the shapes, not the formatting.
#if !defined(__CUDACC__)
#include <fmt/format.h>
#endif

namespace mpt {

inline constexpr int kMaxDims = 8;

// Sizes or strides: up to kMaxDims of them (every shape a kernel takes)
// without an allocation.
using Shape = InlineVector<int64_t, kMaxDims>;

int64_t numel(const Shape& s);
Shape contiguous_strides(const Shape& s);

// A shape's "[2, 3]", written out only when it is formatted or made a
// string: operand checks pass it to messages that are built only when the
// check fails (see describe() in tensor.h). It holds a copy of the sizes
// (a Shape: inline up to kMaxDims of them, so taking one allocates nothing).
class ShapeDescription {
 public:
  explicit ShapeDescription(const Shape& s) : sizes_(s) {}
  // The sizes of a view (a TensorView's shape array).
  ShapeDescription(const int64_t* sizes, size_t rank) : sizes_(sizes, sizes + rank) {}
  std::string str() const;
  operator std::string() const { return str(); }  // NOLINT: a description is text wherever text is asked for

 private:
  Shape sizes_;
};
inline ShapeDescription shape_str(const Shape& s) { return ShapeDescription(s); }
std::ostream& operator<<(std::ostream& os, const ShapeDescription& d);
// The shape two operands broadcast to, NumPy rules; throws ShapeError naming `op`.
Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op);
// Whether `from` broadcasts to exactly `to` (no more dimensions; each of
// size 1 or the same), for callers that name the operands themselves.
bool broadcasts_to(const Shape& from, const Shape& to);
// Strides that read a tensor of (shape, strides) as if it had shape `to`
// (stride 0 along broadcast dimensions). `to` must be a broadcast of `shape`.
Shape broadcast_strides(const Shape& shape, const Shape& strides, const Shape& to);
// The same, written to out[0, to_rank) (a TensorView's strides) without a
// vector, for the element-wise ops that pass here on every call.
void broadcast_strides_into(const Shape& shape, const Shape& strides, size_t to_rank, int64_t* out);
// Wraps a possibly negative dimension index; throws ShapeError naming `op`.
int normalize_dim(int64_t dim, int64_t ndim, const char* op);
// As normalize_dim, for ops that need the dimension to exist: a tensor
// of 0 dimensions (which normalize_dim lets stand for a dimension of size
// 1, as PyTorch does for reductions) is refused, naming the op.
int normalize_existing_dim(int64_t dim, int64_t ndim, const char* op);

}  // namespace mpt

#if !defined(__CUDACC__)
template <>
struct fmt::formatter<mpt::ShapeDescription> : fmt::formatter<std::string_view> {
  auto format(const mpt::ShapeDescription& d, fmt::format_context& ctx) const {
    return fmt::formatter<std::string_view>::format(d.str(), ctx);
  }
};
#endif
