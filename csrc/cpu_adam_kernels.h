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

// One cache-sized block; kAdamW picks decoupled decay vs L2 at compile time so the loop has no branch.
template <class C, bool kAdamW>
ML_INLINE void adam_block(float* __restrict param, const float* __restrict grad, float* __restrict exp_avg,
                          float* __restrict exp_avg_sq, C* __restrict copy, std::int64_t n, const AdamScalars& s) {
  const float decay = s.decay, weight_decay = s.weight_decay, w1 = s.one_minus_beta1, beta2 = s.beta2;
  const float w2 = s.one_minus_beta2, bc2_sqrt = s.bc2_sqrt, eps = s.eps, neg_step = -s.step_size;
#pragma omp simd
  for (std::int64_t i = 0; i < n; ++i) {
    float g = grad[i];
    float p = param[i];
    if constexpr (kAdamW) {
      p = p * decay;
    } else {
      g = g + p * weight_decay;
    }
    const float m = exp_avg[i] + w1 * (g - exp_avg[i]);
    const float v = exp_avg_sq[i] * beta2 + w2 * g * g;
    p = p + neg_step * (m / (std::sqrt(v) / bc2_sqrt + eps));
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    param[i] = p;
    if constexpr (!std::is_same_v<C, void>) store(copy, i, p);
  }
}

template <class C>
void adam_step(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, C* copy, std::int64_t n,
               AdamScalars s, int threads) {
  // Blocks keep the per-thread loop simple for the vectorizer and balance the static schedule.
  constexpr std::int64_t kBlock = 1 << 14;
  const std::int64_t blocks = (n + kBlock - 1) / kBlock;
  const int nt = threads_for(threads, n, 1 << 16);
#pragma omp parallel for num_threads(nt) schedule(static)
  for (std::int64_t blk = 0; blk < blocks; ++blk) {
    const std::int64_t start = blk * kBlock;
    const std::int64_t len = std::min(kBlock, n - start);
    C* block_copy = nullptr;
    if constexpr (!std::is_same_v<C, void>) block_copy = copy + start;
    if (s.adamw) {
      adam_block<C, true>(param + start, grad + start, exp_avg + start, exp_avg_sq + start, block_copy, len, s);
    } else {
      adam_block<C, false>(param + start, grad + start, exp_avg + start, exp_avg_sq + start, block_copy, len, s);
    }
  }
}
