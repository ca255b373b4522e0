// 2-d convolution on the CPU: im2col, then one GEMM per group of images.
// The backward passes use the same column matrix: data = col2im(W^T g),
// weight = sum over groups of g cols^T. The products run in f32 on Eigen,
// or for bf16 tensors on oneDNN's bf16 kernels where it takes them (a CPU
// with bf16 arithmetic: about twice as fast, docs/PERFORMANCE.md): the
// columns then stay bf16, whose products are exact in f32 as the widened
// ones are, and sum in f32. Groups are shared out over the CPU's threads
// (cpu_threads.h); the weight gradient sums each thread's groups, then the
// threads' sums in order.
#include <Eigen/Core>
#include <algorithm>
#include <memory>
#include <mutex>
#include <type_traits>
#include <utility>
#include <vector>

#include "tensor/cpu/cpu_kernels.h"
#include "tensor/cpu/cpu_threads.h"
#include "tensor/cpu/onednn_matmul.h"

namespace mpt::cpu {
namespace {

struct Geometry {
  int64_t n, c, h, w, o, kh, kw, ho, wo;
  Conv2dParams p;
  int64_t col_rows() const { return c * kh * kw; }
  int64_t col_cols() const { return ho * wo; }
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
template <typename C>
using MatMap = Eigen::Map<Mat<C>>;

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

// An element of T as C: converted, or copied as it is where they are the
// same type (bf16 columns for oneDNN).
template <typename T, typename C>
C element_as(const T* p) {
  if constexpr (std::is_same_v<T, C>) {
    return *p;
  } else {
    return load<T, C>(p);
  }
}

// One image's column matrix into `cols`, whose rows are `ld` wide: the
// image's ho * wo columns start at cols (a group's images lie side by side).
template <typename T, typename C>
void im2col(const T* image, const Geometry& g, C* cols, int64_t ld) {
  for_each_patch_run(g, [&](const PatchRun& r) {
    C* dst = cols + r.row * ld + r.oy * g.wo;
    if (!r.inside) {
      std::fill(dst, dst + g.wo, C{});
      return;
    }
    std::fill(dst, dst + r.begin, C{});
    // From the first column inside the image (r.first itself may lie before it).
    const T* src = image + (r.first + r.begin * r.stride);
    C* inside = dst + r.begin;
    const int64_t count = r.end - r.begin;
    if (r.stride == 1) {
      // Unit stride (the usual convolution): a copy that vectorizes.
      for (int64_t i = 0; i < count; ++i) inside[i] = element_as<T, C>(src + i);
    } else {
      for (int64_t i = 0; i < count; ++i) inside[i] = element_as<T, C>(src + i * r.stride);
    }
    std::fill(dst + r.end, dst + g.wo, C{});
  });
}

// The column matrices of `images` images from `group_x` on, side by side
// in `cols` (rows images * ho*wo wide).
template <typename T, typename C>
void im2col_group(const T* group_x, const Geometry& g, int64_t images, C* cols) {
  const int64_t image_size = g.c * g.h * g.w, width = images * g.col_cols();
  for (int64_t j = 0; j < images; ++j) im2col<T, C>(group_x + j * image_size, g, cols + j * g.col_cols(), width);
}

// Images go through the products in groups whose column matrices lie side
// by side: one product [o, c*kh*kw] x [c*kh*kw, images * ho*wo] for the
// group instead of one an image. A 14x14 image has only 196 columns, and
// Eigen's product is slower that narrow (cnn's second layer: 13-15 ms a
// batch one image at a time, 10-11 ms in groups; docs/PERFORMANCE.md); a
// group is at least kGroupColumns wide.
constexpr int64_t kGroupColumns = 1024;

// The groups of a batch: `size` images each, the last one fewer.
struct Groups {
  int64_t size, count;
  int64_t first(int64_t group) const { return group * size; }
  int64_t images(int64_t group, int64_t n) const { return std::min(size, n - group * size); }
};

Groups groups_of(const Geometry& g) {
  const int64_t size = std::clamp<int64_t>(units_for_work(kGroupColumns, g.col_cols()), 1, std::max<int64_t>(g.n, 1));
  return {size, (g.n + size - 1) / size};
}

// Groups a thread takes at least: a share worth handing to another thread.
int64_t min_groups_per_thread(const Geometry& g, const Groups& groups) {
  return units_for_work(kMinMultiplyAddsPerPiece, g.o * g.col_rows() * g.col_cols() * groups.size);
}

// A thread's working memory, left uninitialised (every element is written
// before it is read).
template <typename C>
std::unique_ptr<C[]> scratch(int64_t count) {
  return std::unique_ptr<C[]>(new C[static_cast<size_t>(count)]);
}

// A group's [o, ho*wo] planes of an NCHW tensor, side by side in `dst` (o
// rows of images * ho*wo), and back.
template <typename T, typename C>
void gather_planes(const T* src, const Geometry& g, int64_t images, C* dst) {
  const int64_t plane = g.col_cols(), width = images * plane;
  for (int64_t j = 0; j < images; ++j)
    for (int64_t oc = 0; oc < g.o; ++oc) {
      const T* from = src + (j * g.o + oc) * plane;
      C* to = dst + oc * width + j * plane;
      for (int64_t k = 0; k < plane; ++k) to[k] = element_as<T, C>(from + k);
    }
}

template <typename T, typename C>
void scatter_planes(const C* src, const Geometry& g, int64_t images, T* dst) {
  const int64_t plane = g.col_cols(), width = images * plane;
  for (int64_t j = 0; j < images; ++j)
    for (int64_t oc = 0; oc < g.o; ++oc) {
      const C* from = src + oc * width + j * plane;
      T* to = dst + (j * g.o + oc) * plane;
      for (int64_t k = 0; k < plane; ++k) store<T, C>(to + k, from[k]);
    }
}

// Whether a group's products go to oneDNN's bf16 kernels: T is bf16 and
// oneDNN would take a product of m x k by a full group's n columns (a
// ragged last group it declines goes through Eigen).
template <typename T>
bool bf16_products(const Geometry& g, const Groups& groups, int64_t m, int64_t k) {
  if constexpr (!std::is_same_v<T, BFloat16>) {
    return false;
  } else {
    return onednn_chosen(DType::bf16, DType::f32, 1, m, groups.size * g.col_cols(), k);
  }
}

// out (f32, [m, n], contiguous) = a @ b on oneDNN's bf16 kernels, the bf16
// operands laid out as matrix_view() describes them; false where it
// declines.
bool bf16_product(const TensorView& a, const TensorView& b, float* out) {
  return onednn_matmul(a, b, matrix_view(out, DType::f32, a.shape[1], b.shape[2], b.shape[2], 1), TensorView{});
}

// Row-major [rows, cols] bf16 memory, and its transpose.
TensorView bf16_rows(const void* p, int64_t rows, int64_t cols) {
  return matrix_view(const_cast<void*>(p), DType::bf16, rows, cols, cols, 1);
}
TensorView bf16_transposed(const void* p, int64_t rows, int64_t cols) {
  return matrix_view(const_cast<void*>(p), DType::bf16, cols, rows, 1, cols);
}

}  // namespace

void conv2d_forward(const TensorView& out, const TensorView& x, const TensorView& w, const Conv2dParams& p) {
  dispatch_float(x.dtype, "conv2d", [&](auto tag) {
    using T = decltype(tag);
    using C = typename ComputeType<T>::type;
    const Geometry g = geometry(x, w, out, p);
    const Groups groups = groups_of(g);
    const Mat<C> wm = load_matrix<T, C>(static_cast<const T*>(w.data), g.o, g.col_rows());
    const int64_t image_size = g.c * g.h * g.w, out_size = g.o * g.col_cols();
    const bool on_bf16 = bf16_products<T>(g, groups, g.o, g.col_rows());
    parallel_for(groups.count, 1, min_groups_per_thread(g, groups), [&](int64_t begin, int64_t end) {
      const std::unique_ptr<C[]> cols = scratch<C>(g.col_rows() * g.col_cols() * groups.size);
      const std::unique_ptr<C[]> result = scratch<C>(g.o * g.col_cols() * groups.size);
      const std::unique_ptr<T[]> cols_16 = scratch<T>(on_bf16 ? g.col_rows() * g.col_cols() * groups.size : 0);
      for (int64_t gi = begin; gi < end; ++gi) {
        const int64_t first = groups.first(gi), images = groups.images(gi, g.n), width = images * g.col_cols();
        const T* group_x = static_cast<const T*>(x.data) + first * image_size;
        if constexpr (std::is_same_v<T, BFloat16>) {
          if (on_bf16) {
            im2col_group<T, T>(group_x, g, images, cols_16.get());
            if (bf16_product(bf16_rows(w.data, g.o, g.col_rows()), bf16_rows(cols_16.get(), g.col_rows(), width),
                             result.get())) {
              scatter_planes<T, C>(result.get(), g, images, static_cast<T*>(out.data) + first * out_size);
              continue;
            }
          }
        }
        im2col_group<T, C>(group_x, g, images, cols.get());
        MatMap<C>(result.get(), g.o, width).noalias() = wm * MatMap<C>(cols.get(), g.col_rows(), width);
        scatter_planes<T, C>(result.get(), g, images, static_cast<T*>(out.data) + first * out_size);
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
    const Groups groups = groups_of(g);
    const Mat<C> wt = load_matrix<T, C>(static_cast<const T*>(w.data), g.o, g.col_rows()).transpose();
    const int64_t image_size = g.c * g.h * g.w, out_size = g.o * g.col_cols();
    const bool on_bf16 = bf16_products<T>(g, groups, g.col_rows(), g.o);
    parallel_for(groups.count, 1, min_groups_per_thread(g, groups), [&](int64_t begin, int64_t end) {
      const std::unique_ptr<C[]> go = scratch<C>(g.o * g.col_cols() * groups.size);
      const std::unique_ptr<C[]> cols = scratch<C>(g.col_rows() * g.col_cols() * groups.size);
      const std::unique_ptr<C[]> image = scratch<C>(image_size);
      const std::unique_ptr<T[]> go_16 = scratch<T>(on_bf16 ? g.o * g.col_cols() * groups.size : 0);
      for (int64_t gi = begin; gi < end; ++gi) {
        const int64_t first = groups.first(gi), images = groups.images(gi, g.n), width = images * g.col_cols();
        const T* group_grad_out = static_cast<const T*>(grad_out.data) + first * out_size;
        bool done = false;
        if constexpr (std::is_same_v<T, BFloat16>) {
          if (on_bf16) {
            gather_planes<T, T>(group_grad_out, g, images, go_16.get());
            done = bf16_product(bf16_transposed(w.data, g.o, g.col_rows()), bf16_rows(go_16.get(), g.o, width),
                                cols.get());
          }
        }
        if (!done) {
          gather_planes<T, C>(group_grad_out, g, images, go.get());
          MatMap<C>(cols.get(), g.col_rows(), width).noalias() = wt * MatMap<C>(go.get(), g.o, width);
        }
        for (int64_t j = 0; j < images; ++j) {
          std::fill(image.get(), image.get() + image_size, C{0});
          const C* image_cols = cols.get() + j * g.col_cols();
          for_each_patch_run(g, [&](const PatchRun& r) {
            if (!r.inside) return;
            const C* src = image_cols + r.row * width + r.oy * g.wo + r.begin;
            C* dst = image.get() + (r.first + r.begin * r.stride);
            const int64_t count = r.end - r.begin;
            if (r.stride == 1) {
              for (int64_t i = 0; i < count; ++i) dst[i] += src[i];
            } else {
              for (int64_t i = 0; i < count; ++i) dst[i * r.stride] += src[i];
            }
          });
          T* dst = static_cast<T*>(grad_x.data) + (first + j) * image_size;
          for (int64_t k = 0; k < image_size; ++k) store<T, C>(dst + k, image[k]);
        }
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
    const Groups groups = groups_of(g);
    const int64_t image_size = g.c * g.h * g.w, out_size = g.o * g.col_cols();
    // Each thread's sum over its groups, by its first group; then the sums
    // in order, so a split gives the same bits every run.
    std::vector<std::pair<int64_t, Mat<C>>> sums;
    std::mutex sums_mutex;
    const bool on_bf16 = bf16_products<T>(g, groups, g.o, g.col_rows());
    parallel_for(groups.count, 1, min_groups_per_thread(g, groups), [&](int64_t begin, int64_t end) {
      Mat<C> acc = Mat<C>::Zero(g.o, g.col_rows());
      const std::unique_ptr<C[]> go = scratch<C>(g.o * g.col_cols() * groups.size);
      const std::unique_ptr<C[]> cols = scratch<C>(g.col_rows() * g.col_cols() * groups.size);
      const std::unique_ptr<T[]> go_16 = scratch<T>(on_bf16 ? g.o * g.col_cols() * groups.size : 0);
      const std::unique_ptr<T[]> cols_16 = scratch<T>(on_bf16 ? g.col_rows() * g.col_cols() * groups.size : 0);
      Mat<C> group_sum(on_bf16 ? g.o : 0, on_bf16 ? g.col_rows() : 0);
      for (int64_t gi = begin; gi < end; ++gi) {
        const int64_t first = groups.first(gi), images = groups.images(gi, g.n), width = images * g.col_cols();
        const T* group_x = static_cast<const T*>(x.data) + first * image_size;
        const T* group_grad_out = static_cast<const T*>(grad_out.data) + first * out_size;
        if constexpr (std::is_same_v<T, BFloat16>) {
          if (on_bf16) {
            im2col_group<T, T>(group_x, g, images, cols_16.get());
            gather_planes<T, T>(group_grad_out, g, images, go_16.get());
            if (bf16_product(bf16_rows(go_16.get(), g.o, width), bf16_transposed(cols_16.get(), g.col_rows(), width),
                             group_sum.data())) {
              acc += group_sum;
              continue;
            }
          }
        }
        im2col_group<T, C>(group_x, g, images, cols.get());
        gather_planes<T, C>(group_grad_out, g, images, go.get());
        acc.noalias() += MatMap<C>(go.get(), g.o, width) * MatMap<C>(cols.get(), g.col_rows(), width).transpose();
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
