// Kernels that write values rather than compute them: copy with dtype
// conversion, fill, arange, and the Philox uniform/normal draws. All take the
// dtypes at run time (one kernel each), apart from a packed fast path for the
// float <-> half casts that autocast runs on every step.
#include <cuda_fp8.h>

#include "tensor/cuda/kernel_utils.cuh"
#include "tensor/philox.h"

namespace mpt::cuda {
namespace {

__device__ __forceinline__ bool is_integral(DType t) { return t == DType::i32 || t == DType::i64 || t == DType::u8; }

__device__ __forceinline__ int element_size(DType t) {
  switch (t) {
    case DType::u8:
    case DType::e4m3:
    case DType::e5m2: return 1;
    case DType::f16:
    case DType::bf16: return 2;
    case DType::f32:
    case DType::i32: return 4;
    case DType::f64:
    case DType::i64: return 8;
  }
  return 8;
}

__device__ __forceinline__ __nv_fp8_interpretation_t fp8_format(DType t) {
  return t == DType::e4m3 ? __NV_E4M3 : __NV_E5M2;
}

// Decoded exactly through f16, as tensor/fp8.h decodes on the CPU.
__device__ __forceinline__ float fp8_to_float(uint8_t b, DType t) {
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(b, fp8_format(t))));
}

// One rounding from double, not saturating, as a plain cast on the CPU
// (fp8.h): NaN becomes 0x7F first, as cvt from a float makes it (the double
// conversion would keep the sign and, for e5m2, payload bits).
__device__ __forceinline__ uint8_t double_to_fp8(double v, DType t) {
  return isnan(v) ? uint8_t{0x7F} : __nv_cvt_double_to_fp8(v, __NV_NOSAT, fp8_format(t));
}

// Floating element as a double (exact for every floating dtype).
__device__ __forceinline__ double load_floating(const void* p, DType t, int64_t i) {
  switch (t) {
    case DType::f32: return static_cast<const float*>(p)[i];
    case DType::f16: return __half2float(static_cast<const __half*>(p)[i]);
    case DType::bf16: return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    case DType::e4m3:
    case DType::e5m2: return fp8_to_float(static_cast<const uint8_t*>(p)[i], t);
    default: return static_cast<const double*>(p)[i];
  }
}

__device__ __forceinline__ long long load_integral(const void* p, DType t, int64_t i) {
  switch (t) {
    case DType::i32: return static_cast<const int32_t*>(p)[i];
    case DType::u8: return static_cast<const uint8_t*>(p)[i];
    default: return static_cast<const int64_t*>(p)[i];
  }
}

// One correctly rounded step from double (RNE; overflow to inf), which for a
// value that came from f32 is the same as rounding that f32. Integers
// truncate toward zero, like static_cast (out of range is undefined in C++;
// here it saturates).
__device__ __forceinline__ void store_double(void* p, DType t, int64_t i, double v) {
  switch (t) {
    case DType::f32: static_cast<float*>(p)[i] = __double2float_rn(v); break;
    case DType::f16: static_cast<__half*>(p)[i] = __double2half(v); break;
    case DType::bf16: static_cast<__nv_bfloat16*>(p)[i] = __double2bfloat16(v); break;
    case DType::f64: static_cast<double*>(p)[i] = v; break;
    case DType::i32: static_cast<int32_t*>(p)[i] = static_cast<int32_t>(v); break;
    case DType::i64: static_cast<int64_t*>(p)[i] = static_cast<int64_t>(v); break;
    case DType::u8: static_cast<uint8_t*>(p)[i] = static_cast<uint8_t>(static_cast<int32_t>(v)); break;
    case DType::e4m3:
    case DType::e5m2: static_cast<uint8_t*>(p)[i] = double_to_fp8(v, t); break;
  }
}

// Integers to floats go through double, as on the CPU (exact up to 2^53, so
// one rounding for every practical value). Integer to integer wraps, like
// static_cast.
__device__ __forceinline__ void store_integral(void* p, DType t, int64_t i, long long v) {
  switch (t) {
    case DType::f32: static_cast<float*>(p)[i] = __double2float_rn(__ll2double_rn(v)); break;
    case DType::f16: static_cast<__half*>(p)[i] = __double2half(__ll2double_rn(v)); break;
    case DType::bf16: static_cast<__nv_bfloat16*>(p)[i] = __double2bfloat16(__ll2double_rn(v)); break;
    case DType::f64: static_cast<double*>(p)[i] = __ll2double_rn(v); break;
    case DType::i32: static_cast<int32_t*>(p)[i] = static_cast<int32_t>(v); break;
    case DType::i64: static_cast<int64_t*>(p)[i] = static_cast<int64_t>(v); break;
    case DType::u8: static_cast<uint8_t*>(p)[i] = static_cast<uint8_t>(v); break;
    case DType::e4m3:
    case DType::e5m2: static_cast<uint8_t*>(p)[i] = double_to_fp8(__ll2double_rn(v), t); break;
  }
}

template <typename T>
__device__ __forceinline__ void copy_raw(void* dst, int64_t i, const void* src, int64_t j) {
  static_cast<T*>(dst)[i] = static_cast<const T*>(src)[j];
}

__global__ void copy_kernel(Strided<2> s, int64_t n, DType dst_type, DType src_type) {
  void* dst = s.data[0];
  const void* src = s.data[1];
  if (dst_type == src_type) {  // a strided gather: move the bits
    const int size = element_size(dst_type);
    for_each_strided(s, n, 1, [&](const int64_t (&off)[2]) {
      switch (size) {
        case 1: copy_raw<uint8_t>(dst, off[0], src, off[1]); break;
        case 2: copy_raw<uint16_t>(dst, off[0], src, off[1]); break;
        case 4: copy_raw<uint32_t>(dst, off[0], src, off[1]); break;
        default: copy_raw<uint64_t>(dst, off[0], src, off[1]); break;
      }
    });
  } else if (is_integral(src_type)) {
    for_each_strided(s, n, 1, [&](const int64_t (&off)[2]) {
      store_integral(dst, dst_type, off[0], load_integral(src, src_type, off[1]));
    });
  } else {
    for_each_strided(s, n, 1, [&](const int64_t (&off)[2]) {
      store_double(dst, dst_type, off[0], load_floating(src, src_type, off[1]));
    });
  }
}

// Same-dtype copy whose rows are whole 16-byte Packs on both sides (a permute
// that keeps the innermost dimension, say): offsets once per Pack of
// `per_pack` elements, 16 bytes per load and store.
__global__ void copy_packs_kernel(Strided<2> s, int64_t packs, int per_pack, int element_size) {
  char* dst = static_cast<char*>(s.data[0]);
  const char* src = static_cast<const char*>(s.data[1]);
  for_each_strided(s, packs, per_pack, [&](const int64_t (&off)[2]) {
    *reinterpret_cast<uint4*>(dst + off[0] * element_size) =
        *reinterpret_cast<const uint4*>(src + off[1] * element_size);
  });
}

// Contiguous f32 <-> f16/bf16, four elements per thread and access.
template <typename Src, typename Dst>
__global__ void cast_kernel(Dst* dst, const Src* src, int64_t n, bool packed) {
  const int64_t first = global_thread(), step = grid_threads();
  int64_t tail = 0;
  if (packed) {
    using PS = Pack<Src, 4>;
    using PD = Pack<Dst, 4>;
    const int64_t packs = n / 4;
    for (int64_t p = first; p < packs; p += step) {
      const PS x = reinterpret_cast<const PS*>(src)[p];
      PD y;
#pragma unroll
      for (int j = 0; j < 4; ++j) y.v[j] = Element<Dst>::store(Element<Src>::load(x.v[j]));
      reinterpret_cast<PD*>(dst)[p] = y;
    }
    tail = packs * 4;
  }
  for (int64_t i = tail + first; i < n; i += step) dst[i] = Element<Dst>::store(Element<Src>::load(src[i]));
}

// The same conversion between rows of whole four-element Packs on both
// sides (a third of a [.., 3 * C] block, say): offsets once per Pack.
template <typename Src, typename Dst>
__global__ void cast_packs_kernel(Strided<2> s, int64_t packs) {
  Dst* dst = static_cast<Dst*>(s.data[0]);
  const Src* src = static_cast<const Src*>(s.data[1]);
  for_each_strided(s, packs, 4, [&](const int64_t (&off)[2]) {
    const Pack<Src, 4> x = *reinterpret_cast<const Pack<Src, 4>*>(src + off[1]);
    Pack<Dst, 4> y;
#pragma unroll
    for (int j = 0; j < 4; ++j) y.v[j] = Element<Dst>::store(Element<Src>::load(x.v[j]));
    *reinterpret_cast<Pack<Dst, 4>*>(dst + off[0]) = y;
  });
}

template <typename Src, typename Dst>
void launch_cast(const Launch& l, void* dst, const void* src, int64_t n) {
  const bool packed = aligned_to(4 * sizeof(Src), {src}) && aligned_to(4 * sizeof(Dst), {dst});
  cast_kernel<Src, Dst><<<grid_for(l, packed ? n / 4 + 1 : n), kThreads, 0, l.stream>>>(
      static_cast<Dst*>(dst), static_cast<const Src*>(src), n, packed);
  MPT_CUDA_CHECK_LAUNCH("cast_kernel");
}

template <typename Bits>
__global__ void fill_kernel(Strided<1> s, int64_t n, Bits bits) {
  Bits* out = static_cast<Bits*>(s.data[0]);
  for_each_strided(s, n, 1, [&](const int64_t (&off)[1]) { out[off[0]] = bits; });
}

template <typename Bits>
void launch_fill_bits(const Launch& l, const Strided<1>& s, int64_t n, uint64_t bits) {
  fill_kernel<Bits><<<grid_for(l, n), kThreads, 0, l.stream>>>(s, n, static_cast<Bits>(bits));
  MPT_CUDA_CHECK_LAUNCH("fill_kernel");
}

// __dmul_rn / __dadd_rn are never fused into an FMA, so the result is the
// one the CPU computes with a separate multiply and add.
__global__ void arange_kernel(void* out, DType t, int64_t n, double start, double step) {
  for (int64_t i = global_thread(); i < n; i += grid_threads())
    store_double(out, t, i, __dadd_rn(start, __dmul_rn(static_cast<double>(i), step)));
}

// Element i depends only on (seed, offset, i), never on the launch shape.
// A uniform draw that rounds up to `high` in the tensor's floating dtype
// becomes `shift` (low), as on the CPU and in PyTorch: [low, high) holds.
__global__ void random_kernel(void* out, DType t, int64_t n, uint64_t seed, uint64_t offset, bool normal,
                              double scale, double shift, double high) {
  for (int64_t i = global_thread(); i < n; i += grid_threads()) {
    const uint64_t u = static_cast<uint64_t>(i);
    const double x = normal ? philox_normal_at(seed, offset, u) : philox_uniform_at(seed, offset, u);
    store_double(out, t, i, __dadd_rn(__dmul_rn(x, scale), shift));
    if (!normal && !is_integral(t) && load_floating(out, t, i) >= high) store_double(out, t, i, shift);
  }
}

template <typename Src, typename Dst>
void launch_cast(const Launch& l, DType dst, DType src, const Strided<2>& s, int64_t n) {
  if (s.contiguous()) return launch_cast<Src, Dst>(l, s.data[0], s.data[1], n);
  // Rows of whole Packs (alignment checked as for 16-byte f32 Packs).
  if (choose_layout(s, sizeof(float), /*allow_broadcast=*/false) == Layout::packed && n % 4 == 0) {
    cast_packs_kernel<Src, Dst><<<grid_for(l, n / 4), kThreads, 0, l.stream>>>(s, n / 4);
    MPT_CUDA_CHECK_LAUNCH("cast_packs_kernel");
    return;
  }
  copy_kernel<<<grid_for(l, n), kThreads, 0, l.stream>>>(s, n, dst, src);
  MPT_CUDA_CHECK_LAUNCH("copy_kernel");
}

}  // namespace

void launch_copy(const Launch& l, DType dst, DType src, const Strided<2>& s, int64_t n) {
  if (src == DType::f32 && dst == DType::f16) return launch_cast<float, __half>(l, dst, src, s, n);
  if (src == DType::f32 && dst == DType::bf16) return launch_cast<float, __nv_bfloat16>(l, dst, src, s, n);
  if (src == DType::f16 && dst == DType::f32) return launch_cast<__half, float>(l, dst, src, s, n);
  if (src == DType::bf16 && dst == DType::f32) return launch_cast<__nv_bfloat16, float>(l, dst, src, s, n);
  const size_t size = dtype_size(dst);
  if (src == dst && choose_layout(s, size, /*allow_broadcast=*/false) == Layout::packed &&
      n % (16 / size) == 0) {
    const int per_pack = static_cast<int>(16 / size);
    copy_packs_kernel<<<grid_for(l, n / per_pack), kThreads, 0, l.stream>>>(s, n / per_pack, per_pack,
                                                                            static_cast<int>(size));
    MPT_CUDA_CHECK_LAUNCH("copy_packs_kernel");
    return;
  }
  copy_kernel<<<grid_for(l, n), kThreads, 0, l.stream>>>(s, n, dst, src);
  MPT_CUDA_CHECK_LAUNCH("copy_kernel");
}

void launch_fill(const Launch& l, const Strided<1>& s, size_t element_size, uint64_t bits, int64_t n) {
  switch (element_size) {
    case 1: return launch_fill_bits<uint8_t>(l, s, n, bits);
    case 2: return launch_fill_bits<uint16_t>(l, s, n, bits);
    case 4: return launch_fill_bits<uint32_t>(l, s, n, bits);
    default: return launch_fill_bits<uint64_t>(l, s, n, bits);
  }
}

void launch_arange(const Launch& l, void* out, DType dtype, int64_t n, double start, double step) {
  arange_kernel<<<grid_for(l, n), kThreads, 0, l.stream>>>(out, dtype, n, start, step);
  MPT_CUDA_CHECK_LAUNCH("arange_kernel");
}

void launch_random(const Launch& l, void* out, DType dtype, int64_t n, uint64_t seed, uint64_t offset, bool normal,
                   double a, double b) {
  // uniform: x * (high - low) + low; normal: x * stddev + mean.
  const double scale = normal ? b : b - a;
  const double shift = a;
  random_kernel<<<grid_for(l, n), kThreads, 0, l.stream>>>(out, dtype, n, seed, offset, normal, scale, shift, b);
  MPT_CUDA_CHECK_LAUNCH("random_kernel");
}

}  // namespace mpt::cuda
