#pragma once
// Weight gradients beside the chain of input gradients.
//
// Backward is a chain: each layer needs the gradient of the layer after it.
// A weight's gradient is not on that chain (only the optimizer reads it),
// and its GEMM (rows summed over the whole batch into a small output) keeps
// few of the GPU's SMs busy. So on CUDA the backward engine gives each pass a
// second stream of the device (one per thread), and an op's backward rule
// may issue such work there (beside::run): it starts after everything
// queued so far on the pass's stream and overlaps what the chain does next,
// in eager mode and in a captured CUDA graph alike (the fork and join are
// events).
//
// The engine keeps track of the gradients made beside. A node all of whose
// incoming gradients were made beside, and that reads nothing else (a dtype
// cast, a leaf's sink without hooks), runs beside as well; any other node
// that receives one first makes its stream wait for the side stream. The
// pass ends with the same wait, so after backward every gradient is
// complete on the caller's stream, as without this.
//
// Memory: tensors of the chain that side work reads are held until the
// chain's stream has caught up with that work, which it does when the next
// but one piece of side work is issued; so at most two pieces are in flight
// and their inputs outlive their rule by that long.
#include <functional>
#include <vector>

#include "tensor/tensor.h"

namespace mpt::beside {

// Whether backward passes overlap weight gradients with the chain (on by
// default; off, every rule runs on the pass's stream, as written). Read by
// each pass as it starts, on every thread.
bool enabled();
void set_enabled(bool on);

// Inside a backward pass on a CUDA device with a side stream: runs `work` on
// the side stream, after the work queued so far on the current stream,
// holds `inputs` until the current stream has caught up with it, and marks
// the tensors it returns as made beside. Elsewhere: runs `work` as it is.
std::vector<Tensor> run(const Device& device, std::vector<Tensor> inputs,
                        const std::function<std::vector<Tensor>()>& work);

// For work that reads gradients wherever they were made (data
// parallelism's bucket fills, from a leaf's stream-ordered hooks): runs
// `work` in place when the current stream is the pass's own and none of
// `inputs` was made beside; otherwise as run() does, on the side stream
// after the work queued so far on both.
void follow(const Device& device, std::vector<Tensor> inputs, const std::function<void()>& work);

// For a rule that writes a gradient other than its results (a leaf's sink,
// into the leaf's .grad, which hooks on the chain may read before the pass
// ends): when the current stream is the pass's side stream, counts `t` as
// made beside, so follow() waits for it. Elsewhere: nothing.
void written_here(const Tensor& t);

}  // namespace mpt::beside
