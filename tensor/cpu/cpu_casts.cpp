// Casts between f32, f16 and bf16 on the CPU, and lists of tensors copied
// scaled: loops the compiler vectorizes, split over the backend's threads.
// Autocast casts every weight ahead of each step and the backward casts
// the gradients back to f32; one element at a time on one thread these
// took a tenth of a small model's step.
#include <algorithm>
#include <type_traits>
#include <vector>

#include "tensor/cpu/cpu_kernels.h"
#include "tensor/cpu/cpu_threads.h"

namespace mpt::cpu {
namespace {

bool castable(DType t) { return t == DType::f32 || t == DType::f16 || t == DType::bf16; }

// Calls f(D{}, S{}) for a destination and a source dtype among f32, f16 and bf16.
template <typename F>
void dispatch_pair(DType dst, DType src, const char* op, F&& f) {
  dispatch_half_or_float(dst, op, [&](auto d) { dispatch_half_or_float(src, op, [&](auto s) { f(d, s); }); });
}

// d[i] = s[i] (times scale where kScaled), through f32 and rounded once.
// Unscaled, a value's bits go through as copy's casts take them (a
// signalling NaN stays one, where x * 1 would quiet it).
template <bool kScaled, typename D, typename S>
void cast_run(D* d, const S* s, int64_t n, float scale) {
  if constexpr (!kScaled && std::is_same_v<D, S>) {
    std::copy(s, s + n, d);
  } else {
    for (int64_t i = 0; i < n; ++i) {
      const float x = load<S, float>(s + i);
      store<D, float>(d + i, kScaled ? x * scale : x);
    }
  }
}

}  // namespace

bool cast_dense(const TensorView& dst, const TensorView& src) {
  if (dst.dtype == src.dtype || !castable(dst.dtype) || !castable(src.dtype) || !dst.is_contiguous() ||
      !src.is_contiguous())
    return false;
  dispatch_pair(dst.dtype, src.dtype, "copy", [&](auto dtag, auto stag) {
    using D = decltype(dtag);
    using S = decltype(stag);
    D* d = static_cast<D*>(dst.data);
    const S* s = static_cast<const S*>(src.data);
    parallel_for_elements(dst.numel(), [&](int64_t begin, int64_t end) {
      cast_run<false>(d + begin, s + begin, end - begin, 1.0f);
    });
  });
  return true;
}

void scaled_copy_list(const std::vector<TensorView>& dsts, const std::vector<TensorView>& srcs, double scale) {
  if (dsts.empty()) return;
  // The tensors' elements end to end, split as one dense range: a model's
  // many small tensors share the threads as its few large ones do.
  std::vector<int64_t> starts(dsts.size() + 1, 0);
  for (size_t i = 0; i < dsts.size(); ++i) starts[i + 1] = starts[i] + dsts[i].numel();
  const float f32_scale = static_cast<float>(scale);
  dispatch_pair(dsts.front().dtype, srcs.front().dtype, "scaled_copy_list", [&](auto dtag, auto stag) {
    using D = decltype(dtag);
    using S = decltype(stag);
    parallel_for_elements(starts.back(), [&](int64_t begin, int64_t end) {
      size_t i = static_cast<size_t>(std::upper_bound(starts.begin(), starts.end(), begin) - starts.begin()) - 1;
      for (; i < dsts.size() && starts[i] < end; ++i) {
        const int64_t first = std::max(begin, starts[i]) - starts[i];
        const int64_t last = std::min(end, starts[i + 1]) - starts[i];
        D* d = static_cast<D*>(dsts[i].data) + first;
        const S* s = static_cast<const S*>(srcs[i].data) + first;
        if (scale == 1.0) {
          cast_run<false>(d, s, last - first, 1.0f);
        } else {
          cast_run<true>(d, s, last - first, f32_scale);
        }
      }
    });
  });
}

}  // namespace mpt::cpu
