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

// Reduce over the block (blockDim.x a multiple of 32, at most 1024) with the warp reduction `warp_op`; lanes past
// the last warp contribute `identity`. Every thread gets the result.
template <float (*warp_op)(float)>
__device__ __forceinline__ float block_reduce(float v, float identity) {
  __shared__ float partial[32];
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  v = warp_op(v);
  __syncthreads();  // partial[] may still be read by a previous call
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  const int warps = blockDim.x / 32;
  v = lane < warps ? partial[lane] : identity;
  return warp_op(v);
}

__device__ __forceinline__ float block_sum(float v) { return block_reduce<warp_sum>(v, 0.0f); }
__device__ __forceinline__ float block_max(float v) { return block_reduce<warp_max>(v, -INFINITY); }

// Column reductions over rows (the norms' weight gradients, bias-GELU's bias gradient): a block of
// kColumnTile x kRowLanes threads owns kColumnTile adjacent columns (a warp reads 32 neighbours of one row:
// coalesced) and its kRowLanes warps walk the rows kRowLanes apart, each thread summing its column's rows into
// `partial`. One thread per column walking every row left ~4 blocks busy for h = 1024 (1.6 ms for 8192 rows of an
// RMSNorm weight gradient on an H200, 60% of a Llama step; docs/kernels.md).
constexpr int kColumnTile = 32;
constexpr int kRowLanes = 32;

// Adds each column's kRowLanes partial sums in shared memory in a fixed order (deterministic, no atomics, no
// workspace). Every thread of the block must call it; the result is valid in the threads with threadIdx.y == 0.
__device__ __forceinline__ float sum_over_row_lanes(float partial) {
  __shared__ float lanes[kRowLanes][kColumnTile + 1];
  __syncthreads();  // lanes[] may still be read by a previous call
  lanes[threadIdx.y][threadIdx.x] = partial;
  __syncthreads();
  float sum = 0.0f;
  if (threadIdx.y == 0)
    for (int lane = 0; lane < kRowLanes; ++lane) sum += lanes[lane][threadIdx.x];
  return sum;
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
