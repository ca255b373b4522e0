// Fused attention on the CPU: softmax(q k^T * scale [+ causal mask]) v and
// its gradients, one (batch, head) pair at a time on each of the backend's
// threads. A pair's q, k and v are widened into f32 buffers of [T, D]; its
// queries go in blocks of kQueryBlock rows, and each block's scores against
// the keys it may see live in a tile of kQueryBlock x Tk floats that stays in
// the core's cache. The composed math it replaces wrote the [B, H, T, T]
// scores, their scaled, masked and softmaxed copies, and as many again
// backward, to memory (gpt_mini: 100 MB each, per layer).
//
// The backward pass recomputes each block's probabilities from the forward's
// log-sum-exp, as flash attention does on a GPU, instead of keeping them.
// Keys that a causal mask hides from a whole block of queries are never
// touched: about half the products of a square causal attention.
#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <vector>

#include "tensor/cpu/cpu_kernels.h"
#include "tensor/cpu/cpu_rows.h"
#include "tensor/cpu/cpu_threads.h"
#include "tensor/cpu/fast_math.h"

namespace mpt::cpu {
namespace {

using Matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using Block = Eigen::Map<Matrix>;
using ConstBlock = Eigen::Map<const Matrix>;

// Rows a block of queries holds: 64 x 1024 scores (context 1024) are 256 KB,
// within a core's L2 cache beside the block's share of k and v.
constexpr int64_t kQueryBlock = 64;

// x[j] = exp(x[j] - shift) for j < n, returning their sum (the
// exponentials in a loop of their own, so that both loops vectorise).
float exp_shifted_sum(float* x, int64_t n, float shift) {
  for (int64_t j = 0; j < n; ++j) x[j] = exp_f32(x[j] - shift);
  return row_sum(n, [x](int64_t j) { return x[j]; });
}

// One [B, H, T, D] view's (b, h) slice: row i at row(i).
template <typename T>
struct Slice {
  T* base;
  int64_t row_stride;
  T* row(int64_t i) const { return base + i * row_stride; }
};

template <typename T>
Slice<T> slice_of(const TensorView& v, int64_t b, int64_t h) {
  return {static_cast<T*>(v.data) + b * v.strides[0] + h * v.strides[1], v.strides[2]};
}

template <typename T>
void widen(const Slice<T>& from, int64_t rows, int64_t d, float* to) {
  for (int64_t i = 0; i < rows; ++i) {
    const T* src = from.row(i);
    float* dst = to + i * d;
    for (int64_t j = 0; j < d; ++j) dst[j] = static_cast<float>(src[j]);
  }
}

template <typename T>
void narrow(const float* from, int64_t rows, int64_t d, const Slice<T>& to) {
  for (int64_t i = 0; i < rows; ++i) {
    const float* src = from + i * d;
    T* dst = to.row(i);
    for (int64_t j = 0; j < d; ++j) dst[j] = static_cast<T>(src[j]);
  }
}

// The shape every kernel here reads, and which keys a query sees: query i
// sits at key position tk - tq + i, and with the causal mask sees the keys
// up to it.
struct Problem {
  int64_t batch, heads, tq, tk, d;
  bool causal;
  float scale;

  int64_t keys_seen(int64_t query) const { return causal ? std::min(tk, tk - tq + query + 1) : tk; }
  int64_t pairs() const { return batch * heads; }
  // Multiply-adds of one pair, forward, roughly (for splitting the work).
  int64_t pair_work() const { return std::max<int64_t>(2 * tq * tk * d, 1); }
};

Problem problem_of(const TensorView& q, const TensorView& k, bool causal, double scale) {
  return {q.shape[0], q.shape[1], q.shape[2], k.shape[2], q.shape[3], causal, static_cast<float>(scale)};
}

// Pairs split over the threads, each piece with its own scratch.
template <typename Scratch, typename F>
void for_each_pair(const Problem& p, int64_t work_factor, F&& f) {
  const int64_t min_pairs = units_for_work(kMinMultiplyAddsPerPiece, work_factor * p.pair_work());
  parallel_for(p.pairs(), 1, min_pairs, [&](int64_t begin, int64_t end) {
    Scratch scratch(p);
    for (int64_t pair = begin; pair < end; ++pair) f(pair / p.heads, pair % p.heads, scratch);
  });
}

struct ForwardScratch {
  std::vector<float> q, k, v, scores, out;
  explicit ForwardScratch(const Problem& p)
      : q(p.tq * p.d), k(p.tk * p.d), v(p.tk * p.d), scores(kQueryBlock * p.tk), out(kQueryBlock * p.d) {}
};

template <typename T>
void forward_typed(const TensorView& out, const TensorView& lse, const TensorView& q, const TensorView& k,
                   const TensorView& v, const Problem& p) {
  for_each_pair<ForwardScratch>(p, 1, [&](int64_t b, int64_t h, ForwardScratch& s) {
    widen(slice_of<T>(q, b, h), p.tq, p.d, s.q.data());
    widen(slice_of<T>(k, b, h), p.tk, p.d, s.k.data());
    widen(slice_of<T>(v, b, h), p.tk, p.d, s.v.data());
    float* lse_row = static_cast<float*>(lse.data) + (b * p.heads + h) * p.tq;
    const Slice<T> out_slice = slice_of<T>(out, b, h);
    for (int64_t i0 = 0; i0 < p.tq; i0 += kQueryBlock) {
      const int64_t rows = std::min(kQueryBlock, p.tq - i0);
      const int64_t keys = p.keys_seen(i0 + rows - 1);  // the block's last query sees the most
      Block scores(s.scores.data(), rows, keys);
      scores.noalias() = ConstBlock(s.q.data() + i0 * p.d, rows, p.d) *
                         ConstBlock(s.k.data(), keys, p.d).transpose() * p.scale;
      for (int64_t r = 0; r < rows; ++r) {
        float* row = s.scores.data() + r * keys;
        const int64_t seen = p.keys_seen(i0 + r);
        const float max = row_max(row, seen);
        const float sum = exp_shifted_sum(row, seen, max);
        const float inverse = 1.0f / sum;
        for (int64_t j = 0; j < seen; ++j) row[j] *= inverse;
        std::fill(row + seen, row + keys, 0.0f);
        lse_row[i0 + r] = max + std::log(sum);
      }
      Block block_out(s.out.data(), rows, p.d);
      block_out.noalias() = scores * ConstBlock(s.v.data(), keys, p.d);
      narrow(s.out.data(), rows, p.d, Slice<T>{out_slice.row(i0), out_slice.row_stride});
    }
  });
}

struct BackwardScratch {
  std::vector<float> q, k, v, out, grad_out, grad_q, grad_k, grad_v, probs, grad_scores;
  explicit BackwardScratch(const Problem& p)
      : q(p.tq * p.d), k(p.tk * p.d), v(p.tk * p.d), out(p.tq * p.d), grad_out(p.tq * p.d),
        grad_q(kQueryBlock * p.d), grad_k(p.tk * p.d), grad_v(p.tk * p.d), probs(kQueryBlock * p.tk),
        grad_scores(kQueryBlock * p.tk) {}
};

template <typename T>
void backward_typed(const TensorView& grad_q, const TensorView& grad_k, const TensorView& grad_v,
                    const TensorView& delta, const TensorView& q, const TensorView& k, const TensorView& v,
                    const TensorView& out, const TensorView& lse, const TensorView& grad_out, const Problem& p) {
  // Backward runs five products of the forward's size to its two.
  for_each_pair<BackwardScratch>(p, 2, [&](int64_t b, int64_t h, BackwardScratch& s) {
    widen(slice_of<T>(q, b, h), p.tq, p.d, s.q.data());
    widen(slice_of<T>(k, b, h), p.tk, p.d, s.k.data());
    widen(slice_of<T>(v, b, h), p.tk, p.d, s.v.data());
    widen(slice_of<T>(out, b, h), p.tq, p.d, s.out.data());
    widen(slice_of<T>(grad_out, b, h), p.tq, p.d, s.grad_out.data());
    const int64_t row0 = (b * p.heads + h) * p.tq;
    const float* lse_row = static_cast<const float*>(lse.data) + row0;
    float* delta_row = static_cast<float*>(delta.data) + row0;
    // delta_i = sum_j P_ij dP_ij = dO_i . O_i: what each row's softmax
    // gradient subtracts.
    for (int64_t i = 0; i < p.tq; ++i) {
      const float* o = s.out.data() + i * p.d;
      const float* g = s.grad_out.data() + i * p.d;
      float sum = 0.0f;
      for (int64_t j = 0; j < p.d; ++j) sum += o[j] * g[j];
      delta_row[i] = sum;
    }
    Block all_grad_k(s.grad_k.data(), p.tk, p.d), all_grad_v(s.grad_v.data(), p.tk, p.d);
    all_grad_k.setZero();
    all_grad_v.setZero();
    const Slice<T> grad_q_slice = slice_of<T>(grad_q, b, h);
    for (int64_t i0 = 0; i0 < p.tq; i0 += kQueryBlock) {
      const int64_t rows = std::min(kQueryBlock, p.tq - i0);
      const int64_t keys = p.keys_seen(i0 + rows - 1);
      const ConstBlock block_q(s.q.data() + i0 * p.d, rows, p.d), block_grad_out(s.grad_out.data() + i0 * p.d, rows, p.d);
      const ConstBlock seen_k(s.k.data(), keys, p.d), seen_v(s.v.data(), keys, p.d);
      Block probs(s.probs.data(), rows, keys), grad_scores(s.grad_scores.data(), rows, keys);
      probs.noalias() = block_q * seen_k.transpose() * p.scale;
      for (int64_t r = 0; r < rows; ++r) {
        float* row = s.probs.data() + r * keys;
        const int64_t seen = p.keys_seen(i0 + r);
        const float shift = lse_row[i0 + r];
        for (int64_t j = 0; j < seen; ++j) row[j] = exp_f32(row[j] - shift);
        std::fill(row + seen, row + keys, 0.0f);
      }
      all_grad_v.topRows(keys).noalias() += probs.transpose() * block_grad_out;
      grad_scores.noalias() = block_grad_out * seen_v.transpose();
      for (int64_t r = 0; r < rows; ++r) {
        const float* pr = s.probs.data() + r * keys;
        float* gr = s.grad_scores.data() + r * keys;
        const float dr = delta_row[i0 + r];
        for (int64_t j = 0; j < keys; ++j) gr[j] = pr[j] * (gr[j] - dr) * p.scale;
      }
      Block block_grad_q(s.grad_q.data(), rows, p.d);
      block_grad_q.noalias() = grad_scores * seen_k;
      all_grad_k.topRows(keys).noalias() += grad_scores.transpose() * block_q;
      narrow(s.grad_q.data(), rows, p.d, Slice<T>{grad_q_slice.row(i0), grad_q_slice.row_stride});
    }
    narrow(s.grad_k.data(), p.tk, p.d, slice_of<T>(grad_k, b, h));
    narrow(s.grad_v.data(), p.tk, p.d, slice_of<T>(grad_v, b, h));
  });
}

template <typename F>
void dispatch_attention(DType dtype, F&& f) {
  switch (dtype) {
    case DType::f32: return f(float{});
    case DType::f16: return f(Half{});
    case DType::bf16: return f(BFloat16{});
    default:
      throw DTypeError(fmt::format("CPU attention: dtype {} is not supported (f32, f16, bf16)", dtype_name(dtype)));
  }
}

}  // namespace

bool attention_supported(DType dtype) { return dtype == DType::f32 || dtype == DType::f16 || dtype == DType::bf16; }

void attention_forward(const TensorView& out, const TensorView& lse, const TensorView& q, const TensorView& k,
                       const TensorView& v, bool causal, double scale) {
  const Problem p = problem_of(q, k, causal, scale);
  if (p.pairs() == 0 || p.tq == 0) return;
  dispatch_attention(q.dtype, [&](auto t) { forward_typed<decltype(t)>(out, lse, q, k, v, p); });
}

void attention_backward(const TensorView& grad_q, const TensorView& grad_k, const TensorView& grad_v,
                        const TensorView& delta, const TensorView& q, const TensorView& k, const TensorView& v,
                        const TensorView& out, const TensorView& lse, const TensorView& grad_out, bool causal,
                        double scale) {
  const Problem p = problem_of(q, k, causal, scale);
  if (p.pairs() == 0) return;
  dispatch_attention(q.dtype, [&](auto t) {
    backward_typed<decltype(t)>(grad_q, grad_k, grad_v, delta, q, k, v, out, lse, grad_out, p);
  });
}

}  // namespace mpt::cpu
