#pragma once
// The library's version (the CMake project's), for logs and for the
// settings every rank of a job must share.
namespace mpt {

const char* library_version();

}  // namespace mpt
