#pragma once
// ProcessGroup: the collectives data parallelism needs, over one backend
// per device type (Gloo for CPU tensors, NCCL for CUDA tensors). Every call
// returns at once with a Work handle; the operation runs on the group's
// communication thread (or stream), in call order, so the same sequence of
// calls on every rank pairs up. Work::wait() rethrows the operation's error.
//
// Tensors must be contiguous and stay alive (and untouched) until their
// work has completed. A call counts as a write of the tensors it writes
// (Tensor::version), so a backward rule that saved one refuses to run. Every rank must call the same collectives, in the
// same order, with the same shapes and dtypes.
#include <memory>
#include <string>
#include <vector>

#include "parallel/store.h"
#include "tensor/tensor.h"

namespace mpt::dist {

enum class ReduceOp { sum, avg, max };
const char* reduce_op_name(ReduceOp op);

// The handle of one asynchronous collective.
class Work {
 public:
  virtual ~Work() = default;
  // Blocks until done; throws the operation's error (TimeoutError,
  // DistributedError, ...). Waiting twice is fine. A Work may be dropped
  // unwaited: the operation's tensors are safe to free at once (on CUDA,
  // later work on the stream that launched it runs after it), but their
  // values are defined only after wait().
  virtual void wait() = 0;
  virtual bool is_completed() = 0;
};
using WorkPtr = std::shared_ptr<Work>;

class ProcessGroup {
 public:
  virtual ~ProcessGroup() = default;
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  virtual std::string backend_name() const = 0;

  // In place: every rank ends with op over all ranks' tensors.
  virtual WorkPtr allreduce(const Tensor& tensor, ReduceOp op = ReduceOp::sum) = 0;
  // In place: every rank ends with root's tensor.
  virtual WorkPtr broadcast(const Tensor& tensor, int root = 0) = 0;
  // outputs[r] receives rank r's input (size() outputs, each shaped like input).
  virtual WorkPtr allgather(const std::vector<Tensor>& outputs, const Tensor& input) = 0;
  // input is size() equal chunks along dim 0; rank r's output receives op
  // over all ranks' chunk r.
  virtual WorkPtr reduce_scatter(const Tensor& output, const Tensor& input, ReduceOp op = ReduceOp::sum) = 0;
  virtual WorkPtr barrier() = 0;

  // A flat buffer of `numel` elements on `device` that this backend's
  // collectives run fastest on, or an undefined tensor when the backend has
  // none (then any memory does as well). NCCL: memory from ncclMemAlloc
  // registered as a symmetric window with every rank, which lets NCCL use
  // its low-latency kernels for collectives on it. A collective call: every
  // rank asks for the same sizes in the same order, and a collective on it
  // uses the same offsets on every rank. The memory stays with the group
  // until the group ends, so ask once and reuse it.
  virtual Tensor registered_buffer(int64_t numel, DType dtype, const Device& device);

 protected:
  ProcessGroup(int rank, int size) : rank_(rank), size_(size) {}

 private:
  int rank_;
  int size_;
};

struct ProcessGroupOptions {
  Millis timeout = kDefaultTimeout;  // bound on every collective and on connecting
  // Gloo: the network interface to use ("eth0"); empty: the address this
  // host's name resolves to, or loopback when the master is local.
  std::string interface;
  // Gloo: this host's address as peers should reach it; overrides interface.
  std::string hostname;
  // NCCL: registered_buffer() gives memory every rank's GPU maps (one host,
  // peer access between the GPUs), and sums and averages of tensors in it
  // run as the group's own kernel, each GPU reading the others' memory
  // directly (PeerAllReduce): less latency than NCCL for small all-reduces,
  // and bounded by the timeout even after a peer died. Where some pair of
  // ranks cannot, registered_buffer() gives none.
  bool peer_collectives = false;
};

// A group over `store` (whose ranks have already met, see rendezvous()) for
// tensors on `device_type`: Gloo for the CPU, NCCL for CUDA. `device` is the
// CUDA device this rank drives (NCCL only). NotAvailableError when the
// backend was not built in.
std::shared_ptr<ProcessGroup> new_process_group(const std::shared_ptr<Store>& store, int rank, int size,
                                                DeviceType device_type, const ProcessGroupOptions& options = {},
                                                int device = 0);

// Checks shared by the backends; messages name the collective.
void check_collective_tensor(const char* op, const Tensor& t, DeviceType expected);

}  // namespace mpt::dist
