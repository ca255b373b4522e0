#include "parallel/cuda/peer_all_reduce.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>

#include <fmt/format.h>

#include "parallel/cuda/peer_all_reduce_kernel.h"
#include "parallel/distributed_error.h"
#include "tensor/cuda/check.h"
#include "tensor/device_guard.h"
#include "tensor/host_name.h"

namespace mpt::dist {

namespace {

// What a rank tells the others about itself: "host\npid\nPCI bus id".
struct Whereabouts {
  std::string host, pid, bus;
};

Whereabouts whereabouts_of(const std::string& text) {
  Whereabouts w;
  const size_t a = text.find('\n'), b = a == std::string::npos ? a : text.find('\n', a + 1);
  w.host = text.substr(0, a);
  if (b != std::string::npos) {
    w.pid = text.substr(a + 1, b - a - 1);
    w.bus = text.substr(b + 1);
  }
  return w;
}

// Why this rank (on `device`) cannot read the memory of the rank at `peer`,
// or "" when it can (peer access enabled where the devices differ).
std::string reach(int device, const Whereabouts& me, const Whereabouts& peer, int peer_rank) {
  if (peer.host != me.host)
    return fmt::format("rank {} is on host {}, this one on {}", peer_rank, peer.host, me.host);
  int theirs = -1;
  if (cudaDeviceGetByPCIBusId(&theirs, peer.bus.c_str()) != cudaSuccess) {
    (void)cudaGetLastError();  // not sticky: clear it
    return fmt::format("rank {}'s GPU (PCI {}) is not visible to this process (CUDA_VISIBLE_DEVICES?)", peer_rank,
                       peer.bus);
  }
  if (theirs == device) return "";
  int can = 0;
  MPT_CUDA_CHECK(cudaDeviceCanAccessPeer(&can, device, theirs));
  if (!can) return fmt::format("cuda:{} cannot access rank {}'s cuda:{} as a peer", device, peer_rank, theirs);
  if (peer.pid != me.pid) return "";  // IPC maps the memory with peer access (cudaIpcMemLazyEnablePeerAccess)
  const cudaError_t enabled = cudaDeviceEnablePeerAccess(theirs, 0);
  if (enabled == cudaErrorPeerAccessAlreadyEnabled) (void)cudaGetLastError();
  else MPT_CUDA_CHECK(enabled);
  return "";
}

}  // namespace

// One cudaMalloc'd allocation of this rank and where every rank's
// counterpart is mapped here.
struct PeerAllReduce::Shared {
  char* mine = nullptr;
  size_t bytes = 0;
  std::vector<char*> of_rank;  // of_rank[rank_] == mine
  std::vector<char*> opened;   // IPC mappings to close

  // Closes the mappings of the others' memory and frees this rank's.
  void release() {
    for (char* p : opened) MPT_CUDA_RELEASE(cudaIpcCloseMemHandle(p));
    opened.clear();
    if (mine != nullptr) MPT_CUDA_RELEASE(cudaFree(mine));
    mine = nullptr;
  }
};

std::shared_ptr<PeerAllReduce> PeerAllReduce::connect(std::shared_ptr<Store> store, const std::string& prefix,
                                                      int rank, int world, int device, Millis timeout,
                                                      std::string& why) {
  check<ValueError>(store != nullptr, "PeerAllReduce: null store");
  check<ValueError>(world >= 1 && rank >= 0 && rank < world, "PeerAllReduce: rank {} of a world of {}", rank, world);
  DeviceGuard guard(Device(DeviceType::cuda, device));
  char bus[32] = {};
  MPT_CUDA_CHECK(cudaDeviceGetPCIBusId(bus, sizeof bus, device));
  const std::string mine = fmt::format("{}\n{}\n{}", host_name(), ::getpid(), bus);
  store->set(fmt::format("{}/where/{}", prefix, rank), mine);
  std::vector<Whereabouts> where;
  for (int r = 0; r < world; ++r)
    where.push_back(whereabouts_of(r == rank ? mine : store->get_string(fmt::format("{}/where/{}", prefix, r))));

  std::string verdict;
  if (world > peer::kMaxRanks) verdict = fmt::format("{} ranks, more than {}", world, peer::kMaxRanks);
  for (int r = 0; r < world && verdict.empty(); ++r)
    if (r != rank) verdict = reach(device, where[rank], where[r], r);
  // Every rank reads every verdict, so every rank decides alike.
  store->set(fmt::format("{}/verdict/{}", prefix, rank), verdict.empty() ? "ok" : "no: " + verdict);
  why.clear();
  for (int r = 0; r < world && why.empty(); ++r) {
    const std::string v = store->get_string(fmt::format("{}/verdict/{}", prefix, r));
    if (v != "ok") why = fmt::format("rank {}: {}", r, v.substr(v.find(' ') + 1));
  }
  if (!why.empty()) return nullptr;

  std::vector<bool> same_process;
  for (const auto& w : where) same_process.push_back(w.pid == where[rank].pid);
  return std::shared_ptr<PeerAllReduce>(
      new PeerAllReduce(std::move(store), prefix, rank, world, device, timeout, same_process));
}

PeerAllReduce::PeerAllReduce(std::shared_ptr<Store> store, std::string prefix, int rank, int world, int device,
                             Millis timeout, std::vector<bool> same_process)
    : store_(std::move(store)), prefix_(std::move(prefix)), rank_(rank), world_(world), device_(device),
      timeout_(timeout), same_process_(std::move(same_process)) {
  DeviceGuard guard(Device(DeviceType::cuda, device_));
  try {
    MPT_CUDA_CHECK(cudaHostAlloc(&host_words_, 2 * sizeof(int), cudaHostAllocMapped | cudaHostAllocPortable));
    host_words_[0] = peer::kRunning;
    host_words_[1] = 0;
    MPT_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&device_words_), host_words_, 0));
    MPT_CUDA_CHECK(cudaMalloc(&calls_, peer::kMaxBlocks * sizeof(uint32_t)));
    MPT_CUDA_CHECK(cudaMemset(calls_, 0, peer::kMaxBlocks * sizeof(uint32_t)));
    flags_ = share(peer::kFlagWords * sizeof(uint32_t));
  } catch (...) {
    release();
    throw;
  }
}

std::unique_ptr<PeerAllReduce::Shared> PeerAllReduce::share(size_t bytes) {
  DeviceGuard guard(Device(DeviceType::cuda, device_));
  auto s = std::make_unique<Shared>();
  s->bytes = bytes;
  try {
    exchange(*s);
  } catch (...) {
    s->release();
    throw;
  }
  return s;
}

void PeerAllReduce::exchange(Shared& s) {
  MPT_CUDA_CHECK(cudaMalloc(&s.mine, s.bytes));
  // Zeroed before any peer can learn where it is: the flags start at zero,
  // and a peer writes them only after reading the address published below.
  MPT_CUDA_CHECK(cudaMemset(s.mine, 0, s.bytes));
  MPT_CUDA_CHECK(cudaDeviceSynchronize());
  // An IPC handle only where some rank is another process (a container
  // may forbid IPC; ranks that are threads of one process do not need it).
  cudaIpcMemHandle_t handle{};
  if (std::find(same_process_.begin(), same_process_.end(), false) != same_process_.end())
    MPT_CUDA_CHECK(cudaIpcGetMemHandle(&handle, s.mine));
  // The device pointer (for ranks in this process) and the IPC handle.
  Bytes published(sizeof(char*) + sizeof handle);
  std::memcpy(published.data(), &s.mine, sizeof(char*));
  std::memcpy(published.data() + sizeof(char*), &handle, sizeof handle);
  const int serial = shares_++;
  auto key = [&](int r) { return fmt::format("{}/memory/{}/{}", prefix_, serial, r); };
  store_->set(key(rank_), published);
  for (int r = 0; r < world_; ++r) {
    if (r == rank_) {
      s.of_rank.push_back(s.mine);
      continue;
    }
    const Bytes theirs = store_->get(key(r));
    check<DistributedError>(theirs.size() == published.size(),
                            "PeerAllReduce: rank {} published {} bytes for its memory, expected {}", r, theirs.size(),
                            published.size());
    char* at = nullptr;
    if (same_process_[r]) {
      std::memcpy(&at, theirs.data(), sizeof(char*));
    } else {
      cudaIpcMemHandle_t h{};
      std::memcpy(&h, theirs.data() + sizeof(char*), sizeof h);
      MPT_CUDA_CHECK(cudaIpcOpenMemHandle(reinterpret_cast<void**>(&at), h, cudaIpcMemLazyEnablePeerAccess));
      s.opened.push_back(at);
    }
    s.of_rank.push_back(at);
  }
}

PeerAllReduce::~PeerAllReduce() {
  // After an abort or a failed launch, kernels (here or on a peer) may
  // still touch this memory: it stays allocated.
  if (aborted_ || status() != peer::kRunning) return;
  release();
}

void PeerAllReduce::release() {
  DeviceGuard guard(Device(DeviceType::cuda, device_));
  for (auto& b : buffers_) b->release();
  if (flags_) flags_->release();
  if (calls_) MPT_CUDA_RELEASE(cudaFree(calls_));
  if (host_words_) MPT_CUDA_RELEASE(cudaFreeHost(host_words_));
  calls_ = nullptr;
  host_words_ = nullptr;
}

Tensor PeerAllReduce::buffer(int64_t numel, DType dtype) {
  check<ValueError>(numel > 0, "PeerAllReduce::buffer: {} elements", numel);
  const size_t bytes = static_cast<size_t>(numel) * dtype_size(dtype);
  buffers_.push_back(share(bytes));
  auto storage = std::make_shared<Storage>(buffers_.back()->mine, bytes, Device(DeviceType::cuda, device_),
                                           [keep = shared_from_this()](void*) {});
  return Tensor::view_of(std::move(storage), {numel}, {1}, 0, dtype);
}

const PeerAllReduce::Shared* PeerAllReduce::region_of(const Tensor& t, ReduceOp op) const {
  if (op != ReduceOp::sum && op != ReduceOp::avg) return nullptr;
  if (t.dtype() != DType::f32 && t.dtype() != DType::f16 && t.dtype() != DType::bf16) return nullptr;
  if (!t.device().is_cuda() || t.device().index != device_ || !t.is_contiguous() || t.numel() == 0) return nullptr;
  const char* begin = static_cast<const char*>(t.data_ptr());
  for (const auto& b : buffers_)
    if (begin >= b->mine && begin + t.nbytes() <= b->mine + b->bytes) return b.get();
  return nullptr;
}

bool PeerAllReduce::serves(const Tensor& t, ReduceOp op) const { return region_of(t, op) != nullptr; }

void PeerAllReduce::enqueue(const Tensor& t, ReduceOp op, cudaStream_t stream) {
  const Shared* region = region_of(t, op);
  check<ValueError>(region != nullptr, "PeerAllReduce: {} is not a sum or average of a tensor in its buffers",
                    describe(t).str());
  check<DistributedError>(!aborted_ && status() == peer::kRunning,
                          "PeerAllReduce: an earlier all-reduce gave up ({}); make a new process group",
                          aborted_ ? "aborted" : failure());
  const ptrdiff_t offset = static_cast<const char*>(t.data_ptr()) - region->mine;
  peer::Args a;
  for (int r = 0; r < world_; ++r) {
    a.data[r] = region->of_rank[r] + offset;
    a.flags[r] = reinterpret_cast<uint32_t*>(flags_->of_rank[r]);
  }
  a.calls = calls_;
  a.status = device_words_;
  a.abort = device_words_ + 1;
  a.rank = rank_;
  a.world = world_;
  a.numel = t.numel();
  a.scale = op == ReduceOp::avg ? 1.0f / static_cast<float>(world_) : 1.0f;
  a.timeout_ns = static_cast<uint64_t>(timeout_.count()) * 1000000u;
  DeviceGuard guard(t.device());
  MPT_CUDA_CHECK(peer::launch_all_reduce(a, t.dtype(), stream));
}

int PeerAllReduce::status() const {
  return host_words_ == nullptr ? peer::kRunning : static_cast<const volatile int*>(host_words_)[0];
}

std::string PeerAllReduce::failure() const {
  switch (status()) {
    case peer::kRunning: return "";
    case peer::kTimedOut:
      return fmt::format("the peer all-reduce kernel on rank {} of {} waited {} ms for another rank's GPU, which "
                         "never arrived (a peer may be dead or stalled)",
                         rank_, world_, timeout_.count());
    default: return fmt::format("the peer all-reduce kernel on rank {} of {} was aborted", rank_, world_);
  }
}

bool PeerAllReduce::timed_out() const { return status() == peer::kTimedOut; }

void PeerAllReduce::abort() {
  aborted_ = true;
  static_cast<volatile int*>(host_words_)[1] = 1;
}

}  // namespace mpt::dist
