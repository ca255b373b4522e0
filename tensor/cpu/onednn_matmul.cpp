#include "tensor/cpu/onednn_matmul.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cstddef>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <vector>

#include "tensor/cpu/cpu_threads.h"
#include "tensor/cpu/onednn_runtime.h"
#include "tensor/error.h"

namespace mpt::cpu {
namespace {

using dnnl::memory;

std::atomic<OnednnUse> use{OnednnUse::kWhereFaster};
std::atomic<int64_t> products_run{0}, products_declined{0}, primitives_made{0};

// Thrown by a piece whose primitive oneDNN refuses; the whole product then
// goes to Eigen (pieces already run wrote only into out, which Eigen
// overwrites).
struct Declined {};

// One operand of a piece: [batch, rows, cols] and strides in elements.
// oneDNN rejects layouts whose elements could overlap and takes its
// matrices row-major or transposed, so a dimension of size 1 gets the
// stride a row-major layout would give it, and a broadcast batch (stride
// 0) is a batch of 1, which oneDNN's matmul broadcasts.
struct Operand {
  std::array<int64_t, 3> dims, strides;
};

Operand operand(int64_t batch, int64_t rows, int64_t cols, int64_t bs, int64_t rs, int64_t cs) {
  if (bs == 0) batch = 1;
  if (cols == 1) cs = 1;
  if (rows == 1) rs = cols * cs;
  if (batch == 1) bs = std::max(rows * rs, cols * cs);
  return {{batch, rows, cols}, {bs, rs, cs}};
}

// A piece's primitive is looked up by everything its descriptors hold.
struct Key {
  std::array<int64_t, 22> v{};
  bool operator==(const Key& o) const { return v == o.v; }
};
struct KeyHash {
  size_t operator()(const Key& k) const {
    uint64_t h = 1469598103934665603ull;
    for (int64_t x : k.v) h = (h ^ static_cast<uint64_t>(x)) * 1099511628211ull;
    return static_cast<size_t>(h);
  }
};

struct Piece {
  Operand a, b, out;
  DType in = DType::f32, out_dtype = DType::f32, bias_dtype = DType::f32;
  bool bias = false;
  int ndims = 2;  // 2 where every batch is 1, else 3

  Key key() const {
    Key k;
    size_t i = 0;
    for (const Operand* o : {&a, &b, &out}) {
      for (int64_t d : o->dims) k.v[i++] = d;
      for (int64_t s : o->strides) k.v[i++] = s;
    }
    k.v[i++] = static_cast<int64_t>(in);
    k.v[i++] = static_cast<int64_t>(out_dtype);
    k.v[i++] = bias ? static_cast<int64_t>(bias_dtype) : -1;
    k.v[i++] = ndims;
    return k;
  }
};

// A made primitive with its descriptors (memory objects are made from them
// at each run), or a refusal (no primitive).
struct Entry {
  std::optional<dnnl::matmul> primitive;
  memory::desc a, b, out, bias;
  size_t scratchpad_bytes = 0;
};

memory::data_type dnnl_type(DType t) {
  switch (t) {
    case DType::f32: return memory::data_type::f32;
    case DType::bf16: return memory::data_type::bf16;
    default: return memory::data_type::undef;
  }
}

memory::desc describe(const Operand& o, DType t, int ndims) {
  if (ndims == 2) return memory::desc({o.dims[1], o.dims[2]}, dnnl_type(t), {o.strides[1], o.strides[2]});
  return memory::desc({o.dims[0], o.dims[1], o.dims[2]}, dnnl_type(t), {o.strides[0], o.strides[1], o.strides[2]});
}

std::string shapes_of(const Piece& p) {
  return fmt::format("matmul [{}, {}, {}] @ [{}, {}, {}] ({} -> {})", p.a.dims[0], p.a.dims[1], p.a.dims[2], p.b.dims[0],
                     p.b.dims[1], p.b.dims[2], dtype_name(p.in), dtype_name(p.out_dtype));
}

std::mutex last_implementation_mutex;
std::string last_implementation;

// Under onednn::OneThread (the primitive is made for one thread).
std::shared_ptr<const Entry> make_entry(const Piece& p) {
  auto entry = std::make_shared<Entry>();
  try {
    entry->a = describe(p.a, p.in, p.ndims);
    entry->b = describe(p.b, p.in, p.ndims);
    entry->out = describe(p.out, p.out_dtype, p.ndims);
    const int64_t n = p.out.dims[2];
    if (p.bias)
      entry->bias = p.ndims == 2 ? memory::desc({1, n}, dnnl_type(p.bias_dtype), {n, 1})
                                 : memory::desc({1, 1, n}, dnnl_type(p.bias_dtype), {n, n, 1});
    dnnl::primitive_attr attr;
    // Scratch memory handed in at each run, so that one primitive can run
    // on several threads at once (the library's own is one per primitive).
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    const dnnl::matmul::desc desc =
        p.bias ? dnnl::matmul::desc(entry->a, entry->b, entry->bias, entry->out) : dnnl::matmul::desc(entry->a, entry->b, entry->out);
    const dnnl::matmul::primitive_desc pd(desc, attr, onednn::engine());
    const std::string implementation = pd.impl_info_str();
    // Its reference kernels (bf16 on a CPU without AVX-512, say) run far
    // slower than Eigen on widened operands.
    if (implementation.rfind("ref", 0) == 0) return std::make_shared<Entry>();
    entry->scratchpad_bytes = pd.scratchpad_desc().get_size();
    entry->primitive.emplace(pd);
    ++primitives_made;
    const std::lock_guard<std::mutex> lock(last_implementation_mutex);
    last_implementation = implementation;
  } catch (const dnnl::error& e) {
    // No implementation for these dtypes, or a layout oneDNN's descriptors
    // cannot hold: Eigen runs it. Anything else is a failure.
    if (e.status == dnnl_unimplemented || e.status == dnnl_invalid_arguments) return std::make_shared<Entry>();
    onednn::rethrow(e, shapes_of(p));
  }
  return entry;
}

// The most recently used primitives and refusals. A model has a few dozen
// pieces' shapes; generating text with a growing context adds some per
// length; the bound keeps a long run's memory flat.
class Cache {
 public:
  static constexpr size_t kCapacity = 512;

  std::shared_ptr<const Entry> get(const Piece& p) {
    const Key key = p.key();
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      if (auto it = index_.find(key); it != index_.end()) {
        order_.splice(order_.begin(), order_, it->second);
        return it->second->second;
      }
    }
    // Made outside the lock: two threads may make the same one, and the
    // second to finish keeps the first's.
    std::shared_ptr<const Entry> made = make_entry(p);
    const std::lock_guard<std::mutex> lock(mutex_);
    if (auto it = index_.find(key); it != index_.end()) return it->second->second;
    order_.emplace_front(key, made);
    index_.emplace(key, order_.begin());
    if (order_.size() > kCapacity) {
      index_.erase(order_.back().first);
      order_.pop_back();
    }
    return made;
  }

  int64_t size() {
    const std::lock_guard<std::mutex> lock(mutex_);
    return static_cast<int64_t>(order_.size());
  }

 private:
  using Item = std::pair<Key, std::shared_ptr<const Entry>>;
  std::mutex mutex_;
  std::list<Item> order_;
  std::unordered_map<Key, std::list<Item>::iterator, KeyHash> index_;
};

Cache& cache() {
  static Cache* const instance = new Cache();  // never destroyed: pool threads may still use it at exit
  return *instance;
}

// The whole product's views, and a piece of it: batches [b0, b1), rows
// [r0, r1), columns [c0, c1).
struct Product {
  const TensorView &a, &b, &out, &bias;

  void run(int64_t b0, int64_t b1, int64_t r0, int64_t r1, int64_t c0, int64_t c1) const {
    const int64_t k = a.shape[2];
    Piece p;
    p.in = a.dtype;
    p.out_dtype = out.dtype;
    p.bias = bias.data != nullptr;
    p.bias_dtype = bias.dtype;
    p.a = operand(b1 - b0, r1 - r0, k, a.strides[0], a.strides[1], a.strides[2]);
    p.b = operand(b1 - b0, k, c1 - c0, b.strides[0], b.strides[1], b.strides[2]);
    p.out = operand(b1 - b0, r1 - r0, c1 - c0, out.strides[0], out.strides[1], 1);
    p.ndims = p.a.dims[0] == 1 && p.b.dims[0] == 1 ? 2 : 3;

    const onednn::OneThread one_thread;
    const std::shared_ptr<const Entry> entry = cache().get(p);
    if (!entry->primitive) throw Declined{};
    auto at = [](const TensorView& v, int64_t offset) {
      return static_cast<void*>(static_cast<std::byte*>(v.data) + offset * static_cast<int64_t>(dtype_size(v.dtype)));
    };
    thread_local std::vector<std::byte> scratchpad;
    if (scratchpad.size() < entry->scratchpad_bytes) scratchpad.resize(entry->scratchpad_bytes);
    try {
      dnnl::engine& engine = onednn::engine();
      std::unordered_map<int, memory> args{
          {DNNL_ARG_SRC, memory(entry->a, engine, at(a, b0 * a.strides[0] + r0 * a.strides[1]))},
          {DNNL_ARG_WEIGHTS, memory(entry->b, engine, at(b, b0 * b.strides[0] + c0 * b.strides[2]))},
          {DNNL_ARG_DST, memory(entry->out, engine, at(out, b0 * out.strides[0] + r0 * out.strides[1] + c0))},
          {DNNL_ARG_SCRATCHPAD, memory(memory::desc({static_cast<int64_t>(entry->scratchpad_bytes)},
                                                    memory::data_type::u8, {1}),
                                       engine, scratchpad.data())}};
      if (p.bias) args.emplace(DNNL_ARG_BIAS, memory(entry->bias, engine, at(bias, c0)));
      entry->primitive->execute(onednn::stream(), args);
      onednn::stream().wait();
    } catch (const dnnl::error& e) {
      onednn::rethrow(e, shapes_of(p));
    }
  }
};

// Whether oneDNN found instructions beyond AVX2 here (AVX-512 and up).
bool beyond_avx2() {
  static const bool beyond = [] {
    const auto isa = static_cast<unsigned>(dnnl::get_effective_cpu_isa());
    return (isa & dnnl_cpu_isa_avx512_core) == dnnl_cpu_isa_avx512_core;
  }();
  return beyond;
}

// Split like the Eigen products (cpu_gemm.cpp): whole output rows, or
// columns where there are more of those, in multiples of this many.
constexpr int64_t kBlockGrain = 16;

}  // namespace

bool onednn_built() { return true; }

bool onednn_usable(std::string* reason) {
  if (reason != nullptr) *reason = onednn::unusable_reason();
  return onednn::usable();
}

void set_onednn_use(OnednnUse u) { use = u; }
OnednnUse onednn_use() { return use; }

OnednnMatmulStats onednn_matmul_stats() {
  OnednnMatmulStats s;
  s.products = products_run;
  s.declined = products_declined;
  s.primitives = primitives_made;
  s.cached = cache().size();
  const std::lock_guard<std::mutex> lock(last_implementation_mutex);
  s.last_implementation = last_implementation;
  return s;
}

bool onednn_chosen(DType in, DType out, int64_t batch, int64_t m, int64_t n, int64_t k) {
  const OnednnUse how = use;
  if (how == OnednnUse::kNever || !onednn::usable()) return false;
  auto takes = [](DType t) { return t == DType::f32 || t == DType::bf16; };
  if (!takes(in) || !takes(out)) return false;
  if (how == OnednnUse::kWhereFaster) {
    const double work =
        static_cast<double>(batch) * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k);
    if (work < static_cast<double>(kOnednnMinMultiplyAdds) || (batch == 1 && !beyond_avx2())) return false;
  }
  return true;
}

bool onednn_matmul(const TensorView& a, const TensorView& b, const TensorView& out, const TensorView& bias) {
  if (b.dtype != a.dtype || (bias.data != nullptr && bias.dtype != DType::f32 && bias.dtype != out.dtype)) return false;
  const int64_t batch = out.shape[0], m = out.shape[1], n = out.shape[2], k = a.shape[2];
  if (!onednn_chosen(a.dtype, out.dtype, batch, m, n, k)) return false;
  const Product product{a, b, out, bias};
  try {
    if (batch >= cpu_threads()) {
      // Enough whole products for every thread: pieces of whole batches,
      // one primitive for all but the last.
      parallel_for(batch, 1, units_for_work(kMinMultiplyAddsPerPiece, m * n * k),
                   [&](int64_t begin, int64_t end) { product.run(begin, end, 0, m, 0, n); });
    } else {
      const bool by_rows = m >= n;
      const int64_t min_grains = units_for_work(kMinMultiplyAddsPerPiece, kBlockGrain * (by_rows ? n : m) * k);
      for (int64_t i = 0; i < batch; ++i)
        parallel_for(by_rows ? m : n, kBlockGrain, min_grains, [&](int64_t begin, int64_t end) {
          if (by_rows) {
            product.run(i, i + 1, begin, end, 0, n);
          } else {
            product.run(i, i + 1, 0, m, begin, end);
          }
        });
    }
  } catch (const Declined&) {
    ++products_declined;
    return false;
  }
  ++products_run;
  return true;
}

}  // namespace mpt::cpu
