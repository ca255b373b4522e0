#include "tensor/index_check.h"

#include <fmt/format.h>

#include "tensor/cuda/index_check.h"
#include "tensor/error.h"

namespace mpt {

void check_index_range(const char* op, const Tensor& indices, int64_t bound, std::optional<int64_t> ignore) {
  check<DTypeError>(indices.dtype() == DType::i64 || indices.dtype() == DType::i32,
                    "{}: indices must be i64 or i32, got {}", op, describe(indices));
  if (indices.numel() == 0) return;
  if (indices.device().is_cuda()) {
    cuda::enqueue_index_check(op, indices, bound, ignore);
    return;
  }
  for (int64_t v : indices.to_vector<int64_t>()) {
    if (ignore && v == *ignore) continue;
    if (v >= 0 && v < bound) continue;  // the message is made only for a failure
    check(false, "{}: index {} is out of range [0, {}){}", op, v, bound,
          ignore ? fmt::format(" (ignore_index is {})", *ignore) : std::string());
  }
}

}  // namespace mpt
