#pragma once
// What the two NCCL users (the process group and DataParallel's in-process
// clique) share: dtype and op mapping, the header/library version check,
// and a bounded wait on a non-blocking communicator.
#include <nccl.h>

#include <chrono>
#include <string>
#include <vector>

#include "parallel/process_group.h"
#include "tensor/dtype.h"

namespace mpt::dist::nccl {

ncclDataType_t data_type(DType dtype);
ncclRedOp_t red_op(ReduceOp op);
// DistributedError unless the loaded libnccl has the major and minor
// version nccl.h described at compile time (mixing them corrupts memory
// instead of failing cleanly).
void check_version();
// Polls ncclCommGetAsyncError on every comm until none is in progress, or
// throws TimeoutError (DistributedError on an async error); the caller
// then aborts the communicators (ncclCommAbort). `what` names the operation
// for the message.
void wait_for(const std::vector<ncclComm_t>& comms, Millis timeout, const std::string& what);

}  // namespace mpt::dist::nccl
