// LayerNorm with the optional fused "x + x_bias + residual" in front, forward and backward, one block
// per row. Same contract as the CPU kernels (csrc/layer_norm_kernels.h): the sum is rounded to T and
// stored, mean/rstd are float32 per row, statistics accumulate in fp32.
#pragma once

#include "common.cuh"

namespace ml_cuda {

constexpr int kLayerNormThreads = 256;

template <class T>
__device__ __forceinline__ float summed(const T* xr, const T* x_bias, const T* rr, std::int64_t j) {
  float v = to_float(xr[j]);
  if (x_bias != nullptr) v += to_float(x_bias[j]);
  if (rr != nullptr) v += to_float(rr[j]);
  return to_float(from_float<T>(v));  // normalize exactly what is stored
}

template <class T>
__global__ void layer_norm_forward_kernel(const T* __restrict__ x, const T* __restrict__ x_bias,
                                          const T* __restrict__ residual, const T* __restrict__ gamma,
                                          const T* __restrict__ beta, T* __restrict__ out, T* __restrict__ sum_out,
                                          float* __restrict__ mean_out, float* __restrict__ rstd_out, std::int64_t h,
                                          float eps) {
  const std::int64_t row = blockIdx.x;
  const T* xr = x + row * h;
  const T* rr = residual != nullptr ? residual + row * h : nullptr;
  const bool fused = x_bias != nullptr || residual != nullptr;
  float sum = 0.0f;
  for (std::int64_t j = threadIdx.x; j < h; j += blockDim.x) {
    const float v = summed(xr, x_bias, rr, j);
    if (fused) sum_out[row * h + j] = from_float<T>(v);
    sum += v;
  }
  const float mean = block_sum(sum) / static_cast<float>(h);
  float sq = 0.0f;
  for (std::int64_t j = threadIdx.x; j < h; j += blockDim.x) {
    const float d = summed(xr, x_bias, rr, j) - mean;
    sq += d * d;
  }
  const float rstd = rsqrtf(block_sum(sq) / static_cast<float>(h) + eps);
  for (std::int64_t j = threadIdx.x; j < h; j += blockDim.x) {
    const float xhat = (summed(xr, x_bias, rr, j) - mean) * rstd;
    out[row * h + j] = from_float<T>(xhat * to_float(gamma[j]) + to_float(beta[j]));
  }
  if (threadIdx.x == 0) {
    mean_out[row] = mean;
    rstd_out[row] = rstd;
  }
}

// ds[row] = rstd * (g - mean(g) - xhat * mean(g * xhat)) + dsum, g = dy * gamma.
template <class T>
__global__ void layer_norm_backward_input_kernel(const T* __restrict__ dy, const T* __restrict__ dsum,
                                                 const T* __restrict__ s, const T* __restrict__ gamma,
                                                 const float* __restrict__ mean, const float* __restrict__ rstd,
                                                 T* __restrict__ ds, std::int64_t h) {
  const std::int64_t row = blockIdx.x;
  const float mu = mean[row];
  const float rs = rstd[row];
  float sum_g = 0.0f;
  float sum_gx = 0.0f;
  for (std::int64_t j = threadIdx.x; j < h; j += blockDim.x) {
    const float g = to_float(dy[row * h + j]) * to_float(gamma[j]);
    sum_g += g;
    sum_gx += g * (to_float(s[row * h + j]) - mu) * rs;
  }
  const float mean_g = block_sum(sum_g) / static_cast<float>(h);
  const float mean_gx = block_sum(sum_gx) / static_cast<float>(h);
  for (std::int64_t j = threadIdx.x; j < h; j += blockDim.x) {
    const float xhat = (to_float(s[row * h + j]) - mu) * rs;
    float v = rs * (to_float(dy[row * h + j]) * to_float(gamma[j]) - mean_g - xhat * mean_gx);
    if (dsum != nullptr) v += to_float(dsum[row * h + j]);
    ds[row * h + j] = from_float<T>(v);
  }
}

// Column sums: dgamma = sum(dy * xhat), dbeta = sum(dy), dx_bias = sum(ds), as column reductions (common.cuh:
// sum_over_row_lanes).
template <class T>
__global__ void layer_norm_backward_params_kernel(const T* __restrict__ dy, const T* __restrict__ s,
                                                  const T* __restrict__ ds, const float* __restrict__ mean,
                                                  const float* __restrict__ rstd, T* __restrict__ dgamma,
                                                  T* __restrict__ dbeta, T* __restrict__ dx_bias, std::int64_t n,
                                                  std::int64_t h) {
  const std::int64_t j = static_cast<std::int64_t>(blockIdx.x) * kColumnTile + threadIdx.x;
  float g = 0.0f, b = 0.0f, xb = 0.0f;
  if (j < h) {
#pragma unroll 4
    for (std::int64_t r = threadIdx.y; r < n; r += kRowLanes) {
      const float d = to_float(dy[r * h + j]);
      g += d * (to_float(s[r * h + j]) - mean[r]) * rstd[r];
      b += d;
      if (dx_bias != nullptr) xb += to_float(ds[r * h + j]);
    }
  }
  g = sum_over_row_lanes(g);
  b = sum_over_row_lanes(b);
  xb = sum_over_row_lanes(xb);
  if (threadIdx.y != 0 || j >= h) return;
  dgamma[j] = from_float<T>(g);
  dbeta[j] = from_float<T>(b);
  if (dx_bias != nullptr) dx_bias[j] = from_float<T>(xb);
}

}  // namespace ml_cuda
