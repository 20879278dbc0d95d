// One fused Adam/AdamW pass over flat fp32 buffers, included once per ISA by isa_dispatch.h: reads
// grad, updates param / exp_avg / exp_avg_sq in place and optionally writes a bf16 or fp16 copy of
// the new param, so an offloaded optimizer step touches each byte once. The arithmetic follows
// torch.optim.AdamW's single-tensor path operation by operation (lerp for exp_avg, sqrt(v)/bc2 + eps).

struct AdamScalars {
  float lr;
  float beta1;
  float beta2;
  float eps;
  float weight_decay;
  float one_minus_beta1;  // lerp weight for exp_avg
  float one_minus_beta2;
  float decay;            // 1 - lr * weight_decay (AdamW) as torch rounds it
  float step_size;        // lr / bias_correction1
  float bc2_sqrt;         // sqrt(bias_correction2)
  bool adamw;
};

template <class C>
void adam_step(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, C* copy, std::int64_t n,
               AdamScalars s, int threads) {
  const int nt = threads_for(threads, n, 1 << 16);
#pragma omp parallel for simd num_threads(nt) schedule(static)
  for (std::int64_t i = 0; i < n; ++i) {
    float g = grad[i];
    float p = param[i];
    if (s.adamw) {
      p = p * s.decay;
    } else {
      g = g + p * s.weight_decay;
    }
    const float m = exp_avg[i] + s.one_minus_beta1 * (g - exp_avg[i]);
    const float v = exp_avg_sq[i] * s.beta2 + s.one_minus_beta2 * g * g;
    const float denom = std::sqrt(v) / s.bc2_sqrt + s.eps;
    p = p + (-s.step_size) * (m / denom);
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    param[i] = p;
    if constexpr (!std::is_same_v<C, void>) store(copy, i, p);
  }
}
