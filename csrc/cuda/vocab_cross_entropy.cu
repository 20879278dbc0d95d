// CUDA twin of csrc/vocab_cross_entropy.cpp: per-row cross entropy of logits [n, v] against int64 targets [n]
// without materializing the softmax, and its backward in one pass over the logits; same signatures and contract
// (row_max and log_sum = log(sum(exp(logits - row_max))) kept apart, float32; the loss of an ignored row is 0, of an
// out-of-range target NaN: the Python wrapper checks the targets before it launches, as the fallback does).
// One block per row; the row is read twice (max, then the sum of exponentials) from L2 rather than rescaled
// online. Built as megatron_like._csrc.cuda_vocab_cross_entropy; compile-checked by tests/unit/test_cuda_compile.py.
#include "common.cuh"

namespace ml_cuda {

constexpr int kCrossEntropyThreads = 512;

template <class T>
__global__ void cross_entropy_forward_kernel(const T* __restrict__ logits, const std::int64_t* __restrict__ targets,
                                             float* __restrict__ loss, float* __restrict__ row_max,
                                             float* __restrict__ log_sum, std::int64_t v, std::int64_t ignore_index) {
  const std::int64_t row = blockIdx.x;
  const T* xr = logits + row * v;
  float mx = -INFINITY;
  for (std::int64_t j = threadIdx.x; j < v; j += blockDim.x) mx = fmaxf(mx, to_float(xr[j]));
  mx = block_max(mx);
  float sum = 0.0f;
  for (std::int64_t j = threadIdx.x; j < v; j += blockDim.x) sum += __expf(to_float(xr[j]) - mx);
  sum = block_sum(sum);
  if (threadIdx.x != 0) return;
  const float ls = logf(sum);
  row_max[row] = mx;
  log_sum[row] = ls;
  const std::int64_t t = targets[row];
  if (t == ignore_index) {
    loss[row] = 0.0f;
  } else if (t < 0 || t >= v) {
    loss[row] = NAN;
  } else {
    loss[row] = (mx - to_float(xr[t])) + ls;
  }
}

// grad[r, j] = grad_loss[r] * (exp(logits[r, j] - max[r] - log_sum[r]) - [j == target[r]]); zero rows for
// ignore_index. Each element is read just before its gradient is written by the same thread, so grad may be the
// logits themselves (the wrapper's inplace_backward): hence no __restrict__ on those two.
template <class T>
__global__ void cross_entropy_backward_kernel(const T* logits, const std::int64_t* __restrict__ targets,
                                              const float* __restrict__ row_max, const float* __restrict__ log_sum,
                                              const float* __restrict__ grad_loss, T* grad, std::int64_t v,
                                              std::int64_t ignore_index) {
  const std::int64_t row = blockIdx.x;
  const std::int64_t t = targets[row];
  const float g = t == ignore_index ? 0.0f : grad_loss[row];
  const float mx = row_max[row];
  const float ls = log_sum[row];
  const T* xr = logits + row * v;
  T* gr = grad + row * v;
  for (std::int64_t j = threadIdx.x; j < v; j += blockDim.x) {
    const float p = __expf((to_float(xr[j]) - mx) - ls);
    gr[j] = from_float<T>(j == t ? g * p - g : g * p);
  }
}

void cross_entropy_forward(std::uintptr_t logits, std::uintptr_t targets, std::uintptr_t loss, std::uintptr_t row_max,
                           std::uintptr_t log_sum, std::int64_t n, std::int64_t v, std::int64_t ignore_index,
                           int dtype, std::uintptr_t stream) {
  if (n == 0) return;
  ML_CUDA_DTYPE_CALL(dtype, {
    cross_entropy_forward_kernel<T><<<static_cast<unsigned>(n), kCrossEntropyThreads, 0, as_stream(stream)>>>(
        reinterpret_cast<const T*>(logits), reinterpret_cast<const std::int64_t*>(targets),
        reinterpret_cast<float*>(loss), reinterpret_cast<float*>(row_max), reinterpret_cast<float*>(log_sum), v,
        ignore_index);
  });
  check_launch("vocab_cross_entropy_forward");
}

void cross_entropy_backward(std::uintptr_t logits, std::uintptr_t targets, std::uintptr_t row_max,
                            std::uintptr_t log_sum, std::uintptr_t grad_loss, std::uintptr_t grad, std::int64_t n,
                            std::int64_t v, std::int64_t ignore_index, int dtype, std::uintptr_t stream) {
  if (n == 0) return;
  ML_CUDA_DTYPE_CALL(dtype, {
    cross_entropy_backward_kernel<T><<<static_cast<unsigned>(n), kCrossEntropyThreads, 0, as_stream(stream)>>>(
        reinterpret_cast<const T*>(logits), reinterpret_cast<const std::int64_t*>(targets),
        reinterpret_cast<const float*>(row_max), reinterpret_cast<const float*>(log_sum),
        reinterpret_cast<const float*>(grad_loss), reinterpret_cast<T*>(grad), v, ignore_index);
  });
  check_launch("vocab_cross_entropy_backward");
}

}  // namespace ml_cuda

#ifdef ML_CUDA_PYBIND
#include <pybind11/pybind11.h>
PYBIND11_MODULE(ML_CUDA_MODULE, m) {
  m.doc() = "CUDA fused vocabulary cross entropy (same contract as the CPU vocab_cross_entropy module).";
  m.def("forward", &ml_cuda::cross_entropy_forward);
  m.def("backward", &ml_cuda::cross_entropy_backward);
}
#endif
