// CUDA twin of csrc/layer_norm.cpp: LayerNorm(x + x_bias + residual) forward and backward on [n, h]
// rows. Built as megatron_like._csrc.cuda_layer_norm with a CUDA toolkit and a CUDA torch;
// compile-checked by tests/unit/test_cuda_compile.py.
#include "layer_norm.cuh"

namespace ml_cuda {

void layer_norm_forward(std::uintptr_t x, std::uintptr_t x_bias, std::uintptr_t residual, std::uintptr_t gamma,
                        std::uintptr_t beta, std::uintptr_t out, std::uintptr_t sum_out, std::uintptr_t mean,
                        std::uintptr_t rstd, std::int64_t n, std::int64_t h, double eps, int dtype,
                        std::uintptr_t stream) {
  if (n == 0) return;
  ML_CUDA_DTYPE_CALL(dtype, {
    layer_norm_forward_kernel<T><<<static_cast<unsigned>(n), kLayerNormThreads, 0, as_stream(stream)>>>(
        reinterpret_cast<const T*>(x), reinterpret_cast<const T*>(x_bias), reinterpret_cast<const T*>(residual),
        reinterpret_cast<const T*>(gamma), reinterpret_cast<const T*>(beta), reinterpret_cast<T*>(out),
        reinterpret_cast<T*>(sum_out), reinterpret_cast<float*>(mean), reinterpret_cast<float*>(rstd), h,
        static_cast<float>(eps));
  });
  check_launch("layer_norm_forward");
}

void layer_norm_backward(std::uintptr_t dy, std::uintptr_t dsum, std::uintptr_t s, std::uintptr_t gamma,
                         std::uintptr_t mean, std::uintptr_t rstd, std::uintptr_t ds, std::uintptr_t dgamma,
                         std::uintptr_t dbeta, std::uintptr_t dx_bias, std::int64_t n, std::int64_t h, int dtype,
                         std::uintptr_t stream) {
  if (n == 0) return;
  ML_CUDA_DTYPE_CALL(dtype, {
    const T* dy_t = reinterpret_cast<const T*>(dy);
    const T* s_t = reinterpret_cast<const T*>(s);
    layer_norm_backward_input_kernel<T><<<static_cast<unsigned>(n), kLayerNormThreads, 0, as_stream(stream)>>>(
        dy_t, reinterpret_cast<const T*>(dsum), s_t, reinterpret_cast<const T*>(gamma),
        reinterpret_cast<const float*>(mean), reinterpret_cast<const float*>(rstd), reinterpret_cast<T*>(ds), h);
    const unsigned column_blocks = static_cast<unsigned>((h + kColumnTile - 1) / kColumnTile);
    layer_norm_backward_params_kernel<T><<<column_blocks, dim3(kColumnTile, kRowLanes), 0, as_stream(stream)>>>(
        dy_t, s_t, reinterpret_cast<const T*>(ds), reinterpret_cast<const float*>(mean),
        reinterpret_cast<const float*>(rstd), reinterpret_cast<T*>(dgamma), reinterpret_cast<T*>(dbeta),
        reinterpret_cast<T*>(dx_bias), n, h);
  });
  check_launch("layer_norm_backward");
}

}  // namespace ml_cuda

#ifdef ML_CUDA_PYBIND
#include <pybind11/pybind11.h>
PYBIND11_MODULE(ML_CUDA_MODULE, m) {
  m.doc() = "CUDA LayerNorm with fused bias + residual add (same contract as the CPU layer_norm module).";
  m.def("forward", &ml_cuda::layer_norm_forward);
  m.def("backward", &ml_cuda::layer_norm_backward);
}
#endif
