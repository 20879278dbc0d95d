// Row kernels of LayerNorm with an optional fused "x + x_bias + residual" in front, included once per
// ISA by isa_dispatch.h. Rows are [n, h] row-major; mean/rstd are saved per row in the accumulation
// type for the backward pass.

// out = LayerNorm(s) * gamma + beta with s = x (+ x_bias) (+ residual); s is also written to
// sum_out when anything was added, rounded to T first so that LN normalizes exactly what it stores
// (the backward pass recomputes x_hat from the stored s).
template <class T>
void layer_norm_forward(const T* x, const T* x_bias, const T* residual, const T* gamma, const T* beta, T* out,
                        T* sum_out, typename Acc<T>::type* mean_out, typename Acc<T>::type* rstd_out, std::int64_t n,
                        std::int64_t h, double eps, int threads) {
  using A = typename Acc<T>::type;
  const int nt = threads_for(threads, n * h);
#pragma omp parallel num_threads(nt)
  {
    std::vector<A> s(static_cast<std::size_t>(h));
#pragma omp for schedule(static)
    for (std::int64_t r = 0; r < n; ++r) {
      const T* xr = x + r * h;
      A sum = 0;
      if (residual != nullptr || x_bias != nullptr) {
        const T* rr = residual != nullptr ? residual + r * h : nullptr;
        T* so = sum_out + r * h;
        // Four branch-free variants would cost compile time for little gain: the row sits in L1.
#pragma omp simd reduction(+ : sum)
        for (std::int64_t j = 0; j < h; ++j) {
          A v = load(xr, j);
          if (x_bias != nullptr) v += load(x_bias, j);
          if (rr != nullptr) v += load(rr, j);
          v = round_to(so, v);
          store(so, j, v);
          s[j] = v;
          sum += v;
        }
      } else if constexpr (std::is_same_v<T, A>) {
        // Plain LN on float rows: read x in place, no staging copy.
#pragma omp simd reduction(+ : sum)
        for (std::int64_t j = 0; j < h; ++j) sum += xr[j];
      } else {
#pragma omp simd reduction(+ : sum)
        for (std::int64_t j = 0; j < h; ++j) {
          A v = load(xr, j);
          s[j] = v;
          sum += v;
        }
      }
      const A* src = s.data();
      if constexpr (std::is_same_v<T, A>) {
        if (residual == nullptr && x_bias == nullptr) src = xr;
      }
      const A mean = sum / static_cast<A>(h);
      // Two-pass variance on the cached row: no cancellation, unlike E[x^2] - E[x]^2.
      A sq = 0;
#pragma omp simd reduction(+ : sq)
      for (std::int64_t j = 0; j < h; ++j) sq += (src[j] - mean) * (src[j] - mean);
      const A rstd = A(1) / std::sqrt(sq / static_cast<A>(h) + static_cast<A>(eps));
      T* outr = out + r * h;
#pragma omp simd
      for (std::int64_t j = 0; j < h; ++j)
        store(outr, j, (src[j] - mean) * rstd * load(gamma, j) + load(beta, j));
      mean_out[r] = mean;
      rstd_out[r] = rstd;
    }
  }
}

// ds = dLN/ds(dy) (+ dsum), the gradient of every summand x / residual; dgamma, dbeta and dx_bias
// (column sums) are reduced through per-thread partial rows so that threads never share a line.
template <class T>
void layer_norm_backward(const T* dy, const T* dsum, const T* s, const T* gamma, const typename Acc<T>::type* mean,
                         const typename Acc<T>::type* rstd, T* ds, T* dgamma, T* dbeta, T* dx_bias, std::int64_t n,
                         std::int64_t h, int threads) {
  using A = typename Acc<T>::type;
  const int nt = threads_for(threads, n * h);
  const std::int64_t cols = 3 * h;
  std::vector<A> partial(static_cast<std::size_t>(nt * cols), A(0));
#pragma omp parallel num_threads(nt)
  {
    A* pg = partial.data() + thread_id() * cols;
    A* pb = pg + h;
    A* px = pb + h;
#pragma omp for schedule(static)
    for (std::int64_t r = 0; r < n; ++r) {
      const T* dyr = dy + r * h;
      const T* sr = s + r * h;
      const A mu = mean[r];
      const A rs = rstd[r];
      A sum_g = 0;
      A sum_gx = 0;
#pragma omp simd reduction(+ : sum_g, sum_gx)
      for (std::int64_t j = 0; j < h; ++j) {
        const A d = load(dyr, j);
        const A xhat = (load(sr, j) - mu) * rs;
        const A g = d * load(gamma, j);
        sum_g += g;
        sum_gx += g * xhat;
        pg[j] += d * xhat;
        pb[j] += d;
      }
      const A mean_g = sum_g / static_cast<A>(h);
      const A mean_gx = sum_gx / static_cast<A>(h);
      T* dsr = ds + r * h;
      const T* dsumr = dsum != nullptr ? dsum + r * h : nullptr;
#pragma omp simd
      for (std::int64_t j = 0; j < h; ++j) {
        const A xhat = (load(sr, j) - mu) * rs;
        A v = rs * (load(dyr, j) * load(gamma, j) - mean_g - xhat * mean_gx);
        if (dsumr != nullptr) v += load(dsumr, j);
        store(dsr, j, v);
        px[j] += v;
      }
    }
  }
  for (std::int64_t j = 0; j < h; ++j) {
    A g = 0, b = 0, xb = 0;
    for (int t = 0; t < nt; ++t) {
      g += partial[t * cols + j];
      b += partial[t * cols + h + j];
      xb += partial[t * cols + 2 * h + j];
    }
    store(dgamma, j, g);
    store(dbeta, j, b);
    if (dx_bias != nullptr) store(dx_bias, j, xb);
  }
}
