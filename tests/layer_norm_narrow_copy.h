#pragma once
// The 16-bit copy of the gradient that the fused layer norm's backward
// leaves with its f32 result (Storage::NarrowCopy), checked on one device:
// the CPU's and the GPU's tests both call it.
#include <gtest/gtest.h>

#include <vector>

#include "tensor/ops.h"
#include "tensor/random.h"
#include "tests/test_util.h"

namespace mpt::testing {

// Backward of an f32 x normalised into `out` (f16 or bf16) on `device`, over
// rows of d (with a skip gradient added in where with_more): the cast of the
// gradient to `out` takes the kernel's copy, which holds the cast's bits,
// and takes it once; a gradient written in place since is cast afresh.
inline void check_layer_norm_narrow_copy(const Device& device, Generator& gen, int64_t rows, int64_t d, DType out,
                                         bool with_more) {
  SCOPED_TRACE(::testing::Message() << device.str() << ": f32 -> " << dtype_name(out) << ", " << rows
                                    << " rows of " << d << (with_more ? ", grad_x_more" : ""));
  auto draw = [&](const Shape& s, DType dt) {
    return prim::to(prim::to(randn(s, DType::f32, kCPU, &gen), dt), device);
  };
  const Tensor x = draw({rows, d}, DType::f32), w = draw({d}, DType::f32), b = draw({d}, DType::f32);
  const Tensor dy = draw({rows, d}, out), more = with_more ? draw({rows, d}, DType::f32) : Tensor();
  ASSERT_TRUE(prim::fused_layer_norm_available(x, w, b, out));
  const std::vector<Tensor> fwd = prim::layer_norm_forward(x, w, b, 1e-5, out);
  auto backward_x = [&] { return prim::layer_norm_backward(dy, x, w, fwd[1], fwd[2], true, true, more)[0]; };

  // The cast of a clone, which carries no copy, is the cast kernel's.
  const Tensor gx = backward_x();
  const std::vector<double> cast = host_f64(prim::to(prim::clone(gx), out));
  const Tensor taken = prim::to(gx, out);
  EXPECT_EQ(taken.dtype(), out);
  EXPECT_EQ(taken.shape(), gx.shape());
  EXPECT_EQ(host_f64(taken), cast) << "the kernel's copy against the cast";
  EXPECT_EQ(gx.storage()->take_narrow_copy(out, gx.offset(), gx.numel()), nullptr) << "the cast did not take it";
  EXPECT_EQ(host_f64(prim::to(gx, out)), cast) << "a second cast";

  // Asked for in another dtype, or for part of the gradient, it stays.
  const Tensor again = backward_x();
  const DType other = out == DType::f16 ? DType::bf16 : DType::f16;
  EXPECT_EQ(again.storage()->take_narrow_copy(other, again.offset(), again.numel()), nullptr);
  EXPECT_EQ(host_f64(prim::to(prim::slice(again, 0, 1, rows), out)),
            std::vector<double>(cast.begin() + d, cast.end()));
  EXPECT_NE(again.storage()->take_narrow_copy(out, again.offset(), again.numel()), nullptr);

  // Written in place since the kernel: the copy no longer holds its values.
  const Tensor written = backward_x();
  prim::fill_(written, 0.25);
  EXPECT_EQ(host_f64(prim::to(written, out)), std::vector<double>(static_cast<size_t>(rows * d), 0.25));
}

}  // namespace mpt::testing
