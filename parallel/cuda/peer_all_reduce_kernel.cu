#include "parallel/cuda/peer_all_reduce_kernel.h"

#include <algorithm>

#include "tensor/cuda/kernel_utils.cuh"

namespace mpt::dist::peer {

namespace {

using cuda::Element;
using cuda::Pack;

constexpr int kThreads = 512;
constexpr int kUnroll = 4;     // units each thread has in flight per pass step
constexpr int kBlocksUsed = 32;  // at most, of kMaxBlocks

__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ void store_release(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ uint32_t load_acquire(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Block blockIdx.x of every rank meets here for the `meeting`th time of
// call `call`. Thread t < world tells rank t that this block arrived, then
// waits until rank t's block says the same. False when a wait gave up
// (timeout or abort), with the reason in *status.
__device__ bool meet(const Args& a, int meeting, uint32_t call, uint64_t deadline, int& gave_up) {
  __syncthreads();  // this block's writes so far come before its flag
  if (threadIdx.x < a.world) {
    const int peer = threadIdx.x;
    const size_t slot = (static_cast<size_t>(meeting) * kMaxBlocks + blockIdx.x) * kMaxRanks;
    __threadfence_system();
    store_release(a.flags[peer] + slot + a.rank, call);
    const uint32_t* theirs = a.flags[a.rank] + slot + peer;
    // Counts wrap; a peer is at most one call ahead of this one.
    for (uint32_t spins = 1; static_cast<int32_t>(load_acquire(theirs) - call) < 0; ++spins) {
      if (spins % 256 != 0) continue;
      int why = kRunning;
      if (*static_cast<const volatile int*>(a.abort) != 0) why = kAborted;
      else if (global_ns() > deadline) why = kTimedOut;
      if (why != kRunning) {
        // A plain store: system-scope atomics on host memory need hardware
        // support that PCIe hosts may lack, and any nonzero word will do.
        *static_cast<volatile int*>(a.status) = why;
        __threadfence_system();
        gave_up = 1;
        break;
      }
    }
  }
  __syncthreads();
  return gave_up == 0;
}

// A unit read past the caches of this GPU's L1 (another GPU wrote it during
// this kernel): one 16-byte load for a pack, else one element.
template <typename U>
__device__ __forceinline__ U load_fresh(const U* p) {
  U out;
  if constexpr (sizeof(U) == 16) {
    const uint4 v = __ldcg(reinterpret_cast<const uint4*>(p));
    memcpy(&out, &v, sizeof v);
  } else {
    out.v[0] = __ldcg(&p->v[0]);
  }
  return out;
}

// Chunk c of `units` split over `world` ranks: [chunk_begin(c), chunk_begin(c + 1)).
__device__ __forceinline__ int64_t chunk_begin(int64_t units, int c, int world) { return units * c / world; }

// Units [begin, end) of this rank's chunk: the sum over every rank, in rank
// order, scaled and rounded once, written into every rank's memory. Block b
// handles the same units on every rank, so after the ranks' blocks b meet
// again, those units are final everywhere.
template <typename T, int N>
__device__ void sum_and_spread(const Args& a, int64_t begin, int64_t end) {
  using U = Pack<T, N>;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t base = begin + static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; base < end;
       base += stride * kUnroll) {
    float acc[kUnroll][N];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
#pragma unroll
      for (int k = 0; k < N; ++k) acc[u][k] = 0.f;
#pragma unroll
    for (int r = 0; r < kMaxRanks; ++r) {
      if (r >= a.world) break;
      const U* from = static_cast<const U*>(a.data[r]);
      U in[kUnroll]{};
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t i = base + u * stride;
        if (i < end) in[u] = load_fresh(from + i);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
#pragma unroll
        for (int k = 0; k < N; ++k) acc[u][k] += Element<T>::load(in[u].v[k]);
    }
    U out[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
#pragma unroll
      for (int k = 0; k < N; ++k) out[u].v[k] = Element<T>::store(acc[u][k] * a.scale);
#pragma unroll
    for (int r = 0; r < kMaxRanks; ++r) {
      if (r >= a.world) break;
      U* to = static_cast<U*>(a.data[r]);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t i = base + u * stride;
        if (i < end) to[i] = out[u];
      }
    }
  }
}

// The elements past the last whole pack, one at a time, by the last rank's
// block 0 (whose partners on the other ranks are blocks 0 too).
template <typename T>
__device__ void sum_and_spread_tail(const Args& a, int64_t from) {
  for (int64_t i = from + threadIdx.x; i < a.numel; i += kThreads) {
    float acc = 0.f;
    for (int r = 0; r < a.world; ++r) acc += Element<T>::load(__ldcg(static_cast<const T*>(a.data[r]) + i));
    const T out = Element<T>::store(acc * a.scale);
    for (int r = 0; r < a.world; ++r) static_cast<T*>(a.data[r])[i] = out;
  }
}

// Rank r owns chunk r: it reads that chunk from every rank, sums it and
// writes the result into every rank. Nobody else reads or writes chunk r,
// and the thread that writes a unit anywhere has read it there first, so
// the two meetings suffice: before (every rank's input is in place: its
// kernel started after its stream's earlier work) and after (every rank's
// writes into this memory are done, and nobody reads it any more, so the
// next fill may overwrite it).
template <typename T, int N>
__global__ void __launch_bounds__(kThreads) all_reduce_kernel(const Args a) {
  __shared__ uint32_t call;
  __shared__ int gave_up;
  if (threadIdx.x == 0) {
    call = a.calls[blockIdx.x] + 1;
    gave_up = 0;
  }
  const uint64_t deadline = global_ns() + a.timeout_ns;
  const int64_t units = a.numel / N;

  if (!meet(a, 0, call, deadline, gave_up)) return;
  sum_and_spread<T, N>(a, chunk_begin(units, a.rank, a.world), chunk_begin(units, a.rank + 1, a.world));
  if (blockIdx.x == 0 && a.rank == a.world - 1) sum_and_spread_tail<T>(a, units * N);
  if (!meet(a, 1, call, deadline, gave_up)) return;
  if (threadIdx.x == 0) a.calls[blockIdx.x] = call;
}

template <typename T>
cudaError_t launch_for(const Args& args, cudaStream_t stream) {
  constexpr int kPack = 16 / sizeof(T);
  const int blocks = blocks_for(args.numel * static_cast<int64_t>(sizeof(T)), args.world);
  if (reinterpret_cast<uintptr_t>(args.data[args.rank]) % 16 == 0)
    all_reduce_kernel<T, kPack><<<blocks, kThreads, 0, stream>>>(args);
  else
    all_reduce_kernel<T, 1><<<blocks, kThreads, 0, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace

int blocks_for(int64_t bytes, int world) {
  // Enough blocks that each thread has about kUnroll 16-byte units of its
  // rank's chunk per pass, up to kBlocksUsed.
  const int64_t units_per_chunk = (bytes / 16 + world - 1) / std::max(world, 1);
  const int64_t want = (units_per_chunk + int64_t(kThreads) * kUnroll - 1) / (int64_t(kThreads) * kUnroll);
  return static_cast<int>(std::clamp<int64_t>(want, 1, kBlocksUsed));
}

cudaError_t launch_all_reduce(const Args& args, DType dtype, cudaStream_t stream) {
  switch (dtype) {
    case DType::f32: return launch_for<float>(args, stream);
    case DType::f16: return launch_for<__half>(args, stream);
    case DType::bf16: return launch_for<__nv_bfloat16>(args, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace mpt::dist::peer
