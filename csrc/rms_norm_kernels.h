// RMSNorm rows, forward and backward, included once per ISA by isa_dispatch.h. Rows are [n, h]
// row-major; rstd is saved per row in the accumulation type for the backward pass.
//
// Contract (megatron_like/model/norms.py: rms_norm): the statistics are float32 (float64 for float64
// rows), the normalized row is rounded to T before the weight multiplies it, and the product is
// rounded to T again, exactly as `(x.float() * rstd).to(x.dtype) * weight` does.

// out = round_T(x * rstd) * w, rstd = 1 / sqrt(mean(x^2) + eps). Each square is rounded before it is
// summed, as `x.pow(2).mean()` does: GNU C++ would otherwise contract square and sum into an FMA, and
// that one-ulp difference in rstd, small as it is, moves logits of a model with large weights by 1e-5.
template <class T>
__attribute__((optimize("fp-contract=off"))) void rms_norm_forward(const T* x, const T* w, T* out, typename Acc<T>::type* rstd_out, std::int64_t n,
                      std::int64_t h, double eps, int threads) {
  using A = typename Acc<T>::type;
  const int nt = threads_for(threads, n * h);
#pragma omp parallel for num_threads(nt) schedule(static)
  for (std::int64_t r = 0; r < n; ++r) {
    const T* xr = x + r * h;
    T* outr = out + r * h;
    A sq = 0;
#pragma omp simd reduction(+ : sq)
    for (std::int64_t j = 0; j < h; ++j) {
      const A v = load(xr, j);
      sq += v * v;
    }
    const A rstd = A(1) / std::sqrt(sq / static_cast<A>(h) + static_cast<A>(eps));
#pragma omp simd
    for (std::int64_t j = 0; j < h; ++j) store(outr, j, round_to(outr, load(xr, j) * rstd) * load(w, j));
    rstd_out[r] = rstd;
  }
}

// dx = rstd * (g - xhat * mean(g * xhat)) with g = dy * w and xhat = x * rstd; dw = sum over rows of
// dy * round_T(xhat), reduced through per-thread partial rows (threads never share a line). dw is
// skipped when null (the weight needs no gradient).
template <class T>
void rms_norm_backward(const T* dy, const T* x, const T* w, const typename Acc<T>::type* rstd, T* dx, T* dw,
                       std::int64_t n, std::int64_t h, int threads) {
  using A = typename Acc<T>::type;
  const int nt = threads_for(threads, n * h);
  std::vector<A> partial(dw != nullptr ? static_cast<std::size_t>(nt * h) : 0, A(0));
#pragma omp parallel num_threads(nt)
  {
    A* pw = dw != nullptr ? partial.data() + thread_id() * h : nullptr;
#pragma omp for schedule(static)
    for (std::int64_t r = 0; r < n; ++r) {
      const T* dyr = dy + r * h;
      const T* xr = x + r * h;
      T* dxr = dx + r * h;
      const A rs = rstd[r];
      A dot = 0;
      if (pw != nullptr) {
#pragma omp simd reduction(+ : dot)
        for (std::int64_t j = 0; j < h; ++j) {
          const A d = load(dyr, j);
          const A xv = load(xr, j);
          dot += d * load(w, j) * xv;
          pw[j] += d * round_to(dxr, xv * rs);
        }
      } else {
#pragma omp simd reduction(+ : dot)
        for (std::int64_t j = 0; j < h; ++j) dot += load(dyr, j) * load(w, j) * load(xr, j);
      }
      // mean(g * xhat) * rstd, folded: xhat * mean(g * xhat) = x * rs^2 * dot / h.
      const A k = dot * rs * rs / static_cast<A>(h);
#pragma omp simd
      for (std::int64_t j = 0; j < h; ++j) {
        const A xv = load(xr, j);
        store(dxr, j, rs * (load(dyr, j) * load(w, j) - xv * k));
      }
    }
  }
  if (dw == nullptr) return;
  for (std::int64_t j = 0; j < h; ++j) {
    A s = 0;
    for (int t = 0; t < nt; ++t) s += partial[t * h + j];
    store(dw, j, s);
  }
}
