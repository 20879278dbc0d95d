// Shared plumbing for the megatron_like CPU kernels: dtype codes, raw-pointer helpers, thread counts
// and the runtime ISA choice. Kernels never see torch: Python passes `tensor.data_ptr()` integers plus
// shapes, so building needs only pybind11 and a C++17 compiler.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace ml {

// Element types, as the Python wrappers encode them (see megatron_like/kernels/_common.py).
enum class DType : int { kFloat32 = 0, kFloat64 = 1, kBFloat16 = 2, kFloat16 = 3 };

// 16-bit storage types: only bit patterns; arithmetic happens in float after conversion.
struct bf16 {
  std::uint16_t bits;
};
struct fp16 {
  std::uint16_t bits;
};

enum class Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

inline const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAvx512:
      return "avx512";
    case Isa::kAvx2:
      return "avx2";
    default:
      return "scalar";
  }
}

// Best ISA this CPU (and OS, which __builtin_cpu_supports checks through XGETBV) can run.
inline Isa detect_isa() {
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
    return Isa::kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::kAvx2;
#endif
  return Isa::kScalar;
}

inline Isa parse_isa(const std::string& name) {
  if (name == "avx512") return Isa::kAvx512;
  if (name == "avx2") return Isa::kAvx2;
  if (name == "scalar") return Isa::kScalar;
  throw std::invalid_argument("unknown ISA '" + name + "' (expected avx512, avx2 or scalar)");
}

// The ISA kernels dispatch to: the best supported one until set_isa pins another. The Python loader
// (megatron_like/kernels/_loader.py) pins every module to MEGATRON_LIKE_ISA when it imports it.
inline Isa& active_isa() {
  static Isa isa = detect_isa();
  return isa;
}

template <class T>
inline T* ptr(std::uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

// Threads for `work` elements: tiny problems stay on one thread, since waking a team costs ~10 us.
inline int threads_for(int requested, std::int64_t work, std::int64_t min_work_per_thread = 1 << 14) {
  if (requested < 1) requested = 1;
  std::int64_t useful = work / min_work_per_thread;
  if (useful < 1) useful = 1;
  return static_cast<int>(useful < requested ? useful : requested);
}

inline int thread_id() {
#ifdef _OPENMP
  return omp_get_thread_num();
#else
  return 0;
#endif
}

inline int team_size() {
#ifdef _OPENMP
  return omp_get_num_threads();
#else
  return 1;
#endif
}

// `isa()` / `set_isa(name)` on every module, so Python can report and pin the path that runs.
inline void bind_isa(pybind11::module_& m) {
  m.def("isa", [] { return std::string(isa_name(active_isa())); }, "Name of the ISA path kernels use.");
  m.def("best_isa", [] { return std::string(isa_name(detect_isa())); }, "Widest ISA path this CPU runs.");
  m.def(
      "set_isa",
      [](const std::string& name) {
        Isa want = parse_isa(name);
        if (static_cast<int>(want) > static_cast<int>(detect_isa()))
          throw std::invalid_argument("this CPU does not support the '" + name + "' path");
        active_isa() = want;
      },
      pybind11::arg("name"), "Pin the ISA path (avx512, avx2, scalar); only narrower than detected.");
  m.def("openmp", [] {
#ifdef _OPENMP
    return true;
#else
    return false;
#endif
  });
}

}  // namespace ml

// ML_ISA_CALL(stmt): runs `stmt` with the namespace alias `isa` bound to the active ISA's build
// (see isa_dispatch.h), e.g. ML_ISA_CALL(isa::adam_step(p, g, n)).
#define ML_ISA_CALL(...)                                  \
  do {                                                    \
    switch (::ml::active_isa()) {                         \
      case ::ml::Isa::kAvx512: {                          \
        namespace isa = ::ml::isa_avx512;                 \
        __VA_ARGS__;                                      \
        break;                                            \
      }                                                   \
      case ::ml::Isa::kAvx2: {                            \
        namespace isa = ::ml::isa_avx2;                   \
        __VA_ARGS__;                                      \
        break;                                            \
      }                                                   \
      default: {                                          \
        namespace isa = ::ml::isa_scalar;                 \
        __VA_ARGS__;                                      \
        break;                                            \
      }                                                   \
    }                                                     \
  } while (0)

// ML_DTYPE_CALL(dtype, stmt): runs `stmt` with the type alias `T` bound to the storage type of the
// DType code and `isa` as in ML_ISA_CALL. float64 exists for gradcheck only, so it is built once
// (baseline ISA) instead of three times: that keeps the install under a minute.
#define ML_DTYPE_CALL(dtype, ...)                                                       \
  do {                                                                                  \
    switch (static_cast<::ml::DType>(dtype)) {                                          \
      case ::ml::DType::kFloat32: {                                                     \
        using T = float;                                                                \
        ML_ISA_CALL(__VA_ARGS__);                                                       \
        break;                                                                          \
      }                                                                                 \
      case ::ml::DType::kBFloat16: {                                                    \
        using T = ::ml::bf16;                                                           \
        ML_ISA_CALL(__VA_ARGS__);                                                       \
        break;                                                                          \
      }                                                                                 \
      case ::ml::DType::kFloat16: {                                                     \
        using T = ::ml::fp16;                                                           \
        ML_ISA_CALL(__VA_ARGS__);                                                       \
        break;                                                                          \
      }                                                                                 \
      case ::ml::DType::kFloat64: {                                                     \
        using T = double;                                                               \
        namespace isa = ::ml::isa_scalar;                                               \
        __VA_ARGS__;                                                                    \
        break;                                                                          \
      }                                                                                 \
      default:                                                                          \
        throw std::invalid_argument("unsupported dtype code " + std::to_string(dtype)); \
    }                                                                                   \
  } while (0)
