// CUDA twin of csrc/scaled_masked_softmax.cpp: softmax(scale * x, mask) over [b, np, sq, sk] with a
// [b or 1, 1, sq, sk] byte mask (nonzero = masked out). Built as megatron_like._csrc.cuda_scaled_masked_softmax
// when a CUDA toolkit and a CUDA torch are present; compile-checked by tests/unit/test_cuda_compile.py.
#include "softmax.cuh"

namespace ml_cuda {

void scaled_masked_softmax_forward(std::uintptr_t x, std::uintptr_t mask, std::uintptr_t y, std::int64_t b,
                                   std::int64_t np, std::int64_t sq, std::int64_t sk, std::int64_t mask_batches,
                                   double scale, int dtype, std::uintptr_t stream) {
  ML_CUDA_DTYPE_CALL(dtype, softmax_forward<T, false>(reinterpret_cast<const T*>(x),
                                                       reinterpret_cast<const std::uint8_t*>(mask),
                                                       reinterpret_cast<T*>(y), b * np * sq, np, sq, sk, mask_batches,
                                                       static_cast<float>(scale), as_stream(stream)));
}

void scaled_masked_softmax_backward(std::uintptr_t dy, std::uintptr_t y, std::uintptr_t dx, std::int64_t rows,
                                    std::int64_t sk, double scale, int dtype, std::uintptr_t stream) {
  ML_CUDA_DTYPE_CALL(dtype, softmax_backward<T, false>(reinterpret_cast<const T*>(dy), reinterpret_cast<const T*>(y),
                                                        reinterpret_cast<T*>(dx), rows, 1, sk,
                                                        static_cast<float>(scale), as_stream(stream)));
}

}  // namespace ml_cuda

#ifdef ML_CUDA_PYBIND
#include <pybind11/pybind11.h>
PYBIND11_MODULE(ML_CUDA_MODULE, m) {
  m.doc() = "CUDA fused scale + mask + softmax (same contract as the CPU scaled_masked_softmax module).";
  m.def("forward", &ml_cuda::scaled_masked_softmax_forward);
  m.def("backward", &ml_cuda::scaled_masked_softmax_backward);
}
#endif
