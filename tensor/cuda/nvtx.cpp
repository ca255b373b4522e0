// tensor/nvtx.h for the CUDA build: NVTX3 from the toolkit (header-only).
#include "tensor/nvtx.h"

#include <nvtx3/nvToolsExt.h>

namespace mpt {

void nvtx_push(const char* name) { nvtxRangePushA(name); }
void nvtx_pop() { nvtxRangePop(); }

}  // namespace mpt
