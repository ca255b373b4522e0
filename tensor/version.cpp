#include "tensor/version.h"

namespace mpt {

// MPT_VERSION_TEXT comes from CMake's project(VERSION ...).
const char* library_version() { return MPT_VERSION_TEXT; }

}  // namespace mpt
