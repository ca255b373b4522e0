// Row gathers and max pooling on the CPU; pooling shares its planes out
// over the CPU's threads.
#include <algorithm>
#include <limits>
#include <vector>

#include "tensor/cpu/cpu_kernels.h"
#include "tensor/cpu/cpu_threads.h"

namespace mpt::cpu {
namespace {

// Planes a thread takes at least: about 64K elements' work.
int64_t min_planes_per_thread(int64_t work_per_plane) { return units_for_work(int64_t{1} << 16, work_per_plane); }

}  // namespace

void index_select_rows(const TensorView& out, const TensorView& table, const TensorView& idx) {
  const int64_t n = idx.shape[0], d = table.shape[1];
  const auto* ix = static_cast<const int64_t*>(idx.data);
  const size_t row_bytes = static_cast<size_t>(d) * dtype_size(table.dtype);
  for (int64_t i = 0; i < n; ++i)
    std::memcpy(static_cast<char*>(out.data) + i * row_bytes, static_cast<const char*>(table.data) + ix[i] * row_bytes,
                row_bytes);
}

void index_add_rows(const TensorView& table, const TensorView& idx, const TensorView& src) {
  dispatch_float(table.dtype, "index_add_rows", [&](auto tag) {
    using T = decltype(tag);
    using C = typename ComputeType<T>::type;
    const int64_t n = idx.shape[0], d = table.shape[1];
    const auto* ix = static_cast<const int64_t*>(idx.data);
    T* t = static_cast<T*>(table.data);
    const T* s = static_cast<const T*>(src.data);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < d; ++j) {
        T* dst = t + ix[i] * d + j;
        store<T, C>(dst, load<T, C>(dst) + load<T, C>(s + i * d + j));
      }
  });
}

void max_pool2d_forward(const TensorView& out, const TensorView& indices, const TensorView& x, const Pool2dParams& p) {
  dispatch_float(x.dtype, "max_pool2d", [&](auto tag) {
    using T = decltype(tag);
    using C = typename ComputeType<T>::type;
    const int64_t planes = x.shape[0] * x.shape[1], h = x.shape[2], w = x.shape[3];
    const int64_t ho = out.shape[2], wo = out.shape[3];
    const T* in = static_cast<const T*>(x.data);
    T* o = static_cast<T*>(out.data);
    auto* ix = static_cast<int64_t*>(indices.data);
    auto pool_plane = [&](int64_t pl) {
      for (int64_t oy = 0; oy < ho; ++oy)
        for (int64_t ox = 0; ox < wo; ++ox) {
          C best = -std::numeric_limits<C>::infinity();
          int64_t best_at = -1;
          for (int64_t ky = 0; ky < p.kernel_h; ++ky)
            for (int64_t kx = 0; kx < p.kernel_w; ++kx) {
              const int64_t y = oy * p.stride_h - p.pad_h + ky, xx = ox * p.stride_w - p.pad_w + kx;
              if (y < 0 || y >= h || xx < 0 || xx >= w) continue;
              const C v = load<T, C>(in + pl * h * w + y * w + xx);
              // NaN wins, as in PyTorch.
              if (best_at < 0 || v > best || (v != v && best == best)) {
                best = v;
                best_at = y * w + xx;
              }
            }
          const int64_t k = pl * ho * wo + oy * wo + ox;
          store<T, C>(o + k, best);
          ix[k] = best_at;
        }
    };
    parallel_for(planes, 1, min_planes_per_thread(ho * wo * p.kernel_h * p.kernel_w), [&](int64_t first, int64_t last) {
      for (int64_t pl = first; pl < last; ++pl) pool_plane(pl);
    });
  });
}

void max_pool2d_backward(const TensorView& grad_x, const TensorView& grad_out, const TensorView& indices) {
  dispatch_float(grad_x.dtype, "max_pool2d backward", [&](auto tag) {
    using T = decltype(tag);
    using C = typename ComputeType<T>::type;
    const int64_t planes = grad_x.shape[0] * grad_x.shape[1], hw = grad_x.shape[2] * grad_x.shape[3];
    const int64_t ohw = grad_out.shape[2] * grad_out.shape[3];
    T* gx = static_cast<T*>(grad_x.data);
    const T* go = static_cast<const T*>(grad_out.data);
    const auto* ix = static_cast<const int64_t*>(indices.data);
    // Accumulate per plane in the compute type, then store once.
    parallel_for(planes, 1, min_planes_per_thread(hw + ohw), [&](int64_t first, int64_t last) {
      std::vector<C> acc(static_cast<size_t>(hw));
      for (int64_t pl = first; pl < last; ++pl) {
        std::fill(acc.begin(), acc.end(), C{0});
        for (int64_t k = 0; k < ohw; ++k) acc[ix[pl * ohw + k]] += load<T, C>(go + pl * ohw + k);
        for (int64_t i = 0; i < hw; ++i) store<T, C>(gx + pl * hw + i, acc[i]);
      }
    });
  });
}

}  // namespace mpt::cpu
