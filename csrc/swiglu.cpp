// megatron_like._csrc.swiglu: silu(gate) * up on interleaved (gate, up) pairs (Llama's MLP activation),
// forward and backward in one pass each. Python wrapper: megatron_like/kernels/swiglu.py.
#include "common.h"

#define ML_KERNELS "swiglu_kernels.h"
#include "isa_dispatch.h"

namespace py = pybind11;

namespace {

void forward(std::uintptr_t gate_up, std::uintptr_t y, std::int64_t n, std::int64_t f, int dtype, int threads) {
  py::gil_scoped_release release;
  ML_DTYPE_CALL(dtype, isa::swiglu_forward<T>(ml::ptr<const T>(gate_up), ml::ptr<T>(y), n, f, threads));
}

void backward(std::uintptr_t dy, std::uintptr_t gate_up, std::uintptr_t dgate_up, std::int64_t n, std::int64_t f,
              int dtype, int threads) {
  py::gil_scoped_release release;
  ML_DTYPE_CALL(dtype, isa::swiglu_backward<T>(ml::ptr<const T>(dy), ml::ptr<const T>(gate_up),
                                               ml::ptr<T>(dgate_up), n, f, threads));
}

}  // namespace

PYBIND11_MODULE(swiglu, m) {
  m.doc() = "SwiGLU on interleaved (gate, up) pairs, CPU, runtime ISA dispatch.";
  ml::bind_isa(m);
  m.def("forward", &forward, py::arg("gate_up"), py::arg("y"), py::arg("n"), py::arg("f"), py::arg("dtype"),
        py::arg("threads"), "y[n,f] = silu(gate_up[:, 0::2]) * gate_up[:, 1::2].");
  m.def("backward", &backward, py::arg("dy"), py::arg("gate_up"), py::arg("dgate_up"), py::arg("n"), py::arg("f"),
        py::arg("dtype"), py::arg("threads"), "dgate_up[n,2f]: d gate at even columns, d up at odd columns.");
}
