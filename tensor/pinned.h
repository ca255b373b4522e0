#pragma once
// Page-locked ("pinned") host memory. A host-to-device copy from it is truly
// asynchronous: it returns at once and overlaps with the GPU's work, which is
// what a data loader needs to keep the GPU fed. The memory comes from a cache
// (page-locking is slow), and a block is handed out again only after every
// copy that read it has finished; one that a copy captured into a CUDA graph
// reads (at every replay) is never handed out again.
#include "tensor/tensor.h"

namespace mpt {

// A contiguous CPU tensor in pinned memory; plain host memory where CUDA is
// not built or no device is present (copies then just are synchronous).
Tensor empty_pinned(const Shape& shape, DType dtype);
// A pinned copy of a CPU tensor (contiguous).
Tensor pin_memory(const Tensor& t);
// Whether t's memory is pinned.
bool is_pinned(const Tensor& t);

}  // namespace mpt
