#pragma once
// MPT_HOST_DEVICE marks a function that both the host compiler and a CUDA
// kernel call: the rules written once (scale_rule.h, fp8_scale_rule.h).
#if defined(__CUDACC__)
#define MPT_HOST_DEVICE __host__ __device__
#else
#define MPT_HOST_DEVICE
#endif
