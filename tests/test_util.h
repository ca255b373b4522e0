#pragma once
// Helpers shared by the tests: fresh seeds (printed on failure), host
// copies in f64, and error norms.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <string>
#include <random>
#include <vector>

#include "tensor/half.h"
#include "tensor/ops.h"

namespace mpt::testing {

// A file of the build tree, looked up beside the running test binary first
// (the build folder may have been copied, e.g. to a GPU machine), else at
// the path configured at build time.
inline std::string build_file(const std::string& relative_to_tests, const char* configured) {
  std::error_code ec;
  const auto self = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    const auto candidate = self.parent_path() / relative_to_tests;
    if (std::filesystem::exists(candidate)) return candidate.lexically_normal().string();
  }
  return configured;
}

// A fresh folder under the system's temporary directory, named after the
// prefix, the process and the running test (and numbered, for several in
// one test), removed with everything in it when the object goes.
class TempDir {
 public:
  explicit TempDir(const std::string& prefix) {
    static int count = 0;
    const auto* test = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = std::filesystem::temp_directory_path() /
            (prefix + "-" + std::to_string(getpid()) + "-" + (test ? test->name() : "none") + "-" +
             std::to_string(count++));
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ignored;  // a destructor must not throw; a leftover folder is harmless
    std::filesystem::remove_all(path_, ignored);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::filesystem::path& path() const { return path_; }
  std::string file(const std::string& name) const { return (path_ / name).string(); }

 private:
  std::filesystem::path path_;
};

// A new seed every run, so each run checks fresh inputs; SCOPED_TRACE it.
inline uint64_t fresh_seed() {
  static std::random_device rd;
  return (static_cast<uint64_t>(rd()) << 32) | rd();
}

// The message of the E that f throws (a test failure if it throws none).
template <typename E, typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  ADD_FAILURE() << "no exception of the expected type";
  return "";
}

// Expects every part in s (an error message, usually).
inline void expect_contains(const std::string& s, const std::vector<std::string>& parts) {
  for (const auto& p : parts) EXPECT_NE(s.find(p), std::string::npos) << "'" << p << "' not in: " << s;
}

inline std::vector<double> host_f64(const Tensor& t) { return t.to_vector<double>(); }

// v rounded to dt (f32, f16 or bf16; anything else as is).
inline double round_to(double v, DType dt) {
  switch (dt) {
    case DType::f32: return static_cast<float>(v);
    case DType::f16: return static_cast<float>(Half(v));
    case DType::bf16: return static_cast<float>(BFloat16(v));
    default: return v;
  }
}

// Every element finite; else which is not. rel_error below passes NaN
// against NaN, so a check whose values must be finite asserts this too.
inline ::testing::AssertionResult all_finite(const std::vector<double>& v) {
  for (size_t i = 0; i < v.size(); ++i)
    if (!std::isfinite(v[i]))
      return ::testing::AssertionFailure() << "element " << i << " of " << v.size() << " is " << v[i];
  return ::testing::AssertionSuccess();
}

// ||a - b|| / ||b|| (0 when both are 0); NaN in one only gives infinity, NaN
// in both is skipped (see all_finite).
inline double rel_error(const std::vector<double>& a, const std::vector<double>& b) {
  EXPECT_EQ(a.size(), b.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    if (std::isnan(a[i]) != std::isnan(b[i])) return INFINITY;
    if (std::isnan(a[i])) continue;
    if (std::isinf(a[i]) || std::isinf(b[i])) {
      if (a[i] != b[i]) return INFINITY;
      continue;
    }
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  if (den == 0) return std::sqrt(num);
  return std::sqrt(num / den);
}

inline double max_abs_diff(const std::vector<double>& a, const std::vector<double>& b) {
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::fabs(a[i] - b[i]));
  return m;
}

// Relative tolerance for results computed in `t` (inputs rounded to t).
inline double tolerance(DType t) {
  switch (t) {
    case DType::f64: return 1e-12;
    case DType::f32: return 1e-5;
    case DType::f16: return 2e-3;
    case DType::bf16: return 1.6e-2;
    default: return 0;
  }
}

inline bool has_cuda() { return cuda_device_count() > 0; }

// GPU work on the current stream, whose result no one reads: work on
// another stream that races ahead of what is queued after it wins against
// it. Eight f32 matmuls of `size` squared: at 1024 a fraction of a
// millisecond on an H200, at 4096 a few milliseconds (for races whose other
// side first goes through host calls that take longer, a graph's
// instantiation, say).
inline void busy_gpu(const Device& device, int64_t size = 1024) {
  const Tensor a = full({size, size}, 1e-3, DType::f32, device);
  Tensor y = a;
  for (int i = 0; i < 8; ++i) y = prim::matmul(y, a);
}

#define MPT_SKIP_WITHOUT_CUDA() \
  if (!::mpt::testing::has_cuda()) GTEST_SKIP() << "skipped: no CUDA device"

}  // namespace mpt::testing
