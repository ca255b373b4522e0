// Fused softmax cross-entropy over rows of logits on the CPU, the GPU
// kernel's math (tensor/cuda/cross_entropy.cu) row by row in f32. Forward
// takes each row's maximum, then its sum of exp(logit - maximum), and
// writes the loss (0 where the target is ignored), the log-sum-exp and
// whether the row counts; the softmax itself is never stored. Backward
// writes (softmax - onehot) * row_scale in the logits' dtype, rebuilding the
// softmax from the saved log-sum-exp. The composed path instead makes half a
// dozen tensors the size of the logits, which at a large vocabulary are the
// largest of the step.
//
// The exponentials are fast_math.h's exp_f32 (within 2 ulp of expf), which
// the loops inline and vectorise: with libm's expf, a call per element, they
// were over half of the forward pass's time.
//
// Rows are split over the backend's threads; each row's results depend on
// that row alone, so the bits do not depend on the thread count.
#include <cmath>
#include <limits>
#include <vector>

#include "tensor/cpu/cpu_kernels.h"
#include "tensor/cpu/cpu_rows.h"
#include "tensor/cpu/cpu_threads.h"
#include "tensor/cpu/fast_math.h"

namespace mpt::cpu {
namespace {

// About 16K exponentials make a piece worth a thread.
constexpr int64_t kMinLogitsPerPiece = int64_t{1} << 14;

constexpr float kInf = std::numeric_limits<float>::infinity();

ShapeDescription shape_of(const TensorView& v) { return ShapeDescription(v.shape, static_cast<size_t>(v.ndim)); }

// Checks logits [rows, classes], i64 targets [rows] and an f32 per-row
// tensor, all contiguous; returns {rows, classes}.
std::pair<int64_t, int64_t> check_operands(const char* op, const TensorView& logits, const TensorView& target,
                                           const TensorView& per_row) {
  check<DTypeError>(fused_cross_entropy_supported(logits.dtype), "CPU {}: logits must be f32, f16 or bf16, got {}",
                    op, dtype_name(logits.dtype));
  check<DTypeError>(target.dtype == DType::i64, "CPU {}: targets must be i64, got {}", op, dtype_name(target.dtype));
  check<ShapeError>(logits.ndim == 2 && target.numel() == logits.shape[0] && per_row.numel() == logits.shape[0] &&
                        per_row.dtype == DType::f32,
                    "CPU {}: logits {}, targets {} and per-row f32 {} {} do not fit together", op, shape_of(logits),
                    shape_of(target), dtype_name(per_row.dtype), shape_of(per_row));
  for (const TensorView* t : {&logits, &target, &per_row})
    check<ShapeError>(t->is_contiguous(), "CPU {}: needs contiguous operands (shape {})", op, shape_of(*t));
  return {logits.shape[0], logits.shape[1]};
}

template <typename T>
void forward_typed(int64_t rows, int64_t classes, float* loss, float* lse, float* valid, const T* logits,
                   const int64_t* target, int64_t ignore_index) {
  parallel_for(rows, 1, units_for_work(kMinLogitsPerPiece, classes), [&](int64_t begin, int64_t end) {
    std::vector<float> buf(std::is_same_v<T, float> ? 0 : static_cast<size_t>(classes));
    for (int64_t row = begin; row < end; ++row) {
      const float* x = widen_row(logits + row * classes, classes, buf.data());
      // A NaN does not win the maximum but makes the sum NaN, and with it
      // the loss: what a loss scaler looks for.
      const float m = row_max(x, classes);
      // A -inf logit adds nothing, even where the maximum is -inf too
      // (where -inf - -inf would be NaN).
      const float s = row_sum(classes, [x, m](int64_t i) { return x[i] == -kInf ? 0.0f : exp_f32(x[i] - m); });
      const float row_lse = m + std::log(s);
      const int64_t t = target[row];
      const bool counts = t != ignore_index;
      lse[row] = row_lse;
      valid[row] = counts ? 1.0f : 0.0f;
      // A target outside [0, classes) was reported by the caller's index
      // check; its loss is NaN rather than a read outside the row.
      loss[row] = !counts ? 0.0f : t >= 0 && t < classes ? row_lse - x[t] : std::numeric_limits<float>::quiet_NaN();
    }
  });
}

template <typename T>
void backward_typed(int64_t rows, int64_t classes, T* grad, const T* logits, const int64_t* target, const float* lse,
                    const float* row_scale) {
  parallel_for(rows, 1, units_for_work(kMinLogitsPerPiece, classes), [&](int64_t begin, int64_t end) {
    const size_t n = std::is_same_v<T, float> ? 0 : static_cast<size_t>(classes);
    std::vector<float> xbuf(n), gbuf(n);
    for (int64_t row = begin; row < end; ++row) {
      const float* __restrict x = widen_row(logits + row * classes, classes, xbuf.data());
      float* __restrict g = f32_row(grad + row * classes, gbuf.data());
      const float row_lse = lse[row], scale = row_scale[row];
      // (softmax - 0) * scale off the target is softmax * scale, bit for
      // bit; the target's element is redone with its 1 below.
      for (int64_t i = 0; i < classes; ++i) g[i] = exp_f32(x[i] - row_lse) * scale;
      const int64_t t = target[row];
      if (t >= 0 && t < classes) g[t] = (exp_f32(x[t] - row_lse) - 1.0f) * scale;
      store_row(grad + row * classes, g, classes);
    }
  });
}

}  // namespace

bool fused_cross_entropy_supported(DType dtype) {
  return dtype == DType::f32 || dtype == DType::f16 || dtype == DType::bf16;
}

void cross_entropy_forward(const TensorView& loss, const TensorView& lse, const TensorView& valid,
                           const TensorView& logits, const TensorView& target, int64_t ignore_index) {
  // Named copies, not a structured binding: the lambda below captures them
  // (which clang 14, the sanitizer build's compiler, does not allow).
  const std::pair<int64_t, int64_t> shape = check_operands("cross_entropy", logits, target, lse);
  const int64_t rows = shape.first, classes = shape.second;
  for (const TensorView* t : {&loss, &valid})
    check<ShapeError>(t->dtype == DType::f32 && t->numel() == rows && t->is_contiguous(),
                      "CPU cross_entropy: loss and valid must be contiguous f32 [{}], got {} {}", rows,
                      dtype_name(t->dtype), shape_of(*t));
  dispatch_half_or_float(logits.dtype, "CPU cross_entropy", [&](auto tag) {
    using T = decltype(tag);
    forward_typed<T>(rows, classes, static_cast<float*>(loss.data), static_cast<float*>(lse.data),
                     static_cast<float*>(valid.data), static_cast<const T*>(logits.data),
                     static_cast<const int64_t*>(target.data), ignore_index);
  });
}

void cross_entropy_backward(const TensorView& grad, const TensorView& logits, const TensorView& target,
                            const TensorView& lse, const TensorView& row_scale) {
  const std::pair<int64_t, int64_t> shape = check_operands("cross_entropy backward", logits, target, lse);
  const int64_t rows = shape.first, classes = shape.second;
  check<ShapeError>(grad.dtype == logits.dtype && grad.numel() == logits.numel() && grad.is_contiguous(),
                    "CPU cross_entropy backward: gradient {} {} does not match logits {} {}", dtype_name(grad.dtype),
                    shape_of(grad), dtype_name(logits.dtype), shape_of(logits));
  check<ShapeError>(row_scale.dtype == DType::f32 && row_scale.numel() == rows && row_scale.is_contiguous(),
                    "CPU cross_entropy backward: row scale must be contiguous f32 [{}], got {} {}", rows,
                    dtype_name(row_scale.dtype), shape_of(row_scale));
  dispatch_half_or_float(logits.dtype, "CPU cross_entropy backward", [&](auto tag) {
    using T = decltype(tag);
    backward_typed<T>(rows, classes, static_cast<T*>(grad.data), static_cast<const T*>(logits.data),
                      static_cast<const int64_t*>(target.data), static_cast<const float*>(lse.data),
                      static_cast<const float*>(row_scale.data));
  });
}

}  // namespace mpt::cpu
