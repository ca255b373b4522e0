// The CPU backend's products through oneDNN (tensor/cpu/onednn_matmul.h)
// against an f64 reference on fresh random inputs: layouts (transposed,
// strided, batched, broadcast, single rows and columns), f32 and bf16, the
// bias and relu epilogues; the same bits every run; no threads of oneDNN's
// own; the bounded primitive cache; oneDNN's failures as mpt::Error. Skips
// where the build has no oneDNN.
#include <gtest/gtest.h>

#include <dirent.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>

#include "tensor/cpu/cpu_threads.h"
#include "tensor/cpu/onednn_matmul.h"
#include "tensor/ops.h"
#include "tests/test_util.h"
#ifdef MPT_TEST_ONEDNN
#include "tensor/cpu/onednn_runtime.h"
#endif

namespace mpt {
namespace {

using testing::host_f64;

class CpuOnednn : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (!cpu::onednn_usable(&why)) GTEST_SKIP() << "skipped: " << why;
    // Every product it takes, whatever this CPU would leave to Eigen.
    cpu::set_onednn_use(cpu::OnednnUse::kAlways);
    seed_ = testing::fresh_seed();
    gen_.manual_seed(seed_);
  }
  void TearDown() override { cpu::set_onednn_use(cpu::OnednnUse::kWhereFaster); }
  Tensor randn(const Shape& s, DType dt) { return mpt::randn(s, dt, kCPU, &gen_); }
  std::string trace() const { return fmt::format("seed {}", seed_); }

  uint64_t seed_ = 0;
  Generator gen_{0};
};

// a @ b (a [.., m, k], b [.., k, n], batch dimensions broadcast) in f64 from
// the operands' own (already rounded) values, and for each element the sum
// of |a_ik b_kj|, which bounds the error of any summation order.
struct Reference {
  std::vector<double> value, magnitude;
};

Tensor abs_of(const Tensor& t) { return prim::unary(UnaryOp::abs, t); }

Reference reference(const Tensor& a, const Tensor& b) {
  const Tensor a64 = prim::to(a, DType::f64), b64 = prim::to(b, DType::f64);
  return {host_f64(prim::matmul(a64, b64)), host_f64(prim::matmul(abs_of(a64), abs_of(b64)))};
}

// Every element within what f32 accumulation over k terms may lose (k
// roundings of 2^-24, in any order) plus, for a 16-bit result, its own
// rounding; the shapes and dtypes checked too.
void expect_close(const Tensor& got, const Reference& want, int64_t k) {
  const std::vector<double> g = host_f64(got);
  ASSERT_EQ(g.size(), want.value.size());
  const double out_rounding = got.dtype() == DType::bf16 ? std::ldexp(1.0, -8) : 0.0;
  const double accumulation = static_cast<double>(k + 1) * std::ldexp(1.0, -24);
  for (size_t i = 0; i < g.size(); ++i) {
    if (std::isnan(want.value[i]) && std::isnan(g[i])) continue;
    const double bound = accumulation * want.magnitude[i] + out_rounding * std::fabs(want.value[i]) + 1e-30;
    ASSERT_LE(std::fabs(g[i] - want.value[i]), bound) << "element " << i << " of " << g.size();
  }
}

// Runs f and expects it to have gone through oneDNN (at least once).
template <typename F>
Tensor through_onednn(F&& f) {
  const int64_t before = cpu::onednn_matmul_stats().products;
  Tensor out = f();
  EXPECT_GT(cpu::onednn_matmul_stats().products, before) << "the product did not run on oneDNN";
  return out;
}

TEST_F(CpuOnednn, ProductsMatchF64ReferenceInEveryLayout) {
  SCOPED_TRACE(trace());
  for (DType dt : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(dtype_name(dt));
    const int64_t m = 64, k = 96, n = 48;
    auto check = [&](const std::string& what, const Tensor& a, const Tensor& b) {
      SCOPED_TRACE(what);
      const Tensor out = through_onednn([&] { return prim::matmul(a, b); });
      expect_close(out, reference(a, b), a.shape()[a.dim() - 1]);
    };
    check("plain", randn({m, k}, dt), randn({k, n}, dt));
    check("a transposed", prim::transpose(randn({k, m}, dt), 0, 1), randn({k, n}, dt));
    check("b transposed", randn({m, k}, dt), prim::transpose(randn({n, k}, dt), 0, 1));
    check("both transposed", prim::transpose(randn({k, m}, dt), 0, 1), prim::transpose(randn({n, k}, dt), 0, 1));
    // Rows longer than the matrix: slices of wider tensors, read in place.
    check("strided rows", prim::slice(randn({m, k + 7}, dt), 1, 3, k + 3), prim::slice(randn({k, n + 5}, dt), 1, 5, n + 5));
    check("strided columns", prim::transpose(prim::slice(randn({k, m + 9}, dt), 1, 0, m), 0, 1),
          prim::transpose(prim::slice(randn({n, k + 3}, dt), 1, 1, k + 1), 0, 1));
    check("batched", randn({4, m, k}, dt), prim::transpose(randn({4, n, k}, dt), 1, 2));
    check("batch broadcast", prim::transpose(randn({3, k, m}, dt), 1, 2), randn({k, n}, dt));
    check("batch broadcast on the left", randn({1, m, k}, dt), randn({5, k, n}, dt));
    check("one row", randn({1, 4096}, dt), randn({4096, 16}, dt));
    check("one column", randn({300, 200}, dt), randn({200, 1}, dt));
    check("k of one", randn({256, 1}, dt), randn({1, 256}, dt));
    // Split over the threads by rows, by columns, and by whole batches.
    check("split by rows", randn({520, 512}, dt), prim::transpose(randn({130, 512}, dt), 0, 1));
    check("split by columns", randn({130, 512}, dt), prim::transpose(randn({520, 512}, dt), 0, 1));
    check("split by batches", randn({16, 128, 64}, dt), prim::transpose(randn({16, 128, 64}, dt), 1, 2));
  }
}

// linear(): the bias in oneDNN's primitive, relu after it here (oneDNN's
// relu would turn NaN into 0; relu() keeps NaN, and so must linear's).
TEST_F(CpuOnednn, LinearBiasAndReluKeepNaN) {
  SCOPED_TRACE(trace());
  for (DType dt : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(dtype_name(dt));
    const int64_t rows = 96, in = 128, out = 80;
    Tensor x = randn({rows, in}, dt);
    const Tensor w = randn({out, in}, dt), bias = randn({out}, dt);
    prim::fill_(prim::slice(prim::slice(x, 0, 5, 6), 1, 7, 8), std::numeric_limits<double>::quiet_NaN());
    const Tensor x64 = prim::to(x, DType::f64), w64 = prim::to(w, DType::f64);
    const Tensor want64 = prim::add(prim::matmul(x64, prim::transpose(w64, 0, 1)), prim::to(bias, DType::f64));
    const Reference want{host_f64(want64), host_f64(prim::add(prim::matmul(abs_of(x64), prim::transpose(abs_of(w64), 0, 1)),
                                                              abs_of(prim::to(bias, DType::f64))))};
    for (bool relu : {false, true}) {
      SCOPED_TRACE(relu ? "relu" : "no relu");
      const Tensor got = through_onednn([&] { return prim::linear(x, w, bias, relu); });
      const std::vector<double> g = host_f64(got);
      for (int64_t c = 0; c < out; ++c) EXPECT_TRUE(std::isnan(g[5 * out + c])) << "row 5, column " << c;
      Reference expected = want;
      for (size_t i = 0; i < expected.value.size(); ++i) {
        if (relu && expected.value[i] < 0) {
          // relu of a value near 0 may go either way within the bound.
          expected.value[i] = std::fabs(expected.value[i]) <= expected.magnitude[i] * 1e-5 ? g[i] : 0.0;
        }
      }
      expect_close(got, expected, in + 1);
    }
  }
}

// The relu epilogue (on the stored 16-bit result, by its bits, split over
// the threads) gives relu() of the product without it, bit for bit: NaN
// kept, -0 and negatives made +0, over an output large enough to split.
TEST_F(CpuOnednn, ReluEpilogueIsReluOfTheProductBitForBit) {
  SCOPED_TRACE(trace());
  for (DType dt : {DType::f32, DType::bf16, DType::f16}) {
    SCOPED_TRACE(dtype_name(dt));
    const int64_t rows = 2 * cpu::kMinElementsPerPiece / 80 + 37, in = 64, out = 80;
    Tensor x = randn({rows, in}, dt);
    const Tensor w = randn({out, in}, dt), bias = randn({out}, dt);
    prim::fill_(prim::slice(x, 0, 3, 4), std::numeric_limits<double>::quiet_NaN());
    prim::fill_(prim::slice(x, 0, rows - 2, rows - 1), 0.0);  // a row of bias alone, some of it negative
    const Tensor got = prim::linear(x, w, bias, true);
    const Tensor want = prim::unary(UnaryOp::relu, prim::linear(x, w, bias, false));
    EXPECT_EQ(std::memcmp(got.data_ptr(), want.data_ptr(), got.nbytes()), 0);
    const std::vector<double> g = host_f64(got);
    EXPECT_TRUE(std::isnan(g[3 * out])) << "relu must keep NaN";
    EXPECT_TRUE(std::all_of(g.begin(), g.end(), [](double v) { return std::isnan(v) || !std::signbit(v); }));
  }
}

// bf16 convolutions run their products on oneDNN's bf16 kernels (bf16
// columns, f32 sums): forward, data and weight gradients within what f32
// accumulation and the result's rounding allow of the exact f64 result, in
// groups of images with a ragged last one (13 images of 16x16: groups of 4).
TEST_F(CpuOnednn, Bf16ConvolutionsMeetTheF64Reference) {
  SCOPED_TRACE(trace());
  const Conv2dParams p{.pad_h = 1, .pad_w = 1};
  const Tensor x = randn({13, 8, 16, 16}, DType::bf16), w = randn({16, 8, 3, 3}, DType::bf16);
  const Tensor dy = randn({13, 16, 16, 16}, DType::bf16);
  const auto f64 = [](const Tensor& t) { return prim::to(t, DType::f64); };
  const auto f64_abs = [&](const Tensor& t) { return abs_of(f64(t)); };
  // Each pass as a function of its inputs: in bf16 (4 groups, each
  // product counted on oneDNN), in f64, and in f64 on the magnitudes.
  struct Pass {
    const char* name;
    std::function<Tensor(const Tensor& x, const Tensor& w, const Tensor& dy)> run;
    int64_t terms;  // products summed into each result
  };
  const Pass passes[] = {
      {"forward", [&](const Tensor& x_, const Tensor& w_, const Tensor&) { return prim::conv2d(x_, w_, p); }, 8 * 9},
      {"data gradient",
       [&](const Tensor&, const Tensor& w_, const Tensor& dy_) {
         return prim::conv2d_backward_data(dy_, w_, x.shape(), p);
       },
       16 * 9},
      {"weight gradient",
       [&](const Tensor& x_, const Tensor&, const Tensor& dy_) {
         return prim::conv2d_backward_weight(x_, dy_, w.shape(), p);
       },
       13 * 16 * 16}};
  for (const Pass& pass : passes) {
    SCOPED_TRACE(pass.name);
    const int64_t before = cpu::onednn_matmul_stats().products;
    const Tensor got = pass.run(x, w, dy);
    EXPECT_EQ(cpu::onednn_matmul_stats().products - before, 4) << "products run on oneDNN";
    const Reference want{host_f64(pass.run(f64(x), f64(w), f64(dy))),
                         host_f64(pass.run(f64_abs(x), f64_abs(w), f64_abs(dy)))};
    expect_close(got, want, pass.terms);
  }
}

// The same inputs give the same bits every time (resumed runs repeat
// their steps exactly): the pieces depend only on the shapes and
// cpu_threads(), and each piece's primitive runs on one thread.
TEST_F(CpuOnednn, SameBitsEveryRun) {
  SCOPED_TRACE(trace());
  for (DType dt : {DType::f32, DType::bf16}) {
    const Tensor a = randn({300, 257}, dt), b = prim::transpose(randn({190, 257}, dt), 0, 1);
    const std::vector<double> first = host_f64(prim::matmul(a, b));
    for (int i = 0; i < 3; ++i) EXPECT_EQ(host_f64(prim::matmul(a, b)), first) << dtype_name(dt) << ", run " << i;
  }
}

// Turned off, Eigen runs the product; both meet the reference.
TEST_F(CpuOnednn, EigenAndOnednnBothMeetTheReference) {
  SCOPED_TRACE(trace());
  const Tensor a = randn({200, 300}, DType::f32), b = randn({300, 100}, DType::f32);
  const Reference want = reference(a, b);
  cpu::set_onednn_use(cpu::OnednnUse::kNever);
  const int64_t before = cpu::onednn_matmul_stats().products;
  const Tensor eigen = prim::matmul(a, b);
  EXPECT_EQ(cpu::onednn_matmul_stats().products, before);
  cpu::set_onednn_use(cpu::OnednnUse::kAlways);
  expect_close(eigen, want, 300);
  expect_close(through_onednn([&] { return prim::matmul(a, b); }), want, 300);
}

// The default choice: batched products of a million multiply-adds or more
// go to oneDNN on every CPU, and smaller ones stay with Eigen.
TEST_F(CpuOnednn, DefaultTakesLargeBatchedProducts) {
  cpu::set_onednn_use(cpu::OnednnUse::kWhereFaster);
  const Tensor a = randn({16, 128, 64}, DType::f32), b = randn({16, 64, 128}, DType::f32);
  expect_close(through_onednn([&] { return prim::matmul(a, b); }), reference(a, b), 64);
  const Tensor small_a = randn({4, 16, 16}, DType::f32), small_b = randn({4, 16, 16}, DType::f32);
  const int64_t before = cpu::onednn_matmul_stats().products;
  prim::matmul(small_a, small_b);
  EXPECT_EQ(cpu::onednn_matmul_stats().products, before);
}

int threads_of_this_process() {
  int count = 0;
  if (DIR* dir = opendir("/proc/self/task")) {
    while (const dirent* entry = readdir(dir))
      if (entry->d_name[0] != '.') ++count;
    closedir(dir);
  }
  return count;
}

// oneDNN runs each piece on the thread that took it: after products large
// enough to use every thread, the process has the threads it had (the
// backend's pool, made by the first split), and no OpenMP team beside them.
TEST_F(CpuOnednn, StartsNoThreadsOfItsOwn) {
  cpu::parallel_for(1 << 20, 1, 1, [](int64_t, int64_t) {});  // the pool exists
  const int before = threads_of_this_process();
  const Tensor a = randn({1024, 512}, DType::f32), b = randn({512, 512}, DType::f32);
  for (int i = 0; i < 3; ++i) through_onednn([&] { return prim::matmul(a, b); });
  EXPECT_EQ(threads_of_this_process(), before);
}

// More shapes than the cache holds: it stays at its bound, and products of
// shapes it dropped are made again and still right.
TEST_F(CpuOnednn, PrimitiveCacheStaysBounded) {
  const Tensor b = randn({64, 64}, DType::f32);
  for (int64_t rows = 8; rows < 8 + 600; ++rows) prim::matmul(randn({rows, 64}, DType::f32), b);
  EXPECT_LE(cpu::onednn_matmul_stats().cached, 512);
  const Tensor a = randn({8, 64}, DType::f32);
  expect_close(through_onednn([&] { return prim::matmul(a, b); }), reference(a, b), 64);
}

#ifdef MPT_TEST_ONEDNN
// oneDNN's failures surface as the library's errors, naming the op.
TEST(CpuOnednnErrors, FailuresBecomeMptErrors) {
  const std::string what = "matmul [1, 2, 3] @ [1, 3, 4] (f32 -> f32)";
  const std::string oom = testing::error_of<OutOfMemoryError>(
      [&] { cpu::onednn::rethrow(dnnl::error(dnnl_out_of_memory, "could not allocate"), what); });
  testing::expect_contains(oom, {what, "oneDNN failed", "could not allocate"});
  const std::string other = testing::error_of<LibraryError>(
      [&] { cpu::onednn::rethrow(dnnl::error(dnnl_runtime_error, "a kernel failed"), what); });
  testing::expect_contains(other, {what, "status 5", "a kernel failed"});
}
#endif

}  // namespace
}  // namespace mpt
