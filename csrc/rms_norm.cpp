// megatron_like._csrc.rms_norm: RMSNorm over the last dimension (Llama's normalization), forward and
// backward with the weight gradient reduced in the same pass. Python wrapper:
// megatron_like/kernels/rms_norm.py.
#include "common.h"

#define ML_KERNELS "rms_norm_kernels.h"
#include "isa_dispatch.h"

namespace py = pybind11;

namespace {

void forward(std::uintptr_t x, std::uintptr_t w, std::uintptr_t out, std::uintptr_t rstd, std::int64_t n,
             std::int64_t h, double eps, int dtype, int threads) {
  py::gil_scoped_release release;
  ML_DTYPE_CALL(dtype, {
    using A = typename isa::Acc<T>::type;
    isa::rms_norm_forward<T>(ml::ptr<const T>(x), ml::ptr<const T>(w), ml::ptr<T>(out), ml::ptr<A>(rstd), n, h, eps,
                             threads);
  });
}

void backward(std::uintptr_t dy, std::uintptr_t x, std::uintptr_t w, std::uintptr_t rstd, std::uintptr_t dx,
              std::uintptr_t dw, std::int64_t n, std::int64_t h, int dtype, int threads) {
  py::gil_scoped_release release;
  ML_DTYPE_CALL(dtype, {
    using A = typename isa::Acc<T>::type;
    isa::rms_norm_backward<T>(ml::ptr<const T>(dy), ml::ptr<const T>(x), ml::ptr<const T>(w), ml::ptr<const A>(rstd),
                              ml::ptr<T>(dx), ml::ptr<T>(dw), n, h, threads);
  });
}

}  // namespace

PYBIND11_MODULE(rms_norm, m) {
  m.doc() = "RMSNorm, CPU, runtime ISA dispatch.";
  ml::bind_isa(m);
  m.def("forward", &forward, py::arg("x"), py::arg("w"), py::arg("out"), py::arg("rstd"), py::arg("n"), py::arg("h"),
        py::arg("eps"), py::arg("dtype"), py::arg("threads"),
        "out[n,h] = round(x * rstd) * w; writes rstd [n] (float32, float64 for float64 inputs).");
  m.def("backward", &backward, py::arg("dy"), py::arg("x"), py::arg("w"), py::arg("rstd"), py::arg("dx"),
        py::arg("dw"), py::arg("n"), py::arg("h"), py::arg("dtype"), py::arg("threads"),
        "dx[n,h]; dw[h] = sum over rows of dy * round(x * rstd) (skipped when dw is 0).");
}
