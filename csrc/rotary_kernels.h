// Rotary position embedding applied to rows of head_dim, forward and backward, included once per ISA by
// isa_dispatch.h (megatron_like/model/rotary.py: apply_rotary). x is [b, heads, s, hd] with any strides
// over the first three dimensions (the model passes permuted views of the QKV output) and unit stride
// over hd; out is contiguous [b, heads, s, hd]. cos and sin are [s, rd] in the accumulation type and
// are rounded to T first, as the reference casts the tables to x's dtype.
//
// "Rotate half" layout, h = rd / 2, for j < h:
//   forward:  out[j] = x[j] c[j] - x[j+h] s[j],    out[j+h] = x[j+h] c[j+h] + x[j] s[j+h]
//   backward: dx[j]  = dy[j] c[j] + dy[j+h] s[j+h], dx[j+h]  = dy[j+h] c[j+h] - dy[j] s[j]
// and columns rd.. hd pass through. Each product is rounded to T before the sum, as in the reference;
// in float32 that means no FMA contraction of product and sum (GNU C++ contracts by default), hence
// the optimize attribute, which also makes the float32 result bit-equal to the reference's.

template <bool kBackward, class T>
__attribute__((optimize("fp-contract=off"))) void rotary_apply(
    const T* x, std::int64_t stride_b, std::int64_t stride_heads, std::int64_t stride_s, const typename Acc<T>::type* cos,
    const typename Acc<T>::type* sin, T* out, std::int64_t b, std::int64_t heads, std::int64_t s, std::int64_t hd,
    std::int64_t rd, int threads) {
  using A = typename Acc<T>::type;
  const std::int64_t rows = b * heads * s;
  const std::int64_t half = rd / 2;
  const int nt = threads_for(threads, rows * hd);
#pragma omp parallel for num_threads(nt) schedule(static)
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::int64_t si = r % s;
    const std::int64_t hi = (r / s) % heads;
    const std::int64_t bi = r / (s * heads);
    const T* xr = x + bi * stride_b + hi * stride_heads + si * stride_s;
    const A* c = cos + si * rd;
    const A* sn = sin + si * rd;
    T* o = out + r * hd;
#pragma omp simd
    for (std::int64_t j = 0; j < half; ++j) {
      const A x1 = load(xr, j);
      const A x2 = load(xr, j + half);
      const A c1 = round_to(o, c[j]);
      const A c2 = round_to(o, c[j + half]);
      const A s1 = round_to(o, sn[j]);
      const A s2 = round_to(o, sn[j + half]);
      if constexpr (kBackward) {
        store(o, j, round_to(o, x1 * c1) + round_to(o, x2 * s2));
        store(o, j + half, round_to(o, x2 * c2) - round_to(o, x1 * s1));
      } else {
        store(o, j, round_to(o, x1 * c1) - round_to(o, x2 * s1));
        store(o, j + half, round_to(o, x2 * c2) + round_to(o, x1 * s2));
      }
    }
    if (rd < hd) std::memcpy(o + rd, xr + rd, static_cast<std::size_t>(hd - rd) * sizeof(T));
  }
}
