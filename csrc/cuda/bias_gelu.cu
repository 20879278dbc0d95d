// CUDA twin of csrc/bias_gelu.cpp: y = gelu_tanh(x + bias) on [n, h] rows and its backward with the bias
// gradient, same signatures and contract (float32 math, one rounding to T per output; dbias sums the unrounded
// float32 dx). Built as megatron_like._csrc.cuda_bias_gelu; compile-checked by tests/unit/test_cuda_compile.py.
#include "common.cuh"

namespace ml_cuda {

constexpr int kBiasGeluThreads = 256;
constexpr float kGeluBeta = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluKappa = 0.044715f;

// One thread per element, grid-stride.
template <class T>
__global__ void bias_gelu_forward_kernel(const T* __restrict__ x, const T* __restrict__ bias, T* __restrict__ y,
                                         std::int64_t total, std::int64_t h) {
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const float u = to_float(x[i]) + to_float(bias[i % h]);
    const float t = tanhf(kGeluBeta * (u + kGeluKappa * u * u * u));
    y[i] = from_float<T>(0.5f * u * (1.0f + t));
  }
}

// dx = dy * gelu'(x + bias), and dbias = column sums of dx in the same pass, as a column reduction (common.cuh:
// sum_over_row_lanes; the tile is 32 of the ffn columns).
template <class T>
__global__ void bias_gelu_backward_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                          const T* __restrict__ bias, T* __restrict__ dx, T* __restrict__ dbias,
                                          std::int64_t n, std::int64_t h) {
  const std::int64_t j = static_cast<std::int64_t>(blockIdx.x) * kColumnTile + threadIdx.x;
  float acc = 0.0f;
  if (j < h) {
    const float b = to_float(bias[j]);
#pragma unroll 4
    for (std::int64_t r = threadIdx.y; r < n; r += kRowLanes) {
      const float u = to_float(x[r * h + j]) + b;
      const float t = tanhf(kGeluBeta * (u + kGeluKappa * u * u * u));
      const float du = 0.5f * (1.0f + t) + 0.5f * u * (1.0f - t * t) * kGeluBeta * (1.0f + 3.0f * kGeluKappa * u * u);
      const float g = to_float(dy[r * h + j]) * du;
      dx[r * h + j] = from_float<T>(g);
      acc += g;
    }
  }
  if (dbias == nullptr) return;  // uniform over the block: no thread waits at a barrier alone
  const float sum = sum_over_row_lanes(acc);
  if (threadIdx.y == 0 && j < h) dbias[j] = from_float<T>(sum);
}

void bias_gelu_forward(std::uintptr_t x, std::uintptr_t bias, std::uintptr_t y, std::int64_t n, std::int64_t h,
                       int dtype, std::uintptr_t stream) {
  const std::int64_t total = n * h;
  if (total == 0) return;
  const std::int64_t wanted = (total + kBiasGeluThreads - 1) / kBiasGeluThreads;
  const unsigned blocks = static_cast<unsigned>(wanted < 65535 ? wanted : 65535);
  ML_CUDA_DTYPE_CALL(dtype, {
    bias_gelu_forward_kernel<T><<<blocks, kBiasGeluThreads, 0, as_stream(stream)>>>(
        reinterpret_cast<const T*>(x), reinterpret_cast<const T*>(bias), reinterpret_cast<T*>(y), total, h);
  });
  check_launch("bias_gelu_forward");
}

void bias_gelu_backward(std::uintptr_t dy, std::uintptr_t x, std::uintptr_t bias, std::uintptr_t dx,
                        std::uintptr_t dbias, std::int64_t n, std::int64_t h, int dtype, std::uintptr_t stream) {
  if (n * h == 0) return;
  const unsigned column_blocks = static_cast<unsigned>((h + kColumnTile - 1) / kColumnTile);
  ML_CUDA_DTYPE_CALL(dtype, {
    bias_gelu_backward_kernel<T><<<column_blocks, dim3(kColumnTile, kRowLanes), 0, as_stream(stream)>>>(
        reinterpret_cast<const T*>(dy), reinterpret_cast<const T*>(x), reinterpret_cast<const T*>(bias),
        reinterpret_cast<T*>(dx), reinterpret_cast<T*>(dbias), n, h);
  });
  check_launch("bias_gelu_backward");
}

}  // namespace ml_cuda

#ifdef ML_CUDA_PYBIND
#include <pybind11/pybind11.h>
PYBIND11_MODULE(ML_CUDA_MODULE, m) {
  m.doc() = "CUDA fused bias + GELU, tanh approximation (same contract as the CPU bias_gelu module).";
  m.def("forward", &ml_cuda::bias_gelu_forward);
  m.def("backward", &ml_cuda::bias_gelu_backward);
}
#endif
