// 2-d convolution on the CPU: im2col, then one GEMM per image (Eigen). The
// backward passes use the same column matrix: data = col2im(W^T g),
// weight = sum over images of g cols^T. 16-bit floats compute in f32.
// Images are shared out over the CPU's threads (cpu_threads.h); the weight
// gradient sums each thread's images, then the threads' sums in order.
#include <Eigen/Core>
#include <algorithm>
#include <mutex>
#include <utility>
#include <vector>

#include "tensor/cpu/cpu_kernels.h"
#include "tensor/cpu/cpu_threads.h"

namespace mpt::cpu {
namespace {

struct Geometry {
  int64_t n, c, h, w, o, kh, kw, ho, wo;
  Conv2dParams p;
  int64_t col_rows() const { return c * kh * kw; }
  int64_t col_cols() const { return ho * wo; }
  // Images a thread takes at least: a share worth handing to another thread.
  int64_t min_images_per_thread() const {
    return units_for_work(kMinMultiplyAddsPerPiece, o * col_rows() * col_cols());
  }
};

Geometry geometry(const TensorView& x_like, const TensorView& w, const TensorView& out_like, const Conv2dParams& p) {
  return {x_like.shape[0], x_like.shape[1], x_like.shape[2], x_like.shape[3], w.shape[0], w.shape[2], w.shape[3],
          out_like.shape[2], out_like.shape[3], p};
}

// ceil(a / b) for b > 0 and any a.
int64_t ceil_div(int64_t a, int64_t b) { return a >= 0 ? (a + b - 1) / b : -((-a) / b); }

// One output row of one column row: output columns [begin, end) read the
// input at offset `first + ox * stride` (`first` itself, output column 0's,
// may lie outside); the other columns, and the whole row where `inside` is
// false, fall on the padding.
struct PatchRun {
  int64_t row, oy;
  bool inside;
  int64_t first, stride, begin, end;
};

// Visits every (column row, output row) in order: column rows (channel,
// kernel row, kernel column) outermost, then output rows.
template <typename F>
void for_each_patch_run(const Geometry& g, F&& f) {
  for (int64_t ci = 0; ci < g.c; ++ci)
    for (int64_t ky = 0; ky < g.kh; ++ky)
      for (int64_t kx = 0; kx < g.kw; ++kx) {
        const int64_t row = (ci * g.kh + ky) * g.kw + kx;
        const int64_t x0 = kx * g.p.dilation_w - g.p.pad_w;  // input column of output column 0
        const int64_t begin = std::clamp<int64_t>(ceil_div(-x0, g.p.stride_w), 0, g.wo);
        const int64_t end = std::clamp<int64_t>(ceil_div(g.w - x0, g.p.stride_w), begin, g.wo);
        for (int64_t oy = 0; oy < g.ho; ++oy) {
          const int64_t y = oy * g.p.stride_h - g.p.pad_h + ky * g.p.dilation_h;
          const bool inside = y >= 0 && y < g.h;
          f(PatchRun{row, oy, inside, (ci * g.h + y) * g.w + x0, g.p.stride_w, begin, end});
        }
      }
}

template <typename C>
using Mat = Eigen::Matrix<C, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

template <typename T, typename C>
Mat<C> load_matrix(const T* p, int64_t rows, int64_t cols) {
  Mat<C> m(rows, cols);
  for (int64_t i = 0; i < rows * cols; ++i) m.data()[i] = load<T, C>(p + i);
  return m;
}

template <typename T, typename C>
void store_matrix(T* p, const Mat<C>& m) {
  for (int64_t i = 0; i < m.size(); ++i) store<T, C>(p + i, m.data()[i]);
}

template <typename T, typename C>
Mat<C> im2col(const T* image, const Geometry& g) {
  Mat<C> cols(g.col_rows(), g.col_cols());
  for_each_patch_run(g, [&](const PatchRun& r) {
    C* dst = cols.data() + r.row * g.col_cols() + r.oy * g.wo;
    if (!r.inside) {
      std::fill(dst, dst + g.wo, C{0});
      return;
    }
    std::fill(dst, dst + r.begin, C{0});
    for (int64_t ox = r.begin; ox < r.end; ++ox) dst[ox] = load<T, C>(image + (r.first + ox * r.stride));
    std::fill(dst + r.end, dst + g.wo, C{0});
  });
  return cols;
}

}  // namespace

void conv2d_forward(const TensorView& out, const TensorView& x, const TensorView& w, const Conv2dParams& p) {
  dispatch_float(x.dtype, "conv2d", [&](auto tag) {
    using T = decltype(tag);
    using C = typename ComputeType<T>::type;
    const Geometry g = geometry(x, w, out, p);
    const Mat<C> wm = load_matrix<T, C>(static_cast<const T*>(w.data), g.o, g.col_rows());
    parallel_for(g.n, 1, g.min_images_per_thread(), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const Mat<C> cols = im2col<T, C>(static_cast<const T*>(x.data) + i * g.c * g.h * g.w, g);
        store_matrix<T, C>(static_cast<T*>(out.data) + i * g.o * g.col_cols(), Mat<C>(wm * cols));
      }
    });
  });
}

void conv2d_backward_data(const TensorView& grad_x, const TensorView& grad_out, const TensorView& w,
                          const Conv2dParams& p) {
  dispatch_float(grad_x.dtype, "conv2d backward", [&](auto tag) {
    using T = decltype(tag);
    using C = typename ComputeType<T>::type;
    const Geometry g = geometry(grad_x, w, grad_out, p);
    const Mat<C> wt = load_matrix<T, C>(static_cast<const T*>(w.data), g.o, g.col_rows()).transpose();
    parallel_for(g.n, 1, g.min_images_per_thread(), [&](int64_t begin, int64_t end) {
      std::vector<C> image(static_cast<size_t>(g.c * g.h * g.w));
      for (int64_t i = begin; i < end; ++i) {
        const Mat<C> go =
            load_matrix<T, C>(static_cast<const T*>(grad_out.data) + i * g.o * g.col_cols(), g.o, g.col_cols());
        const Mat<C> cols = wt * go;
        std::fill(image.begin(), image.end(), C{0});
        for_each_patch_run(g, [&](const PatchRun& r) {
          if (!r.inside) return;
          const C* src = cols.data() + r.row * g.col_cols() + r.oy * g.wo;
          for (int64_t ox = r.begin; ox < r.end; ++ox) image[r.first + ox * r.stride] += src[ox];
        });
        T* dst = static_cast<T*>(grad_x.data) + i * g.c * g.h * g.w;
        for (size_t k = 0; k < image.size(); ++k) store<T, C>(dst + k, image[k]);
      }
    });
  });
}

void conv2d_backward_weight(const TensorView& grad_w, const TensorView& x, const TensorView& grad_out,
                            const Conv2dParams& p) {
  dispatch_float(x.dtype, "conv2d backward", [&](auto tag) {
    using T = decltype(tag);
    using C = typename ComputeType<T>::type;
    const Geometry g = geometry(x, grad_w, grad_out, p);
    // Each thread's sum over its images, by its first image; then the sums
    // in image order, so a split gives the same bits every run.
    std::vector<std::pair<int64_t, Mat<C>>> sums;
    std::mutex sums_mutex;
    parallel_for(g.n, 1, g.min_images_per_thread(), [&](int64_t begin, int64_t end) {
      Mat<C> acc = Mat<C>::Zero(g.o, g.col_rows());
      for (int64_t i = begin; i < end; ++i) {
        const Mat<C> cols = im2col<T, C>(static_cast<const T*>(x.data) + i * g.c * g.h * g.w, g);
        const Mat<C> go =
            load_matrix<T, C>(static_cast<const T*>(grad_out.data) + i * g.o * g.col_cols(), g.o, g.col_cols());
        acc.noalias() += go * cols.transpose();
      }
      const std::lock_guard<std::mutex> lock(sums_mutex);
      sums.emplace_back(begin, std::move(acc));
    });
    std::sort(sums.begin(), sums.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
    Mat<C> total = Mat<C>::Zero(g.o, g.col_rows());
    for (const auto& [first, sum] : sums) total += sum;
    store_matrix<T, C>(static_cast<T*>(grad_w.data), total);
  });
}

}  // namespace mpt::cpu
