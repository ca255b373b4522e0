#include "tensor/shape.h"

#include <algorithm>
#include <ostream>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "tensor/error.h"

namespace mpt {

int64_t numel(const Shape& s) {
  for (int64_t d : s)
    if (d == 0) return 0;  // before the product, which could overflow on the other dimensions
  int64_t n = 1;
  for (int64_t d : s)
    if (__builtin_mul_overflow(n, d, &n))
      throw ShapeError(fmt::format("shape {} has more elements than an int64 can count", shape_str(s)));
  return n;
}

Shape contiguous_strides(const Shape& s) {
  Shape st(s.size());
  int64_t acc = 1;
  for (size_t i = s.size(); i-- > 0;) {
    st[i] = acc;
    acc *= std::max<int64_t>(s[i], 1);
  }
  return st;
}

std::string ShapeDescription::str() const { return fmt::format("[{}]", fmt::join(sizes_, ", ")); }

std::ostream& operator<<(std::ostream& os, const ShapeDescription& d) { return os << d.str(); }

Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op) {
  const size_t n = std::max(a.size(), b.size());
  Shape out(n);
  for (size_t i = 0; i < n; ++i) {
    const int64_t da = i < n - a.size() ? 1 : a[i - (n - a.size())];
    const int64_t db = i < n - b.size() ? 1 : b[i - (n - b.size())];
    if (da != db && da != 1 && db != 1)
      throw ShapeError(fmt::format("{}: shapes {} and {} do not broadcast (dimension {}: {} vs {})", op,
                                   shape_str(a), shape_str(b), i, da, db));
    out[i] = da == 1 ? db : da;
  }
  return out;
}

bool broadcasts_to(const Shape& from, const Shape& to) {
  if (from.size() > to.size()) return false;
  const size_t lead = to.size() - from.size();
  for (size_t i = 0; i < from.size(); ++i)
    if (from[i] != 1 && from[i] != to[lead + i]) return false;
  return true;
}

Shape broadcast_strides(const Shape& shape, const Shape& strides, const Shape& to) {
  Shape out(to.size());
  broadcast_strides_into(shape, strides, to.size(), out.data());
  return out;
}

void broadcast_strides_into(const Shape& shape, const Shape& strides, size_t to_rank, int64_t* out) {
  const size_t lead = to_rank - shape.size();
  std::fill(out, out + lead, 0);
  for (size_t i = 0; i < shape.size(); ++i) out[lead + i] = shape[i] == 1 ? 0 : strides[i];
}

int normalize_dim(int64_t dim, int64_t ndim, const char* op) {
  const int64_t d = dim < 0 ? dim + ndim : dim;
  if (d < 0 || d >= std::max<int64_t>(ndim, 1))
    throw ShapeError(fmt::format("{}: dimension {} out of range for a tensor of {} dimensions", op, dim, ndim));
  return static_cast<int>(d);
}

int normalize_existing_dim(int64_t dim, int64_t ndim, const char* op) {
  if (ndim == 0)
    throw ShapeError(fmt::format("{}: a tensor of 0 dimensions has no dimension {}", op, dim));
  return normalize_dim(dim, ndim, op);
}

}  // namespace mpt
