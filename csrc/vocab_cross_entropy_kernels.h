// Cross entropy over a vocabulary row, fused: the forward keeps only the row max and log(sum(exp))
// per row (never the [n, v] softmax) and the backward writes softmax - one_hot in one pass. Included
// once per ISA by isa_dispatch.h. logits are [n, v]; targets, loss, row_max, log_sum are [n].
// Max and log-sum are kept apart rather than as lse = max + log_sum: with logits around 3e4 a float
// lse has an ulp of 0.002, which would show up in both the loss and exp(x - lse).

template <class T>
void cross_entropy_forward(const T* logits, const std::int64_t* targets, typename Acc<T>::type* loss,
                           typename Acc<T>::type* max_out, typename Acc<T>::type* log_sum_out, std::int64_t n, std::int64_t v, std::int64_t ignore_index,
                           int threads, std::int64_t* bad_row) {
  using A = typename Acc<T>::type;
  const int nt = threads_for(threads, n * v);
  std::int64_t bad = -1;
#pragma omp parallel for num_threads(nt) schedule(static) reduction(max : bad)
  for (std::int64_t r = 0; r < n; ++r) {
    const T* xr = logits + r * v;
    A mx = -std::numeric_limits<A>::infinity();
#pragma omp simd reduction(max : mx)
    for (std::int64_t j = 0; j < v; ++j) {
      const A x = load(xr, j);
      mx = x > mx ? x : mx;
    }
    // Second pass re-reads the row from L2 (a 50k-vocab fp32 row is 200 KB): cheaper than an
    // online max/rescale, which would put a dependent rescale in every step.
    A sum = 0;
#pragma omp simd reduction(+ : sum)
    for (std::int64_t j = 0; j < v; ++j) sum += fast_exp(load(xr, j) - mx);
    const A log_sum = fast_log(sum);
    max_out[r] = mx;
    log_sum_out[r] = log_sum;
    const std::int64_t t = targets[r];
    if (t == ignore_index) {
      loss[r] = A(0);
    } else if (t < 0 || t >= v) {
      loss[r] = std::numeric_limits<A>::quiet_NaN();
      bad = r;
    } else {
      loss[r] = (mx - load(xr, t)) + log_sum;
    }
  }
  *bad_row = bad;
}

// grad[r, j] = grad_loss[r] * (exp(logits[r, j] - max[r] - log_sum[r]) - [j == target[r]]); zero for
// ignored rows.
template <class T>
void cross_entropy_backward(const T* logits, const std::int64_t* targets, const typename Acc<T>::type* row_max,
                            const typename Acc<T>::type* log_sum,
                            const typename Acc<T>::type* grad_loss, T* grad, std::int64_t n, std::int64_t v,
                            std::int64_t ignore_index, int threads) {
  using A = typename Acc<T>::type;
  const int nt = threads_for(threads, n * v);
#pragma omp parallel for num_threads(nt) schedule(static)
  for (std::int64_t r = 0; r < n; ++r) {
    const T* xr = logits + r * v;
    T* gr = grad + r * v;
    const std::int64_t t = targets[r];
    const A g = t == ignore_index ? A(0) : grad_loss[r];
    const A mx = row_max[r];
    const A ls = log_sum[r];
#pragma omp simd
    for (std::int64_t j = 0; j < v; ++j) store(gr, j, g * fast_exp((load(xr, j) - mx) - ls));
    if (t != ignore_index && t >= 0 && t < v) store(gr, t, load(gr, t) - g);
  }
}
