// Row gathers and max pooling on the CPU; pooling shares its planes out
// over the CPU's threads.
#include <algorithm>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "tensor/cpu/cpu_kernels.h"
#include "tensor/cpu/cpu_threads.h"

namespace mpt::cpu {
namespace {

// Planes a thread takes at least: about 64K elements' work.
int64_t min_planes_per_thread(int64_t work_per_plane) { return units_for_work(int64_t{1} << 16, work_per_plane); }

// One window element across a row of outputs: output column ox reads the
// input at offset first + ox * stride. The first element of the window
// starts the running maximum; the loop vectorizes.
template <typename T, typename C>
void pool_window_element(const T* plane, int64_t first, int64_t stride, int64_t begin, int64_t end, bool starts,
                         C* __restrict best, int64_t* __restrict best_at) {
  if (starts) {
    for (int64_t ox = begin; ox < end; ++ox) {
      best[ox] = load<T, C>(plane + (first + ox * stride));
      best_at[ox] = first + ox * stride;
    }
    return;
  }
  for (int64_t ox = begin; ox < end; ++ox) {
    const C v = load<T, C>(plane + (first + ox * stride));
    const C current = best[ox];
    const bool take = beats_max(v, current);
    best[ox] = take ? v : current;
    best_at[ox] = take ? first + ox * stride : best_at[ox];
  }
}

// A 2x2 window's element `place` (0 to 3, row by row) as an offset from
// its top-left element, in a plane `w` wide.
inline int64_t place_offset(int32_t place, int64_t w) { return (place & 1) + (place >> 1) * w; }

// The place of the window's maximum by beats_max (a NaN wins, a tie keeps
// the earlier element): the rule for rows that hold a NaN.
template <typename T, typename C>
int32_t window_max_place(const T* window, int64_t w) {
  auto value = [&](int32_t place) { return load<T, C>(window + place_offset(place, w)); };
  int32_t best = 0;
  for (int32_t place = 1; place < 4; ++place)
    if (beats_max(value(place), value(best))) best = place;
  return best;
}

// The common 2x2 window with stride 2 and no padding, one output row of a
// plane (bf16: pool_2x2_row_bf16). Each window's four elements are
// compared in the order the general path takes them (row by row), by
// plain `>` first: without NaNs that is beats_max, and the loop vectorizes
// (the NaN rule's extra tests keep GCC's vectorizer off it). The winner
// and its index are written in that same loop: read back in a second loop
// from what the vector loop had just stored, they stalled on every load
// (bench_cpu_conv, f32 pool1: 3.4 -> 1.0-1.2 ms). A row that holds a NaN
// is done again with beats_max.
template <typename T, typename C>
void pool_2x2_row(const T* plane, int64_t w, int64_t oy, int64_t wo, T* __restrict out, int64_t* __restrict at) {
  const int64_t top = 2 * oy * w;
  const T* r0 = plane + top;
  const T* r1 = r0 + w;
  int32_t any_nan = 0;
  for (int64_t ox = 0; ox < wo; ++ox) {
    const C a = load<T, C>(r0 + 2 * ox), b = load<T, C>(r0 + 2 * ox + 1);
    const C c = load<T, C>(r1 + 2 * ox), d = load<T, C>(r1 + 2 * ox + 1);
    const bool t1 = b > a;
    const C m1 = t1 ? b : a;
    const bool t2 = c > m1;
    const C m2 = t2 ? c : m1;
    const bool t3 = d > m2;
    store<T, C>(out + ox, t3 ? d : m2);  // a value read from T: exact
    at[ox] = top + 2 * ox + (t3 ? w + 1 : t2 ? w : t1 ? 1 : 0);
    any_nan |= (a != a) | (b != b) | (c != c) | (d != d);
  }
  if (any_nan) {
    for (int64_t ox = 0; ox < wo; ++ox) {
      const int64_t offset = place_offset(window_max_place<T, C>(r0 + 2 * ox, w), w);
      out[ox] = r0[2 * ox + offset];
      at[ox] = top + 2 * ox + offset;
    }
  }
}

// pool_2x2_row for bf16: the comparisons in one loop, noting each
// winner's place in its window (`which`, wo entries of scratch), then the
// winners copied and their indices written in another. Written in the
// comparisons' loop as for f32, the mix of 16-, 32- and 64-bit values kept
// it scalar and slower on cnn's 7-wide rows (bench_cpu_conv, pool2: 1.6 ->
// 2.3 ms). Copied as they are, the winners keep their bits: stored back
// from f32 they would go through the rounding's NaN test, which kept the
// comparisons' loop scalar too.
void pool_2x2_row_bf16(const BFloat16* plane, int64_t w, int64_t oy, int64_t wo, BFloat16* __restrict out,
                       int64_t* __restrict at, int32_t* __restrict which) {
  const int64_t top = 2 * oy * w;
  const BFloat16* r0 = plane + top;
  const BFloat16* r1 = r0 + w;
  int32_t any_nan = 0;
  for (int64_t ox = 0; ox < wo; ++ox) {
    // Each pair of neighbours as one 32-bit word, low half first: a
    // unit-stride load that vectorizes, where 16-bit loads two apart do not
    // (a bf16 value is the top half of its f32).
    uint32_t top_pair, bottom_pair;
    std::memcpy(&top_pair, r0 + 2 * ox, sizeof top_pair);
    std::memcpy(&bottom_pair, r1 + 2 * ox, sizeof bottom_pair);
    const float a = bits_float(top_pair << 16), b = bits_float(top_pair & 0xffff0000u);
    const float c = bits_float(bottom_pair << 16), d = bits_float(bottom_pair & 0xffff0000u);
    const bool t1 = b > a;
    const float m1 = t1 ? b : a;
    const bool t2 = c > m1;
    const float m2 = t2 ? c : m1;
    const bool t3 = d > m2;
    which[ox] = t3 ? 3 : t2 ? 2 : t1 ? 1 : 0;
    any_nan |= (a != a) | (b != b) | (c != c) | (d != d);
  }
  if (any_nan)
    for (int64_t ox = 0; ox < wo; ++ox) which[ox] = window_max_place<BFloat16, float>(r0 + 2 * ox, w);
  for (int64_t ox = 0; ox < wo; ++ox) {
    const int64_t offset = place_offset(which[ox], w);
    out[ox] = r0[2 * ox + offset];
    at[ox] = top + 2 * ox + offset;
  }
}

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
    // Output columns whose windows lie inside the image's width.
    const int64_t inner_begin = std::min(wo, (p.pad_w + p.stride_w - 1) / p.stride_w);
    const int64_t inner_end =
        std::max(inner_begin, std::min(wo, w + p.pad_w - p.kernel_w < 0 ? 0 : (w + p.pad_w - p.kernel_w) / p.stride_w + 1));
    auto pool_plane = [&](int64_t pl, std::vector<C>& best, std::vector<int64_t>& best_at) {
      const T* plane = in + pl * h * w;
      for (int64_t oy = 0; oy < ho; ++oy) {
        const int64_t y0 = std::max<int64_t>(oy * p.stride_h - p.pad_h, 0);
        const int64_t y1 = std::min<int64_t>(oy * p.stride_h - p.pad_h + p.kernel_h, h);
        // Windows clipped by the image's sides (or empty: -inf, index -1).
        auto pool_clipped = [&](int64_t ox) {
          const int64_t x0 = std::max<int64_t>(ox * p.stride_w - p.pad_w, 0);
          const int64_t x1 = std::min<int64_t>(ox * p.stride_w - p.pad_w + p.kernel_w, w);
          best[ox] = -std::numeric_limits<C>::infinity();
          best_at[ox] = -1;
          for (int64_t y = y0; y < y1; ++y)
            for (int64_t xx = x0; xx < x1; ++xx) {
              const C v = load<T, C>(plane + y * w + xx);
              if (best_at[ox] < 0 || beats_max(v, best[ox])) {
                best[ox] = v;
                best_at[ox] = y * w + xx;
              }
            }
        };
        for (int64_t ox = 0; ox < inner_begin; ++ox) pool_clipped(ox);
        for (int64_t ox = inner_end; ox < wo; ++ox) pool_clipped(ox);
        if (y0 < y1) {
          // The rest one window element at a time across the row.
          for (int64_t y = y0; y < y1; ++y)
            for (int64_t kx = 0; kx < p.kernel_w; ++kx)
              pool_window_element<T, C>(plane, y * w + kx - p.pad_w, p.stride_w, inner_begin, inner_end,
                                        y == y0 && kx == 0, best.data(), best_at.data());
        } else {
          for (int64_t ox = inner_begin; ox < inner_end; ++ox) pool_clipped(ox);
        }
        const int64_t k = pl * ho * wo + oy * wo;
        for (int64_t ox = 0; ox < wo; ++ox) {
          store<T, C>(o + k + ox, best[ox]);
          ix[k + ox] = best_at[ox];
        }
      }
    };
    const bool plain_2x2 = p.kernel_h == 2 && p.kernel_w == 2 && p.stride_h == 2 && p.stride_w == 2 && p.pad_h == 0 &&
                           p.pad_w == 0;
    parallel_for(planes, 1, min_planes_per_thread(ho * wo * p.kernel_h * p.kernel_w), [&](int64_t first, int64_t last) {
      if (plain_2x2) {
        std::vector<int32_t> which(static_cast<size_t>(wo));
        for (int64_t pl = first; pl < last; ++pl)
          for (int64_t oy = 0; oy < ho; ++oy) {
            const T* plane = in + pl * h * w;
            T* out_row = o + (pl * ho + oy) * wo;
            int64_t* at_row = ix + (pl * ho + oy) * wo;
            if constexpr (std::is_same_v<T, BFloat16>) {
              pool_2x2_row_bf16(plane, w, oy, wo, out_row, at_row, which.data());
            } else {
              pool_2x2_row<T, C>(plane, w, oy, wo, out_row, at_row);
            }
          }
        return;
      }
      std::vector<C> best(static_cast<size_t>(wo));
      std::vector<int64_t> best_at(static_cast<size_t>(wo));
      for (int64_t pl = first; pl < last; ++pl) pool_plane(pl, best, best_at);
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
