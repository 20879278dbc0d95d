// megatron_like._csrc.vocab_cross_entropy: per-row cross entropy of logits [n, v] against int64
// targets [n] without materializing the softmax; backward in one pass over the logits.
// Python wrapper: megatron_like/kernels/cross_entropy.py.
#include "common.h"

#define ML_KERNELS "vocab_cross_entropy_kernels.h"
#include "isa_dispatch.h"

namespace py = pybind11;

namespace {

void forward(std::uintptr_t logits, std::uintptr_t targets, std::uintptr_t loss, std::uintptr_t row_max,
             std::uintptr_t log_sum, std::int64_t n, std::int64_t v, std::int64_t ignore_index, int dtype, int threads) {
  std::int64_t bad_row = -1;
  {
    py::gil_scoped_release release;
    ML_DTYPE_CALL(dtype, {
      using A = typename isa::Acc<T>::type;
      isa::cross_entropy_forward<T>(ml::ptr<const T>(logits), ml::ptr<const std::int64_t>(targets), ml::ptr<A>(loss),
                                    ml::ptr<A>(row_max), ml::ptr<A>(log_sum), n, v, ignore_index, threads, &bad_row);
    });
  }
  if (bad_row >= 0) {
    const std::int64_t t = ml::ptr<const std::int64_t>(targets)[bad_row];
    throw py::index_error("target " + std::to_string(t) + " at row " + std::to_string(bad_row) +
                          " is out of range for a vocabulary of " + std::to_string(v));
  }
}

void backward(std::uintptr_t logits, std::uintptr_t targets, std::uintptr_t row_max, std::uintptr_t log_sum,
              std::uintptr_t grad_loss,
              std::uintptr_t grad, std::int64_t n, std::int64_t v, std::int64_t ignore_index, int dtype, int threads) {
  py::gil_scoped_release release;
  ML_DTYPE_CALL(dtype, {
    using A = typename isa::Acc<T>::type;
    isa::cross_entropy_backward<T>(ml::ptr<const T>(logits), ml::ptr<const std::int64_t>(targets),
                                   ml::ptr<const A>(row_max), ml::ptr<const A>(log_sum), ml::ptr<const A>(grad_loss), ml::ptr<T>(grad), n, v,
                                   ignore_index, threads);
  });
}

}  // namespace

PYBIND11_MODULE(vocab_cross_entropy, m) {
  m.doc() = "Fused vocabulary cross entropy (CPU, runtime ISA dispatch).";
  ml::bind_isa(m);
  m.def("forward", &forward, py::arg("logits"), py::arg("targets"), py::arg("loss"), py::arg("row_max"),
        py::arg("log_sum"), py::arg("n"),
        py::arg("v"), py::arg("ignore_index"), py::arg("dtype"), py::arg("threads"),
        "loss[n] = logsumexp(logits[n,v]) - logits[n, target]; also writes row_max[n] and log_sum[n] = "
        "log(sum(exp(logits - row_max))) for backward (float32, float64 for float64 logits).");
  m.def("backward", &backward, py::arg("logits"), py::arg("targets"), py::arg("row_max"), py::arg("log_sum"),
        py::arg("grad_loss"),
        py::arg("grad"), py::arg("n"), py::arg("v"), py::arg("ignore_index"), py::arg("dtype"), py::arg("threads"),
        "grad[n,v] = grad_loss * (softmax(logits) - one_hot(target)), zero rows for ignore_index.");
}
