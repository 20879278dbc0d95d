// CUDA twin of csrc/scaled_upper_triang_masked_softmax.cpp: causal softmax(scale * x) over
// [..., sq, sk] (sq == sk). Built as megatron_like._csrc.cuda_scaled_upper_triang_masked_softmax with a
// CUDA toolkit and a CUDA torch; compile-checked by tests/unit/test_cuda_compile.py.
#include "softmax.cuh"

namespace ml_cuda {

void causal_softmax_forward(std::uintptr_t x, std::uintptr_t y, std::int64_t rows, std::int64_t sq, std::int64_t sk,
                            double scale, int dtype, std::uintptr_t stream) {
  ML_CUDA_DTYPE_CALL(dtype, softmax_forward<T, true>(reinterpret_cast<const T*>(x), nullptr, reinterpret_cast<T*>(y),
                                                      rows, 1, sq, sk, 1, static_cast<float>(scale),
                                                      as_stream(stream)));
}

void causal_softmax_backward(std::uintptr_t dy, std::uintptr_t y, std::uintptr_t dx, std::int64_t rows,
                             std::int64_t sq, std::int64_t sk, double scale, int dtype, std::uintptr_t stream) {
  ML_CUDA_DTYPE_CALL(dtype, softmax_backward<T, true>(reinterpret_cast<const T*>(dy), reinterpret_cast<const T*>(y),
                                                       reinterpret_cast<T*>(dx), rows, sq, sk,
                                                       static_cast<float>(scale), as_stream(stream)));
}

}  // namespace ml_cuda

#ifdef ML_CUDA_PYBIND
#include <pybind11/pybind11.h>
PYBIND11_MODULE(ML_CUDA_MODULE, m) {
  m.doc() = "CUDA fused causal softmax (same contract as the CPU scaled_upper_triang_masked_softmax module).";
  m.def("forward", &ml_cuda::causal_softmax_forward);
  m.def("backward", &ml_cuda::causal_softmax_backward);
}
#endif
