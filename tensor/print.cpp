// Printing: nested brackets like PyTorch, long dimensions elided to their
// first and last three entries.
#include <ostream>
#include <sstream>

#include "tensor/ops.h"

namespace mpt {
namespace {

constexpr int64_t kEdge = 3;

void print_dim(std::ostringstream& os, const std::vector<double>& v, const Shape& shape, const Shape& strides,
               size_t d, int64_t base, bool integral) {
  if (d == shape.size()) {
    if (integral) {
      os << static_cast<int64_t>(v[base]);
    } else {
      os << fmt::format("{:.6g}", v[base]);
    }
    return;
  }
  os << '[';
  const int64_t n = shape[d];
  for (int64_t i = 0; i < n; ++i) {
    if (n > 2 * kEdge && i == kEdge) {
      os << "..., ";
      i = n - kEdge - 1;
      continue;
    }
    print_dim(os, v, shape, strides, d + 1, base + i * strides[d], integral);
    if (i + 1 < n) os << (d + 1 == shape.size() ? ", " : ",\n" + std::string(d + 8, ' '));
  }
  os << ']';
}

}  // namespace

std::string Tensor::str() const {
  if (!defined()) return "tensor(undefined)";
  std::ostringstream os;
  os << "tensor(";
  const std::vector<double> values = to_vector<double>();
  print_dim(os, values, shape(), contiguous_strides(shape()), 0, 0, !is_floating(dtype()));
  os << ", dtype=" << dtype_name(dtype()) << ", device=" << device().str();
  if (requires_grad()) os << ", requires_grad";
  os << ')';
  return os.str();
}

std::ostream& operator<<(std::ostream& os, const Tensor& t) { return os << t.str(); }

}  // namespace mpt
