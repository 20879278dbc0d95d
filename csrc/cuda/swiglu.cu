// CUDA twin of csrc/swiglu.cpp: silu(gate) * up on interleaved (gate, up) pairs, forward and backward,
// same signatures and rounding (silu rounded to T, then the product). One thread per pair, grid-stride.
// Built as megatron_like._csrc.cuda_swiglu; compile-checked by tests/unit/test_cuda_compile.py.
#include "common.cuh"

namespace ml_cuda {

constexpr int kSwigluThreads = 256;

__device__ __forceinline__ float sigmoidf(float g) { return 1.0f / (1.0f + __expf(-g)); }

template <class T>
__global__ void swiglu_forward_kernel(const T* __restrict__ gate_up, T* __restrict__ y, std::int64_t pairs) {
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < pairs;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const float g = to_float(gate_up[2 * i]);
    const float silu = to_float(from_float<T>(g * sigmoidf(g)));
    y[i] = from_float<T>(silu * to_float(gate_up[2 * i + 1]));
  }
}

template <class T>
__global__ void swiglu_backward_kernel(const T* __restrict__ dy, const T* __restrict__ gate_up,
                                       T* __restrict__ dgate_up, std::int64_t pairs) {
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < pairs;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const float g = to_float(gate_up[2 * i]);
    const float u = to_float(gate_up[2 * i + 1]);
    const float d = to_float(dy[i]);
    const float sg = sigmoidf(g);
    dgate_up[2 * i] = from_float<T>(d * u * sg * (1.0f + g * (1.0f - sg)));
    dgate_up[2 * i + 1] = from_float<T>(d * to_float(from_float<T>(g * sg)));
  }
}

inline unsigned blocks_for(std::int64_t pairs) {
  const std::int64_t blocks = (pairs + kSwigluThreads - 1) / kSwigluThreads;
  return static_cast<unsigned>(blocks < 65535 ? blocks : 65535);
}

void swiglu_forward(std::uintptr_t gate_up, std::uintptr_t y, std::int64_t n, std::int64_t f, int dtype,
                    std::uintptr_t stream) {
  const std::int64_t pairs = n * f;
  if (pairs == 0) return;
  ML_CUDA_DTYPE_CALL(dtype, {
    swiglu_forward_kernel<T><<<blocks_for(pairs), kSwigluThreads, 0, as_stream(stream)>>>(
        reinterpret_cast<const T*>(gate_up), reinterpret_cast<T*>(y), pairs);
  });
  check_launch("swiglu_forward");
}

void swiglu_backward(std::uintptr_t dy, std::uintptr_t gate_up, std::uintptr_t dgate_up, std::int64_t n,
                     std::int64_t f, int dtype, std::uintptr_t stream) {
  const std::int64_t pairs = n * f;
  if (pairs == 0) return;
  ML_CUDA_DTYPE_CALL(dtype, {
    swiglu_backward_kernel<T><<<blocks_for(pairs), kSwigluThreads, 0, as_stream(stream)>>>(
        reinterpret_cast<const T*>(dy), reinterpret_cast<const T*>(gate_up), reinterpret_cast<T*>(dgate_up), pairs);
  });
  check_launch("swiglu_backward");
}

}  // namespace ml_cuda

#ifdef ML_CUDA_PYBIND
#include <pybind11/pybind11.h>
PYBIND11_MODULE(ML_CUDA_MODULE, m) {
  m.doc() = "CUDA SwiGLU on interleaved (gate, up) pairs (same contract as the CPU swiglu module).";
  m.def("forward", &ml_cuda::swiglu_forward);
  m.def("backward", &ml_cuda::swiglu_backward);
}
#endif
