// Row kernels of the scaled (masked / causal) softmax, included once per ISA by isa_dispatch.h.
// Layout: scores x, probs y, grads are [rows, sk] with rows = b * np * sq; mask is
// [mask_batches, sq, sk] bytes (nonzero = masked out). A row with no unmasked entry yields zeros
// (and zero gradient), as Megatron's kernels do, instead of the NaNs of softmax over all -inf.

// One row: y[0:len] = softmax(scale * x[0:len] with masked entries removed), y[len:n] = 0.
template <class T, bool kHasMask>
ML_INLINE void softmax_row_forward(const T* xr, const std::uint8_t* mr, T* yr, typename Acc<T>::type* e,
                                   std::int64_t len, std::int64_t n, typename Acc<T>::type scale) {
  using A = typename Acc<T>::type;
  const A neg_inf = -std::numeric_limits<A>::infinity();
  A mx = neg_inf;
#pragma omp simd reduction(max : mx)
  for (std::int64_t j = 0; j < len; ++j) {
    A v = load(xr, j) * scale;
    if constexpr (kHasMask) v = mr[j] ? neg_inf : v;
    mx = v > mx ? v : mx;
  }
  // The OpenMP max identity may be -FLT_MAX rather than -inf: both mean "nothing unmasked".
  if (!(mx > std::numeric_limits<A>::lowest())) {
    for (std::int64_t j = 0; j < n; ++j) store(yr, j, A(0));
    return;
  }
  // Write exp() straight into y when y already holds the accumulation type: saves a pass.
  A* out = e;
  if constexpr (std::is_same_v<T, A>) out = yr;
  A sum = 0;
#pragma omp simd reduction(+ : sum)
  for (std::int64_t j = 0; j < len; ++j) {
    A v = fast_exp(load(xr, j) * scale - mx);
    if constexpr (kHasMask) v = mr[j] ? A(0) : v;
    out[j] = v;
    sum += v;
  }
  const A inv = A(1) / sum;
#pragma omp simd
  for (std::int64_t j = 0; j < len; ++j) store(yr, j, out[j] * inv);
  for (std::int64_t j = len; j < n; ++j) store(yr, j, A(0));
}

template <class T, bool kCausal>
void softmax_forward(const T* x, const std::uint8_t* mask, T* y, std::int64_t heads, std::int64_t rows,
                     std::int64_t sq, std::int64_t sk, std::int64_t mask_batches, double scale, int threads) {
  using A = typename Acc<T>::type;
  const int nt = threads_for(threads, rows * sk);
#pragma omp parallel num_threads(nt)
  {
    std::vector<A> scratch(static_cast<std::size_t>(sk));
#pragma omp for schedule(static)
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::int64_t q = r % sq;
      if constexpr (kCausal) {
        softmax_row_forward<T, false>(x + r * sk, nullptr, y + r * sk, scratch.data(), std::min(q + 1, sk), sk,
                                      static_cast<A>(scale));
      } else if (mask != nullptr) {
        const std::int64_t mb = mask_batches == 1 ? 0 : r / (heads * sq);
        softmax_row_forward<T, true>(x + r * sk, mask + (mb * sq + q) * sk, y + r * sk, scratch.data(), sk, sk,
                                     static_cast<A>(scale));
      } else {
        softmax_row_forward<T, false>(x + r * sk, nullptr, y + r * sk, scratch.data(), sk, sk,
                                      static_cast<A>(scale));
      }
    }
  }
}

// dx = scale * y * (dy - <dy, y>) per row; entries past the causal diagonal are zero.
template <class T, bool kCausal>
void softmax_backward(const T* dy, const T* y, T* dx, std::int64_t rows, std::int64_t sq, std::int64_t sk,
                      double scale_d, int threads) {
  using A = typename Acc<T>::type;
  const A scale = static_cast<A>(scale_d);
  const int nt = threads_for(threads, rows * sk);
#pragma omp parallel for num_threads(nt) schedule(static)
  for (std::int64_t r = 0; r < rows; ++r) {
    const T* dyr = dy + r * sk;
    const T* yr = y + r * sk;
    T* dxr = dx + r * sk;
    const std::int64_t len = kCausal ? std::min(r % sq + 1, sk) : sk;
    A dot = 0;
#pragma omp simd reduction(+ : dot)
    for (std::int64_t j = 0; j < len; ++j) dot += load(dyr, j) * load(yr, j);
#pragma omp simd
    for (std::int64_t j = 0; j < len; ++j) store(dxr, j, scale * load(yr, j) * (load(dyr, j) - dot));
    for (std::int64_t j = len; j < sk; ++j) store(dxr, j, A(0));
  }
}
