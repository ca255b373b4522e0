#include "parallel/cuda/nccl_util.h"

#include <thread>

#include "parallel/distributed_error.h"
#include "parallel/nccl_info.h"
#include "tensor/cuda/check.h"

namespace mpt::dist::nccl {

ncclDataType_t data_type(DType dtype) {
  switch (dtype) {
    case DType::f32: return ncclFloat32;
    case DType::f64: return ncclFloat64;
    case DType::f16: return ncclFloat16;
    case DType::bf16: return ncclBfloat16;
    case DType::i32: return ncclInt32;
    case DType::i64: return ncclInt64;
    case DType::u8: return ncclUint8;
    // Moved as bytes: the reductions refuse float8 before they get here.
    case DType::e4m3: return ncclUint8;
    case DType::e5m2: return ncclUint8;
  }
  throw DTypeError(fmt::format("NCCL: no data type for {}", dtype_name(dtype)));
}

ncclRedOp_t red_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return ncclSum;
    case ReduceOp::avg: return ncclAvg;
    case ReduceOp::max: return ncclMax;
  }
  return ncclSum;
}

void check_version() {
  int loaded = 0;
  MPT_NCCL_CHECK(ncclGetVersion(&loaded));
  // Patch releases keep the ABI; a different minor version may change the
  // layout of ncclConfig_t, which would corrupt memory rather than fail.
  check<DistributedError>(loaded / 100 == NCCL_VERSION_CODE / 100,
                          "NCCL: mptrain was compiled against nccl.h {} but the loaded libnccl is {}; make "
                          "LD_LIBRARY_PATH point at a matching libnccl.so, or rebuild against this one",
                          nccl_version_text(NCCL_VERSION_CODE), nccl_version_text(loaded));
}

void wait_for(const std::vector<ncclComm_t>& comms, Millis timeout, const std::string& what) {
  const auto start = std::chrono::steady_clock::now();
  for (;;) {
    bool in_progress = false;
    for (ncclComm_t c : comms) {
      ncclResult_t state = ncclSuccess;
      MPT_NCCL_CHECK(ncclCommGetAsyncError(c, &state));
      if (state == ncclInProgress) {
        in_progress = true;
      } else if (state != ncclSuccess) {
        throw DistributedError(
            fmt::format("NCCL {}: {} (a peer failed or the network broke)", what, ncclGetErrorString(state)));
      }
    }
    if (!in_progress) return;
    const auto waited = std::chrono::duration_cast<Millis>(std::chrono::steady_clock::now() - start);
    if (waited >= timeout)
      throw TimeoutError(fmt::format("NCCL {}: not done after {} ms (timeout {} ms)", what, waited.count(),
                                     timeout.count()));
    // Enqueuing usually finishes within microseconds: poll without sleeping
    // at first, then back off.
    if (waited < Millis(2)) std::this_thread::yield();
    else std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

}  // namespace mpt::dist::nccl

namespace mpt::dist {

NcclVersions nccl_versions() {
  NcclVersions v;
  v.built = true;
  v.compiled = NCCL_VERSION_CODE;
  if (const ncclResult_t s = ncclGetVersion(&v.loaded); s != ncclSuccess) {
    v.loaded = 0;
    v.load_error = ncclGetErrorString(s);
  }
  return v;
}

}  // namespace mpt::dist
