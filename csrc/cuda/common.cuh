// Shared device helpers of the CUDA twins: storage-type conversions, warp/block reductions, and the
// pybind11 glue (compiled only when setup.py defines ML_CUDA_PYBIND). Kernels take raw device
// pointers and a cudaStream_t passed as an integer, like the CPU kernels: no torch headers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

namespace ml_cuda {

// Codes as in csrc/common.h (ml::DType).
enum class DType : int { kFloat32 = 0, kFloat64 = 1, kBFloat16 = 2, kFloat16 = 3 };

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }

template <class T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16(v); }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half(v); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
// Column reductions over rows (the norms' weight gradients): a block of kColumnTile x kRowLanes threads.
constexpr int kColumnTile = 32;
constexpr int kRowLanes = 32;

__device__ __forceinline__ float block_sum(float v) {
  __shared__ float partial[32];
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  v = warp_sum(v);
  __syncthreads();  // partial[] may still be read by a previous call
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  const int warps = blockDim.x / 32;
  v = lane < warps ? partial[lane] : 0.0f;
  return warp_sum(v);
}

// Max over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
__device__ __forceinline__ float block_max(float v) {
  __shared__ float partial[32];
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  v = warp_max(v);
  __syncthreads();  // partial[] may still be read by a previous call
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  const int warps = blockDim.x / 32;
  v = lane < warps ? partial[lane] : -INFINITY;
  return warp_max(v);
}

inline void check_launch(const char* what) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(err));
}

inline cudaStream_t as_stream(std::uintptr_t stream) { return reinterpret_cast<cudaStream_t>(stream); }

// Calls body with T bound to the CUDA storage type of a DType code (float, bf16, fp16).
#define ML_CUDA_DTYPE_CALL(dtype, ...)                                            \
  do {                                                                            \
    switch (static_cast<::ml_cuda::DType>(dtype)) {                               \
      case ::ml_cuda::DType::kFloat32: {                                          \
        using T = float;                                                          \
        __VA_ARGS__;                                                              \
        break;                                                                    \
      }                                                                           \
      case ::ml_cuda::DType::kBFloat16: {                                         \
        using T = __nv_bfloat16;                                                  \
        __VA_ARGS__;                                                              \
        break;                                                                    \
      }                                                                           \
      case ::ml_cuda::DType::kFloat16: {                                          \
        using T = __half;                                                         \
        __VA_ARGS__;                                                              \
        break;                                                                    \
      }                                                                           \
      default:                                                                    \
        throw std::invalid_argument("CUDA kernels take float32, bfloat16 or float16"); \
    }                                                                             \
  } while (0)

}  // namespace ml_cuda
