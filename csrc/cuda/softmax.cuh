// Scaled (masked / causal) softmax over attention scores [rows, sk], rows = b * np * sq, one warp
// per row. Same contract as the CPU kernels (csrc/softmax_kernels.h): masked entries get 0, a row
// with nothing unmasked is all zeros, bf16/fp16 are computed in fp32. Simple three-sweep version:
// the row is re-read from L1/L2 rather than held in registers, which keeps it valid for any sk.
#pragma once

#include "common.cuh"

namespace ml_cuda {

constexpr int kSoftmaxWarpsPerBlock = 4;

template <class T, bool kCausal>
__global__ void softmax_forward_kernel(const T* __restrict__ x, const std::uint8_t* __restrict__ mask,
                                       T* __restrict__ y, std::int64_t rows, std::int64_t heads, std::int64_t sq,
                                       std::int64_t sk, std::int64_t mask_batches, float scale) {
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * kSoftmaxWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  const std::int64_t q = row % sq;
  const std::int64_t len = kCausal ? min(q + 1, sk) : sk;
  const T* xr = x + row * sk;
  T* yr = y + row * sk;
  const std::uint8_t* mr = nullptr;
  if (!kCausal && mask != nullptr) mr = mask + ((mask_batches == 1 ? 0 : row / (heads * sq)) * sq + q) * sk;

  float mx = -INFINITY;
  for (std::int64_t j = lane; j < len; j += 32) {
    const bool masked = mr != nullptr && mr[j];
    if (!masked) mx = fmaxf(mx, to_float(xr[j]) * scale);
  }
  mx = warp_max(mx);
  if (mx == -INFINITY) {
    for (std::int64_t j = lane; j < sk; j += 32) yr[j] = from_float<T>(0.0f);
    return;
  }
  float sum = 0.0f;
  for (std::int64_t j = lane; j < len; j += 32) {
    const bool masked = mr != nullptr && mr[j];
    if (!masked) sum += __expf(to_float(xr[j]) * scale - mx);
  }
  const float inv = 1.0f / warp_sum(sum);
  for (std::int64_t j = lane; j < sk; j += 32) {
    const bool keep = j < len && !(mr != nullptr && mr[j]);
    yr[j] = from_float<T>(keep ? __expf(to_float(xr[j]) * scale - mx) * inv : 0.0f);
  }
}

// dx = scale * y * (dy - <dy, y>) per row; zero past the causal diagonal.
template <class T, bool kCausal>
__global__ void softmax_backward_kernel(const T* __restrict__ dy, const T* __restrict__ y, T* __restrict__ dx,
                                        std::int64_t rows, std::int64_t sq, std::int64_t sk, float scale) {
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * kSoftmaxWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  const std::int64_t len = kCausal ? min(row % sq + 1, sk) : sk;
  const T* dyr = dy + row * sk;
  const T* yr = y + row * sk;
  T* dxr = dx + row * sk;
  float dot = 0.0f;
  for (std::int64_t j = lane; j < len; j += 32) dot += to_float(dyr[j]) * to_float(yr[j]);
  dot = warp_sum(dot);
  for (std::int64_t j = lane; j < sk; j += 32) {
    const float v = j < len ? scale * to_float(yr[j]) * (to_float(dyr[j]) - dot) : 0.0f;
    dxr[j] = from_float<T>(v);
  }
}

inline unsigned softmax_blocks(std::int64_t rows) {
  return static_cast<unsigned>((rows + kSoftmaxWarpsPerBlock - 1) / kSoftmaxWarpsPerBlock);
}

template <class T, bool kCausal>
void softmax_forward(const T* x, const std::uint8_t* mask, T* y, std::int64_t rows, std::int64_t heads,
                     std::int64_t sq, std::int64_t sk, std::int64_t mask_batches, float scale, cudaStream_t stream) {
  if (rows == 0) return;
  softmax_forward_kernel<T, kCausal><<<softmax_blocks(rows), kSoftmaxWarpsPerBlock * 32, 0, stream>>>(
      x, mask, y, rows, heads, sq, sk, mask_batches, scale);
  check_launch("softmax_forward");
}

template <class T, bool kCausal>
void softmax_backward(const T* dy, const T* y, T* dx, std::int64_t rows, std::int64_t sq, std::int64_t sk,
                      float scale, cudaStream_t stream) {
  if (rows == 0) return;
  softmax_backward_kernel<T, kCausal><<<softmax_blocks(rows), kSoftmaxWarpsPerBlock * 32, 0, stream>>>(
      dy, y, dx, rows, sq, sk, scale);
  check_launch("softmax_backward");
}

}  // namespace ml_cuda
