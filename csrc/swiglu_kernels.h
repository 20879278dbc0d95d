// SwiGLU on interleaved (gate, up) pairs, forward and backward, included once per ISA by
// isa_dispatch.h. gate_up is [n, 2 f] with gate i at column 2 i and up i at column 2 i + 1; y is
// [n, f] (megatron_like/model/transformer.py: swiglu).
//
// Rounding follows `F.silu(gate) * up` in T: silu is rounded to T, then the product.

// sigmoid(g) = 1 / (1 + exp(-g)); exp overflows to inf for g < -88.7, which gives exactly 0.
template <class A>
ML_INLINE A sigmoid(A g) {
  return A(1) / (A(1) + fast_exp(-g));
}

template <class T>
void swiglu_forward(const T* gate_up, T* y, std::int64_t n, std::int64_t f, int threads) {
  using A = typename Acc<T>::type;
  const int nt = threads_for(threads, n * f);
#pragma omp parallel for num_threads(nt) schedule(static)
  for (std::int64_t r = 0; r < n; ++r) {
    const T* gu = gate_up + r * 2 * f;
    T* yr = y + r * f;
#pragma omp simd
    for (std::int64_t i = 0; i < f; ++i) {
      const A g = load(gu, 2 * i);
      const A silu = round_to(yr, g / (A(1) + fast_exp(-g)));  // PyTorch's form of silu: one rounding fewer
      store(yr, i, silu * load(gu, 2 * i + 1));
    }
  }
}

// d gate = dy * up * sigmoid(g) * (1 + g * (1 - sigmoid(g))), d up = dy * round_T(silu(g)); written
// back interleaved like gate_up.
template <class T>
void swiglu_backward(const T* dy, const T* gate_up, T* dgate_up, std::int64_t n, std::int64_t f, int threads) {
  using A = typename Acc<T>::type;
  const int nt = threads_for(threads, n * f);
#pragma omp parallel for num_threads(nt) schedule(static)
  for (std::int64_t r = 0; r < n; ++r) {
    const T* gu = gate_up + r * 2 * f;
    const T* dyr = dy + r * f;
    T* dgu = dgate_up + r * 2 * f;
#pragma omp simd
    for (std::int64_t i = 0; i < f; ++i) {
      const A g = load(gu, 2 * i);
      const A u = load(gu, 2 * i + 1);
      const A d = load(dyr, i);
      const A sg = sigmoid(g);
      store(dgu, 2 * i, d * u * sg * (A(1) + g * (A(1) - sg)));
      store(dgu, 2 * i + 1, d * round_to(dgu, g * sg));
    }
  }
}
