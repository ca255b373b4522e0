#pragma once
// Which NCCL this build was compiled against and which one the process
// loaded. Training refuses a different major.minor (see nccl::check_version
// in parallel/cuda/nccl_util.h: the ABI may differ); a different patch
// release works. NCCL_VERSION_CODE is major * 10000 + minor * 100 + patch.
#include <string>

namespace mpt::dist {

struct NcclVersions {
  bool built = false;  // this build has the NCCL backend
  int compiled = 0;    // NCCL_VERSION_CODE of nccl.h
  int loaded = 0;      // ncclGetVersion of the loaded libnccl (0: unknown)
  std::string load_error;  // why ncclGetVersion failed
  bool same_major_minor() const { return compiled / 100 == loaded / 100; }
};
NcclVersions nccl_versions();

// "2.21.5" from 22105.
std::string nccl_version_text(int code);

}  // namespace mpt::dist
