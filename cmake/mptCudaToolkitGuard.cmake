# find_package(CUDAToolkit) and find_dependency(CUDAToolkit) under CMake 3.25
# as Debian 12 ships it. That release's FindCUDAToolkit marks the target
# CUDA::nvToolsExt deprecated whenever the calling project requires CMake
# 3.25 or newer, without checking that the target exists; CUDA 13 ships no
# nvToolsExt library, so the call stops with "set_property could not find
# TARGET CUDA::nvToolsExt" (CMake 3.26 checks first). The module reads only
# CMAKE_MINIMUM_REQUIRED_VERSION for this, so the guard lowers that variable
# around the call; the project's policies stay as they are.
#
#   mpt_cuda_toolkit_guard_begin()
#   find_package(CUDAToolkit)
#   mpt_cuda_toolkit_guard_end()

macro(mpt_cuda_toolkit_guard_begin)
  set(mpt_guarded_minimum_version "${CMAKE_MINIMUM_REQUIRED_VERSION}")
  if(CMAKE_VERSION VERSION_LESS 3.26 AND CMAKE_MINIMUM_REQUIRED_VERSION VERSION_GREATER_EQUAL 3.25)
    set(CMAKE_MINIMUM_REQUIRED_VERSION 3.24)
  endif()
endmacro()

macro(mpt_cuda_toolkit_guard_end)
  set(CMAKE_MINIMUM_REQUIRED_VERSION "${mpt_guarded_minimum_version}")
  unset(mpt_guarded_minimum_version)
endmacro()
