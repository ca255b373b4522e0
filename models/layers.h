#pragma once
// The standard layers, each a thin Module around one differentiable op of
// autograd/ops.h. Constructors take an optional Generator (the thread's
// default when null) and initialise exactly as PyTorch does in
// distribution, drawing weight first, then bias, as PyTorch does.
// Layers are built on the CPU; Module::to() moves them.
#include <memory>
#include <optional>

#include "amp/fp8_linear.h"
#include "autograd/ops.h"
#include "models/module.h"

namespace mpt::nn {

// y = x W^T + b. weight [out, in], bias [out]; both U(-1/sqrt(in), 1/sqrt(in)).
class Linear : public Module {
 public:
  Linear(int64_t in_features, int64_t out_features, bool bias = true, Generator* gen = nullptr);
  Tensor forward(const Tensor& x) override;
  Tensor forward_relu(const Tensor& x);  // relu(forward(x)) as one op (linear_relu)

  int64_t in_features, out_features;
  Tensor weight, bias;  // bias undefined when built without one
  // Set (by train::MixedPrecision for Precision::fp8): the products run in
  // FP8 (amp/fp8_linear.h) in forwards under amp::Fp8Guard with grad on.
  std::shared_ptr<amp::Fp8LinearState> fp8;

  bool runs_fp8() const;  // fp8 set, inside an amp::Fp8Guard, grad mode on
};

// out(gelu(fc(x))), a transformer's MLP: where both layers run in FP8 and
// allow it (Fp8LinearState::fused_mlp), as one amp::fp8_mlp (GELU folded
// into the FP8 quantizations around it), else as the three ops.
Tensor linear_gelu_linear(Linear& fc, Linear& out, const Tensor& x, GeluApprox approx = GeluApprox::none);

// NCHW convolution with a square kernel. weight [out, in, k, k], bias
// [out]; both U(-1/sqrt(in*k*k), 1/sqrt(in*k*k)).
class Conv2d : public Module {
 public:
  Conv2d(int64_t in_channels, int64_t out_channels, int64_t kernel_size, int64_t stride = 1, int64_t padding = 0,
         bool bias = true, Generator* gen = nullptr);
  Tensor forward(const Tensor& x) override;

  int64_t in_channels, out_channels, kernel_size;
  Conv2dParams geometry;
  Tensor weight, bias;
};

// Normalises over the last dimension (size d); weight 1, bias 0.
class LayerNorm : public Module {
 public:
  explicit LayerNorm(int64_t d, double eps = 1e-5);
  Tensor forward(const Tensor& x) override;
  // The norm of x written in the dtype autocast gives an input of
  // `consumer` (an op name, such as "linear"): what that op would cast it
  // to at once, without the cast's kernel each way or the wide copy.
  Tensor forward_into(const char* consumer, const Tensor& x);
  // {x, forward_into(consumer, x)} for a pre-norm residual block, whose
  // backward adds x's two gradients inside the norm's kernel
  // (layer_norm_with_skip): use the first result for the residual sum.
  std::pair<Tensor, Tensor> forward_with_skip(const char* consumer, const Tensor& x);

  int64_t d;
  double eps;
  Tensor weight, bias;
};

// Rows of a [num, dim] table, N(0, 1); the input is i64 indices of any shape.
class Embedding : public Module {
 public:
  Embedding(int64_t num_embeddings, int64_t embedding_dim, Generator* gen = nullptr);
  Tensor forward(const Tensor& indices) override;

  int64_t num_embeddings, embedding_dim;
  Tensor weight;
};

// Active only in training mode. Keeps its generator pointer (null: the
// thread's default), so seeded runs drop the same elements, and a
// checkpoint of that generator (ckpt::capture) resumes the same masks; the
// generator must outlive the module.
class Dropout : public Module {
 public:
  explicit Dropout(double p = 0.5, Generator* gen = nullptr);
  Tensor forward(const Tensor& x) override;

  double p;

 private:
  Generator* gen_;
};

class ReLU : public Module {
 public:
  ReLU() : Module("ReLU") {}
  Tensor forward(const Tensor& x) override { return relu(x); }
};

class SiLU : public Module {
 public:
  SiLU() : Module("SiLU") {}
  Tensor forward(const Tensor& x) override { return silu(x); }
};

class Tanh : public Module {
 public:
  Tanh() : Module("Tanh") {}
  Tensor forward(const Tensor& x) override { return tanh(x); }
};

class Sigmoid : public Module {
 public:
  Sigmoid() : Module("Sigmoid") {}
  Tensor forward(const Tensor& x) override { return sigmoid(x); }
};

class GELU : public Module {
 public:
  explicit GELU(GeluApprox approx = GeluApprox::none) : Module("GELU"), approx(approx) {}
  Tensor forward(const Tensor& x) override { return gelu(x, approx); }

  GeluApprox approx;
};

// Max pooling with a square window; the stride defaults to the kernel size
// (PyTorch's default).
class MaxPool2d : public Module {
 public:
  explicit MaxPool2d(int64_t kernel_size, std::optional<int64_t> stride = std::nullopt, int64_t padding = 0);
  Tensor forward(const Tensor& x) override;

  Pool2dParams geometry;
};

// Flattens dimensions start_dim.. into one ([N, C, H, W] -> [N, C*H*W]).
class Flatten : public Module {
 public:
  explicit Flatten(int64_t start_dim = 1) : Module("Flatten"), start_dim(start_dim) {}
  Tensor forward(const Tensor& x) override { return flatten(x, start_dim); }

  int64_t start_dim;
};

}  // namespace mpt::nn
