# NVIDIA's cudnn-frontend (header-only C++ over cuDNN's graph API), for the
# fused attention of the CUDA backend. Its headers come in the
# nvidia-cudnn-frontend wheel on PyPI: the wheel of one pinned version is
# downloaded once (checked against its SHA-256) and only its include/ folder
# is unpacked into the build folder. Nothing of it lives in the source tree.
#
# MPT_CUDNN_FRONTEND_INCLUDE_DIR names a folder holding cudnn_frontend.h to
# use instead (a machine without network access, or another version).
#
# Sets mpt_cudnn_frontend_include to the folder, or leaves it empty and says
# why (the fused attention then runs the own kernels only).
set(MPT_CUDNN_FRONTEND_VERSION 1.32.0)
set(mpt_cudnn_frontend_wheel
    "https://files.pythonhosted.org/packages/11/02/660e2dd9f9d9f940e1641443771730612c3aadaafbc5ef7a93cc313d519d/nvidia_cudnn_frontend-1.32.0-cp311-cp311-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl")
set(mpt_cudnn_frontend_sha256 c6006556017a4d1c914c52a556c71b1267f2d6a0500f742e7b4edef539878df0)
set(MPT_CUDNN_FRONTEND_INCLUDE_DIR "" CACHE PATH "A folder with cudnn_frontend.h (else version ${MPT_CUDNN_FRONTEND_VERSION} is downloaded)")

function(mpt_find_cudnn_frontend out_var)
  set(${out_var} "" PARENT_SCOPE)
  if(MPT_CUDNN_FRONTEND_INCLUDE_DIR)
    if(NOT EXISTS ${MPT_CUDNN_FRONTEND_INCLUDE_DIR}/cudnn_frontend.h)
      message(FATAL_ERROR "MPT_CUDNN_FRONTEND_INCLUDE_DIR=${MPT_CUDNN_FRONTEND_INCLUDE_DIR} holds no cudnn_frontend.h")
    endif()
    set(${out_var} ${MPT_CUDNN_FRONTEND_INCLUDE_DIR} PARENT_SCOPE)
    return()
  endif()
  set(dir ${PROJECT_BINARY_DIR}/_deps/cudnn-frontend-${MPT_CUDNN_FRONTEND_VERSION})
  if(NOT EXISTS ${dir}/include/cudnn_frontend.h)
    set(wheel ${PROJECT_BINARY_DIR}/_deps/nvidia_cudnn_frontend-${MPT_CUDNN_FRONTEND_VERSION}.whl)
    message(STATUS "mptrain: downloading cudnn-frontend ${MPT_CUDNN_FRONTEND_VERSION} (its headers) from PyPI")
    # The hash is checked here rather than by file(DOWNLOAD): a failed
    # download must leave a warning, not an error that stops configuring.
    file(DOWNLOAD ${mpt_cudnn_frontend_wheel} ${wheel} STATUS status TLS_VERIFY ON)
    list(GET status 0 code)
    list(GET status 1 why)
    if(code EQUAL 0)
      file(SHA256 ${wheel} actual)
      if(NOT actual STREQUAL mpt_cudnn_frontend_sha256)
        set(code 1)
        set(why "its SHA-256 is ${actual}, not the pinned ${mpt_cudnn_frontend_sha256}")
      endif()
    endif()
    if(NOT code EQUAL 0)
      file(REMOVE ${wheel})
      message(WARNING "mptrain: could not download cudnn-frontend ${MPT_CUDNN_FRONTEND_VERSION} (${why}): attention "
                      "runs on the own kernels only. Set MPT_CUDNN_FRONTEND_INCLUDE_DIR to its headers to use cuDNN's.")
      return()
    endif()
    file(ARCHIVE_EXTRACT INPUT ${wheel} DESTINATION ${dir} PATTERNS "include/*")
    file(REMOVE ${wheel})
  endif()
  set(${out_var} ${dir}/include PARENT_SCOPE)
endfunction()
