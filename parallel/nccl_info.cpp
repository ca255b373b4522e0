#include "parallel/nccl_info.h"

#include <fmt/format.h>

namespace mpt::dist {

std::string nccl_version_text(int code) {
  return code > 0 ? fmt::format("{}.{}.{}", code / 10000, code / 100 % 100, code % 100) : "none";
}

}  // namespace mpt::dist
