// megatron_like._csrc.grouped_gemm: one GEMM per expert over contiguous row groups, forward and both
// gradients, in one call (no Python loop over experts). Python wrapper: megatron_like/kernels/grouped_gemm.py.
#include <memory>
#include <type_traits>

#include "common.h"

#define ML_KERNELS "grouped_gemm_kernels.h"
#include "isa_dispatch.h"

namespace py = pybind11;

namespace {

// op: 0 forward (y = x w), 1 grad input (dx = dy w^T), 2 grad weight (dw = x^T dy); see the kernel header.
void run(int op, std::uintptr_t lhs, std::uintptr_t rhs, std::uintptr_t out, std::uintptr_t counts,
         std::int64_t groups, std::int64_t k, std::int64_t n, int dtype, int threads) {
  if (op < 0 || op > 2) throw std::invalid_argument("grouped_gemm: op must be 0, 1 or 2");
  py::gil_scoped_release release;
  ML_DTYPE_CALL(dtype, isa::grouped_gemm<T>(static_cast<isa::GroupedOp>(op), ml::ptr<const T>(lhs),
                                            ml::ptr<const T>(rhs), ml::ptr<T>(out),
                                            ml::ptr<const std::int64_t>(counts), groups, k, n, threads));
}

}  // namespace

PYBIND11_MODULE(grouped_gemm, m) {
  m.doc() = "Grouped GEMM over contiguous row groups (mixture of experts), CPU, runtime ISA dispatch.";
  ml::bind_isa(m);
  m.def("run", &run, py::arg("op"), py::arg("lhs"), py::arg("rhs"), py::arg("out"), py::arg("counts"),
        py::arg("groups"), py::arg("k"), py::arg("n"), py::arg("dtype"), py::arg("threads"),
        "op 0: out[rows,n] = x w_g per group; 1: out[rows,k] = dy w_g^T; 2: out[groups,k,n] = x_g^T dy_g.");
}
