// CUDA twin of csrc/rotary.cpp: rotary position embedding ("rotate half", partial rotary_dim) on
// x [b, heads, s, hd] with any strides over the first three dimensions, into a contiguous output; same
// signature and rounding as the CPU module (tables float32 [s, rd], rounded to T; each product rounded to
// T before the sum). One block per row, threads over columns. Built as megatron_like._csrc.cuda_rotary;
// compile-checked by tests/unit/test_cuda_compile.py.
#include "common.cuh"

namespace ml_cuda {

constexpr int kRotaryThreads = 64;

template <class T>
__device__ __forceinline__ float rounded(float v) {
  return to_float(from_float<T>(v));
}

template <bool kBackward, class T>
__global__ void rotary_kernel(const T* __restrict__ x, std::int64_t stride_b, std::int64_t stride_heads,
                              std::int64_t stride_s, const float* __restrict__ cos, const float* __restrict__ sin,
                              T* __restrict__ out, std::int64_t heads, std::int64_t s, std::int64_t hd,
                              std::int64_t rd) {
  const std::int64_t r = blockIdx.x;
  const std::int64_t si = r % s;
  const std::int64_t hi = (r / s) % heads;
  const std::int64_t bi = r / (s * heads);
  const T* xr = x + bi * stride_b + hi * stride_heads + si * stride_s;
  const float* c = cos + si * rd;
  const float* sn = sin + si * rd;
  T* o = out + r * hd;
  const std::int64_t half = rd / 2;
  for (std::int64_t j = threadIdx.x; j < half; j += blockDim.x) {
    const float x1 = to_float(xr[j]);
    const float x2 = to_float(xr[j + half]);
    const float c1 = rounded<T>(c[j]), c2 = rounded<T>(c[j + half]);
    const float s1 = rounded<T>(sn[j]), s2 = rounded<T>(sn[j + half]);
    if (kBackward) {
      o[j] = from_float<T>(rounded<T>(x1 * c1) + rounded<T>(x2 * s2));
      o[j + half] = from_float<T>(rounded<T>(x2 * c2) - rounded<T>(x1 * s1));
    } else {
      o[j] = from_float<T>(rounded<T>(x1 * c1) - rounded<T>(x2 * s1));
      o[j + half] = from_float<T>(rounded<T>(x2 * c2) + rounded<T>(x1 * s2));
    }
  }
  for (std::int64_t j = rd + threadIdx.x; j < hd; j += blockDim.x) o[j] = xr[j];
}

void rotary_apply(std::uintptr_t x, std::int64_t stride_b, std::int64_t stride_heads, std::int64_t stride_s,
                  std::uintptr_t cos, std::uintptr_t sin, std::uintptr_t out, std::int64_t b, std::int64_t heads,
                  std::int64_t s, std::int64_t hd, std::int64_t rd, bool backward, int dtype, std::uintptr_t stream) {
  if (rd % 2 != 0 || rd > hd) throw std::invalid_argument("rotary: rotary_dim must be even and <= head_dim");
  const std::int64_t rows = b * heads * s;
  if (rows == 0) return;
  ML_CUDA_DTYPE_CALL(dtype, {
    const T* x_t = reinterpret_cast<const T*>(x);
    const float* c = reinterpret_cast<const float*>(cos);
    const float* sn = reinterpret_cast<const float*>(sin);
    T* o = reinterpret_cast<T*>(out);
    if (backward)
      rotary_kernel<true, T><<<static_cast<unsigned>(rows), kRotaryThreads, 0, as_stream(stream)>>>(
          x_t, stride_b, stride_heads, stride_s, c, sn, o, heads, s, hd, rd);
    else
      rotary_kernel<false, T><<<static_cast<unsigned>(rows), kRotaryThreads, 0, as_stream(stream)>>>(
          x_t, stride_b, stride_heads, stride_s, c, sn, o, heads, s, hd, rd);
  });
  check_launch("rotary_apply");
}

}  // namespace ml_cuda

#ifdef ML_CUDA_PYBIND
#include <pybind11/pybind11.h>
PYBIND11_MODULE(ML_CUDA_MODULE, m) {
  m.doc() = "CUDA rotary position embedding (same contract as the CPU rotary module).";
  m.def("apply", &ml_cuda::rotary_apply);
}
#endif
