// megatron_like._csrc.layer_norm: LayerNorm over the last dimension, optionally fused with the
// residual add in front of it (s = x + x_bias + residual; out = LN(s)), forward and backward.
// Python wrapper: megatron_like/kernels/layer_norm.py.
#include "common.h"

#define ML_KERNELS "layer_norm_kernels.h"
#include "isa_dispatch.h"

namespace py = pybind11;

namespace {

void forward(std::uintptr_t x, std::uintptr_t x_bias, std::uintptr_t residual, std::uintptr_t gamma,
             std::uintptr_t beta, std::uintptr_t out, std::uintptr_t sum_out, std::uintptr_t mean,
             std::uintptr_t rstd, std::int64_t n, std::int64_t h, double eps, int dtype, int threads) {
  py::gil_scoped_release release;
  if ((x_bias != 0 || residual != 0) && sum_out == 0)
    throw std::invalid_argument("sum_out is required when x_bias or residual is given");
  ML_DTYPE_CALL(dtype, {
    using A = typename isa::Acc<T>::type;
    isa::layer_norm_forward<T>(ml::ptr<const T>(x), ml::ptr<const T>(x_bias), ml::ptr<const T>(residual),
                               ml::ptr<const T>(gamma), ml::ptr<const T>(beta), ml::ptr<T>(out), ml::ptr<T>(sum_out),
                               ml::ptr<A>(mean), ml::ptr<A>(rstd), n, h, eps, threads);
  });
}

void backward(std::uintptr_t dy, std::uintptr_t dsum, std::uintptr_t s, std::uintptr_t gamma, std::uintptr_t mean,
              std::uintptr_t rstd, std::uintptr_t ds, std::uintptr_t dgamma, std::uintptr_t dbeta,
              std::uintptr_t dx_bias, std::int64_t n, std::int64_t h, int dtype, int threads) {
  py::gil_scoped_release release;
  ML_DTYPE_CALL(dtype, {
    using A = typename isa::Acc<T>::type;
    isa::layer_norm_backward<T>(ml::ptr<const T>(dy), ml::ptr<const T>(dsum), ml::ptr<const T>(s),
                                ml::ptr<const T>(gamma), ml::ptr<const A>(mean), ml::ptr<const A>(rstd), ml::ptr<T>(ds),
                                ml::ptr<T>(dgamma), ml::ptr<T>(dbeta), ml::ptr<T>(dx_bias), n, h, threads);
  });
}

}  // namespace

PYBIND11_MODULE(layer_norm, m) {
  m.doc() = "LayerNorm (optionally fused with bias + residual add), CPU, runtime ISA dispatch.";
  ml::bind_isa(m);
  m.def("forward", &forward, py::arg("x"), py::arg("x_bias"), py::arg("residual"), py::arg("gamma"),
        py::arg("beta"), py::arg("out"), py::arg("sum_out"), py::arg("mean"), py::arg("rstd"), py::arg("n"),
        py::arg("h"), py::arg("eps"), py::arg("dtype"), py::arg("threads"),
        "out[n,h] = LN(x + x_bias + residual) * gamma + beta; 0 for absent x_bias/residual; writes the sum to "
        "sum_out and mean/rstd [n] (float32, float64 for float64 inputs).");
  m.def("backward", &backward, py::arg("dy"), py::arg("dsum"), py::arg("s"), py::arg("gamma"), py::arg("mean"),
        py::arg("rstd"), py::arg("ds"), py::arg("dgamma"), py::arg("dbeta"), py::arg("dx_bias"), py::arg("n"),
        py::arg("h"), py::arg("dtype"), py::arg("threads"),
        "ds = dLN/ds (+ dsum); dgamma, dbeta and (if dx_bias != 0) the column sum of ds.");
}
