// megatron_like._csrc.bias_gelu: y = gelu_tanh(x + bias) and its backward with the bias gradient
// reduced in the same pass. Python wrapper: megatron_like/kernels/bias_gelu.py.
#include "common.h"

#define ML_KERNELS "bias_gelu_kernels.h"
#include "isa_dispatch.h"

namespace py = pybind11;

namespace {

void forward(std::uintptr_t x, std::uintptr_t bias, std::uintptr_t y, std::int64_t n, std::int64_t h, int dtype,
             int threads) {
  py::gil_scoped_release release;
  ML_DTYPE_CALL(dtype, isa::bias_gelu_forward<T>(ml::ptr<const T>(x), ml::ptr<const T>(bias), ml::ptr<T>(y), n, h,
                                                 threads));
}

void backward(std::uintptr_t dy, std::uintptr_t x, std::uintptr_t bias, std::uintptr_t dx, std::uintptr_t dbias,
              std::int64_t n, std::int64_t h, int dtype, int threads) {
  py::gil_scoped_release release;
  ML_DTYPE_CALL(dtype, isa::bias_gelu_backward<T>(ml::ptr<const T>(dy), ml::ptr<const T>(x), ml::ptr<const T>(bias),
                                                  ml::ptr<T>(dx), ml::ptr<T>(dbias), n, h, threads));
}

}  // namespace

PYBIND11_MODULE(bias_gelu, m) {
  m.doc() = "Fused bias + GELU (tanh approximation), CPU, runtime ISA dispatch.";
  ml::bind_isa(m);
  m.def("forward", &forward, py::arg("x"), py::arg("bias"), py::arg("y"), py::arg("n"), py::arg("h"),
        py::arg("dtype"), py::arg("threads"), "y[n,h] = gelu_tanh(x + bias[h]).");
  m.def("backward", &backward, py::arg("dy"), py::arg("x"), py::arg("bias"), py::arg("dx"), py::arg("dbias"),
        py::arg("n"), py::arg("h"), py::arg("dtype"), py::arg("threads"),
        "dx = dy * gelu_tanh'(x + bias); dbias = sum over rows of dx (skipped when dbias is 0).");
}
