// CUDA twin of csrc/grouped_gemm.cpp: one GEMM per row group (mixture of experts), forward and both
// gradients, same signature (the group sizes `counts` are a host pointer, as on the CPU). Each group is a
// launch of a shared-memory tiled kernel on the caller's stream (launches are asynchronous, so the loop
// over groups costs only launch overhead); operands are strided views, so the transposed products of the
// backward pass need no copies. Accumulation in fp32, one rounding to T.
// Built as megatron_like._csrc.cuda_grouped_gemm; compile-checked by tests/unit/test_cuda_compile.py.
#include "common.cuh"

namespace ml_cuda {

constexpr int kTile = 32;   // C tile kTile x kTile per block
constexpr int kRows = 8;    // threads per block: kTile x kRows, each computes kTile / kRows outputs

// C[m, n] = A[m, kdim] B[kdim, n]; element (i, j) of a view is p[i * rs + j * cs]; C rows are ldc apart.
template <class T>
__global__ void strided_gemm_kernel(const T* __restrict__ a, std::int64_t a_rs, std::int64_t a_cs,
                                    const T* __restrict__ b, std::int64_t b_rs, std::int64_t b_cs, T* __restrict__ c,
                                    std::int64_t ldc, std::int64_t m, std::int64_t n, std::int64_t kdim) {
  __shared__ float as[kTile][kTile + 1];
  __shared__ float bs[kTile][kTile + 1];
  const std::int64_t row0 = static_cast<std::int64_t>(blockIdx.y) * kTile;
  const std::int64_t col0 = static_cast<std::int64_t>(blockIdx.x) * kTile;
  const int tx = threadIdx.x, ty = threadIdx.y;
  float acc[kTile / kRows] = {};
  for (std::int64_t p0 = 0; p0 < kdim; p0 += kTile) {
    for (int r = ty; r < kTile; r += kRows) {
      const std::int64_t i = row0 + r, p = p0 + tx;
      as[r][tx] = (i < m && p < kdim) ? to_float(a[i * a_rs + p * a_cs]) : 0.0f;
      const std::int64_t q = p0 + r, j = col0 + tx;
      bs[r][tx] = (q < kdim && j < n) ? to_float(b[q * b_rs + j * b_cs]) : 0.0f;
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kTile; ++kk) {
      const float bv = bs[kk][tx];
#pragma unroll
      for (int s = 0; s < kTile / kRows; ++s) acc[s] += as[ty + s * kRows][kk] * bv;
    }
    __syncthreads();
  }
#pragma unroll
  for (int s = 0; s < kTile / kRows; ++s) {
    const std::int64_t i = row0 + ty + s * kRows, j = col0 + tx;
    if (i < m && j < n) c[i * ldc + j] = from_float<T>(acc[s]);
  }
}

// op 0: out[rows, n] = x_g w_g; op 1: out[rows, k] = dy_g w_g^T; op 2: out[groups, k, n] = x_g^T dy_g.
void grouped_gemm_run(int op, std::uintptr_t lhs, std::uintptr_t rhs, std::uintptr_t out, std::uintptr_t counts,
                      std::int64_t groups, std::int64_t k, std::int64_t n, int dtype, std::uintptr_t stream) {
  if (op < 0 || op > 2) throw std::invalid_argument("grouped_gemm: op must be 0, 1 or 2");
  const std::int64_t* sizes = reinterpret_cast<const std::int64_t*>(counts);
  ML_CUDA_DTYPE_CALL(dtype, {
    const T* l = reinterpret_cast<const T*>(lhs);
    const T* r = reinterpret_cast<const T*>(rhs);
    T* o = reinterpret_cast<T*>(out);
    std::int64_t r0 = 0;
    for (std::int64_t g = 0; g < groups; ++g) {
      const std::int64_t mg = sizes[g];
      std::int64_t m, nn, kk, a_rs, a_cs, b_rs, b_cs;
      const T *a, *b;
      T* c;
      if (op == 0) {  // y_g = x_g w_g
        a = l + r0 * k, a_rs = k, a_cs = 1, b = r + g * k * n, b_rs = n, b_cs = 1, c = o + r0 * n;
        m = mg, nn = n, kk = k;
      } else if (op == 1) {  // dx_g = dy_g w_g^T
        a = l + r0 * n, a_rs = n, a_cs = 1, b = r + g * k * n, b_rs = 1, b_cs = n, c = o + r0 * k;
        m = mg, nn = k, kk = n;
      } else {  // dw_g = x_g^T dy_g (zero for an empty group: the kernel runs with kdim = 0)
        a = l + r0 * k, a_rs = 1, a_cs = k, b = r + r0 * n, b_rs = n, b_cs = 1, c = o + g * k * n;
        m = k, nn = n, kk = mg;
      }
      r0 += mg;
      if (m == 0 || nn == 0) continue;
      const dim3 grid(static_cast<unsigned>((nn + kTile - 1) / kTile), static_cast<unsigned>((m + kTile - 1) / kTile));
      strided_gemm_kernel<T><<<grid, dim3(kTile, kRows), 0, as_stream(stream)>>>(a, a_rs, a_cs, b, b_rs, b_cs, c, nn,
                                                                                m, nn, kk);
    }
  });
  check_launch("grouped_gemm");
}

}  // namespace ml_cuda

#ifdef ML_CUDA_PYBIND
#include <pybind11/pybind11.h>
PYBIND11_MODULE(ML_CUDA_MODULE, m) {
  m.doc() = "CUDA grouped GEMM over contiguous row groups (same contract as the CPU grouped_gemm module).";
  m.def("run", &ml_cuda::grouped_gemm_run);
}
#endif
