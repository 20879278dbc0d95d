// Builds the kernels in ML_KERNELS (a header path) three times, into ml::isa_avx512, ml::isa_avx2 and
// ml::isa_scalar, each compiled for its instruction set through `#pragma GCC target`; ML_ISA_CALL in
// common.h picks one at run time. The shipped binary therefore runs on any x86-64 (no -march=native)
// yet uses 512-bit vectors where the CPU has them. The kernel headers are plain loops written so that
// GCC's vectorizer handles them (`#pragma omp simd`, no branches in the hot loops); the per-ISA copy
// of simd_math.h makes exp/tanh/conversions inline into those loops at the right width.
//
// Usage, once per translation unit, after including common.h:
//   #define ML_KERNELS "softmax_kernels.h"
//   #include "isa_dispatch.h"
// No include guard on purpose; the included headers have none either.
#ifndef ML_KERNELS
#error "define ML_KERNELS before including isa_dispatch.h"
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define ML_MULTI_ISA 1
#else
#define ML_MULTI_ISA 0
#endif

#if ML_MULTI_ISA
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,bmi2")
namespace ml {
namespace isa_avx512 {
constexpr int kVectorBytes = 64;
#include "simd_math.h"
#include ML_KERNELS
}  // namespace isa_avx512
}  // namespace ml
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi2")
namespace ml {
namespace isa_avx2 {
constexpr int kVectorBytes = 32;
#include "simd_math.h"
#include ML_KERNELS
}  // namespace isa_avx2
}  // namespace ml
#pragma GCC pop_options
#endif

namespace ml {
namespace isa_scalar {
constexpr int kVectorBytes = 16;
#include "simd_math.h"
#include ML_KERNELS
}  // namespace isa_scalar
#if !ML_MULTI_ISA
// Without GCC on x86-64 every ISA name maps to the baseline build.
namespace isa_avx512 = isa_scalar;
namespace isa_avx2 = isa_scalar;
#endif
}  // namespace ml
