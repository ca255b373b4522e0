#include "amp/autocast_policy.h"

#include <array>
#include <utility>

namespace mpt::amp {
namespace {

// Op names as the autograd ops pass them to the autocast hook.
// Binary arithmetic is not listed (as in PyTorch): the ops promote mixed
// inputs themselves, and the GPU widens a 16-bit input as it loads it
// instead of casting it in a pass of its own.
constexpr std::array<std::pair<std::string_view, CastPolicy>, 15> kPolicies{{
    // Tensor-core ops: 16-bit inputs, f32 accumulation inside the GEMM.
    {"matmul", CastPolicy::lower_precision},
    {"bmm", CastPolicy::lower_precision},
    {"linear", CastPolicy::lower_precision},
    {"linear_relu", CastPolicy::lower_precision},
    {"conv2d", CastPolicy::lower_precision},
    {"scaled_dot_product_attention", CastPolicy::lower_precision},
    // Range-hungry or accumulation-heavy ops.
    {"exp", CastPolicy::fp32},
    {"log", CastPolicy::fp32},
    {"pow", CastPolicy::fp32},
    {"softmax", CastPolicy::fp32},
    {"log_softmax", CastPolicy::fp32},
    {"layer_norm", CastPolicy::fp32},
    {"mse_loss", CastPolicy::fp32},
    {"sum", CastPolicy::fp32},
    // Not listed, unlike PyTorch's fp32 list: cross_entropy. It computes in
    // f32 from logits of any floating dtype and returns an f32 loss, so a
    // cast would give the same loss and gradient and only cost an f32 copy
    // of the logits (N x vocabulary: 1.6 GB for 8192 tokens of GPT-2's 50257
    // words) and its cast back in backward.
    // Several inputs of possibly mixed dtypes.
    {"cat", CastPolicy::promote},
}};

}  // namespace

CastPolicy autocast_policy(std::string_view op) {
  for (const auto& [name, policy] : kPolicies)
    if (name == op) return policy;
  return CastPolicy::none;
}

}  // namespace mpt::amp
