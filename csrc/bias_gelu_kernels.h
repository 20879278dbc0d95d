// GELU (tanh approximation, as GPT-2) of x + bias, forward and backward, included once per ISA by
// isa_dispatch.h. x and y are [n, h]; bias is [h].

constexpr float kGeluBeta = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluKappa = 0.044715f;

template <class T>
void bias_gelu_forward(const T* x, const T* bias, T* y, std::int64_t n, std::int64_t h, int threads) {
  using A = typename Acc<T>::type;
  const int nt = threads_for(threads, n * h);
#pragma omp parallel for num_threads(nt) schedule(static)
  for (std::int64_t r = 0; r < n; ++r) {
    const T* xr = x + r * h;
    T* yr = y + r * h;
#pragma omp simd
    for (std::int64_t j = 0; j < h; ++j) {
      const A u = load(xr, j) + load(bias, j);
      const A t = fast_tanh(A(kGeluBeta) * (u + A(kGeluKappa) * u * u * u));
      store(yr, j, A(0.5) * u * (A(1) + t));
    }
  }
}

// dx = dy * gelu'(x + bias); dbias = column sums of dx, through per-thread partial rows. The
// forward output is not saved: recomputing tanh is cheaper than storing and re-reading y.
template <class T>
void bias_gelu_backward(const T* dy, const T* x, const T* bias, T* dx, T* dbias, std::int64_t n, std::int64_t h,
                        int threads) {
  using A = typename Acc<T>::type;
  const int nt = threads_for(threads, n * h);
  std::vector<A> partial(static_cast<std::size_t>(nt * h), A(0));
#pragma omp parallel num_threads(nt)
  {
    A* pb = partial.data() + thread_id() * h;
#pragma omp for schedule(static)
    for (std::int64_t r = 0; r < n; ++r) {
      const T* dyr = dy + r * h;
      const T* xr = x + r * h;
      T* dxr = dx + r * h;
#pragma omp simd
      for (std::int64_t j = 0; j < h; ++j) {
        const A u = load(xr, j) + load(bias, j);
        const A t = fast_tanh(A(kGeluBeta) * (u + A(kGeluKappa) * u * u * u));
        const A du = A(0.5) * (A(1) + t) +
                     A(0.5) * u * (A(1) - t * t) * A(kGeluBeta) * (A(1) + A(3 * kGeluKappa) * u * u);
        const A g = load(dyr, j) * du;
        store(dxr, j, g);
        pb[j] += g;
      }
    }
  }
  if (dbias == nullptr) return;
  for (std::int64_t j = 0; j < h; ++j) {
    A b = 0;
    for (int t = 0; t < nt; ++t) b += partial[t * h + j];
    store(dbias, j, b);
  }
}
