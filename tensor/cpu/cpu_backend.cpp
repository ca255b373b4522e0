// The CPU backend: fill, copy and casts, random numbers and ranges here; the
// arithmetic in cpu_elementwise.cpp, cpu_reduce.cpp and cpu_gemm.cpp.
#include "tensor/cpu/cpu_backend.h"

#include <atomic>
#include <cstring>

#include "tensor/cpu/cpu_kernels.h"
#include "tensor/philox.h"

namespace mpt {
namespace {

using cpu::dispatch_all;
using cpu::for_each_row;

// Converts through double, except: one type to itself moves the bits, as
// the GPU's strided copies do (a round trip through float would make every
// 16-bit or float8 NaN the canonical one); from float or a narrower float
// (exact in float) through float, as float -> 16-bit or float8 must round
// once from the float (double rounding could differ from the GPU's); and
// integer -> integer, which must not lose bits above 2^53. A cast to float8
// does not saturate (fp8.h).
template <typename D, typename S>
D convert(S v) {
  if constexpr (std::is_same_v<D, S>) {
    return v;
  } else if constexpr (std::is_integral_v<S> && std::is_integral_v<D>) {
    return static_cast<D>(v);
  } else if constexpr (std::is_same_v<S, float> || std::is_same_v<S, Half> || std::is_same_v<S, BFloat16> ||
                       std::is_same_v<S, Float8E4M3> || std::is_same_v<S, Float8E5M2>) {
    return static_cast<D>(static_cast<float>(v));
  } else {
    return static_cast<D>(static_cast<double>(v));
  }
}

template <typename D>
void fill_typed(const TensorView& out, double value) {
  const D v = static_cast<D>(value);
  D* o = static_cast<D*>(out.data);
  for_each_row<1>(out, {out.strides}, [&](auto off, int64_t n, auto st) {
    for (int64_t i = 0; i < n; ++i) o[off[0] + i * st[0]] = v;
  });
}

template <typename F>
void generate(const TensorView& out, F value_at) {
  dispatch_all(out.dtype, [&](auto tag) {
    using T = decltype(tag);
    T* o = static_cast<T*>(out.data);
    const int64_t n = out.numel();
    for (int64_t i = 0; i < n; ++i) o[i] = static_cast<T>(value_at(i));
  });
}

class CpuBackend final : public Backend {
 public:
  void fill(const TensorView& out, double value) override {
    dispatch_all(out.dtype, [&](auto tag) { fill_typed<decltype(tag)>(out, value); });
  }

  void copy(const TensorView& dst, const TensorView& src) override {
    if (dst.dtype == src.dtype && dst.is_contiguous() && src.is_contiguous()) {
      std::memcpy(dst.data, src.data, static_cast<size_t>(dst.numel()) * dtype_size(dst.dtype));
      return;
    }
    if (cpu::cast_dense(dst, src)) return;
    dispatch_all(dst.dtype, [&](auto dtag) {
      dispatch_all(src.dtype, [&](auto stag) {
        using D = decltype(dtag);
        using S = decltype(stag);
        D* d = static_cast<D*>(dst.data);
        const S* s = static_cast<const S*>(src.data);
        for_each_row<2>(dst, {dst.strides, src.strides}, [&](auto off, int64_t n, auto st) {
          for (int64_t i = 0; i < n; ++i) d[off[0] + i * st[0]] = convert<D>(s[off[1] + i * st[1]]);
        });
      });
    });
  }

  void scaled_copy_list(const std::vector<TensorView>& dsts, const std::vector<TensorView>& srcs,
                        double scale) override {
    cpu::scaled_copy_list(dsts, srcs, scale);
  }

  void unary(UnaryOp op, const TensorView& out, const TensorView& in, double alpha, double beta) override {
    cpu::unary(op, out, in, alpha, beta);
  }
  void binary(BinaryOp op, const TensorView& out, const TensorView& a, const TensorView& b) override {
    cpu::binary(op, out, a, b);
  }
  void reduce(ReduceOp op, const TensorView& out, const TensorView& in, int64_t outer, int64_t k,
              int64_t inner) override {
    cpu::reduce(op, out, in, outer, k, inner);
  }
  void gemm(const GemmArgs& args) override { cpu::gemm(args); }

  // A draw that rounds up to `high` in the tensor's floating dtype becomes
  // `low`, as in PyTorch, so that every value lies in [low, high).
  void uniform(const TensorView& out, uint64_t seed, uint64_t offset, double low, double high) override {
    const bool floating = is_floating(out.dtype);
    dispatch_all(out.dtype, [&](auto tag) {
      using T = decltype(tag);
      T* o = static_cast<T*>(out.data);
      for (int64_t i = 0, n = out.numel(); i < n; ++i) {
        const T v = static_cast<T>(philox_uniform_at(seed, offset, i) * (high - low) + low);
        o[i] = floating && static_cast<double>(v) >= high ? static_cast<T>(low) : v;
      }
    });
  }
  void normal(const TensorView& out, uint64_t seed, uint64_t offset, double mean, double stddev) override {
    generate(out, [&](int64_t i) { return philox_normal_at(seed, offset, i) * stddev + mean; });
  }
  void arange(const TensorView& out, double start, double step) override {
    generate(out, [&](int64_t i) { return start + static_cast<double>(i) * step; });
  }

  void index_select_rows(const TensorView& out, const TensorView& table, const TensorView& idx) override {
    cpu::index_select_rows(out, table, idx);
  }
  void index_add_rows(const TensorView& table, const TensorView& idx, const TensorView& src) override {
    cpu::index_add_rows(table, idx, src);
  }
  void conv2d_forward(const TensorView& out, const TensorView& x, const TensorView& w,
                      const Conv2dParams& p) override {
    cpu::conv2d_forward(out, x, w, p);
  }
  void conv2d_backward_data(const TensorView& grad_x, const TensorView& grad_out, const TensorView& w,
                            const Conv2dParams& p) override {
    cpu::conv2d_backward_data(grad_x, grad_out, w, p);
  }
  void conv2d_backward_weight(const TensorView& grad_w, const TensorView& x, const TensorView& grad_out,
                              const Conv2dParams& p) override {
    cpu::conv2d_backward_weight(grad_w, x, grad_out, p);
  }
  void max_pool2d_forward(const TensorView& out, const TensorView& indices, const TensorView& x,
                          const Pool2dParams& p) override {
    cpu::max_pool2d_forward(out, indices, x, p);
  }
  void max_pool2d_backward(const TensorView& grad_x, const TensorView& grad_out, const TensorView& indices,
                           const Pool2dParams&) override {
    cpu::max_pool2d_backward(grad_x, grad_out, indices);
  }
  // Fused layer norm and cross-entropy: f64 is left to the composed path
  // (cpu_kernels.h says why), as is everything while they are switched off.
  bool fused_layer_norm_supported(DType dtype, DType out_dtype, int64_t d) const override {
    return cpu::fused_kernels() && cpu::fused_layer_norm_supported(dtype, out_dtype, d);
  }
  void layer_norm_forward(const TensorView& out, const TensorView& mean, const TensorView& rstd, const TensorView& x,
                          const TensorView& weight, const TensorView& bias, double eps) override {
    cpu::layer_norm_forward(out, mean, rstd, x, weight, bias, eps);
  }
  void layer_norm_backward(const TensorView& grad_x, const TensorView& grad_x_narrow, const TensorView& grad_weight,
                           const TensorView& grad_bias, const TensorView& grad_out, const TensorView& grad_x_more,
                           const TensorView& x, const TensorView& weight, const TensorView& mean,
                           const TensorView& rstd) override {
    cpu::layer_norm_backward(grad_x, grad_x_narrow, grad_weight, grad_bias, grad_out, grad_x_more, x, weight, mean,
                             rstd);
  }
  bool fused_cross_entropy_supported(DType dtype) const override {
    return cpu::fused_kernels() && cpu::fused_cross_entropy_supported(dtype);
  }
  void cross_entropy_forward(const TensorView& loss, const TensorView& lse, const TensorView& valid,
                             const TensorView& logits, const TensorView& target, int64_t ignore_index) override {
    cpu::cross_entropy_forward(loss, lse, valid, logits, target, ignore_index);
  }
  void cross_entropy_backward(const TensorView& grad, const TensorView& logits, const TensorView& target,
                              const TensorView& lse, const TensorView& row_scale) override {
    cpu::cross_entropy_backward(grad, logits, target, lse, row_scale);
  }
  void quantize_fp8(const Fp8QuantizeArgs& args) override { cpu::quantize_fp8(args); }
  void gemm_fp8(const Fp8GemmArgs& args) override { cpu::gemm_fp8(args); }
  void amax_into(const TensorView& amax, const TensorView& in) override { cpu::amax_into(amax, in); }
  bool fused_attention_supported(DType dtype, int64_t) const override {
    return cpu::fused_kernels() && cpu::attention_supported(dtype);
  }
  void attention_forward(const TensorView& out, const TensorView& lse, const TensorView& q, const TensorView& k,
                         const TensorView& v, bool causal, double scale) override {
    cpu::attention_forward(out, lse, q, k, v, causal, scale);
  }
  void attention_backward(const TensorView& grad_q, const TensorView& grad_k, const TensorView& grad_v,
                          const TensorView& delta, const TensorView& q, const TensorView& k, const TensorView& v,
                          const TensorView& out, const TensorView& lse, const TensorView& grad_out, bool causal,
                          double scale) override {
    cpu::attention_backward(grad_q, grad_k, grad_v, delta, q, k, v, out, lse, grad_out, causal, scale);
  }
};

// Read by every *_supported call, so relaxed atomic loads: a program sets it
// between steps (a benchmark, say), not while ops run.
std::atomic<bool> fused_kernels_on{true};

}  // namespace

namespace cpu {
void set_fused_kernels(bool on) { fused_kernels_on.store(on, std::memory_order_relaxed); }
bool fused_kernels() { return fused_kernels_on.load(std::memory_order_relaxed); }
}  // namespace cpu

Backend& cpu_backend() {
  static CpuBackend backend;
  return backend;
}

}  // namespace mpt
