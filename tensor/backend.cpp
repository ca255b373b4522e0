#include "tensor/backend.h"

#include "tensor/cpu/cpu_backend.h"
#include "tensor/error.h"
#ifdef MPT_WITH_CUDA
#include "tensor/cuda/cuda_backend.h"
#endif

namespace mpt {

Backend& backend_for(const Device& d) {
  if (d.is_cpu()) return cpu_backend();
#ifdef MPT_WITH_CUDA
  check_device_available(d);
  return cuda_backend();
#else
  throw DeviceError(fmt::format("{} requested, but this build of mptrain has no CUDA support", d.str()));
#endif
}

void check_gemm_epilogues(const GemmArgs& g) {
  auto check_vector = [&](const TensorView& v, int64_t size, const char* name) {
    if (!v.data) return;
    check<ShapeError>(g.out.shape[0] == 1 && g.beta == 0.0f,
                      "gemm: the {} epilogue needs a single product with beta 0 (batch {}, beta {})", name,
                      g.out.shape[0], g.beta);
    check<DTypeError>(v.dtype == g.out.dtype, "gemm: {} is {}, the product {}", name, dtype_name(v.dtype),
                      dtype_name(g.out.dtype));
    check<ShapeError>(v.ndim == 1 && v.shape[0] == size && (size == 1 || v.strides[0] == 1),
                      "gemm: {} must be a contiguous vector of {} elements, got {} dimensions and {} elements", name,
                      size, v.ndim, v.numel());
  };
  check_vector(g.bias, g.out.shape[2], "bias");
  check_vector(g.bias_grad, g.out.shape[1], "bias_grad");
  check<ValueError>(!(g.relu && g.bias_grad.data), "gemm: the relu epilogue does not go with bias_grad");
}

namespace {
[[noreturn]] void not_available(const char* op) {
  throw NotAvailableError(fmt::format("{} is not implemented on this device's backend", op));
}
}  // namespace

void Backend::index_select_rows(const TensorView&, const TensorView&, const TensorView&) {
  not_available("index_select_rows");
}
void Backend::index_add_rows(const TensorView&, const TensorView&, const TensorView&) {
  not_available("index_add_rows");
}
void Backend::conv2d_forward(const TensorView&, const TensorView&, const TensorView&, const Conv2dParams&) {
  not_available("conv2d");
}
void Backend::conv2d_backward_data(const TensorView&, const TensorView&, const TensorView&, const Conv2dParams&) {
  not_available("conv2d backward (data)");
}
void Backend::conv2d_backward_weight(const TensorView&, const TensorView&, const TensorView&, const Conv2dParams&) {
  not_available("conv2d backward (weight)");
}
void Backend::max_pool2d_forward(const TensorView&, const TensorView&, const TensorView&, const Pool2dParams&) {
  not_available("max_pool2d");
}
void Backend::max_pool2d_backward(const TensorView&, const TensorView&, const TensorView&, const Pool2dParams&) {
  not_available("max_pool2d backward");
}

#define MPT_OP_NAME(enumerator, name) name,
const char* unary_op_name(UnaryOp op) {
  static constexpr const char* kNames[] = {MPT_UNARY_OPS(MPT_OP_NAME)};
  return kNames[static_cast<int>(op)];
}

const char* binary_op_name(BinaryOp op) {
  static constexpr const char* kNames[] = {MPT_BINARY_OPS(MPT_OP_NAME)};
  return kNames[static_cast<int>(op)];
}

const char* reduce_op_name(ReduceOp op) {
  static constexpr const char* kNames[] = {MPT_REDUCE_OPS(MPT_OP_NAME)};
  return kNames[static_cast<int>(op)];
}
#undef MPT_OP_NAME

void Backend::layer_norm_forward(const TensorView&, const TensorView&, const TensorView&, const TensorView&,
                                 const TensorView&, const TensorView&, double) {
  not_available("fused layer_norm");
}
void Backend::layer_norm_backward(const TensorView&, const TensorView&, const TensorView&, const TensorView&,
                                  const TensorView&, const TensorView&, const TensorView&, const TensorView&,
                                  const TensorView&, const TensorView&) {
  not_available("fused layer_norm backward");
}
void Backend::batch_norm_forward(const TensorView&, const TensorView&, const TensorView&, const TensorView&,
                                 const TensorView&, const TensorView&, const TensorView&, const TensorView&, bool,
                                 double, double) {
  not_available("fused batch_norm");
}
void Backend::batch_norm_backward(const TensorView&, const TensorView&, const TensorView&, const TensorView&,
                                  const TensorView&, const TensorView&, const TensorView&, const TensorView&, bool) {
  not_available("fused batch_norm backward");
}
void Backend::cross_entropy_forward(const TensorView&, const TensorView&, const TensorView&, const TensorView&,
                                    const TensorView&, int64_t) {
  not_available("fused cross_entropy");
}
void Backend::cross_entropy_backward(const TensorView&, const TensorView&, const TensorView&, const TensorView&,
                                     const TensorView&) {
  not_available("fused cross_entropy backward");
}
void Backend::scaled_copy_list(const std::vector<TensorView>&, const std::vector<TensorView>&, double) {
  not_available("multi-tensor scaled copy");
}
void Backend::attention_forward(const TensorView&, const TensorView&, const TensorView&, const TensorView&,
                                const TensorView&, bool, double) {
  not_available("fused attention");
}
void Backend::attention_backward(const TensorView&, const TensorView&, const TensorView&, const TensorView&,
                                 const TensorView&, const TensorView&, const TensorView&, const TensorView&,
                                 const TensorView&, const TensorView&, bool, double) {
  not_available("fused attention backward");
}
void Backend::quantize_fp8(const Fp8QuantizeArgs&) { not_available("FP8 quantization"); }

UnaryOp fp8_prologue_unary(Fp8Prologue p) {
  check(p == Fp8Prologue::gelu_erf || p == Fp8Prologue::gelu_tanh, "fp8_prologue_unary: {} is not a unary op",
        fp8_prologue_name(p));
  return p == Fp8Prologue::gelu_erf ? UnaryOp::gelu_erf : UnaryOp::gelu_tanh;
}

BinaryOp fp8_prologue_binary(Fp8Prologue p) {
  switch (p) {
    case Fp8Prologue::relu_backward: return BinaryOp::relu_backward;
    case Fp8Prologue::gelu_erf_backward: return BinaryOp::gelu_erf_backward;
    case Fp8Prologue::gelu_tanh_backward: return BinaryOp::gelu_tanh_backward;
    default: throw Error(fmt::format("fp8_prologue_binary: {} is not a binary op", fp8_prologue_name(p)));
  }
}

const char* fp8_prologue_name(Fp8Prologue p) {
  switch (p) {
    case Fp8Prologue::none: return "none";
    case Fp8Prologue::relu_backward: return "relu_backward";
    case Fp8Prologue::gelu_erf: return "gelu_erf";
    case Fp8Prologue::gelu_tanh: return "gelu_tanh";
    case Fp8Prologue::gelu_erf_backward: return "gelu_erf_backward";
    case Fp8Prologue::gelu_tanh_backward: return "gelu_tanh_backward";
  }
  return "?";
}
void Backend::gemm_fp8(const Fp8GemmArgs&) { not_available("FP8 GEMM"); }
void Backend::amax_into(const TensorView&, const TensorView&) { not_available("amax"); }

}  // namespace mpt
