// megatron_like._csrc.scaled_masked_softmax: softmax(scale * x + mask) over the last dimension of
// attention scores [b, np, sq, sk], mask [b or 1, 1, sq, sk] (nonzero = masked out), forward and
// backward. Python wrapper: megatron_like/kernels/fused_softmax.py.
#include "common.h"

#define ML_KERNELS "softmax_kernels.h"
#include "isa_dispatch.h"

namespace py = pybind11;

namespace {

void forward(std::uintptr_t x, std::uintptr_t mask, std::uintptr_t y, std::int64_t b, std::int64_t np,
             std::int64_t sq, std::int64_t sk, std::int64_t mask_batches, double scale, int dtype, int threads) {
  py::gil_scoped_release release;
  const auto* m = ml::ptr<const std::uint8_t>(mask);
  ML_DTYPE_CALL(dtype, isa::softmax_forward<T, false>(ml::ptr<const T>(x), m, ml::ptr<T>(y), np, b * np * sq, sq,
                                                      sk, mask_batches, scale, threads));
}

void backward(std::uintptr_t dy, std::uintptr_t y, std::uintptr_t dx, std::int64_t rows, std::int64_t sk,
              double scale, int dtype, int threads) {
  py::gil_scoped_release release;
  ML_DTYPE_CALL(dtype, isa::softmax_backward<T, false>(ml::ptr<const T>(dy), ml::ptr<const T>(y), ml::ptr<T>(dx),
                                                       rows, 1, sk, scale, threads));
}

}  // namespace

PYBIND11_MODULE(scaled_masked_softmax, m) {
  m.doc() = "Fused scale + mask + softmax over attention scores (CPU, runtime ISA dispatch).";
  ml::bind_isa(m);
  m.def("forward", &forward, py::arg("x"), py::arg("mask"), py::arg("y"), py::arg("b"), py::arg("np"),
        py::arg("sq"), py::arg("sk"), py::arg("mask_batches"), py::arg("scale"), py::arg("dtype"),
        py::arg("threads"),
        "y[b,np,sq,sk] = softmax(scale*x masked); pointers from data_ptr(), mask 0 for none, "
        "mask_batches 1 broadcasts one mask over the batch.");
  m.def("backward", &backward, py::arg("dy"), py::arg("y"), py::arg("dx"), py::arg("rows"), py::arg("sk"),
        py::arg("scale"), py::arg("dtype"), py::arg("threads"), "dx = scale * y * (dy - sum(dy * y)) per row.");
}
