// Grouped GEMM for mixture-of-experts layers, included once per ISA by isa_dispatch.h.
//
// Every group g multiplies its own row block: C_g[M_g, N] (+)= A_g[M_g, K] B_g[K, N]. The operands are
// addressed through (row stride, column stride) pairs, so one routine serves the three products of the
// layer y = x w (megatron_like/kernels/grouped_gemm.py):
//   forward  y_e  = x_e   w_e      A = x_e,   B = w_e
//   dx       dx_e = dy_e  w_e^T    A = dy_e,  B = w_e read transposed (strides swapped)
//   dw       dw_e = x_e^T dy_e     A = x_e read transposed, B = dy_e
// The algorithm is GotoBLAS's: B is packed in [KC, NC] panels (fp32, NR-wide column slivers), each
// thread packs [MC, KC] blocks of A (MR-tall row slivers) and a register-blocked MR x NR micro-kernel
// runs over the packed data. Packing is where transposes and bf16/fp16 -> fp32 conversions happen, so
// the micro-kernel is a single loop the vectorizer turns into broadcast + FMA on NR / lanes vectors.
// Accumulation is in Acc<T> (fp32; fp64 for gradcheck) over the whole K: C blocks of a 16-bit T are
// summed in an fp32 scratch and rounded once.

// Micro-tile: MR rows x NR columns of accumulators; NR is two vectors, so MR * 2 accumulators, two B
// vectors and a broadcast fit the register file (avx512: 27 of 32 zmm at MR 12; avx2/SSE: 15 of 16).
constexpr int kGemmMR = kVectorBytes == 64 ? 12 : 6;
template <class A>
constexpr int gemm_nr() {
  return 2 * kVectorBytes / static_cast<int>(sizeof(A));
}
// Cache blocks: a packed KC x NR B sliver (32 KiB fp32 at NR 32) stays in L1, the MC x KC A block in L2.
constexpr std::int64_t kGemmKC = 256;
constexpr std::int64_t kGemmMC = 96;  // a multiple of every kGemmMR
constexpr std::int64_t kGemmNC = 1024;

// A strided matrix view: element (i, j) at p[i * rs + j * cs].
template <class T>
struct View {
  const T* p;
  std::int64_t rs, cs;
};

// Packs rows [i0, i0 + mc) x columns [p0, p0 + kc) of a into MR-row slivers: sliver s holds, for each
// column kk, the MR values a(i0 + s MR + r, p0 + kk) contiguously. Rows past m are zero.
template <class T, class A>
void pack_a(View<T> a, std::int64_t m, std::int64_t i0, std::int64_t mc, std::int64_t p0, std::int64_t kc,
            A* out) {
  for (std::int64_t s = 0; s < mc; s += kGemmMR) {
    A* dst = out + s * kc;
    for (int r = 0; r < kGemmMR; ++r) {
      const std::int64_t i = i0 + s + r;
      if (i < m) {
        const T* src = a.p + i * a.rs + p0 * a.cs;
        for (std::int64_t kk = 0; kk < kc; ++kk) dst[kk * kGemmMR + r] = load(src, kk * a.cs);
      } else {
        for (std::int64_t kk = 0; kk < kc; ++kk) dst[kk * kGemmMR + r] = A(0);
      }
    }
  }
}

// Packs rows [p0, p0 + kc) x columns [j0, j0 + nc) of b into NR-column slivers: sliver s holds, for each
// row kk, the NR values b(p0 + kk, j0 + s NR + c) contiguously. Columns past n are zero.
template <class T, class A>
void pack_b_sliver(View<T> b, std::int64_t n, std::int64_t p0, std::int64_t kc, std::int64_t j, A* dst) {
  constexpr int NR = gemm_nr<A>();
  for (std::int64_t kk = 0; kk < kc; ++kk) {
    const T* src = b.p + (p0 + kk) * b.rs;
    A* row = dst + kk * NR;
    if (j + NR <= n && b.cs == 1) {
#pragma omp simd
      for (int c = 0; c < NR; ++c) row[c] = load(src, j + c);
    } else {
      for (int c = 0; c < NR; ++c) row[c] = j + c < n ? A(load(src, (j + c) * b.cs)) : A(0);
    }
  }
}

// acc[MR][NR] = sum over kk of a[kk][r] * b[kk][c] on packed slivers; then C (+)= acc on the valid
// rows/columns. `first` (the first K block) overwrites C instead of adding to it.
template <class A>
ML_INLINE void micro_kernel(const A* __restrict a, const A* __restrict b, std::int64_t kc, A* c, std::int64_t ldc,
                            int rows, int cols, bool first) {
  constexpr int NR = gemm_nr<A>();
  A acc[kGemmMR][NR];
  for (int r = 0; r < kGemmMR; ++r) {
#pragma omp simd
    for (int col = 0; col < NR; ++col) acc[r][col] = A(0);
  }
  for (std::int64_t kk = 0; kk < kc; ++kk) {
    const A* bk = b + kk * NR;
    const A* ak = a + kk * kGemmMR;
    for (int r = 0; r < kGemmMR; ++r) {
      const A ar = ak[r];
#pragma omp simd
      for (int col = 0; col < NR; ++col) acc[r][col] += ar * bk[col];
    }
  }
  if (rows == kGemmMR && cols == NR) {  // a full tile: vector stores
    for (int r = 0; r < kGemmMR; ++r) {
      A* cr = c + r * ldc;
      if (first) {
#pragma omp simd
        for (int col = 0; col < NR; ++col) cr[col] = acc[r][col];
      } else {
#pragma omp simd
        for (int col = 0; col < NR; ++col) cr[col] += acc[r][col];
      }
    }
    return;
  }
  for (int r = 0; r < rows; ++r) {
    A* cr = c + r * ldc;
    if (first) {
      for (int col = 0; col < cols; ++col) cr[col] = acc[r][col];
    } else {
      for (int col = 0; col < cols; ++col) cr[col] += acc[r][col];
    }
  }
}

// C[m, n] = A[m, k] B[k, n] with C in Acc<T> (row stride ldc, contiguous rows). Called from inside an
// OpenMP parallel region: the threads of the team share the B packing and split the A blocks.
// `b_pack` holds min(KC, k) * round_up(min(NC, n), NR) values, `a_pack` MC * min(KC, k) per thread.
template <class T, class A>
void gemm_in_team(View<T> a, View<T> b, A* c, std::int64_t ldc, std::int64_t m, std::int64_t n, std::int64_t k,
                  A* b_pack, A* a_pack_all) {
  constexpr int NR = gemm_nr<A>();
  A* a_pack = a_pack_all + static_cast<std::int64_t>(thread_id()) * kGemmMC * std::min(kGemmKC, k);
  if (k == 0) {  // an empty group contributes nothing: its part of dw is zero
#pragma omp for schedule(static)
    for (std::int64_t i = 0; i < m; ++i)
      for (std::int64_t j = 0; j < n; ++j) c[i * ldc + j] = A(0);
    return;
  }
  for (std::int64_t j0 = 0; j0 < n; j0 += kGemmNC) {
    const std::int64_t nc = std::min(kGemmNC, n - j0);
    const std::int64_t slivers = (nc + NR - 1) / NR;
    for (std::int64_t p0 = 0; p0 < k; p0 += kGemmKC) {
      const std::int64_t kc = std::min(kGemmKC, k - p0);
#pragma omp for schedule(static)
      for (std::int64_t s = 0; s < slivers; ++s) pack_b_sliver(b, n, p0, kc, j0 + s * NR, b_pack + s * kc * NR);
      // (implicit barrier: the panel is complete before anyone reads it)
      const std::int64_t blocks = (m + kGemmMC - 1) / kGemmMC;
#pragma omp for schedule(dynamic, 1)
      for (std::int64_t blk = 0; blk < blocks; ++blk) {
        const std::int64_t i0 = blk * kGemmMC;
        const std::int64_t mc = std::min(kGemmMC, m - i0);
        pack_a(a, m, i0, mc, p0, kc, a_pack);
        for (std::int64_t s = 0; s < slivers; ++s) {
          const int cols = static_cast<int>(std::min<std::int64_t>(NR, nc - s * NR));
          for (std::int64_t ir = 0; ir < mc; ir += kGemmMR) {
            const int rows = static_cast<int>(std::min<std::int64_t>(kGemmMR, mc - ir));
            micro_kernel(a_pack + ir * kc, b_pack + s * kc * NR, kc, c + (i0 + ir) * ldc + j0 + s * NR, ldc, rows,
                         cols, p0 == 0);
          }
        }
      }
      // (implicit barrier: nobody repacks B while another thread still reads it)
    }
  }
}

// Which product of the layer to run (see the top of this file).
enum class GroupedOp : int { kForward = 0, kGradInput = 1, kGradWeight = 2 };

// x [rows, k], w [groups, k, n], dy / y [rows, n]; counts[g] rows per group, in order.
//   kForward:    out = y  [rows, n]       from (x, w)
//   kGradInput:  out = dx [rows, k]       from (dy, w)
//   kGradWeight: out = dw [groups, k, n]  from (x, dy)
// `lhs` is x (kForward, kGradWeight) or dy (kGradInput); `rhs` is w (kForward, kGradInput) or dy.
template <class T>
void grouped_gemm(GroupedOp op, const T* lhs, const T* rhs, T* out, const std::int64_t* counts, std::int64_t groups,
                  std::int64_t k, std::int64_t n, int threads) {
  using A = typename Acc<T>::type;
  constexpr int NR = gemm_nr<A>();
  constexpr bool kDirect = std::is_same<T, A>::value;  // fp32/fp64 accumulate in the output itself
  std::int64_t rows = 0, largest = 0;
  for (std::int64_t g = 0; g < groups; ++g) {
    rows += counts[g];
    largest = std::max(largest, counts[g]);
  }
  const std::int64_t out_cols = op == GroupedOp::kGradInput ? k : n;
  const std::int64_t out_rows_max = op == GroupedOp::kGradWeight ? k : largest;
  const std::int64_t work = 2 * rows * k * n;
  const int nt = threads_for(threads, work, std::int64_t(1) << 20);
  // Buffers sized for the largest block this call can meet, left uninitialized (every value read is
  // written first): small problems must not pay for zeroing megabytes.
  const std::int64_t inner_max = op == GroupedOp::kForward ? k : (op == GroupedOp::kGradInput ? n : largest);
  const std::int64_t kc_max = std::max<std::int64_t>(1, std::min(kGemmKC, inner_max));
  const std::int64_t nc_max = (std::min(kGemmNC, out_cols) + NR - 1) / NR * NR;
  std::unique_ptr<A[]> b_pack(new A[static_cast<std::size_t>(kc_max * nc_max)]);
  std::unique_ptr<A[]> a_pack(new A[static_cast<std::size_t>(kGemmMC * kc_max * nt)]);
  std::unique_ptr<A[]> scratch(new A[kDirect ? 1 : static_cast<std::size_t>(out_rows_max * out_cols)]);
#pragma omp parallel num_threads(nt)
  {
    std::int64_t r0 = 0;
    for (std::int64_t g = 0; g < groups; ++g) {
      const std::int64_t mg = counts[g];
      View<T> a{}, b{};
      T* c_out = nullptr;
      std::int64_t m = 0, nn = 0, kk = 0;
      if (op == GroupedOp::kForward) {  // y_g = x_g w_g
        a = {lhs + r0 * k, k, 1};
        b = {rhs + g * k * n, n, 1};
        c_out = out + r0 * n;
        m = mg, nn = n, kk = k;
      } else if (op == GroupedOp::kGradInput) {  // dx_g = dy_g w_g^T: (p, j) of w_g^T is w_g[j, p]
        a = {lhs + r0 * n, n, 1};
        b = {rhs + g * k * n, 1, n};
        c_out = out + r0 * k;
        m = mg, nn = k, kk = n;
      } else {  // dw_g = x_g^T dy_g: (i, p) of x_g^T is x_g[p, i]
        a = {lhs + r0 * k, 1, k};
        b = {rhs + r0 * n, n, 1};
        c_out = out + g * k * n;
        m = k, nn = n, kk = mg;
      }
      r0 += mg;
      if (m == 0) continue;
      if constexpr (kDirect) {
        gemm_in_team(a, b, reinterpret_cast<A*>(c_out), nn, m, nn, kk, b_pack.get(), a_pack.get());
      } else {
        gemm_in_team(a, b, scratch.get(), nn, m, nn, kk, b_pack.get(), a_pack.get());
#pragma omp for schedule(static)
        for (std::int64_t i = 0; i < m; ++i) {
#pragma omp simd
          for (std::int64_t j = 0; j < nn; ++j) store(c_out, i * nn + j, scratch[i * nn + j]);
        }
      }
    }
  }
}
