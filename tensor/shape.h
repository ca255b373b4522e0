#pragma once
// Shapes and strides, counted in elements.
#include <cstdint>
#include <string>
#include <vector>

namespace mpt {

using Shape = std::vector<int64_t>;

inline constexpr int kMaxDims = 8;

int64_t numel(const Shape& s);
Shape contiguous_strides(const Shape& s);
std::string shape_str(const Shape& s);  // "[2, 3]"
// The shape two operands broadcast to, NumPy rules; throws ShapeError naming `op`.
Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op);
// Whether `from` broadcasts to exactly `to` (no more dimensions; each of
// size 1 or the same), for callers that name the operands themselves.
bool broadcasts_to(const Shape& from, const Shape& to);
// Strides that read a tensor of (shape, strides) as if it had shape `to`
// (stride 0 along broadcast dimensions). `to` must be a broadcast of `shape`.
Shape broadcast_strides(const Shape& shape, const Shape& strides, const Shape& to);
// Wraps a possibly negative dimension index; throws ShapeError naming `op`.
int normalize_dim(int64_t dim, int64_t ndim, const char* op);
// As normalize_dim, for ops that need the dimension to exist: a tensor
// of 0 dimensions (which normalize_dim lets stand for a dimension of size
// 1, as PyTorch does for reductions) is refused, naming the op.
int normalize_existing_dim(int64_t dim, int64_t ndim, const char* op);

}  // namespace mpt
