// Element math written for GCC's vectorizer: exp, tanh and the 16-bit float conversions as
// branch-free scalar code, always inlined so that a `#pragma omp simd` loop calling them becomes
// straight vector code at the ISA of the including namespace (see isa_dispatch.h).
// No include guard: included once per ISA namespace.

#define ML_INLINE inline __attribute__((always_inline))

ML_INLINE float bits_to_float(std::uint32_t u) { return __builtin_bit_cast(float, u); }
ML_INLINE std::uint32_t float_to_bits(float f) { return __builtin_bit_cast(std::uint32_t, f); }

// Arithmetic type for a storage type: float for the 32/16-bit floats, double for double.
template <class T>
struct Acc {
  using type = float;
};
template <>
struct Acc<double> {
  using type = double;
};

ML_INLINE float load(const float* p, std::int64_t i) { return p[i]; }
ML_INLINE double load(const double* p, std::int64_t i) { return p[i]; }
ML_INLINE float load(const bf16* p, std::int64_t i) {
  return bits_to_float(static_cast<std::uint32_t>(p[i].bits) << 16);
}
ML_INLINE float half_to_float(std::uint32_t h) {
  // Shift the 5-bit exponent/10-bit mantissa into float position and rebias; inf/nan and
  // subnormals are patched with selects so the loop stays branch-free.
  std::uint32_t sign = (h & 0x8000u) << 16;
  std::uint32_t o = (h & 0x7fffu) << 13;
  std::uint32_t exp = o & (0x7c00u << 13);
  o += (127u - 15u) << 23;
  std::uint32_t inf_nan = o + ((128u - 16u) << 23);
  float sub = bits_to_float(o + (1u << 23)) - bits_to_float(113u << 23);
  o = exp == (0x7c00u << 13) ? inf_nan : o;
  o = exp == 0 ? float_to_bits(sub) : o;
  return bits_to_float(o | sign);
}
ML_INLINE float load(const fp16* p, std::int64_t i) { return half_to_float(p[i].bits); }

ML_INLINE std::uint16_t float_to_bf16_bits(float f) {
  // Round to nearest even on the dropped 16 bits; NaN stays a quiet NaN.
  std::uint32_t u = float_to_bits(f);
  std::uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  bool is_nan = (u & 0x7fffffffu) > 0x7f800000u;
  return static_cast<std::uint16_t>(is_nan ? ((u >> 16) | 0x40u) : rounded);
}
ML_INLINE std::uint16_t float_to_half_bits(float f) {
  // Round to nearest even (after F. Giesen's float_to_half_fast3_rtne), as selects.
  std::uint32_t u = float_to_bits(f);
  std::uint32_t sign = u & 0x80000000u;
  u ^= sign;
  const std::uint32_t f16_overflow = (127u + 16u) << 23;
  const std::uint32_t denorm_magic = ((127u - 15u) + (23u - 10u) + 1u) << 23;
  std::uint32_t big = u > 0x7f800000u ? 0x7e00u : 0x7c00u;
  std::uint32_t denorm = float_to_bits(bits_to_float(u) + bits_to_float(denorm_magic)) - denorm_magic;
  std::uint32_t mant_odd = (u >> 13) & 1u;
  std::uint32_t normal = (u + ((15u - 127u) << 23) + 0xfffu + mant_odd) >> 13;
  std::uint32_t o = u >= f16_overflow ? big : (u < (113u << 23) ? denorm : normal);
  return static_cast<std::uint16_t>(o | (sign >> 16));
}

ML_INLINE void store(float* p, std::int64_t i, float v) { p[i] = v; }
ML_INLINE void store(double* p, std::int64_t i, double v) { p[i] = v; }
ML_INLINE void store(bf16* p, std::int64_t i, float v) { p[i].bits = float_to_bf16_bits(v); }
ML_INLINE void store(fp16* p, std::int64_t i, float v) { p[i].bits = float_to_half_bits(v); }

// Value after a round trip through T: the LayerNorm must normalize exactly what it stores.
ML_INLINE float round_to(const float*, float v) { return v; }
ML_INLINE double round_to(const double*, double v) { return v; }
ML_INLINE float round_to(const bf16*, float v) {
  return bits_to_float(static_cast<std::uint32_t>(float_to_bf16_bits(v)) << 16);
}
ML_INLINE float round_to(const fp16*, float v) { return half_to_float(float_to_half_bits(v)); }

// exp(x) for x <= 88 within ~2 ulp: 2^n * P(r) with n = round(x / ln 2), r = x - n ln 2 split in
// two constants (Cody-Waite), and Cephes' degree-6 polynomial. Inputs below -87.3 (results under
// FLT_MIN), including -inf, give exactly 0, which is what masked softmax entries need.
ML_INLINE float fast_exp(float x) {
  float xc = x < -87.3f ? -87.3f : x;
  xc = xc > 88.0f ? 88.0f : xc;
  // Adding 1.5 * 2^23 rounds to an integer that lands in the low mantissa bits: n without a
  // float->int conversion, which GCC would not vectorize here.
  const float shifter = 12582912.0f;
  float t = xc * 1.44269504088896341f + shifter;
  std::uint32_t n_plus_bias = float_to_bits(t) - 0x4B400000u + 127u;
  float nf = t - shifter;
  float r = xc - nf * 0.693359375f;
  r = r - nf * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  float y = p * bits_to_float(n_plus_bias << 23);
  y = x < -87.3f ? 0.0f : y;
  return x > 88.72f ? std::numeric_limits<float>::infinity() : y;
}
ML_INLINE double fast_exp(double x) { return std::exp(x); }

// tanh(x) as a 13/6 rational function on [-7.9, 7.9] (saturated beyond), the fit Eigen uses;
// only mul/add and one division, so it vectorizes, and it keeps relative accuracy near 0, where
// 1 - 2/(exp(2x)+1) would cancel.
ML_INLINE float fast_tanh(float x) {
  const float clamp = 7.90531110763549805f;
  float xc = x > clamp ? clamp : (x < -clamp ? -clamp : x);
  float x2 = xc * xc;
  float p = -2.76076847742355e-16f;
  p = p * x2 + 2.00018790482477e-13f;
  p = p * x2 + -8.60467152213735e-11f;
  p = p * x2 + 5.12229709037114e-08f;
  p = p * x2 + 1.48572235717979e-05f;
  p = p * x2 + 6.37261928875436e-04f;
  p = p * x2 + 4.89352455891786e-03f;
  p = p * xc;
  float q = 1.19825839466702e-06f;
  q = q * x2 + 1.18534705686654e-04f;
  q = q * x2 + 2.26843463243900e-03f;
  q = q * x2 + 4.89352518554385e-03f;
  return p / q;
}
ML_INLINE double fast_tanh(double x) { return std::tanh(x); }

ML_INLINE float fast_log(float x) { return std::log(x); }
ML_INLINE double fast_log(double x) { return std::log(x); }
