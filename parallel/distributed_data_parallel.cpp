#include "parallel/distributed_data_parallel.h"

#include <algorithm>
#include <cstring>
#include <unordered_set>

#include <fmt/ranges.h>

#include "amp/unscale.h"
#include "autograd/beside.h"
#include "autograd/grad_mode.h"
#include "autograd/node.h"
#include "parallel/distributed_error.h"
#include "tensor/gpu_timeline.h"
#include "tensor/nvtx.h"
#include "tensor/ops.h"
#include "tensor/step_timer.h"

namespace mpt::dist {

// The per-iteration bookkeeping behind the hooks. It runs on the thread
// that calls backward(); the all-reduces run on the group's thread.
struct DistributedDataParallel::Reducer {
  std::shared_ptr<ProcessGroup> group;
  DdpOptions options;
  std::vector<Tensor> params;
  std::vector<std::string> names;
  std::vector<Bucket> buckets;
  std::vector<size_t> bucket_of;  // per parameter
  // The buckets' buffers, in memory the group's collectives run fastest on
  // (registered_buffer; undefined when the backend has none). Asked for
  // once: its size does not depend on the bucket order, so the rebuilt
  // buckets fit it too.
  Tensor arena;
  bool arena_asked = false;

  // overlap_step_with(): the last bucket of a synchronised backward is left
  // travelling, its inf/NaN flag all-reduced ahead of it.
  bool overlap = false;
  struct Late {
    std::vector<Tensor> params;
    Tensor nonfinite;  // f32 [1]: max over the ranks of "a gradient holds inf/NaN"
    WorkPtr check;     // the flag's all-reduce
    WorkPtr work;      // the bucket's
    Tensor buffer;     // what the all-reduce writes: held until it is waited for
  };
  std::optional<Late> late;

  bool sync = true;               // false inside no_sync()
  bool expecting = false;         // a synchronised forward ran; its backward will reduce
  bool started = false;           // a hook of this iteration fired
  std::vector<bool> ready;
  std::vector<size_t> unused;     // found at forward (find_unused_parameters)
  size_t next_to_launch = 0;
  bool rebuilt = false;
  std::vector<size_t> ready_order;  // recorded until the rebuild
  bool order_complete = false;

  void build(const std::vector<size_t>& order);
  void prepare();
  void find_unused(const Tensor& output);
  void on_gradient_ready(size_t index);
  void mark_ready(size_t index);
  void launch(Bucket& bucket);
  void fill_and_allreduce(Bucket& bucket);
  bool holds_a_large_gradient(const Bucket& b) const;
  bool averaged_in_place(const Bucket& b) const;
  void place_in_arena();
  void finalize();
  void check_ahead(Bucket& bucket, const std::vector<Tensor>& grads);
  std::optional<amp::LateGradients> take_late();
  void wait_for_late();
  std::string not_ready_names() const;
};

namespace {

std::string describe_parameters(const std::vector<std::string>& names, const std::vector<Tensor>& params) {
  std::string out;
  for (size_t i = 0; i < params.size(); ++i)
    out += fmt::format("{} {} {}\n", names[i], shape_str(params[i].shape()), dtype_name(params[i].dtype()));
  return out;
}

std::vector<std::string> lines_of(const std::string& s) {
  std::vector<std::string> lines;
  size_t start = 0, nl;
  while ((nl = s.find('\n', start)) != std::string::npos) {
    lines.push_back(s.substr(start, nl - start));
    start = nl + 1;
  }
  return lines;
}

// Every rank must hold the same parameters: compare with rank 0's list and
// fail on every rank (a rank that went on alone would hang in its first
// all-reduce).
void check_same_parameters(ProcessGroup& group, const std::vector<std::string>& names,
                           const std::vector<Tensor>& params, const Device& device) {
  const std::string mine = describe_parameters(names, params);
  Tensor length = prim::to(scalar_tensor(static_cast<double>(mine.size()), DType::i64), device);
  length = prim::reshape(length, {1});
  group.broadcast(length, 0)->wait();
  const auto n = static_cast<int64_t>(length.item());
  std::vector<uint8_t> bytes(static_cast<size_t>(n));
  if (group.rank() == 0) std::memcpy(bytes.data(), mine.data(), mine.size());
  Tensor text = prim::to(from_vector(std::vector<int64_t>(bytes.begin(), bytes.end()), {n}, DType::u8), device);
  group.broadcast(text, 0)->wait();
  const auto received = text.to_vector<int64_t>();
  const std::string theirs(received.begin(), received.end());

  std::string problem;
  if (theirs != mine) {
    const auto a = lines_of(theirs), b = lines_of(mine);
    for (size_t i = 0; i < std::max(a.size(), b.size()); ++i) {
      const std::string ra = i < a.size() ? a[i] : "(none)";
      const std::string rb = i < b.size() ? b[i] : "(none)";
      if (ra != rb) {
        problem = fmt::format("parameter {} differs: rank 0 has '{}', rank {} has '{}'", i, ra, group.rank(), rb);
        break;
      }
    }
  }
  Tensor flag = prim::to(from_vector(std::vector<float>{problem.empty() ? 0.f : 1.f}, {1}), device);
  group.allreduce(flag, ReduceOp::max)->wait();
  check<ValueError>(problem.empty(), "DistributedDataParallel: ranks hold different models: {}", problem);
  check<ValueError>(flag.item() == 0,
                    "DistributedDataParallel: ranks hold different models: some rank's parameters differ from "
                    "rank 0's (rank {} matches; the differing rank's error names the parameter)",
                    group.rank());
}

}  // namespace

void DistributedDataParallel::Reducer::build(const std::vector<size_t>& order) {
  std::vector<size_t> bytes;
  for (const auto& p : params) bytes.push_back(p.nbytes());
  const size_t first_cap = options.first_bucket_bytes > 0 ? options.first_bucket_bytes : options.bucket_bytes;
  const auto assignment = assign_buckets(order, bytes, first_cap, options.bucket_bytes);
  const DType transit = options.compression.value_or(params.front().dtype());
  buckets.clear();
  bucket_of.assign(params.size(), 0);
  // Each gradient starts 64 bytes into the bucket or a multiple of it: the
  // averaged gradients stay in the bucket as the parameters' gradients, and
  // kernels that read them (the fused optimizers) take 16-byte loads only
  // from aligned tensors. Nothing reads the padding but the all-reduce.
  const int64_t align = std::max<int64_t>(1, 64 / static_cast<int64_t>(dtype_size(transit)));
  for (const auto& members : assignment) {
    Bucket b;
    for (size_t index : members) {
      b.params.push_back(index);
      b.offsets.push_back(b.elements);
      b.elements += (params[index].numel() + align - 1) / align * align;
      bucket_of[index] = buckets.size();
    }
    b.dtype = transit;
    buckets.push_back(std::move(b));
  }
  place_in_arena();
}

bool DistributedDataParallel::Reducer::holds_a_large_gradient(const Bucket& b) const {
  // A gradient of at least the cap is alone in its bucket whatever the
  // order (see assign_buckets).
  return b.params.size() == 1 && params[b.params.front()].nbytes() >= options.bucket_bytes;
}

bool DistributedDataParallel::Reducer::averaged_in_place(const Bucket& b) const {
  // launch() averages a large gradient where backward left it, unless it
  // changes dtype on the way (compressed) or is 16-bit (the collective's
  // average may sum before it divides, and overflow).
  const DType d = params[b.params.front()].dtype();
  return holds_a_large_gradient(b) && b.dtype == d && (d == DType::f32 || d == DType::f64);
}

void DistributedDataParallel::Reducer::place_in_arena() {
  if (!options.registered_buffers) return;  // build()'s buckets start outside it
  // Large gradients stay out: they are averaged in place, or (compressed)
  // get a buffer only while backward needs it. So the arena's size does
  // not depend on the order, and it stays small beside the model.
  int64_t total = 0;
  for (auto& b : buckets)
    if (!holds_a_large_gradient(b)) {
      b.arena_offset = total;
      total += b.elements;
    }
  if (total == 0) return;
  if (!arena_asked) {
    arena = group->registered_buffer(total, buckets.front().dtype, params.front().device());
    arena_asked = true;
  }
  if (!arena.defined() || arena.numel() < total)
    for (auto& b : buckets) b.arena_offset = -1;
}

std::string DistributedDataParallel::Reducer::not_ready_names() const {
  std::vector<std::string> missing;
  for (size_t i = 0; i < params.size(); ++i)
    if (!ready[i]) missing.push_back(names[i]);
  return fmt::format("{}", missing);
}

void DistributedDataParallel::Reducer::prepare() {
  wait_for_late();  // nobody took the last backward's late bucket
  if (started) {
    // The previous backward left buckets waiting for gradients that never
    // came; the other ranks may be stuck on them too.
    const std::string missing = not_ready_names();
    started = false;
    expecting = false;
    throw ValueError(fmt::format(
        "DistributedDataParallel (rank {}): the previous backward did not finish reducing gradients: parameters {} "
        "received no gradient. If they are unused on purpose, pass find_unused_parameters = true; otherwise make "
        "the loss depend on them (and give every forward a backward)",
        group->rank(), missing));
  }
  expecting = sync;
  if (!sync) return;
  if (!rebuilt && order_complete) {
    // Rank 0's observed order decides, so every rank builds the same buckets.
    std::vector<int64_t> order(params.size());
    for (size_t i = 0; i < params.size(); ++i) order[i] = static_cast<int64_t>(ready_order[i]);
    Tensor t = prim::to(from_vector(order, {static_cast<int64_t>(order.size())}, DType::i64), params[0].device());
    group->broadcast(t, 0)->wait();
    const auto agreed = t.to_vector<int64_t>();
    build(std::vector<size_t>(agreed.begin(), agreed.end()));
    rebuilt = true;
  }
  ready.assign(params.size(), false);
  for (auto& b : buckets) {
    b.pending = b.params.size();
    b.work.reset();
    // The last iteration's averaged gradients keep its buffer alive as long
    // as they are held (zero_grad() lets go of them); this one gets a new
    // buffer when its first gradient is ready. So the buffers exist only
    // from backward to zero_grad(), not during forward, where activations
    // peak (mlp_large: 805 MB less at the peak); only the registered arena
    // (which large gradients, averaged in place, stay out of) lasts.
    b.flat = Tensor();
  }
  next_to_launch = 0;
  unused.clear();
  if (!rebuilt) ready_order.clear();
}

void DistributedDataParallel::Reducer::find_unused(const Tensor& output) {
  if (!expecting || !options.find_unused_parameters) return;
  std::unordered_set<const Node*> reachable;
  std::vector<std::shared_ptr<Node>> stack;
  if (output.defined() && output.grad_fn()) stack.push_back(output.grad_fn());
  while (!stack.empty()) {
    auto node = std::move(stack.back());
    stack.pop_back();
    if (!reachable.insert(node.get()).second) continue;
    for (const auto& e : node->next_edges())
      if (e.node) stack.push_back(e.node);
  }
  for (size_t i = 0; i < params.size(); ++i) {
    auto acc = params[i].autograd_meta().grad_accumulator.lock();
    if (!acc || !reachable.count(acc.get())) unused.push_back(i);
  }
}

void DistributedDataParallel::Reducer::on_gradient_ready(size_t index) {
  if (!expecting) return;  // inside no_sync(), or a backward DDP did not prepare
  if (!started) {
    started = true;
    for (size_t i : unused) mark_ready(i);
  }
  mark_ready(index);
}

void DistributedDataParallel::Reducer::mark_ready(size_t index) {
  check<ValueError>(!ready[index],
                    "DistributedDataParallel (rank {}): parameter '{}' got a second gradient in one iteration (a "
                    "second backward through the same forward?); call forward again before each backward",
                    group->rank(), names[index]);
  ready[index] = true;
  if (!rebuilt) ready_order.push_back(index);
  Bucket& bucket = buckets[bucket_of[index]];
  if (--bucket.pending > 0) return;
  // Launch in bucket order, so every rank issues the same sequence.
  while (next_to_launch < buckets.size() && buckets[next_to_launch].pending == 0) launch(buckets[next_to_launch++]);
  if (next_to_launch == buckets.size()) finalize();
}

// A bucket's gradients may come from backward's side stream (large weight
// gradients, autograd/beside.h) and from its own, and the hook that
// completes the bucket may run on either: the fill and the all-reduce go
// where every one of them is complete.
void DistributedDataParallel::Reducer::launch(Bucket& bucket) {
  std::vector<Tensor> grads;
  for (size_t i : bucket.params)
    if (params[i].grad().defined()) grads.push_back(params[i].grad());
  beside::follow(params.front().device(), std::move(grads), [&] { fill_and_allreduce(bucket); });
}

void DistributedDataParallel::Reducer::fill_and_allreduce(Bucket& bucket) {
  NoGradGuard no_grad;
  if (averaged_in_place(bucket)) {
    // Averaged where it lies: no buffer and no copy. Every rank makes this
    // same call (the element count and the op must agree): a rank that has
    // no gradient here (an unused parameter) sends zeros, one whose
    // gradient is laid out otherwise a dense copy, which becomes its
    // gradient.
    Tensor& p = params[bucket.params[0]];
    const Tensor g = p.grad();
    if (g.defined() && g.dtype() == bucket.dtype && g.is_contiguous()) {
      bucket.flat = prim::view(g, {g.numel()});
    } else if (g.defined()) {
      bucket.flat = prim::reshape(prim::contiguous(prim::to(g, bucket.dtype)), {p.numel()});
      p.set_grad(prim::view(bucket.flat, p.shape()));
    } else {
      bucket.flat = zeros({p.numel()}, bucket.dtype, p.device());
    }
    check_ahead(bucket, {bucket.flat});
    NvtxRange range("ddp: all-reduce gradient in place");
    bucket.work = group->allreduce(bucket.flat, ReduceOp::avg);
    if (late) late->work = bucket.work;
    return;
  }
  if (bucket.arena_offset >= 0)
    bucket.flat = prim::slice(arena, 0, bucket.arena_offset, bucket.arena_offset + bucket.elements);
  else
    bucket.flat = Tensor::empty({bucket.elements}, bucket.dtype, params.front().device());
  // Divide before the all-reduce: the sum of averages cannot overflow a
  // 16-bit transit type where the plain sum might.
  const double scale = 1.0 / group->size();
  std::vector<Tensor> slots, grads;  // filled together, in one pass
  for (size_t k = 0; k < bucket.params.size(); ++k) {
    Tensor& p = params[bucket.params[k]];
    Tensor slot = prim::view(prim::slice(bucket.flat, 0, bucket.offsets[k], bucket.offsets[k] + p.numel()), p.shape());
    const Tensor g = p.grad();
    if (!g.defined()) {
      prim::fill_(slot, 0.0);
      continue;
    }
    slots.push_back(slot);
    grads.push_back(g);
    // From here on the gradient lives in the bucket (averaged once the
    // all-reduce ends), so backward's own copy goes back to the allocator
    // once the fill has read it, not when backward ends: otherwise every
    // gradient is held twice at the end of backward. A compressed one keeps
    // its own tensor, which finalize() fills from the bucket.
    if (g.dtype() == slot.dtype()) p.set_grad(slot);
  }
  const size_t index = static_cast<size_t>(&bucket - buckets.data());
  gpu_stamp(bucket.flat.device(), [&] { return fmt::format("ddp bucket {}: fill", index); });
  prim::scaled_copy_list_(slots, grads, scale);
  gpu_stamp(bucket.flat.device(), [&] { return fmt::format("ddp bucket {}: filled", index); });
  check_ahead(bucket, slots);
  NvtxRange range("ddp: all-reduce bucket");
  bucket.work = group->allreduce(bucket.flat, ReduceOp::sum);
  if (late) late->work = bucket.work;
}

// Under overlap_step_with, the last bucket's gradients are checked before
// they are averaged and the ranks' flags all-reduced ahead of them, so the
// scaler's decision does not wait for the bucket.
void DistributedDataParallel::Reducer::check_ahead(Bucket& bucket, const std::vector<Tensor>& grads) {
  // With one bucket nothing is left to step beside it.
  if (!overlap || &bucket != &buckets.back() || buckets.size() == 1) return;
  Late l;
  for (size_t i : bucket.params) l.params.push_back(params[i]);
  l.nonfinite = zeros({1}, DType::f32, bucket.flat.device());
  amp::check_inf_(grads, l.nonfinite);
  l.check = group->allreduce(l.nonfinite, ReduceOp::max);
  l.buffer = bucket.flat;
  late = std::move(l);
}

std::optional<amp::LateGradients> DistributedDataParallel::Reducer::take_late() {
  if (!late) return std::nullopt;
  Late l = std::move(*late);
  late.reset();
  amp::LateGradients out;
  out.params = std::move(l.params);
  out.nonfinite = l.nonfinite;
  out.wait_for_check = [check = l.check] { check->wait(); };
  // The buffer goes with the last copy of this function, after the wait.
  out.wait = [work = l.work, buffer = l.buffer] { work->wait(); };
  return out;
}

void DistributedDataParallel::Reducer::wait_for_late() {
  if (!late) return;
  late->check->wait();
  late->work->wait();
  late.reset();
}

void DistributedDataParallel::Reducer::finalize() {
  NoGradGuard no_grad;
  started = false;
  expecting = false;
  if (!rebuilt) order_complete = ready_order.size() == params.size();
  // The backward's own work ends here; what the step waits for from now on
  // is communication that backward did not hide.
  StepTimer* timer = StepTimer::active();
  if (timer) timer->lap(StepPhase::backward);
  {
    NvtxRange range("ddp: wait for all-reduces");
    for (auto& b : buckets)
      if (!(late && &b == &buckets.back())) b.work->wait();
  }
  gpu_stamp(params.front().device(), "ddp: all-reduces joined");
  if (timer) timer->lap(StepPhase::comm);

  // With unused parameters allowed, a gradient that no rank produced stays
  // undefined (so the optimizer skips it), as if the parameter were frozen.
  std::vector<float> used_anywhere(params.size(), 1.f);
  if (options.find_unused_parameters) {
    std::vector<float> used(params.size());
    for (size_t i = 0; i < params.size(); ++i) used[i] = params[i].grad().defined() ? 1.f : 0.f;
    Tensor t = prim::to(from_vector(used, {static_cast<int64_t>(used.size())}), params[0].device());
    group->allreduce(t, ReduceOp::max)->wait();
    used_anywhere = t.to_vector<float>();
  }
  // The averaged gradient stays where the all-reduce left it: launch()
  // already made the parameter's gradient a view into the bucket, unless it
  // travelled compressed and comes back to its own dtype here (one launch
  // for all of them).
  std::vector<Tensor> decompressed, averaged;
  for (auto& b : buckets)
    for (size_t k = 0; k < b.params.size(); ++k) {
      const size_t i = b.params[k];
      Tensor& p = params[i];
      Tensor slot = prim::view(prim::slice(b.flat, 0, b.offsets[k], b.offsets[k] + p.numel()), p.shape());
      Tensor g = p.grad();
      if (g.defined()) {
        if (slot.dtype() == g.dtype()) continue;
        decompressed.push_back(g);
        averaged.push_back(slot);
      } else if (used_anywhere[i] != 0) {
        p.set_grad(prim::to(prim::clone(slot), p.dtype()));
      }
    }
  prim::scaled_copy_list_(decompressed, averaged, 1.0);
}

DistributedDataParallel::DistributedDataParallel(std::shared_ptr<nn::Module> module,
                                                 std::shared_ptr<ProcessGroup> group, DdpOptions options)
    : module_(std::move(module)), group_(std::move(group)), reducer_(std::make_shared<Reducer>()) {
  check<ValueError>(module_ != nullptr && group_ != nullptr, "DistributedDataParallel: null module or group");
  if (options.compression)
    check<DTypeError>(*options.compression == DType::f16 || *options.compression == DType::bf16,
                      "DistributedDataParallel: compression must be f16 or bf16, got {}",
                      dtype_name(*options.compression));
  Reducer& r = *reducer_;
  r.group = group_;
  r.options = options;
  for (auto& [name, p] : module_->named_parameters()) {
    r.names.push_back(name);
    r.params.push_back(p);
  }
  check<ValueError>(!r.params.empty(), "DistributedDataParallel: {} has no parameters", module_->type_name());
  const Tensor& first = r.params.front();
  for (size_t i = 0; i < r.params.size(); ++i) {
    check<DeviceError>(r.params[i].device() == first.device(),
                       "DistributedDataParallel: parameter '{}' is on {} but '{}' is on {}; one device per process",
                       r.names[i], r.params[i].device().str(), r.names[0], first.device().str());
    check<DTypeError>(r.params[i].dtype() == first.dtype() && is_floating(first.dtype()) && !is_float8(first.dtype()),
                      "DistributedDataParallel: parameter '{}' is {}, '{}' is {}; all must share one dtype of "
                      "f32, f16, bf16 or f64",
                      r.names[i], dtype_name(r.params[i].dtype()), r.names[0], dtype_name(first.dtype()));
    check<ValueError>(r.params[i].is_contiguous(), "DistributedDataParallel: parameter '{}' is not contiguous",
                      r.names[i]);
  }

  check_same_parameters(*group_, r.names, r.params, first.device());
  std::vector<WorkPtr> works;
  for (auto& p : r.params) works.push_back(group_->broadcast(p, 0));
  for (auto& w : works) w->wait();
  if (options.broadcast_buffers) broadcast_buffers();

  std::vector<size_t> reverse(r.params.size());
  for (size_t i = 0; i < reverse.size(); ++i) reverse[i] = reverse.size() - 1 - i;
  r.build(reverse);
  r.ready.assign(r.params.size(), false);

  std::weak_ptr<Reducer> weak = reducer_;
  for (size_t i = 0; i < r.params.size(); ++i)
    r.params[i].autograd_meta().stream_ordered_post_accumulate_hooks.push_back([weak, i](const Tensor&) {
      if (auto reducer = weak.lock()) reducer->on_gradient_ready(i);
    });
}

DistributedDataParallel::~DistributedDataParallel() {
  // A bucket still travelling must not lose its buffer under the all-reduce.
  try {
    reducer_->wait_for_late();
  } catch (...) {
    // A destructor cannot throw; the group reports the failure at its next call.
  }
}

void DistributedDataParallel::broadcast_buffers() {
  const Device device = reducer_->params.front().device();
  std::vector<WorkPtr> works;
  for (const auto& [name, b] : module_->named_buffers()) {
    if (b.device() != device)  // (messages made only for a failure: this runs at every forward)
      throw DeviceError(fmt::format("DistributedDataParallel: buffer '{}' ({}) is on {}, the parameters on {}", name,
                                    describe(b), b.device().str(), device.str()));
    if (!b.is_contiguous())
      throw ValueError(fmt::format("DistributedDataParallel: buffer '{}' ({}) is not contiguous", name, describe(b)));
    works.push_back(group_->broadcast(b, 0));
  }
  for (auto& w : works) w->wait();
}

void DistributedDataParallel::before_forward() {
  if (!grad_enabled()) return;
  // As PyTorch's broadcast_buffers: a forward whose backward will
  // synchronise starts from rank 0's buffers (running statistics, say),
  // so that the ranks, whose forwards updated their own, agree again.
  if (reducer_->sync && reducer_->options.broadcast_buffers && group_->size() > 1) broadcast_buffers();
  reducer_->prepare();
}

void DistributedDataParallel::after_forward(const Tensor& output) { reducer_->find_unused(output); }

Tensor DistributedDataParallel::forward(const Tensor& x) {
  before_forward();
  Tensor out = module_->forward(x);
  after_forward(out);
  return out;
}

DistributedDataParallel::NoSyncGuard::NoSyncGuard(DistributedDataParallel& ddp)
    : ddp_(ddp), previous_(ddp.reducer_->sync) {
  ddp_.reducer_->sync = false;
}

DistributedDataParallel::NoSyncGuard::~NoSyncGuard() { ddp_.reducer_->sync = previous_; }

std::vector<std::vector<size_t>> DistributedDataParallel::bucket_assignment() const {
  std::vector<std::vector<size_t>> out;
  for (const auto& b : reducer_->buckets) out.push_back(b.params);
  return out;
}

bool DistributedDataParallel::buckets_rebuilt() const { return reducer_->rebuilt; }

int64_t DistributedDataParallel::registered_bytes() const {
  return reducer_->arena.defined() ? static_cast<int64_t>(reducer_->arena.nbytes()) : 0;
}

void DistributedDataParallel::overlap_step_with(amp::GradScaler& scaler) {
  Reducer& r = *reducer_;
  check<ValueError>(!r.options.compression && !r.options.find_unused_parameters,
                    "DistributedDataParallel::overlap_step_with: not with {} (the last bucket's gradients would "
                    "need work after their all-reduce that the scaler does not do)",
                    r.options.compression ? "compression" : "find_unused_parameters");
  check<ValueError>(!r.overlap, "DistributedDataParallel::overlap_step_with: already overlapping with a scaler");
  r.overlap = true;
  std::weak_ptr<Reducer> weak = reducer_;
  scaler.add_late_gradient_source([weak]() -> std::optional<amp::LateGradients> {
    auto reducer = weak.lock();
    return reducer ? reducer->take_late() : std::nullopt;
  });
}

void DistributedDataParallel::wait_for_gradients() { reducer_->wait_for_late(); }

void DistributedDataParallel::allreduce_found_inf(const Tensor& found_inf) {
  dist::allreduce_found_inf(*group_, found_inf);
}

void allreduce_found_inf(ProcessGroup& group, const Tensor& found_inf) {
  check<ShapeError>(found_inf.defined() && found_inf.numel() == 1,
                    "allreduce_found_inf: expected a one-element tensor, got {}",
                    describe(found_inf));
  group.allreduce(found_inf, ReduceOp::max)->wait();
}

}  // namespace mpt::dist
