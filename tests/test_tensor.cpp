// Tensor basics: layout, views sharing storage, host round trips, errors.
#include <gtest/gtest.h>

#include <cstdlib>
#include <limits>
#include <sstream>

#include "tensor/cuda_info.h"
#include "tensor/environment.h"
#include "tensor/gpu_timeline.h"
#include "tensor/ops.h"
#include "tensor/pinned.h"
#include "tests/test_util.h"

namespace mpt {
namespace {

TEST(GpuTimeline, NeedsACudaDeviceAndStampsNothingWhenNoneIsActive) {
  EXPECT_THROW(GpuTimeline{kCPU}, DeviceError);
  EXPECT_EQ(GpuTimeline::active(), nullptr);
  gpu_stamp(kCPU, "nothing to stamp on");  // no timeline: does nothing, on any build
}

TEST(Tensor, EmptyHasContiguousLayout) {
  Tensor t = Tensor::empty({2, 3, 4}, DType::f16);
  EXPECT_EQ(t.shape(), (Shape{2, 3, 4}));
  EXPECT_EQ(t.strides(), (Shape{12, 4, 1}));
  EXPECT_EQ(t.numel(), 24);
  EXPECT_EQ(t.nbytes(), 48u);
  EXPECT_TRUE(t.is_contiguous());
  EXPECT_EQ(reinterpret_cast<uintptr_t>(t.data_ptr()) % 64, 0u);
  EXPECT_EQ(t.device(), kCPU);
}

TEST(Tensor, PinnedTensorsAreCpuTensors) {
  // Pinned where a GPU exists, plain host memory elsewhere; a CPU tensor either way.
  const Tensor src = arange(0, 1000, 1, DType::f32);
  const Tensor p = pin_memory(src);
  EXPECT_EQ(p.device(), kCPU);
  EXPECT_EQ(is_pinned(p), cuda_device_count() > 0);
  EXPECT_EQ(p.to_vector<float>(), src.to_vector<float>());
}

TEST(Tensor, FromVectorRoundTripsEveryDType) {
  const std::vector<double> values{-3, -1.5, 0, 0.25, 2, 100};
  for (DType dt : {DType::f32, DType::f64, DType::f16, DType::bf16}) {
    Tensor t = from_vector(values, {2, 3}, dt);
    EXPECT_EQ(t.dtype(), dt);
    EXPECT_EQ(t.to_vector<double>(), values) << dtype_name(dt);
  }
  Tensor i = from_vector(std::vector<int64_t>{1, -2, 3}, {3}, DType::i32);
  EXPECT_EQ(i.to_vector<int64_t>(), (std::vector<int64_t>{1, -2, 3}));
  EXPECT_THROW(from_vector(values, {4, 2}, DType::f32), ShapeError);
}

TEST(Tensor, TypedAccessChecksTheDType) {
  Tensor t = zeros({3});
  EXPECT_NO_THROW(t.data<float>());
  EXPECT_THROW(t.data<double>(), DTypeError);
  EXPECT_DOUBLE_EQ(full({}, 2.5).item(), 2.5);
  EXPECT_THROW(zeros({2}).item(), ShapeError);
  EXPECT_THROW(Tensor().shape(), ValueError);
}

TEST(Tensor, ViewsShareStorage) {
  Tensor t = arange(0, 12);
  Tensor v = prim::view(t, {3, 4});
  Tensor tr = prim::transpose(v, 0, 1);
  EXPECT_EQ(tr.shape(), (Shape{4, 3}));
  EXPECT_EQ(tr.strides(), (Shape{1, 4}));
  EXPECT_FALSE(tr.is_contiguous());
  EXPECT_EQ(tr.storage(), t.storage());
  EXPECT_EQ(tr.to_vector<float>(), (std::vector<float>{0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11}));
  // Writing through a slice shows in the base.
  Tensor col = prim::slice(v, 1, 1, 2);
  prim::fill_(col, -1);
  EXPECT_EQ(t.to_vector<float>(), (std::vector<float>{0, -1, 2, 3, 4, -1, 6, 7, 8, -1, 10, 11}));
}

TEST(Tensor, ViewRefusesIncompatibleStridesButReshapeCopies) {
  Tensor t = prim::transpose(prim::view(arange(0, 6), {2, 3}), 0, 1);  // [3, 2], strides [1, 3]
  EXPECT_THROW(prim::view(t, {6}), ShapeError);
  Tensor r = prim::reshape(t, {6});
  EXPECT_NE(r.storage(), t.storage());
  EXPECT_EQ(r.to_vector<float>(), (std::vector<float>{0, 3, 1, 4, 2, 5}));
  EXPECT_EQ(prim::view(arange(0, 24), {2, -1, 4}).shape(), (Shape{2, 3, 4}));
  EXPECT_THROW(prim::view(arange(0, 24), {5, -1}), ShapeError);
  // A view that splits and merges dimensions of a strided tensor.
  Tensor base = prim::slice(prim::view(arange(0, 48), {4, 12}), 0, 0, 4, 2);  // [2, 12], row stride 24
  Tensor s = prim::view(base, {2, 3, 4});
  EXPECT_EQ(s.strides(), (Shape{24, 4, 1}));
  EXPECT_EQ(s.storage(), base.storage());
}

TEST(Tensor, PermuteExpandSqueeze) {
  Tensor t = prim::view(arange(0, 24), {2, 3, 4});
  Tensor p = prim::permute(t, {2, 0, 1});
  EXPECT_EQ(p.shape(), (Shape{4, 2, 3}));
  EXPECT_EQ(prim::contiguous(p).to_vector<float>()[1], 4.0f);
  EXPECT_THROW(prim::permute(t, {0, 0, 1}), ShapeError);
  Tensor e = prim::expand(prim::view(arange(0, 3), {3, 1}), {2, 3, 4});
  EXPECT_EQ(e.strides(), (Shape{0, 1, 0}));
  EXPECT_EQ(prim::sum(e).item(), 24.0);
  EXPECT_THROW(prim::expand(arange(0, 3), {4}), ShapeError);
  Tensor u = prim::unsqueeze(arange(0, 3), 0);
  EXPECT_EQ(u.shape(), (Shape{1, 3}));
  EXPECT_EQ(prim::squeeze(u, 0).shape(), (Shape{3}));
  EXPECT_EQ(prim::unsqueeze(arange(0, 3), -1).shape(), (Shape{3, 1}));
}

TEST(Tensor, SliceWithStepAndNegativeBounds) {
  Tensor t = arange(0, 10);
  EXPECT_EQ(prim::slice(t, 0, 1, 8, 3).to_vector<float>(), (std::vector<float>{1, 4, 7}));
  EXPECT_EQ(prim::slice(t, 0, -3, 10).to_vector<float>(), (std::vector<float>{7, 8, 9}));
  EXPECT_EQ(prim::slice(t, 0, 5, 2).numel(), 0);
  // A step beyond the length takes the first element only (end - start + step would overflow).
  const int64_t huge = std::numeric_limits<int64_t>::max();
  EXPECT_EQ(prim::slice(t, 0, 2, 10, huge).to_vector<float>(), (std::vector<float>{2}));
  EXPECT_EQ(prim::slice(t, 0, 2, 3, huge - 1).to_vector<float>(), (std::vector<float>{2}));
  EXPECT_THROW(prim::slice(t, 1, 0, 1), ShapeError);
}

// Slices that lie side by side in one contiguous block join back into a
// view of it; anything else (other storage, another order, a gap, strides
// of a non-contiguous block, a missing part) is refused.
TEST(Tensor, JoinedSlicesViewTheBlockTheyLieIn) {
  const Tensor block = prim::view(arange(0, 24), {2, 3, 4});
  std::vector<Tensor> parts{prim::slice(block, 2, 0, 2), prim::slice(block, 2, 2, 4)};
  const std::optional<Tensor> joined = prim::joined_slices(parts, 2, 2, {2, 3, 4});
  ASSERT_TRUE(joined.has_value());
  EXPECT_EQ(joined->storage(), block.storage());
  EXPECT_EQ(joined->to_vector<float>(), block.to_vector<float>());
  // A ragged last part (split's size does not divide the length).
  const std::optional<Tensor> ragged =
      prim::joined_slices({prim::slice(block, 2, 0, 3), prim::slice(block, 2, 3, 4)}, 2, 3, {2, 3, 4});
  ASSERT_TRUE(ragged.has_value());
  EXPECT_EQ(ragged->to_vector<float>(), block.to_vector<float>());
  // Refused.
  EXPECT_FALSE(prim::joined_slices({parts[1], parts[0]}, 2, 2, {2, 3, 4}));
  EXPECT_FALSE(prim::joined_slices({parts[0], prim::clone(parts[1])}, 2, 2, {2, 3, 4}));
  EXPECT_FALSE(prim::joined_slices({parts[0]}, 2, 2, {2, 3, 4}));
  EXPECT_FALSE(prim::joined_slices({parts[0], Tensor()}, 2, 2, {2, 3, 4}));
  const Tensor wide = prim::view(arange(0, 30), {2, 3, 5});  // a gap after each row's fourth
  EXPECT_FALSE(prim::joined_slices({prim::slice(wide, 2, 0, 2), prim::slice(wide, 2, 2, 4)}, 2, 2, {2, 3, 4}));
  const Tensor transposed = prim::transpose(prim::view(arange(0, 24), {4, 3, 2}), 0, 2);  // [2, 3, 4], not contiguous
  EXPECT_FALSE(
      prim::joined_slices({prim::slice(transposed, 2, 0, 2), prim::slice(transposed, 2, 2, 4)}, 2, 2, {2, 3, 4}));
}

TEST(Shape, BroadcastsToSaysWhetherAShapeStretchesToAnother) {
  EXPECT_TRUE(broadcasts_to({}, {2, 3}));
  EXPECT_TRUE(broadcasts_to({3}, {2, 3}));
  EXPECT_TRUE(broadcasts_to({2, 1}, {2, 3}));
  EXPECT_TRUE(broadcasts_to({1, 1, 3}, {4, 2, 3}));
  EXPECT_TRUE(broadcasts_to({2, 3}, {2, 3}));
  EXPECT_FALSE(broadcasts_to({2}, {2, 3}));        // trailing dimensions line up: 2 against 3
  EXPECT_FALSE(broadcasts_to({1, 2, 3}, {2, 3}));  // more dimensions than the target
  EXPECT_FALSE(broadcasts_to({2, 3}, {2, 1}));     // only the source stretches
}

TEST(Tensor, PrintsLikePyTorch) {
  const std::string s = prim::view(arange(0, 4), {2, 2}).str();
  EXPECT_NE(s.find("[[0, 1],"), std::string::npos) << s;
  EXPECT_NE(s.find("dtype=f32, device=cpu"), std::string::npos) << s;
  const std::string big = arange(0, 100).str();
  EXPECT_NE(big.find("0, 1, 2, ..., 97, 98, 99"), std::string::npos) << big;
  EXPECT_EQ(describe(zeros({2, 3}, DType::bf16)).str(), "bf16[2, 3] on cpu");
}

// Descriptions are written out when formatted, not when taken, so they
// must keep what they describe: a description outlives the tensor's last
// other handle and the shape it was given.
TEST(Tensor, DescriptionsKeepWhatTheyDescribe) {
  const TensorDescription tensor = describe(zeros({2, 3}, DType::f16));
  const ShapeDescription shape = [] {
    const Shape s{4, 5, 6};
    return shape_str(s);
  }();
  EXPECT_EQ(fmt::format("{} and {}", tensor, shape), "f16[2, 3] on cpu and [4, 5, 6]");
  EXPECT_EQ(std::string(describe(Tensor())), "undefined tensor");
  EXPECT_EQ(shape_str({}).str(), "[]");
  EXPECT_EQ(shape_str(Shape(kMaxDims + 1, 7)).str(), "[7, 7, 7, 7, 7, 7, 7, 7, 7]");  // past the inline sizes
  std::ostringstream out;
  out << shape << " " << tensor;
  EXPECT_EQ(out.str(), "[4, 5, 6] f16[2, 3] on cpu");
}

TEST(Tensor, DeviceParsingAndAvailability) {
  EXPECT_EQ(Device("cuda:1").index, 1);
  EXPECT_TRUE(Device("cuda").is_cuda());
  EXPECT_EQ(Device("cpu:2").str(), "cpu:2");
  EXPECT_THROW(Device("tpu:0"), DeviceError);
  EXPECT_THROW(Device("cuda:x"), DeviceError);
  const int n = cuda_device_count();
  try {
    zeros({2}, DType::f32, Device(DeviceType::cuda, n));
    FAIL() << "allocating on a GPU that does not exist must throw";
  } catch (const DeviceError& e) {
    EXPECT_NE(std::string(e.what()).find(fmt::format("cuda:{} requested", n)), std::string::npos) << e.what();
  }
}

TEST(Tensor, RandomIsSeededAndCounterBased) {
  Generator g1(42), g2(42);
  Tensor a = randn({1000}, DType::f32, kCPU, &g1);
  Tensor b = randn({1000}, DType::f32, kCPU, &g2);
  EXPECT_EQ(a.to_vector<float>(), b.to_vector<float>());
  // The next draw continues the stream; restoring the state replays it.
  const uint64_t offset = g1.offset();
  Tensor c = rand({10}, DType::f32, kCPU, &g1);
  Generator g3;
  g3.set_state(42, offset);
  EXPECT_EQ(rand({10}, DType::f32, kCPU, &g3).to_vector<float>(), c.to_vector<float>());
  EXPECT_NE(a.to_vector<float>(), randn({1000}, DType::f32, kCPU, &g1).to_vector<float>());
  // Statistics of a large draw.
  Generator g(testing::fresh_seed());
  Tensor n = randn({200000}, DType::f32, kCPU, &g);
  EXPECT_NEAR(prim::mean(n).item(), 0.0, 0.01);
  EXPECT_NEAR(prim::mean(prim::unary(UnaryOp::square, n)).item(), 1.0, 0.02);
  Tensor u = rand({200000}, DType::f64, kCPU, &g, -2.0, 6.0);
  EXPECT_NEAR(prim::mean(u).item(), 2.0, 0.03);
  EXPECT_GE(prim::amin(u).item(), -2.0);
  EXPECT_LT(prim::amax(u).item(), 6.0);
}

// A value halfway between two halves plus a little rounds up, not to even:
// read back as 16 bits from f64, it is rounded once, not through f32.
TEST(Tensor, ToVectorOfSixteenBitsRoundsOnce) {
  const Tensor h = from_vector(std::vector<double>{1.0 + std::ldexp(1.0, -11) + std::ldexp(1.0, -40)}, {1}, DType::f64);
  EXPECT_EQ(h.to_vector<Half>()[0].bits, 0x3c01);
  const Tensor b = from_vector(std::vector<double>{std::ldexp(1.0, 24) + std::ldexp(1.0, 16) + 1.0}, {1}, DType::f64);
  EXPECT_EQ(b.to_vector<BFloat16>()[0].bits, 0x4b81);
}

// x * (high - low) + low rounds up to `high` in a narrow type about once
// in 500 draws for bf16 over [0, 1); those draws must become `low`.
TEST(Tensor, UniformDrawsStayBelowHighInEveryFloatType) {
  Generator g(testing::fresh_seed());
  for (DType dt : {DType::bf16, DType::f16, DType::f32}) {
    for (const auto& [low, high] : {std::pair{0.0, 1.0}, std::pair{1.0, 2.0}}) {
      SCOPED_TRACE(fmt::format("{} [{}, {})", dtype_name(dt), low, high));
      const Tensor u = rand({1 << 20}, dt, kCPU, &g, low, high);
      EXPECT_LT(prim::amax(u).item(), high);
      EXPECT_GE(prim::amin(u).item(), low);
    }
  }
}

// GPUs before Ampere are refused with their compute capability named;
// Ampere, Hopper and later pass.
TEST(CudaInfo, GpusBeforeAmpereAreNamedUnsupported) {
  for (const auto& [major, minor] : {std::pair{6, 1}, std::pair{7, 0}, std::pair{7, 5}}) {
    const std::string why = cuda::unsupported_compute_capability(major, minor);
    EXPECT_NE(why.find(fmt::format("compute capability {}.{}", major, minor)), std::string::npos) << why;
    EXPECT_NE(why.find("8.0 or newer"), std::string::npos) << why;
  }
  for (const auto& [major, minor] : {std::pair{8, 0}, std::pair{8, 6}, std::pair{8, 9}, std::pair{9, 0}, std::pair{12, 0}})
    EXPECT_EQ(cuda::unsupported_compute_capability(major, minor), "") << major << "." << minor;
}

TEST(Environment, WholeNumbersAreReadWithinTheirRangeAndAnythingElseIsNamed) {
  const char* name = "MPT_TEST_WHOLE_NUMBER";
  ::unsetenv(name);
  EXPECT_EQ(whole_number_from_environment(name, 0, 10), std::nullopt);
  ::setenv(name, "", 1);
  EXPECT_EQ(whole_number_from_environment(name, 0, 10), std::nullopt);
  ::setenv(name, "7", 1);
  EXPECT_EQ(whole_number_from_environment(name, 0, 10), 7);
  ::setenv(name, "0", 1);
  EXPECT_EQ(whole_number_from_environment(name, 0, 10), 0);
  for (const char* bad : {"11", "-1", "7x", "many"}) {
    ::setenv(name, bad, 1);
    try {
      whole_number_from_environment(name, 0, 10);
      ADD_FAILURE() << bad << " was taken";
    } catch (const ValueError& e) {
      EXPECT_EQ(std::string(e.what()),
                std::string("MPT_TEST_WHOLE_NUMBER must be a whole number from 0 to 10, got '") + bad + "'");
    }
  }
  ::unsetenv(name);
}

}  // namespace
}  // namespace mpt
