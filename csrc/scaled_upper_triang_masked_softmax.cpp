// megatron_like._csrc.scaled_upper_triang_masked_softmax: causal softmax(scale * x) over attention
// scores [b, np, sq, sk] with sq == sk, where key j > query i is masked out. Only the lower triangle
// is read or exponentiated, so it does about half the work of the general masked kernel.
// Python wrapper: megatron_like/kernels/fused_softmax.py.
#include "common.h"

#define ML_KERNELS "softmax_kernels.h"
#include "isa_dispatch.h"

namespace py = pybind11;

namespace {

void forward(std::uintptr_t x, std::uintptr_t y, std::int64_t rows, std::int64_t sq, std::int64_t sk,
             double scale, int dtype, int threads) {
  py::gil_scoped_release release;
  ML_DTYPE_CALL(dtype, isa::softmax_forward<T, true>(ml::ptr<const T>(x), nullptr, ml::ptr<T>(y), 1, rows, sq, sk,
                                                     1, scale, threads));
}

void backward(std::uintptr_t dy, std::uintptr_t y, std::uintptr_t dx, std::int64_t rows, std::int64_t sq,
              std::int64_t sk, double scale, int dtype, int threads) {
  py::gil_scoped_release release;
  ML_DTYPE_CALL(dtype, isa::softmax_backward<T, true>(ml::ptr<const T>(dy), ml::ptr<const T>(y), ml::ptr<T>(dx),
                                                      rows, sq, sk, scale, threads));
}

}  // namespace

PYBIND11_MODULE(scaled_upper_triang_masked_softmax, m) {
  m.doc() = "Fused scale + causal mask + softmax over attention scores (CPU, runtime ISA dispatch).";
  ml::bind_isa(m);
  m.def("forward", &forward, py::arg("x"), py::arg("y"), py::arg("rows"), py::arg("sq"), py::arg("sk"),
        py::arg("scale"), py::arg("dtype"), py::arg("threads"),
        "y = softmax(scale*x) over keys j <= query i (row r is query r % sq); zeros above the diagonal.");
  m.def("backward", &backward, py::arg("dy"), py::arg("y"), py::arg("dx"), py::arg("rows"), py::arg("sq"),
        py::arg("sk"), py::arg("scale"), py::arg("dtype"), py::arg("threads"),
        "dx = scale * y * (dy - sum(dy * y)) per row, zero above the diagonal.");
}
