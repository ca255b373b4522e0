// Fused layer norm over the last dimension on the CPU, the GPU kernel's
// math (tensor/cuda/layer_norm.cu) row by row: statistics in f32 (the mean,
// then the variance about it), y = (x - mean) * rstd * w + b rounded once to
// y's dtype, which may be 16-bit where x is f32 (autocast: the matmul after
// the norm would cast it at once). One pass over memory each way instead of
// the composed path's dozen, and no temporaries the size of x.
//
// Rows are split over the backend's threads; each row's results depend on
// that row alone. The backward pass's weight and bias gradients are column
// sums over all rows: every block of rows (its size set by the row count
// alone) sums its own in f32, and the blocks' sums are added in order in
// double, so the bits do not depend on the thread count either.
#include <cmath>
#include <vector>

#include "tensor/cpu/cpu_kernels.h"
#include "tensor/cpu/cpu_rows.h"
#include "tensor/cpu/cpu_threads.h"

namespace mpt::cpu {
namespace {

ShapeDescription shape_of(const TensorView& v) { return ShapeDescription(v.shape, static_cast<size_t>(v.ndim)); }

// x viewed as [rows, d], and the checks every pass makes on it: x
// contiguous, weight and bias (where given) contiguous [d] of x's dtype,
// mean and rstd contiguous f32 [rows]; y_dtype the forward's output's and
// the backward's incoming gradient's.
struct Rows {
  int64_t rows = 0, d = 0;

  Rows(const char* op, const TensorView& x, DType y_dtype, std::initializer_list<const TensorView*> params,
       const TensorView& mean, const TensorView& rstd) {
    check<ShapeError>(x.ndim >= 1, "CPU {}: input must have a dimension", op);
    d = x.shape[x.ndim - 1];
    check<DTypeError>(fused_layer_norm_supported(x.dtype, y_dtype, d),
                      "CPU {}: the fused kernel takes f32/f16/bf16 rows, written in their own dtype or, from f32, "
                      "in f16/bf16; got {} {} to {}",
                      op, dtype_name(x.dtype), shape_of(x), dtype_name(y_dtype));
    check<ShapeError>(x.is_contiguous(), "CPU {}: needs a contiguous input (shape {})", op, shape_of(x));
    rows = x.numel() / d;
    for (const TensorView* p : params) {
      if (!p->data) continue;
      check<DTypeError>(p->dtype == x.dtype, "CPU {}: parameter dtype {} differs from the input's {}", op,
                        dtype_name(p->dtype), dtype_name(x.dtype));
      check<ShapeError>(p->numel() == d && p->is_contiguous(), "CPU {}: parameter {} does not fit input {}", op,
                        shape_of(*p), shape_of(x));
    }
    for (const TensorView* t : {&mean, &rstd})
      check<ShapeError>(t->dtype == DType::f32 && t->numel() == rows && t->is_contiguous(),
                        "CPU {}: mean and rstd must be contiguous f32 with one value per row of {}, got {} {}", op,
                        shape_of(x), dtype_name(t->dtype), shape_of(*t));
  }

  // Checks that t (where given) is contiguous, of dtype `dtype` and x's size.
  void check_like_x(const char* op, const TensorView& t, DType dtype, const TensorView& x) const {
    if (!t.data) return;
    check<DTypeError>(t.dtype == dtype, "CPU {}: {} operand given for a {} one", op, dtype_name(t.dtype),
                      dtype_name(dtype));
    check<ShapeError>(t.numel() == x.numel() && t.is_contiguous(),
                      "CPU {}: operand {} does not match input {} (or is not contiguous)", op, shape_of(t), shape_of(x));
  }
};

// A parameter ([d], x's dtype) in f32, or empty where absent.
template <typename T>
std::vector<float> param_f32(const TensorView& p, int64_t d) {
  std::vector<float> out;
  if (!p.data) return out;
  out.resize(static_cast<size_t>(d));
  const T* src = static_cast<const T*>(p.data);
  for (int64_t i = 0; i < d; ++i) out[i] = static_cast<float>(src[i]);
  return out;
}

// The row's mean and 1 / sqrt(variance + eps), as the GPU kernel computes
// them: the sum divided by d, then the squared deviations' sum by d.
struct RowStats {
  float mean, rstd;
};
RowStats row_stats(const float* x, int64_t d, float eps) {
  const float n = static_cast<float>(d);
  const float mean = row_sum(d, [x](int64_t i) { return x[i]; }) / n;
  const float var = row_sum(d, [x, mean](int64_t i) {
                      const float dev = x[i] - mean;
                      return dev * dev;
                    }) / n;
  return {mean, 1.0f / std::sqrt(var + eps)};
}

template <typename T, typename TY>
void forward_typed(const Rows& r, const TensorView& out, const TensorView& mean, const TensorView& rstd,
                   const TensorView& x, const TensorView& weight, const TensorView& bias, float eps) {
  const int64_t d = r.d;
  const std::vector<float> w = param_f32<T>(weight, d), b = param_f32<T>(bias, d);
  const T* xs = static_cast<const T*>(x.data);
  TY* ys = static_cast<TY*>(out.data);
  float* means = static_cast<float*>(mean.data);
  float* rstds = static_cast<float*>(rstd.data);
  parallel_for(r.rows, 1, units_for_work(kMinElementsPerPiece, d), [&](int64_t begin, int64_t end) {
    std::vector<float> xbuf(std::is_same_v<T, float> ? 0 : d), ybuf(std::is_same_v<TY, float> ? 0 : d);
    for (int64_t row = begin; row < end; ++row) {
      const float* __restrict xr = widen_row(xs + row * d, d, xbuf.data());
      const RowStats s = row_stats(xr, d, eps);
      float* __restrict y = f32_row(ys + row * d, ybuf.data());
      for (int64_t i = 0; i < d; ++i) y[i] = (xr[i] - s.mean) * s.rstd;
      // Separate multiply and add (no contraction: -ffp-contract=off), as
      // the GPU kernel rounds them.
      if (!w.empty())
        for (int64_t i = 0; i < d; ++i) y[i] *= w[i];
      if (!b.empty())
        for (int64_t i = 0; i < d; ++i) y[i] += b[i];
      store_row(ys + row * d, y, d);
      means[row] = s.mean;
      rstds[row] = s.rstd;
    }
  });
}

// Rows per block of the parameter-gradient sums: 64, or more where there
// are over 1024 blocks of 64 (which bounds the partial sums' memory).
int64_t rows_per_block(int64_t rows) { return std::max<int64_t>(64, (rows + 1023) / 1024); }

template <typename T, typename TY>
void backward_typed(const Rows& r, const TensorView& grad_x, const TensorView& grad_x_narrow,
                    const TensorView& grad_weight, const TensorView& grad_bias, const TensorView& grad_out,
                    const TensorView& grad_x_more, const TensorView& x, const TensorView& weight,
                    const TensorView& mean, const TensorView& rstd) {
  const int64_t d = r.d, rows = r.rows;
  const std::vector<float> w = param_f32<T>(weight, d);
  const T* xs = static_cast<const T*>(x.data);
  const TY* dys = static_cast<const TY*>(grad_out.data);
  const T* mores = static_cast<const T*>(grad_x_more.data);
  T* dxs = static_cast<T*>(grad_x.data);
  TY* narrows = static_cast<TY*>(grad_x_narrow.data);  // null, or (T f32, TY 16-bit) dx rounded to TY
  const float* means = static_cast<const float*>(mean.data);
  const float* rstds = static_cast<const float*>(rstd.data);
  const bool sums = grad_weight.data || grad_bias.data;
  const int64_t block = rows_per_block(rows), blocks = (rows + block - 1) / block;
  // Each block's column sums of dy * xhat (the weight's gradient) and of dy
  // (the bias's): [blocks, d] each, every block writing its own row.
  std::vector<float> partial_w(sums ? static_cast<size_t>(blocks * d) : 0);
  std::vector<float> partial_b(sums ? static_cast<size_t>(blocks * d) : 0);
  parallel_for(blocks, 1, units_for_work(kMinElementsPerPiece, block * d), [&](int64_t first, int64_t last) {
    const size_t n = static_cast<size_t>(d);
    std::vector<float> xbuf(std::is_same_v<T, float> ? 0 : n), dybuf(std::is_same_v<TY, float> ? 0 : n);
    std::vector<float> morebuf(mores && !std::is_same_v<T, float> ? n : 0);
    std::vector<float> dxbuf(std::is_same_v<T, float> ? 0 : n), xhat(n), g(w.empty() ? 0 : n);
    for (int64_t blk = first; blk < last; ++blk) {
      float* __restrict pw = sums ? partial_w.data() + blk * d : nullptr;
      float* __restrict pb = sums ? partial_b.data() + blk * d : nullptr;
      for (int64_t row = blk * block, end = std::min(rows, row + block); row < end; ++row) {
        const float* __restrict xr = widen_row(xs + row * d, d, xbuf.data());
        const float* __restrict dy = widen_row(dys + row * d, d, dybuf.data());
        const float m = means[row], rs = rstds[row];
        float* __restrict xh = xhat.data();
        for (int64_t i = 0; i < d; ++i) xh[i] = (xr[i] - m) * rs;
        if (sums) {
          for (int64_t i = 0; i < d; ++i) {
            pw[i] += dy[i] * xh[i];
            pb[i] += dy[i];
          }
        }
        // The gradient of xhat: dy * w.
        const float* __restrict gr = dy;
        if (!w.empty()) {
          for (int64_t i = 0; i < d; ++i) g[i] = dy[i] * w[i];
          gr = g.data();
        }
        const float n_f = static_cast<float>(d);
        const float mean_g = row_sum(d, [gr](int64_t i) { return gr[i]; }) / n_f;
        const float mean_gx = row_sum(d, [gr, xh](int64_t i) { return gr[i] * xh[i]; }) / n_f;
        float* __restrict dx = f32_row(dxs + row * d, dxbuf.data());
        for (int64_t i = 0; i < d; ++i) dx[i] = rs * (gr[i] - mean_g - xh[i] * mean_gx);
        if (mores) {
          // Added in f32 before the one rounding to x's dtype, as the GPU
          // kernel adds a pre-norm block's residual gradient.
          const float* __restrict more = widen_row(mores + row * d, d, morebuf.data());
          for (int64_t i = 0; i < d; ++i) dx[i] += more[i];
        }
        store_row(dxs + row * d, dx, d);
        if (narrows) store_row(narrows + row * d, dx, d);
      }
    }
  });
  for (const auto& [grad, partial] : {std::pair{&grad_weight, &partial_w}, std::pair{&grad_bias, &partial_b}}) {
    if (!grad->data) continue;
    std::vector<double> total(static_cast<size_t>(d), 0.0);
    for (int64_t blk = 0; blk < blocks; ++blk)
      for (int64_t i = 0; i < d; ++i) total[i] += static_cast<double>((*partial)[blk * d + i]);
    float* out = static_cast<float*>(grad->data);
    for (int64_t i = 0; i < d; ++i) out[i] = static_cast<float>(total[i]);
  }
}

// Calls f.template operator()<T, TY>() for x's dtype T and the output's
// (and incoming gradient's) TY; fused_layer_norm_supported has vouched for
// the pair.
template <typename F>
void dispatch(DType x_dtype, DType y_dtype, F&& f) {
  if (x_dtype == y_dtype) {
    switch (x_dtype) {
      case DType::f32: return f.template operator()<float, float>();
      case DType::f16: return f.template operator()<Half, Half>();
      default: return f.template operator()<BFloat16, BFloat16>();
    }
  }
  if (y_dtype == DType::f16) return f.template operator()<float, Half>();
  return f.template operator()<float, BFloat16>();
}

}  // namespace

bool fused_layer_norm_supported(DType dtype, DType out_dtype, int64_t d) {
  const bool sixteen = out_dtype == DType::f16 || out_dtype == DType::bf16;
  const bool dtypes = (dtype == DType::f32 || dtype == DType::f16 || dtype == DType::bf16) &&
                      (out_dtype == dtype || (dtype == DType::f32 && sixteen));
  return dtypes && d >= 1;
}

void layer_norm_forward(const TensorView& out, const TensorView& mean, const TensorView& rstd, const TensorView& x,
                        const TensorView& weight, const TensorView& bias, double eps) {
  const Rows r("layer_norm", x, out.dtype, {&weight, &bias}, mean, rstd);
  r.check_like_x("layer_norm", out, out.dtype, x);
  dispatch(x.dtype, out.dtype, [&]<typename T, typename TY>() {
    forward_typed<T, TY>(r, out, mean, rstd, x, weight, bias, static_cast<float>(eps));
  });
}

void layer_norm_backward(const TensorView& grad_x, const TensorView& grad_x_narrow, const TensorView& grad_weight,
                         const TensorView& grad_bias, const TensorView& grad_out, const TensorView& grad_x_more,
                         const TensorView& x, const TensorView& weight, const TensorView& mean,
                         const TensorView& rstd) {
  const Rows r("layer_norm backward", x, grad_out.dtype, {&weight}, mean, rstd);
  check<ShapeError>(grad_x.data && grad_out.data, "CPU layer_norm backward: needs grad_x and grad_out");
  r.check_like_x("layer_norm backward", grad_x, x.dtype, x);
  r.check_like_x("layer_norm backward", grad_out, grad_out.dtype, x);
  r.check_like_x("layer_norm backward", grad_x_more, x.dtype, x);
  check<DTypeError>(!grad_x_narrow.data || (x.dtype == DType::f32 && grad_out.dtype != DType::f32),
                    "CPU layer_norm backward: a narrow copy of the gradient needs f32 x and a 16-bit gradient, "
                    "got x {} and gradient {}",
                    dtype_name(x.dtype), dtype_name(grad_out.dtype));
  r.check_like_x("layer_norm backward", grad_x_narrow, grad_out.dtype, x);
  for (const TensorView* t : {&grad_weight, &grad_bias})
    check<ShapeError>(!t->data || (t->dtype == DType::f32 && t->numel() == r.d && t->is_contiguous()),
                      "CPU layer_norm backward: parameter gradients must be contiguous f32 [{}], got {} {}", r.d,
                      dtype_name(t->dtype), shape_of(*t));
  dispatch(x.dtype, grad_out.dtype, [&]<typename T, typename TY>() {
    backward_typed<T, TY>(r, grad_x, grad_x_narrow, grad_weight, grad_bias, grad_out, grad_x_more, x, weight, mean,
                          rstd);
  });
}

}  // namespace mpt::cpu
