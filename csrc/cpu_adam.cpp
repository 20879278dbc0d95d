// megatron_like._csrc.cpu_adam: the optimizer step of --optimizer-cpu-offload. Adam/AdamW on flat
// fp32 host buffers in one pass, optionally writing the updated params as bf16/fp16 for the model.
// Python wrapper: megatron_like/kernels/cpu_adam.py (adam_step_, CPUAdam).
#include "common.h"

#define ML_KERNELS "cpu_adam_kernels.h"
#include "isa_dispatch.h"

#include <cmath>

namespace py = pybind11;

namespace {

// Scalars are derived in double, as torch.optim.AdamW does in Python, then rounded to float once.
template <class Scalars>
Scalars make_scalars(double lr, double beta1, double beta2, double eps, double weight_decay, double step,
                     bool adamw, bool bias_correction) {
  const double bc1 = bias_correction ? 1.0 - std::pow(beta1, step) : 1.0;
  const double bc2 = bias_correction ? 1.0 - std::pow(beta2, step) : 1.0;
  Scalars s;
  s.lr = static_cast<float>(lr);
  s.beta1 = static_cast<float>(beta1);
  s.beta2 = static_cast<float>(beta2);
  s.eps = static_cast<float>(eps);
  s.weight_decay = static_cast<float>(weight_decay);
  s.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  s.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  s.decay = static_cast<float>(1.0 - lr * weight_decay);
  s.step_size = static_cast<float>(lr / bc1);
  s.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  s.adamw = adamw;
  return s;
}

void step(std::uintptr_t param, std::uintptr_t grad, std::uintptr_t exp_avg, std::uintptr_t exp_avg_sq,
          std::int64_t n, double lr, double beta1, double beta2, double eps, double weight_decay, double step_count,
          bool adamw, bool bias_correction, std::uintptr_t copy, int copy_dtype, int threads) {
  if (step_count < 1) throw std::invalid_argument("step must be >= 1 (it counts this update)");
  py::gil_scoped_release release;
  auto* p = ml::ptr<float>(param);
  const auto* g = ml::ptr<const float>(grad);
  auto* m = ml::ptr<float>(exp_avg);
  auto* v = ml::ptr<float>(exp_avg_sq);
  if (copy == 0) {
    ML_ISA_CALL(isa::adam_step<void>(p, g, m, v, nullptr, n,
                                     make_scalars<isa::AdamScalars>(lr, beta1, beta2, eps, weight_decay, step_count,
                                                                    adamw, bias_correction),
                                     threads));
  } else if (static_cast<ml::DType>(copy_dtype) == ml::DType::kBFloat16) {
    ML_ISA_CALL(isa::adam_step<ml::bf16>(p, g, m, v, ml::ptr<ml::bf16>(copy), n,
                                         make_scalars<isa::AdamScalars>(lr, beta1, beta2, eps, weight_decay,
                                                                        step_count, adamw, bias_correction),
                                         threads));
  } else if (static_cast<ml::DType>(copy_dtype) == ml::DType::kFloat16) {
    ML_ISA_CALL(isa::adam_step<ml::fp16>(p, g, m, v, ml::ptr<ml::fp16>(copy), n,
                                         make_scalars<isa::AdamScalars>(lr, beta1, beta2, eps, weight_decay,
                                                                        step_count, adamw, bias_correction),
                                         threads));
  } else {
    throw std::invalid_argument("copy dtype must be bfloat16 (2) or float16 (3)");
  }
}

}  // namespace

PYBIND11_MODULE(cpu_adam, m) {
  m.doc() = "Fused Adam/AdamW step on fp32 host buffers with an optional bf16/fp16 param copy.";
  ml::bind_isa(m);
  m.def("step", &step, py::arg("param"), py::arg("grad"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("n"),
        py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("step"),
        py::arg("adamw"), py::arg("bias_correction"), py::arg("copy"), py::arg("copy_dtype"), py::arg("threads"),
        "In place on n fp32 elements: AdamW (adamw=True, decoupled decay) or Adam (L2 decay) for update "
        "number `step`; copy != 0 also receives the new params as copy_dtype (2 bf16, 3 fp16).");
}
