// CUDA twin of csrc/rms_norm.cpp: RMSNorm forward and backward on [n, h] rows, same signatures and
// contract (rstd float32 per row; the normalized value rounded to T before the weight multiply).
// Built as megatron_like._csrc.cuda_rms_norm with a CUDA toolkit and a CUDA torch; compile-checked by
// tests/unit/test_cuda_compile.py.
#include "common.cuh"

namespace ml_cuda {

constexpr int kRmsNormThreads = 256;

// One block per row: rstd = 1 / sqrt(mean(x^2) + eps), out = round(x * rstd) * w.
template <class T>
__global__ void rms_norm_forward_kernel(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ out,
                                        float* __restrict__ rstd_out, std::int64_t h, float eps) {
  const std::int64_t row = blockIdx.x;
  const T* xr = x + row * h;
  float sq = 0.0f;
  for (std::int64_t j = threadIdx.x; j < h; j += blockDim.x) {
    const float v = to_float(xr[j]);
    sq += v * v;
  }
  const float rstd = rsqrtf(block_sum(sq) / static_cast<float>(h) + eps);
  for (std::int64_t j = threadIdx.x; j < h; j += blockDim.x) {
    const float normalized = to_float(from_float<T>(to_float(xr[j]) * rstd));
    out[row * h + j] = from_float<T>(normalized * to_float(w[j]));
  }
  if (threadIdx.x == 0) rstd_out[row] = rstd;
}

// dx[row] = rstd * (g - x * rstd^2 * mean(g * x)), g = dy * w.
template <class T>
__global__ void rms_norm_backward_input_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                               const T* __restrict__ w, const float* __restrict__ rstd,
                                               T* __restrict__ dx, std::int64_t h) {
  const std::int64_t row = blockIdx.x;
  const float rs = rstd[row];
  float dot = 0.0f;
  for (std::int64_t j = threadIdx.x; j < h; j += blockDim.x)
    dot += to_float(dy[row * h + j]) * to_float(w[j]) * to_float(x[row * h + j]);
  const float k = block_sum(dot) * rs * rs / static_cast<float>(h);
  for (std::int64_t j = threadIdx.x; j < h; j += blockDim.x) {
    const float g = to_float(dy[row * h + j]) * to_float(w[j]);
    dx[row * h + j] = from_float<T>(rs * (g - to_float(x[row * h + j]) * k));
  }
}

// dw[j] = sum over rows of dy * round(x * rstd), as a column reduction (common.cuh: sum_over_row_lanes).
template <class T>
__global__ void rms_norm_backward_weight_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                                const float* __restrict__ rstd, T* __restrict__ dw, std::int64_t n,
                                                std::int64_t h) {
  const std::int64_t j = static_cast<std::int64_t>(blockIdx.x) * kColumnTile + threadIdx.x;
  float acc = 0.0f;
  if (j < h) {
#pragma unroll 4
    for (std::int64_t r = threadIdx.y; r < n; r += kRowLanes)
      acc += to_float(dy[r * h + j]) * to_float(from_float<T>(to_float(x[r * h + j]) * rstd[r]));
  }
  const float sum = sum_over_row_lanes(acc);
  if (threadIdx.y == 0 && j < h) dw[j] = from_float<T>(sum);
}

void rms_norm_forward(std::uintptr_t x, std::uintptr_t w, std::uintptr_t out, std::uintptr_t rstd, std::int64_t n,
                      std::int64_t h, double eps, int dtype, std::uintptr_t stream) {
  if (n == 0) return;
  ML_CUDA_DTYPE_CALL(dtype, {
    rms_norm_forward_kernel<T><<<static_cast<unsigned>(n), kRmsNormThreads, 0, as_stream(stream)>>>(
        reinterpret_cast<const T*>(x), reinterpret_cast<const T*>(w), reinterpret_cast<T*>(out),
        reinterpret_cast<float*>(rstd), h, static_cast<float>(eps));
  });
  check_launch("rms_norm_forward");
}

void rms_norm_backward(std::uintptr_t dy, std::uintptr_t x, std::uintptr_t w, std::uintptr_t rstd, std::uintptr_t dx,
                       std::uintptr_t dw, std::int64_t n, std::int64_t h, int dtype, std::uintptr_t stream) {
  if (n == 0) return;
  ML_CUDA_DTYPE_CALL(dtype, {
    const T* dy_t = reinterpret_cast<const T*>(dy);
    const T* x_t = reinterpret_cast<const T*>(x);
    const float* rstd_t = reinterpret_cast<const float*>(rstd);
    rms_norm_backward_input_kernel<T><<<static_cast<unsigned>(n), kRmsNormThreads, 0, as_stream(stream)>>>(
        dy_t, x_t, reinterpret_cast<const T*>(w), rstd_t, reinterpret_cast<T*>(dx), h);
    if (dw != 0) {
      const unsigned column_blocks = static_cast<unsigned>((h + kColumnTile - 1) / kColumnTile);
      rms_norm_backward_weight_kernel<T><<<column_blocks, dim3(kColumnTile, kRowLanes), 0, as_stream(stream)>>>(
          dy_t, x_t, rstd_t, reinterpret_cast<T*>(dw), n, h);
    }
  });
  check_launch("rms_norm_backward");
}

}  // namespace ml_cuda

#ifdef ML_CUDA_PYBIND
#include <pybind11/pybind11.h>
PYBIND11_MODULE(ML_CUDA_MODULE, m) {
  m.doc() = "CUDA RMSNorm (same contract as the CPU rms_norm module).";
  m.def("forward", &ml_cuda::rms_norm_forward);
  m.def("backward", &ml_cuda::rms_norm_backward);
}
#endif
