// megatron_like._csrc.rotary: rotary position embedding ("rotate half" layout, partial rotary_dim)
// applied to query/key rows in one pass, forward and backward. Python wrapper:
// megatron_like/kernels/rotary.py.
#include "common.h"

#define ML_KERNELS "rotary_kernels.h"
#include "isa_dispatch.h"

namespace py = pybind11;

namespace {

void apply(std::uintptr_t x, std::int64_t stride_b, std::int64_t stride_heads, std::int64_t stride_s,
           std::uintptr_t cos, std::uintptr_t sin, std::uintptr_t out, std::int64_t b, std::int64_t heads,
           std::int64_t s, std::int64_t hd, std::int64_t rd, bool backward, int dtype, int threads) {
  py::gil_scoped_release release;
  if (rd % 2 != 0 || rd > hd) throw std::invalid_argument("rotary: rotary_dim must be even and <= head_dim");
  ML_DTYPE_CALL(dtype, {
    using A = typename isa::Acc<T>::type;
    if (backward)
      isa::rotary_apply<true, T>(ml::ptr<const T>(x), stride_b, stride_heads, stride_s, ml::ptr<const A>(cos),
                                 ml::ptr<const A>(sin), ml::ptr<T>(out), b, heads, s, hd, rd, threads);
    else
      isa::rotary_apply<false, T>(ml::ptr<const T>(x), stride_b, stride_heads, stride_s, ml::ptr<const A>(cos),
                                  ml::ptr<const A>(sin), ml::ptr<T>(out), b, heads, s, hd, rd, threads);
  });
}

}  // namespace

PYBIND11_MODULE(rotary, m) {
  m.doc() = "Rotary position embedding (rotate-half layout), CPU, runtime ISA dispatch.";
  ml::bind_isa(m);
  m.def("apply", &apply, py::arg("x"), py::arg("stride_b"), py::arg("stride_heads"), py::arg("stride_s"),
        py::arg("cos"), py::arg("sin"), py::arg("out"), py::arg("b"), py::arg("heads"), py::arg("s"), py::arg("hd"),
        py::arg("rd"), py::arg("backward"), py::arg("dtype"), py::arg("threads"),
        "out[b,heads,s,hd] (contiguous) = x rotated by cos/sin [s,rd] (accumulation dtype); backward=True "
        "applies the transposed rotation (the gradient). Columns rd..hd are copied.");
}
