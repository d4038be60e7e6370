// steadylm's native CPU kernels: the small per-layer ops of a decode step, fused, and decode
// attention that reads the paged KV cache in place. Each has a pure-torch reference in
// steadylm/kernels/__init__.py that the tests hold it to. Built once per machine by
// torch.utils.cpp_extension (compiled for this CPU: -march=native).
//
// Numerics follow transformers' order: RMSNorm and SiLU in fp32, rounded to the model dtype
// where torch would round (so bf16 results match torch's bf16 op sequence).

#if defined(__AVX512F__)
#define CPU_CAPABILITY_AVX512
#define CPU_CAPABILITY AVX512
#elif defined(__AVX2__)
#define CPU_CAPABILITY_AVX2
#define CPU_CAPABILITY AVX2
#else
#define CPU_CAPABILITY DEFAULT
#endif

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if defined(__linux__)
#include <omp.h>
#include <sched.h>
#endif

#include <algorithm>
#include <atomic>
#include <mutex>
#include <cstring>
#include <string>
#include <type_traits>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

namespace {

// float and bfloat16 only (the dtypes the CPU path runs).
#define SL_DISPATCH(dtype, name, ...)                                          \
  [&] {                                                                        \
    if ((dtype) == at::kFloat) {                                               \
      using scalar_t = float;                                                  \
      __VA_ARGS__();                                                           \
    } else if ((dtype) == at::kBFloat16) {                                     \
      using scalar_t = c10::BFloat16;                                          \
      __VA_ARGS__();                                                           \
    } else {                                                                   \
      TORCH_CHECK(false, name, ": only float32 and bfloat16 are supported");   \
    }                                                                          \
  }()

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kVec = Vec::size();
// The register under Vec. Accumulators carried across a loop are held as it: GCC 12 keeps an
// array of Vec in memory when the loop has other control flow (a prefetch under a condition),
// so each FMA loads and stores its accumulator and the loop runs at the store port's speed
// (value_pass: 23 of its 24 FMAs took a stack operand).
#if defined(CPU_CAPABILITY_AVX512)
using VReg = __m512;
#elif defined(CPU_CAPABILITY_AVX2)
using VReg = __m256;
#else
using VReg = Vec;
#endif

inline float to_f(float x) { return x; }
inline float to_f(c10::BFloat16 x) { return static_cast<float>(x); }
template <typename T>
inline T from_f(float x) { return static_cast<T>(x); }
// Round through the model dtype, as a torch op with a bf16 output would.
template <typename T>
inline float round_to(float x) { return to_f(from_f<T>(x)); }

inline void exp_inplace(float* x, int64_t n) {
  int64_t i = 0;
  for (; i + kVec <= n; i += kVec) Vec::loadu(x + i).exp_u20().store(x + i);
  for (; i < n; ++i) x[i] = std::exp(x[i]);
}

// 2 * kVec values of T at p as two float vectors, and back (bf16: rounded to nearest even, as
// torch's .to(); whole bf16 vectors: a partial load or store of one goes through a buffer).
constexpr int64_t kVec2 = 2 * kVec;
inline std::tuple<Vec, Vec> load2(const float* p) { return {Vec::loadu(p), Vec::loadu(p + kVec)}; }
inline std::tuple<Vec, Vec> load2(const c10::BFloat16* p) {
  return at::vec::convert_bfloat16_float(at::vec::Vectorized<c10::BFloat16>::loadu(p));
}
inline void store2(float* p, const Vec& a, const Vec& b) {
  a.store(p);
  b.store(p + kVec);
}
// a's lanes then b's as bf16, rounded to nearest even as torch's .to(): one vcvtne2ps2bf16
// where the CPU has AVX512-BF16 (ATen's integer rounding is ~9 instructions a vector: the
// bf16 SiLU-and-mul of a 16 x 256 prefill spent a third of its time there). The instruction
// flushes denormal inputs to zero and keeps a NaN's payload where torch keeps the denormal
// and writes 0xffff: a pair holding either goes ATen's way, so the bits are torch's always.
inline at::vec::Vectorized<c10::BFloat16> to_bf16(const Vec& a, const Vec& b) {
#if defined(__AVX512BF16__) && defined(CPU_CAPABILITY_AVX512)
  constexpr int kNanOrDenormal = 0x01 | 0x20 | 0x80;  // quiet NaN, denormal, signalling NaN
  if (!(_mm512_fpclass_ps_mask(a, kNanOrDenormal) | _mm512_fpclass_ps_mask(b, kNanOrDenormal)))
    return at::vec::Vectorized<c10::BFloat16>(
        reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(b, a)));
#endif
  return at::vec::convert_float_bfloat16(a, b);
}
inline void store2(c10::BFloat16* p, const Vec& a, const Vec& b) { to_bf16(a, b).store(p); }
// a and b rounded through T (a no-op for float)
template <typename T>
inline void round2(Vec& a, Vec& b) {
  if constexpr (!std::is_same<T, float>::value)
    std::tie(a, b) = at::vec::convert_bfloat16_float(to_bf16(a, b));
}

// ---- RMSNorm ---------------------------------------------------------------------------
// out = w * (x * rsqrt(mean(x^2) + eps)), mean in fp32 (transformers' LlamaRMSNorm).
// With a residual: residual += x first (rounded to the model dtype), and the sum is normed.
// The sum of squares goes in 2 * kVec lanes, then across them: a row's bits depend only on
// the row (every path, prefill or decode, module or one-call step, runs this code). Summed
// element by element each row was a chain of c dependent adds: 4096 rows of 768 took 2.6-3.3
// ms (fp32 and bf16) on 2 threads of an Intel Xeon with AMX. A decode step's 16 rows are two
// threads' 8 (in one chunk of 16 the other thread waited, 24 times a step).
template <typename T>
void rms_norm_rows(const T* x, T* residual, const T* w, T* out, int64_t rows, int64_t c,
                   double eps) {
  at::parallel_for(0, rows, 8, [&](int64_t r0, int64_t r1) {
    std::vector<float> buf(c);
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * c;
      T* rr = residual ? residual + r * c : nullptr;
      Vec acc0(0.f), acc1(0.f);
      int64_t i = 0;
      for (; i + kVec2 <= c; i += kVec2) {
        auto [a, b] = load2(xr + i);
        if (rr) {
          const auto [ra, rb] = load2(rr + i);
          a = a + ra;
          b = b + rb;
          round2<T>(a, b);
          store2(rr + i, a, b);
        }
        store2(buf.data() + i, a, b);
        acc0 = at::vec::fmadd(a, a, acc0);
        acc1 = at::vec::fmadd(b, b, acc1);
      }
      float lanes[kVec];
      (acc0 + acc1).store(lanes);
      float ss = 0.f;
      for (int64_t l = 0; l < kVec; ++l) ss += lanes[l];
      for (; i < c; ++i) {
        float v = to_f(xr[i]);
        if (rr) {
          v = round_to<T>(v + to_f(rr[i]));
          rr[i] = from_f<T>(v);
        }
        buf[i] = v;
        ss += v * v;
      }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(c) + static_cast<float>(eps));
      T* o = out + r * c;
      const Vec iv(inv);
      for (i = 0; i + kVec2 <= c; i += kVec2) {
        auto [a, b] = load2(buf.data() + i);
        a = a * iv;
        b = b * iv;
        round2<T>(a, b);
        const auto [wa, wb] = load2(w + i);
        store2(o + i, wa * a, wb * b);
      }
      for (; i < c; ++i) o[i] = from_f<T>(to_f(w[i]) * round_to<T>(buf[i] * inv));
    }
  });
}

void check_rows(const at::Tensor& x, const at::Tensor& w, const char* what) {
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous(), what, ": x must be contiguous on CPU");
  TORCH_CHECK(w.dim() == 1 && w.scalar_type() == x.scalar_type() && w.is_contiguous(), what,
              ": weight must be 1-D, contiguous, of x's dtype");
  TORCH_CHECK(x.size(-1) == w.size(0), what, ": last dim of x must equal the weight size");
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_rows(x, w, "rms_norm");
  auto out = at::empty_like(x);
  const int64_t c = w.size(0), rows = x.numel() / std::max<int64_t>(c, 1);
  SL_DISPATCH(x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), nullptr, w.data_ptr<scalar_t>(),
                            out.data_ptr<scalar_t>(), rows, c, eps);
  });
  return out;
}

// residual <- residual + x (in place); returns rms_norm(residual) * w.
at::Tensor fused_add_rms_norm(const at::Tensor& x, at::Tensor residual, const at::Tensor& w,
                              double eps) {
  check_rows(x, w, "fused_add_rms_norm");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type() &&
                  residual.is_contiguous(),
              "fused_add_rms_norm: residual must be contiguous with x's shape and dtype");
  auto out = at::empty_like(x);
  const int64_t c = w.size(0), rows = x.numel() / std::max<int64_t>(c, 1);
  SL_DISPATCH(x.scalar_type(), "fused_add_rms_norm", [&] {
    rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), residual.data_ptr<scalar_t>(),
                            w.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows, c, eps);
  });
  return out;
}

// ---- SiLU and multiply -----------------------------------------------------------------
// x (T, 2I) = [gate | up] -> silu(gate) * up (T, I); silu rounded to the dtype first.
at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous() && x.size(-1) % 2 == 0,
              "silu_and_mul: x must be contiguous on CPU with an even last dim");
  const int64_t d = x.size(-1) / 2, rows = x.numel() / std::max<int64_t>(2 * d, 1);
  auto sizes = x.sizes().vec();
  sizes.back() = d;
  auto out = at::empty(sizes, x.options());
  SL_DISPATCH(x.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 8, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const scalar_t* g = xp + r * 2 * d;
        const scalar_t* u = g + d;
        scalar_t* o = op + r * d;
        // In vectors, the same arithmetic as element by element, exp(-g) included (the bf16
        // conversions too: the scalar loop ran at ~4 cycles an element). The tail takes its
        // exps as exp_inplace does, from a kVec boundary, so every element's bits are those
        // of one exp_inplace pass over the row.
        const Vec one(1.f);
        int64_t i = 0;
        for (; i + kVec2 <= d; i += kVec2) {
          auto [ga, gb] = load2(g + i);
          const auto [ua, ub] = load2(u + i);
          ga = ga / (one + ga.neg().exp_u20());
          gb = gb / (one + gb.neg().exp_u20());
          round2<scalar_t>(ga, gb);
          store2(o + i, ga * ua, gb * ub);
        }
        float e[kVec2];
        const int64_t i0 = i;
        for (; i < d; ++i) e[i - i0] = -to_f(g[i]);
        exp_inplace(e, d - i0);
        for (i = i0; i < d; ++i) {
          const float s = round_to<scalar_t>(to_f(g[i]) / (1.f + e[i - i0]));
          o[i] = from_f<scalar_t>(s * to_f(u[i]));
        }
      }
    });
  });
  return out;
}

// ---- Row-wise argmax ----------------------------------------------------------------------
// x (S, V) float32 or bf16 -> (S,) int64: torch.argmax(x, -1)'s answer (the first maximum; a NaN
// counts as the maximum, the first NaN wins) in two vector passes over each row (the maximum,
// then its first position), where torch's CPU argmax compares element by element at about a
// tenth of amax's speed (0.22 ms for 16 rows of 32,000 logits on a 2-vCPU Zen 4).
// (bf16 logits are widened as they load: the same answer as for their fp32 copy, which a
// greedy step then need not make: 16 x 32,000 bf16 logits took 0.13 ms to copy to fp32.)
template <typename T>
int64_t argmax_row(const T* x, int64_t n) {
  constexpr int kAll = (1 << kVec) - 1;
  Vec mv(-std::numeric_limits<float>::infinity());
  bool nan = false;
  int64_t i = 0;
  for (; i + kVec2 <= n; i += kVec2) {
    const auto [a, b] = load2(x + i);
    nan |= a.isnan().zero_mask() != kAll || b.isnan().zero_mask() != kAll;  // a lane is NaN
    mv = at::vec::maximum(at::vec::maximum(mv, a), b);
  }
  float m = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); },
                                           mv);
  for (int64_t j = i; j < n; ++j) {
    const float v = to_f(x[j]);
    nan |= std::isnan(v);
    if (v > m) m = v;
  }
  if (nan) {
    for (int64_t j = 0; j < n; ++j)
      if (std::isnan(to_f(x[j]))) return j;
  }
  const Vec target(m);
  i = 0;
  for (; i + kVec2 <= n; i += kVec2) {
    const auto [a, b] = load2(x + i);
    const int na = (a == target).zero_mask(), nb = (b == target).zero_mask();  // set: != m
    if (na != kAll) return i + __builtin_ctz(~na);
    if (nb != kAll) return i + kVec + __builtin_ctz(~nb);
  }
  for (; i < n; ++i)
    if (to_f(x[i]) == m) return i;
  return 0;  // an empty row (not reached: the caller checks V > 0)
}

at::Tensor argmax(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous() && x.dim() == 2 && x.size(1) > 0 &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "argmax: x must be a contiguous, non-empty (S, V) float32 or bfloat16 tensor on "
              "CPU");
  const int64_t rows = x.size(0), n = x.size(1);
  auto out = at::empty({rows}, x.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  SL_DISPATCH(x.scalar_type(), "argmax", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) op[r] = argmax_row(xp + r * n, n);
    });
  });
  return out;
}

// ---- Rotary embedding, in place ----------------------------------------------------------
// x (T, heads, D) with unit stride along D (any row and head stride: a view of the fused qkv
// output); cos, sin (T, 1, D) alike. x <- x * cos + rotate_half(x) * sin, each product and the
// sum rounded to the dtype as torch's separate ops round them (rotate_ref in layers/rotary.py),
// so the bits are the reference's: fp-contract is off for the row function (a lambda would
// not inherit the attribute), so no product fuses into the add.
template <typename T>
__attribute__((optimize("fp-contract=off"))) void rotary_row(T* r, const T* c, const T* s,
                                                             int64_t half) {
  int64_t done = 0;
  // 2 * kVec lanes at a time (bf16: the scalar loop below did not vectorize its roundings;
  // a 16 x 256 bf16 prefill's rotary took 1.9 ms a layer). Same operations, same order:
  // -x2 * s is -(x2 * s) exactly, and a - b is a + (-b).
  for (; done + kVec2 <= half; done += kVec2) {
    const int64_t j = done;
    auto [x1a, x1b] = load2(r + j);
    auto [x2a, x2b] = load2(r + j + half);
    auto [cla, clb] = load2(c + j);
    auto [cha, chb] = load2(c + j + half);
    auto [sla, slb] = load2(s + j);
    auto [sha, shb] = load2(s + j + half);
    Vec a1 = x1a * cla, b1 = x1b * clb, a2 = x2a * sla, b2 = x2b * slb;
    Vec a3 = x2a * cha, b3 = x2b * chb, a4 = x1a * sha, b4 = x1b * shb;
    round2<T>(a1, b1);
    round2<T>(a2, b2);
    round2<T>(a3, b3);
    round2<T>(a4, b4);
    store2(r + j, a1 - a2, b1 - b2);
    store2(r + j + half, a3 + a4, b3 + b4);
  }
#pragma omp simd
  for (int64_t j = done; j < half; ++j) {
    const float x1 = to_f(r[j]), x2 = to_f(r[j + half]);
    const float lo = round_to<T>(x1 * to_f(c[j])) + round_to<T>(-x2 * to_f(s[j]));
    const float hi = round_to<T>(x2 * to_f(c[j + half])) + round_to<T>(x1 * to_f(s[j + half]));
    r[j] = from_f<T>(lo);
    r[j + half] = from_f<T>(hi);
  }
}

template <typename T>
void rotary_rows(T* x, const T* cos, const T* sin, int64_t rows, int64_t heads, int64_t d,
                 int64_t sx0, int64_t sx1, int64_t sc0) {
  at::parallel_for(0, rows * heads, 64, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i / heads;
      rotary_row<T>(x + t * sx0 + (i % heads) * sx1, cos + t * sc0, sin + t * sc0, d / 2);
    }
  });
}

at::Tensor rotary_(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0,
              "rotary_: x must be a CPU (T, heads, D) tensor with unit stride along an even D");
  TORCH_CHECK(cos.dim() == 3 && cos.sizes() == sin.sizes() && cos.strides() == sin.strides() &&
                  cos.size(0) == x.size(0) && cos.size(1) == 1 && cos.size(2) == x.size(2) &&
                  cos.stride(2) == 1 && cos.scalar_type() == x.scalar_type() &&
                  sin.scalar_type() == x.scalar_type(),
              "rotary_: cos and sin must be (T, 1, D) of x's dtype, laid out alike");
  SL_DISPATCH(x.scalar_type(), "rotary_", [&] {
    rotary_rows<scalar_t>(x.data_ptr<scalar_t>(), cos.data_ptr<scalar_t>(),
                          sin.data_ptr<scalar_t>(), x.size(0), x.size(1), x.size(2), x.stride(0),
                          x.stride(1), cos.stride(0));
  });
  return x;
}

// kVec cached values as floats: in place (fp32), or widened in registers (bf16 -> fp32 is
// exact: the 16 bits above 16 zero bits), the same values to_float writes.
inline Vec loadv(const float* p) { return Vec::loadu(p); }
inline Vec loadv(const c10::BFloat16* p) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return Vec(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return Vec(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
#else
  float f[kVec];
  for (int64_t i = 0; i < kVec; ++i) f[i] = static_cast<float>(p[i]);
  return Vec::loadu(f);
#endif
}

// ---- KV store ----------------------------------------------------------------------------
#if defined(CPU_CAPABILITY_AVX512)
// store_kv_rows' two passes over a row of D = 16k values, 16 at a time: its min and max
// (a NaN skipped, as std::min / std::max skip it there), then its codes from zero and scale
// (the same IEEE subtraction and division, rounded half to even, clamped to [0, levels]). 8
// bits: a byte a value; 4 bits: value 2j in byte j's low nibble, 2j + 1 in its high one.
// (torch.profiler over a W1 bf16 prefill with an int8 cache, 16 x 256 rows of 4 KV heads:
// the scalar loops 42.6 ms of its 24 stores, these 7.9 ms.)
template <typename T>
inline std::pair<float, float> row_range16(const T* xr, int64_t D) {
  __m512 lo = _mm512_set1_ps(std::numeric_limits<float>::infinity());
  __m512 hi = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t d = 0; d < D; d += 16) {
    const __m512 v = loadv(xr + d);
    lo = _mm512_min_ps(v, lo);  // a NaN in v: lo (the second operand)
    hi = _mm512_max_ps(v, hi);
  }
  return {_mm512_reduce_min_ps(lo), _mm512_reduce_max_ps(hi)};
}

template <typename T>
inline void row_codes16(const T* xr, int64_t D, float zero, float scale, float levels,
                        int64_t bits, uint8_t* out) {
  const __m512 vz = _mm512_set1_ps(zero), vs = _mm512_set1_ps(scale);
  const __m512 vl = _mm512_set1_ps(levels), v0 = _mm512_setzero_ps();
  const __m512i odd = _mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4);
  for (int64_t d = 0; d < D; d += 16) {
    __m512 c = _mm512_div_ps(_mm512_sub_ps(loadv(xr + d), vz), vs);
    c = _mm512_roundscale_ps(c, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    c = _mm512_min_ps(_mm512_max_ps(c, v0), vl);
    __m512i i = _mm512_cvttps_epi32(c);
    if (bits == 8) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + d), _mm512_cvtepi32_epi8(i));
    } else {  // the odd dims' codes shifted up into the even dims' bytes
      i = _mm512_sllv_epi32(i, odd);
      i = _mm512_or_si512(i, _mm512_srli_epi64(i, 32));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(out + d / 2), _mm512_cvtepi64_epi8(i));
    }
  }
}
#endif

// A step's new k or v rows x (T, Hkv, D), unit stride along D, into the paged cache at flat
// slots (T,) int64 (a negative slot is a padding row: skipped). bits 0: the rows as they are
// (cache of x's dtype). bits 8 / 4: asymmetric per (token, head) quantisation, bit for bit
// attention/torch_ref.quantize_kv's: scale = max((max - min) / levels, 1e-8) and zero = min,
// both stored in x's dtype and read back through it, codes round-half-even((x - zero) / scale)
// clamped to [0, levels] (two 4-bit codes per byte, the even dimension low). The divisions
// are IEEE (no reciprocal), as torch's. One pass instead of ~17 small torch ops per tensor.
template <typename T>
void store_kv_rows(const T* x, int64_t sx0, int64_t sx1, const int64_t* slots, int64_t n,
                   int64_t H, int64_t D, void* cache, T* sz, int64_t bits) {
  at::parallel_for(0, n * H, 256, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i / H, h = i % H, slot = slots[t];
      if (slot < 0) continue;
      const T* xr = x + t * sx0 + h * sx1;
      const int64_t idx = slot * H + h;
      if (bits == 0) {
        std::memcpy(static_cast<T*>(cache) + idx * D, xr, D * sizeof(T));
        continue;
      }
      float lo = std::numeric_limits<float>::infinity(), hi = -lo;
#if defined(CPU_CAPABILITY_AVX512)
      if (D % 16 == 0)
        std::tie(lo, hi) = row_range16(xr, D);
      else
#endif
        for (int64_t d = 0; d < D; ++d) {
          lo = std::min(lo, to_f(xr[d]));
          hi = std::max(hi, to_f(xr[d]));
        }
      const float levels = bits == 8 ? 255.f : 15.f;
      const T scale_q = from_f<T>(std::max((hi - lo) / levels, 1e-8f));
      const T zero_q = from_f<T>(lo);
      const float scale = std::max(to_f(scale_q), 1e-8f), zero = to_f(zero_q);
      sz[idx * 2] = scale_q;
      sz[idx * 2 + 1] = zero_q;
      auto code = [&](int64_t d) {
        const float c = std::nearbyint((to_f(xr[d]) - zero) / scale);
        return static_cast<uint8_t>(std::min(std::max(c, 0.f), levels));
      };
      uint8_t* c = static_cast<uint8_t*>(cache);
#if defined(CPU_CAPABILITY_AVX512)
      if (D % 16 == 0) {
        row_codes16(xr, D, zero, scale, levels, bits, c + idx * (bits == 8 ? D : D / 2));
        continue;
      }
#endif
      if (bits == 8)
        for (int64_t d = 0; d < D; ++d) c[idx * D + d] = code(d);
      else
        for (int64_t d = 0; d < D / 2; ++d)
          c[idx * (D / 2) + d] = static_cast<uint8_t>(code(2 * d) | (code(2 * d + 1) << 4));
    }
  });
}

void store_kv_(at::Tensor cache, const c10::optional<at::Tensor>& scale_zero, const at::Tensor& x,
               const at::Tensor& slots, int64_t bits) {
  TORCH_CHECK(bits == 0 || bits == 8 || bits == 4, "store_kv_: bits must be 0, 8 or 4");
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 3 && x.stride(2) == 1,
              "store_kv_: x must be a CPU (T, Hkv, D) tensor with unit stride along D");
  const int64_t n = x.size(0), H = x.size(1), D = x.size(2);
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == n && slots.scalar_type() == at::kLong &&
                  slots.is_contiguous(),
              "store_kv_: slots must be a contiguous (T,) int64 tensor");
  TORCH_CHECK(cache.is_contiguous() && cache.device().is_cpu(), "store_kv_: cache contiguous");
  const int64_t width = bits == 4 ? D / 2 : D;
  TORCH_CHECK(bits != 4 || D % 2 == 0, "store_kv_: int4 needs an even head_dim");
  TORCH_CHECK(cache.dim() >= 2 && cache.size(-1) == width && cache.size(-2) == H,
              "store_kv_: cache rows must be (.., Hkv, ", width, ")");
  TORCH_CHECK(bits == 0 ? cache.scalar_type() == x.scalar_type()
                        : cache.scalar_type() == at::kByte,
              "store_kv_: cache dtype must be x's (bits 0) or uint8");
  const int64_t num_slots = cache.numel() / (H * width);
  at::Tensor sz;
  if (bits != 0) {
    TORCH_CHECK(scale_zero.has_value() && scale_zero->is_contiguous() &&
                    scale_zero->scalar_type() == x.scalar_type() &&
                    scale_zero->numel() == num_slots * H * 2,
                "store_kv_: scale_zero must be a contiguous (.., Hkv, 2) tensor of x's dtype");
    sz = *scale_zero;
  }
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < n; ++t)  // all checked before anything is written
    TORCH_CHECK(sp[t] < num_slots, "store_kv_: slot ", sp[t], " out of range (", num_slots,
                " slots)");
  SL_DISPATCH(x.scalar_type(), "store_kv_", [&] {
    store_kv_rows<scalar_t>(x.data_ptr<scalar_t>(), x.stride(0), x.stride(1), sp, n, H, D,
                            cache.data_ptr(), bits ? sz.data_ptr<scalar_t>() : nullptr, bits);
  });
}

// ---- Paged decode attention ------------------------------------------------------------
// One new token per sequence. q (S, H, D); k/v cache (num_blocks, block_size, Hkv, D);
// block_tables (S, max_blocks) int64; context_lens (S,) int64 (the new token included).
// Query head h reads KV head h / (H / Hkv) (transformers' repeat_kv). A window W > 0 keeps
// the last W positions. Keys are read where they lie: no gather, no padding.
//
// Work items are (sequence, span of positions); a short batch splits each context into spans
// across threads (flash-decoding) and merges the spans' partial softmaxes. An item walks its
// span in chunks of consecutive positions inside one block (contiguous rows of all KV heads)
// with an online softmax: the chunk's scores, the running max and sum rescaled, then its
// values accumulated (score_rows / value_rows below: q and outputs held in registers, kVec
// keys' lane sums taken together).
// Positions per chunk (at most one block's: a whole 64-token block). Each chunk costs every
// head a softmax update (max, rescale, exp sums); 64 against 32 measured 2-3% less time at
// 4k-16k context and 7% with the rows in cache (bench model, fp32 and bf16, Zen 4 VM).
constexpr int64_t kChunk = 64;
constexpr int kMaxRegVecs = 8;   // output vectors kept in registers per pass

#if defined(CPU_CAPABILITY_AVX2)
// out[i] = the sum of a[i]'s 8 lanes, for 8 vectors: a transposing hadd tree.
inline void lane_sums8(const __m256* a, float* out) {
  const __m256 b0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 b1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  // b0 = [k0 k1 k2 k3 | k0 k1 k2 k3] halves (low lanes, high lanes), b1 likewise for k4-7
  _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20),
                                      _mm256_permute2f128_ps(b0, b1, 0x31)));
}
#endif

// q . k over D in kVec-wide FMAs (the lanes of a partial vector past D load as zeros), then
// the lanes' sum: the key-by-key path for head sizes the register passes below do not take.
inline float dot(const float* q, const float* k, int64_t D) {
  Vec acc(0.f);
  int64_t d = 0;
  for (; d + kVec <= D; d += kVec) acc = at::vec::fmadd(Vec::loadu(q + d), Vec::loadu(k + d), acc);
  if (d < D) acc = at::vec::fmadd(Vec::loadu(q + d, D - d), Vec::loadu(k + d, D - d), acc);
  return at::vec::vec_reduce_all<float>([](const Vec& x, const Vec& y) { return x + y; }, acc);
}

// acc[0, NV * kVec) += sum over t < n of p[t] * v[t * stride + .], acc held in registers.
template <int NV>
inline void weighted_values(float* acc, const float* p, const float* v, int64_t stride,
                            int64_t n) {
  Vec a[NV];
  for (int i = 0; i < NV; ++i) a[i] = Vec::loadu(acc + i * kVec);
  for (int64_t t = 0; t < n; ++t) {
    const Vec w(p[t]);
    for (int i = 0; i < NV; ++i)
      a[i] = at::vec::fmadd(w, Vec::loadu(v + t * stride + i * kVec), a[i]);
  }
  for (int i = 0; i < NV; ++i) a[i].store(acc + i * kVec);
}

template <int NV = kMaxRegVecs>
inline void weighted_values_n(int64_t nv, float* acc, const float* p, const float* v,
                              int64_t stride, int64_t n) {
  if constexpr (NV > 1) {
    if (nv < NV) return weighted_values_n<NV - 1>(nv, acc, p, v, stride, n);
  }
  weighted_values<NV>(acc, p, v, stride, n);
}

// The whole head: register passes of up to kMaxRegVecs vectors, a D tail element-wise.
inline void weighted_values_head(float* acc, const float* p, const float* v, int64_t stride,
                                 int64_t n, int64_t D) {
  int64_t d = 0;
  while (D - d >= kVec) {
    const int64_t nv = std::min<int64_t>(kMaxRegVecs, (D - d) / kVec);
    weighted_values_n(nv, acc + d, p, v + d, stride, n);
    d += nv * kVec;
  }
  for (; d < D; ++d)
    for (int64_t t = 0; t < n; ++t) acc[d] += p[t] * v[t * stride + d];
}

// Vectorised max of x[0, n) (-inf when n is 0).
inline float max_of(const float* x, int64_t n) {
  Vec m(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + kVec <= n; i += kVec) m = at::vec::maximum(m, Vec::loadu(x + i));
  float r =
      at::vec::vec_reduce_all<float>(
          [](const Vec& a, const Vec& b) { return at::vec::maximum(a, b); }, m);
  for (; i < n; ++i) r = std::max(r, x[i]);
  return r;
}

// x[i] = exp(x[i] - m) for i < n; returns their sum.
inline float exp_sum(float* x, int64_t n, float m) {
  const Vec mv(m);
  Vec s(0.f);
  int64_t i = 0;
  for (; i + kVec <= n; i += kVec) {
    const Vec e = (Vec::loadu(x + i) - mv).exp_u20();
    e.store(x + i);
    s = s + e;
  }
  float r =
      at::vec::vec_reduce_all<float>([](const Vec& a, const Vec& b) { return a + b; }, s);
  for (; i < n; ++i) {
    x[i] = std::exp(x[i] - m);
    r += x[i];
  }
  return r;
}

// A prefetch into L2 that the compiler keeps: GCC 12 deletes some __builtin_prefetch calls
// (a loop of them under a condition, or inside the quantized kernel's dequantisation loop).
inline void prefetch_l2(const void* p) {
#if defined(__x86_64__)
  // A register operand: with a memory one ("m") GCC keeps the accumulators of the loops
  // around it in sync in memory, a store each per iteration.
  asm volatile("prefetcht1 (%0)" : : "r"(p));
#else
  __builtin_prefetch(p, 0, 2);
#endif
}

// dst[i] = src[i] for i < n; meanwhile next[0, ahead) is prefetched into L2 alongside.
inline void to_float(const c10::BFloat16* src, float* dst, int64_t n,
                     const c10::BFloat16* next = nullptr, int64_t ahead = 0) {
  using BVec = at::vec::Vectorized<c10::BFloat16>;
  int64_t i = 0;
  for (; i + BVec::size() <= n; i += BVec::size()) {
    if (i < ahead) prefetch_l2(next + i);
    auto [lo, hi] = at::vec::convert_bfloat16_float(BVec::loadu(src + i));
    lo.store(dst + i);
    hi.store(dst + i + kVec);
  }
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// T itself, not deduced from the argument (a `next` of nullptr takes the rows' type).
template <typename T>
struct SameType {
  using type = T;
};
template <typename T>
using Same = typename SameType<T>::type;

// out[i] = the sum of vector i's lanes, for kVec vectors of kVec floats, x + i * ld (a
// transposing tree: 45 shuffles and adds for 16 sums on AVX-512, against ~8 per vector alone).
inline void lane_sums(const float* x, int64_t ld, float* out) {
#if defined(CPU_CAPABILITY_AVX512)
  __m512 r[8], u[4];
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    const __m512 a = _mm512_loadu_ps(x + 2 * i * ld), b = _mm512_loadu_ps(x + (2 * i + 1) * ld);
    r[i] = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  }
  for (int i = 0; i < 4; ++i)  // per 128-bit lane: vectors 4i..4i+3's sums over that lane
    u[i] = _mm512_add_ps(_mm512_shuffle_ps(r[2 * i], r[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(r[2 * i], r[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 w01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 w23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(3, 2, 3, 2)));
  _mm512_storeu_ps(out, _mm512_add_ps(_mm512_shuffle_f32x4(w01, w23, _MM_SHUFFLE(2, 0, 2, 0)),
                                      _mm512_shuffle_f32x4(w01, w23, _MM_SHUFFLE(3, 1, 3, 1))));
#elif defined(CPU_CAPABILITY_AVX2)
  __m256 a[8];
  for (int i = 0; i < 8; ++i) a[i] = _mm256_loadu_ps(x + i * ld);
  lane_sums8(a, out);
#else
  for (int64_t i = 0; i < kVec; ++i) {
    out[i] = 0.f;
    for (int64_t j = 0; j < kVec; ++j) out[i] += x[i * ld + j];
  }
#endif
}

// Decode attention over a chunk of n consecutive cached rows, `row` floats apart (KV head
// hk's D = NV * kVec values at hk * D). A pass takes one KV head and GB of its query heads,
// their q (scores) or outputs (values) held in registers across the chunk's rows, so a row's
// part is loaded once per pass and the FMAs need no other loads; per key and head the scores
// cost NV FMAs and a share of a transposing lane-sum tree, not a whole horizontal reduction.
// (Measured against the kernel before, which scored 8 keys per head with one reduction
// each: 20-25% less time at 2k-16k context on a Zen 4 VM, decode_attention_share.py.)
#if defined(CPU_CAPABILITY_AVX512)
constexpr int kAccRegs = 12;  // vectors of q or output a pass keeps in registers
constexpr int kRunRegs = 24;  // the same for a run of prefill rows (their keys shared)
#else
constexpr int kAccRegs = 6;
constexpr int kRunRegs = 6;
#endif

// Each pass also prefetches into L2 its part of the next chunk's rows (`next`, `ahead` >= 1
// rows laid out as k / v; the chunk itself after the last; nullptr: none): the next chunk is
// usually in another block, where the hardware prefetcher would start cold. (12 layers of the
// bench model's cache, 16k context, 2 threads on a Zen 4 VM: 20-22 -> 14.5-15.9 ms a step;
// into L1 (T0) it measured no better than none.) Rows past `ahead` repeat its last one (the
// next chunk can be shorter than this one and end its block).
template <int NV, typename KT>
inline void prefetch_row_part(const KT* next, int64_t t, int64_t ahead, int64_t row) {
  if (!next) return;
  const KT* r = next + std::min(t, ahead - 1) * row;
  for (int i = 0; i < NV * kVec; i += 64 / int(sizeof(KT))) prefetch_l2(r + i);
}

// part[(t - t0) * H + h0 + j] = the lane products of q_(h0 + j) and row t, for t in [t0, t1).
// Rows of KT: float, or bf16 widened as they load (loadv).
template <int NV, int GB, typename KT>
inline void score_pass(const float* qf, const KT* k, int64_t row, int64_t t0, int64_t t1,
                       int64_t H, int64_t h0, float* part, const KT* next, int64_t ahead) {
  Vec qv[GB][NV];
  for (int j = 0; j < GB; ++j)
    for (int i = 0; i < NV; ++i) qv[j][i] = Vec::loadu(qf + (h0 + j) * NV * kVec + i * kVec);
  for (int64_t t = t0; t < t1; ++t) {
    Vec kv[NV];
    for (int i = 0; i < NV; ++i) kv[i] = loadv(k + t * row + i * kVec);
    prefetch_row_part<NV>(next, t, ahead, row);
    for (int j = 0; j < GB; ++j) {
      Vec a = qv[j][0] * kv[0];
      for (int i = 1; i < NV; ++i) a = at::vec::fmadd(qv[j][i], kv[i], a);
      a.store(part + ((t - t0) * H + h0 + j) * kVec);
    }
  }
}

// acc_(h0 + j) += sum over rows t < n of p[(h0 + j) * ldp + t] * v_t, in row order.
template <int NV, int GB, typename KT>
inline void value_pass(float* acc, const float* p, int64_t ldp, const KT* v, int64_t row,
                       int64_t n, int64_t h0, const KT* next, int64_t ahead) {
  VReg a[GB][NV];
  for (int j = 0; j < GB; ++j)
    for (int i = 0; i < NV; ++i) a[j][i] = Vec::loadu(acc + (h0 + j) * NV * kVec + i * kVec);
  // The loop twice, with and without the prefetches: under a branch inside it GCC stored
  // every accumulator to the stack each row (12 stores a row at head_dim 64; one thread over
  // one layer of 16 x 256 cached rows, 4 MB, 0.435 -> 0.41 ms a call).
  const auto rows = [&](auto prefetch) {
    for (int64_t t = 0; t < n; ++t) {
      Vec vv[NV];
      for (int i = 0; i < NV; ++i) vv[i] = loadv(v + t * row + i * kVec);
      if constexpr (decltype(prefetch)::value) prefetch_row_part<NV>(next, t, ahead, row);
      for (int j = 0; j < GB; ++j) {
        const Vec w(p[(h0 + j) * ldp + t]);
        for (int i = 0; i < NV; ++i) a[j][i] = at::vec::fmadd(w, vv[i], Vec(a[j][i]));
      }
    }
  };
  if (next)
    rows(std::true_type{});
  else
    rows(std::false_type{});
  for (int j = 0; j < GB; ++j)
    for (int i = 0; i < NV; ++i) Vec(a[j][i]).store(acc + (h0 + j) * NV * kVec + i * kVec);
}

// Calls f(std::integral_constant<int, gb>{}, h0) over the G query heads of KV head hk in
// passes of GB = Regs / NV heads (at least 1), the last pass of what is left one by one.
template <int NV, int Regs = kAccRegs, typename F>
inline void head_passes(int64_t hk, int64_t G, F&& f) {
  constexpr int GB = std::max(1, Regs / NV);
  int64_t g = 0;
  for (; g + GB <= G; g += GB) f(std::integral_constant<int, GB>{}, hk * G + g);
  for (; g < G; ++g) f(std::integral_constant<int, 1>{}, hk * G + g);
}

// p[h * ldp + t] = qf_h . k_t for the chunk's rows and every query head: each (row, head)
// product is left as a vector in `part` ((kVec, H, kVec) floats) and kVec rows' lane sums
// are taken together.
template <int NV, int Regs = kAccRegs, typename KT>
inline void score_rows(const float* qf, const KT* k, int64_t row, int64_t n, int64_t hkv,
                       int64_t G, float* part, float* p, int64_t ldp, const Same<KT>* next,
                       int64_t ahead, const Same<KT>* vnext = nullptr, int64_t vahead = 0) {
  const int64_t H = hkv * G;
  for (int64_t t0 = 0; t0 < n; t0 += kVec) {
    const int64_t t1 = std::min<int64_t>(t0 + kVec, n);
    for (int64_t hk = 0; hk < hkv; ++hk) {
      head_passes<NV, Regs>(hk, G, [&](auto gb, int64_t h0) {
        score_pass<NV, decltype(gb)::value>(qf, k + hk * NV * kVec, row, t0, t1, H, h0, part,
                                            next ? next + hk * NV * kVec : nullptr, ahead);
      });
      // The first vahead rows of the next V chunk, spread over the chunk's row groups.
      if (vnext)
        for (int64_t r = t0 * vahead / n; r < t1 * vahead / n; ++r)
          prefetch_row_part<NV>(vnext + hk * NV * kVec, r, vahead, row);
    }
    for (int64_t h = 0; h < H; ++h) {
      float sums[kVec];
      lane_sums(part + h * kVec, H * kVec, sums);
      std::memcpy(p + h * ldp + t0, sums, (t1 - t0) * sizeof(float));
    }
  }
}

// acc_h += sum over the chunk's rows t of p[h * ldp + t] * v_t (KV head h / G's part).
template <int NV, int Regs = kAccRegs, typename KT>
inline void value_rows(float* acc, const float* p, int64_t ldp, const KT* v, int64_t row,
                       int64_t n, int64_t hkv, int64_t G, const Same<KT>* next, int64_t ahead) {
  for (int64_t hk = 0; hk < hkv; ++hk)
    head_passes<NV, Regs>(hk, G, [&](auto gb, int64_t h0) {
      value_pass<NV, decltype(gb)::value>(acc, p, ldp, v + hk * NV * kVec, row, n, h0,
                                          next ? next + hk * NV * kVec : nullptr, ahead);
    });
}

// The online softmax over a chunk's n scores per head (p[h * kChunk + t], replaced by their
// exp): the running max mx, sum sm and output acc rescaled to the new max.
inline void softmax_chunk(float* p, int64_t n, int64_t H, int64_t D, float* mx, float* sm,
                          float* acc) {
  for (int64_t h = 0; h < H; ++h) {
    float* ph = p + h * kChunk;
    const float m = std::max(mx[h], max_of(ph, n));
    if (m > mx[h]) {
      const float f = std::exp(mx[h] - m);  // 0 for the first chunk
      sm[h] *= f;
      float* a = acc + h * D;
      for (int64_t d = 0; d < D; ++d) a[d] *= f;
      mx[h] = m;
    }
    sm[h] += exp_sum(ph, n, m);
  }
}

// Calls f(std::integral_constant<int, D / kVec>) for a head_dim of whole vectors, 1 to 8,
// 10, 12 or 16 of them (head_dim 80 on AVX2 is 10); false (and no call) for any other.
template <typename F>
inline bool scores_and_values(int64_t D, F&& f) {
  if (D % kVec != 0) return false;
#define SL_NV(n) \
  case n:        \
    f(std::integral_constant<int, n>{}); \
    return true;
  switch (D / kVec) {
    SL_NV(1) SL_NV(2) SL_NV(3) SL_NV(4) SL_NV(5) SL_NV(6) SL_NV(7) SL_NV(8) SL_NV(10) SL_NV(12)
    SL_NV(16)
    default:
      return false;
  }
#undef SL_NV
}

template <typename T>
void decode_attention_impl(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
                           const at::Tensor& tables, const at::Tensor& lens, double scale,
                           int64_t window, at::Tensor& out) {
  const int64_t S = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t bs = kc.size(1), hkv = kc.size(2), G = H / hkv;
  const int64_t max_blocks = tables.size(1);
  const int64_t qs = q.stride(0);  // q may be a row slice of the fused qkv tensor
  const T* qp = q.data_ptr<T>();
  const T* kp = kc.data_ptr<T>();
  const T* vp = vc.data_ptr<T>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const int64_t row = hkv * D;  // elements per cached token
  const float sc = static_cast<float>(scale);
  constexpr int64_t kMinSpan = 64;
  constexpr bool kInPlace = std::is_same<T, float>::value;
  const int64_t threads = at::get_num_threads();
  // Enough (sequence, span) items that every thread gets the same number: a batch smaller
  // than a few per thread splits each context into threads / gcd(S, threads) spans.
  const int64_t spans = S >= 4 * threads ? 1 : threads / std::gcd(S, threads);
  // Partials per (sequence, span, head): running max, sum of exp, unnormalised output.
  std::vector<float> pmax(S * spans * H, -std::numeric_limits<float>::infinity());
  std::vector<float> psum(S * spans * H, 0.f), pacc(S * spans * H * D, 0.f);
  at::parallel_for(0, S * spans, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> qf(H * D), p(H * kChunk), part(H * kVec * kVec), kbuf, vbuf;
    // An item's positions [lo, hi) of its sequence's context (empty: lo >= hi).
    const auto span_of = [&](int64_t item) {
      const int64_t s = item / spans, span = item % spans;
      const int64_t ctx = lp[s];
      const int64_t first = window > 0 ? std::max<int64_t>(0, ctx - window) : 0;
      const int64_t len = std::max<int64_t>(kMinSpan, (ctx - first + spans - 1) / spans);
      const int64_t lo = first + span * len;
      return std::pair<int64_t, int64_t>{lo, std::min(ctx, lo + len)};
    };
    // (first slot, rows) of the chunk at position at_pos of a sequence's span ending at hi.
    const auto chunk_of = [&](const int64_t* table, int64_t at_pos, int64_t hi) {
      const int64_t off = at_pos % bs;
      return std::pair<int64_t, int64_t>{table[at_pos / bs] * bs + off,
                                         std::min({kChunk, bs - off, hi - at_pos})};
    };
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t s = item / spans;
      const auto [lo, hi] = span_of(item);
      if (lo >= hi) continue;
      const int64_t* table = tp + s * max_blocks;
      for (int64_t i = 0; i < H * D; ++i) qf[i] = to_f(qp[s * qs + i]) * sc;
      float* mx = pmax.data() + item * H;
      float* sm = psum.data() + item * H;
      float* acc = pacc.data() + item * H * D;
      // Chunks: up to kChunk consecutive positions inside one block, K and V rows read in
      // place, bf16 ones widened to fp32 in registers as they load (`loadv`), except for a
      // head_dim the vector passes do not take (key by key over fp32 buffers).
      // While a chunk is read, the next one's `ahead` rows are prefetched by the passes; while
      // the last is, the first chunk of the thread's next item (else the chunk itself). That
      // first chunk had come from memory unannounced: 12 layers of decode attention with the
      // caches cold, 2 threads, context 320, an Intel Xeon with AMX: fp32 batch 16 6.95-7.07
      // -> 6.65-6.76 ms, batch 64 25.4-26.4 -> 24.5-24.7; bf16 batch 64 16.8-17.4 ->
      // 15.9-16.2, batch 16 level. Prefetches only: the same bits.
      // (bf16 rows went first through fp32 buffers, a whole chunk's, two of 64 KiB that
      // outgrew L1, then 16 rows at a time: 12 layers at batch 16, context 320, an Intel Xeon
      // with AMX, 5.4 -> 4.0-4.6 ms a step; widened in registers 3.3-3.5 ms, and one
      // sequence at 16k 15.8 -> 12.2 ms; the same FMAs in the same order throughout, so the
      // same bits.)
      const auto chunk_at = [&](int64_t at_pos) { return chunk_of(table, at_pos, hi); };
      // After the last chunk: the first chunk of this thread's next item with positions.
      std::pair<int64_t, int64_t> following{-1, 0};
      for (int64_t it = item + 1; it < i1 && following.first < 0; ++it) {
        const auto [lo2, hi2] = span_of(it);
        if (lo2 < hi2) following = chunk_of(tp + (it / spans) * max_blocks, lo2, hi2);
      }
      for (int64_t pos = lo; pos < hi;) {
        const auto [slot, n] = chunk_at(pos);
        const auto [next_slot, ahead] =
            pos + n < hi              ? chunk_at(pos + n)
            : following.first >= 0 ? following
                                   : std::pair<int64_t, int64_t>{slot, n};
        const T* k = kp + slot * row;
        const T* v = vp + slot * row;
        const bool fast = scores_and_values(D, [&](auto nv) {
          constexpr int NV = decltype(nv)::value;
          // The score pass is the longer (~half the kernel's time against ~a third): it
          // also prefetches the first quarter of the next chunk's V rows, the value pass the
          // rest. (12 layers of W1 bf16's attention, cold caches, 2 threads of an Intel Xeon
          // with AMX, 8 alternations: 3.89-4.11 ms, median 4.00, against 3.91-4.22, median
          // 4.12, with every V row prefetched by the value pass; with half or all of them in
          // the score pass it measured slower.)
          const int64_t vq = ahead / 4;
          score_rows<NV>(qf.data(), k, row, n, hkv, G, part.data(), p.data(), kChunk,
                         kp + next_slot * row, ahead, vp + next_slot * row, vq);
          softmax_chunk(p.data(), n, H, D, mx, sm, acc);
          value_rows<NV>(acc, p.data(), kChunk, v, row, n, hkv, G, vp + (next_slot + vq) * row,
                         ahead - vq);
        });
        if (!fast) {  // a head_dim the vector passes do not take: key by key, head by head
          const float* kf;
          const float* vf;
          if constexpr (kInPlace) {
            kf = k;
            vf = v;
          } else {  // fp32 copies, in buffers taken the first time
            if (kbuf.empty()) kbuf.resize(kChunk * row), vbuf.resize(kChunk * row);
            to_float(k, kbuf.data(), n * row, kp + next_slot * row, ahead * row);
            to_float(v, vbuf.data(), n * row, vp + next_slot * row, ahead * row);
            kf = kbuf.data();
            vf = vbuf.data();
          }
          for (int64_t t = 0; t < n; ++t)
            for (int64_t h = 0; h < H; ++h)
              p[h * kChunk + t] = dot(qf.data() + h * D, kf + t * row + (h / G) * D, D);
          softmax_chunk(p.data(), n, H, D, mx, sm, acc);
          for (int64_t h = 0; h < H; ++h)
            weighted_values_head(acc + h * D, p.data() + h * kChunk, vf + (h / G) * D, row, n, D);
        }
        pos += n;
      }
    }
  });
  // Merge the spans of each (sequence, head): rescale each by exp(max_span - max_all).
  at::parallel_for(0, S * H, 64, [&](int64_t j0, int64_t j1) {
    std::vector<float> o(D);
    for (int64_t j = j0; j < j1; ++j) {
      const int64_t s = j / H, h = j % H;
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t sp = 0; sp < spans; ++sp) m = std::max(m, pmax[(s * spans + sp) * H + h]);
      float total = 0.f;
      std::fill(o.begin(), o.end(), 0.f);
      for (int64_t sp = 0; sp < spans; ++sp) {
        const int64_t i = (s * spans + sp) * H + h;
        if (psum[i] == 0.f) continue;  // an empty span
        const float f = spans == 1 ? 1.f : std::exp(pmax[i] - m);
        total += psum[i] * f;
        const float* a = pacc.data() + i * D;
        for (int64_t d = 0; d < D; ++d) o[d] += a[d] * f;
      }
      const float inv = 1.f / total;
      for (int64_t d = 0; d < D; ++d) op[(s * H + h) * D + d] = from_f<T>(o[d] * inv);
    }
  });
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                                  const at::Tensor& context_lens, double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2),
              "paged_decode_attention: q (S, H, D) with contiguous rows");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes(),
              "paged_decode_attention: k/v cache (num_blocks, block_size, Hkv, D) contiguous");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "paged_decode_attention: cache dtype must equal q's");
  TORCH_CHECK(k_cache.size(3) == q.size(2) && q.size(1) % k_cache.size(2) == 0,
              "paged_decode_attention: head_dim must match and H divide by Hkv");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong &&
                  block_tables.is_contiguous() && context_lens.is_contiguous() &&
                  block_tables.size(0) == q.size(0) && context_lens.size(0) == q.size(0),
              "paged_decode_attention: int64 block_tables (S, B) and context_lens (S,)");
  auto out = at::empty(q.sizes(), q.options());
  SL_DISPATCH(q.scalar_type(), "paged_decode_attention", [&] {
    decode_attention_impl<scalar_t>(q, k_cache, v_cache, block_tables, context_lens, scale,
                                    window, out);
  });
  return out;
}

// ---- Paged attention over a quantized cache ----------------------------------------------
// Every query row t (a decode token or one token of a prefill chunk) attends to keys
// [first_t, ctx_t) of its sequence, read from the paged cache in place: q (T, H, D);
// token_seq (T,) names the block_tables row (S, max_blocks) of t's sequence; context_lens
// (T,) = t's position + 1; a window W > 0 keeps the last W positions. Query head h reads KV
// head h / (H / Hkv) (transformers' repeat_kv). The cache is (num_blocks, block_size, Hkv, Dc)
// in q's dtype (bits 0), or uint8 codes (bits 8: Dc = D; bits 4: two codes a byte, low nibble
// first) with (num_blocks, block_size, Hkv, 2) [scale, zero] in q's dtype, dequantized to
// fp32 as code * scale + zero in one fused multiply-add, whatever q's dtype, and used as fp32
// (the reference, attention/torch_ref.py's dequantize_kv, rounds them to q's dtype for SDPA).
// (A bf16 model's rows were rounded to bf16 twice, after the product and after the sum, as
// bf16 arithmetic in torch would: 18 of a vector's ~22 operations. 12 layers of decode
// attention, 16 sequences at context 320, 2 threads of an Intel Xeon with AMX: int8 5.7 ->
// 3.2 ms a step, where an unrounded bf16 cache takes 2.4.)
//
// Batch invariance: a row's result depends only on its q, its keys and its values, never on
// the other rows of the step, the chunk it came in, the thread count or the work split. Keys
// are cut into spans at fixed absolute positions (multiples of kSpan), each span's partial
// softmax is computed by the same explicit vector code, and the spans are merged in position
// order. So a token computed in a prefill chunk, in a decode step, alone or in a batch, after
// a preemption or from a prefix-cache hit gives the same bits; with a quantized cache this is
// what keeps the KV codes written after it identical too (one ulp can move a 4-bit code).
//
// Work items are (tile of up to kQTile consecutive rows of one sequence, span, KV head), the
// KV head fastest: a thread takes a span with all its KV heads, so the heads' rows,
// which interleave in the same cache blocks, are read one right after another (the KV head
// slowest read each block four times over the whole step, a quarter of its lines each time:
// 16k context alone, 12 layers, int8, 2048-block cache: 13.6-21.8 -> 12.5-12.8 ms). The
// span's K and V rows are dequantized to fp32 once and reused by the tile's rows and the G
// query heads that share the KV head; each row's G heads then take the decode kernel's
// register passes over them (score_rows / value_rows with one KV head). The cache rows are
// prefetched kRowsAhead positions ahead of their dequantisation: a KV head's part of a row
// is one cache line of int8 codes, in blocks scattered over memory. (decode_attention_share.py
// --quant-policy 8, 16k context, 2 threads, Zen 4 VM: 15.7-16.1 -> 11.1-11.5 ms a step of 12
// layers with an fp32 model, 24-25 -> 19 ms with a bf16 one; a 512-row prefill chunk at 4k
// 1.2-1.3x faster.) The engine runs it for quant_policy 8 / 4 (decode and prefill);
// unquantized caches keep the decode kernel above and SDPA for prefill.
//
// A prefill tile's rows go through the span together (the `tile_rows` block below): the keys
// all of them have take passes over several rows' query heads at once, in blocks of kL1Keys
// keys that stay in L1, the scores with the keys in the vector lanes (score_rows_t, AVX-512)
// and the values with several rows' outputs in registers; what each row has alone (the
// causal diagonal, a window's start) goes row by row. Every score and every output is still
// the same arithmetic in the same order as a decode row's. (A 512-row chunk at 8k context,
// int8, 2 threads, Intel Xeon with AVX-512: 142-144 -> 84 ms; at 16k 299-305 -> 186-190 ms,
// where torch's SDPA over the same fp32 K/V takes 162; the first token of a 16k prompt over
// an int8 cache 72.7 -> 49 s.)
constexpr int64_t kSpan = 256;
constexpr int64_t kQTile = 64;
constexpr int64_t kRowsAhead = 16;  // rows prefetched ahead of their dequantisation
constexpr int64_t kLdt = kSpan + 16;  // a transposed key buffer's row: a span and one vector
constexpr int64_t kL1Keys = 64;       // keys whose fp32 rows (16 KiB at head_dim 64) share L1
#if defined(CPU_CAPABILITY_AVX512)
constexpr bool kTransposedScores = true;  // score_rows_t
#else
constexpr bool kTransposedScores = false;
#endif

// acc[d] += w * v[d], fused, for every d (a D tail takes the same op on a partial load).
inline void axpy_fixed(float w, const float* v, float* acc, int64_t D) {
  const Vec wv(w);
  for (int64_t d = 0; d < D; d += kVec) {
    const int64_t r = std::min<int64_t>(kVec, D - d);
    at::vec::fmadd(wv, Vec::loadu(v + d, r), Vec::loadu(acc + d, r)).store(acc + d, r);
  }
}

#if defined(CPU_CAPABILITY_AVX512)
// ---- A quantized cache's rows in vectors (AVX-512) -----------------------------------------
// dequant16 gives 16 dims of a cached row at a time, to the decode rows' registers
// (dequant_row, score_codes / value_codes below) and to a prefill tile's fp32 buffers
// (KVReader::row) alike: one function, so both paths of a build read the same values.

// code * scale + zero as KVReader<T>::row computes it: one fused multiply-add in fp32.
inline Vec dequant_vec(__m512 c, __m512 sv, __m512 zv) { return Vec(_mm512_fmadd_ps(c, sv, zv)); }

// The 16 values an int4 code can take for a row's scale and zero (dequant_vec on the codes
// 0-15: the same arithmetic, so the same bits); dequant16 looks each dim's value up in it.
inline __m512 int4_table(__m512 sv, __m512 zv) {
  return dequant_vec(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), sv,
                        zv);
}

// Dims [16 i, 16 i + 16) of a cached row from its codes: int8 through dequant_vec; int4 by
// looking each code up in the row's int4_table (vpermps reads an index's low 4 bits; bf16
// rounded twice per vector of dims before, once per row now: W1 of the bench model with an
// int4 cache, docs/benchmarks.md, the eighteenth session). Byte j holds dims 2j (low nibble)
// and 2j + 1: each byte goes to two lanes, the odd one shifted right by 4.
inline __m512 dequant16(const uint8_t* c, int64_t bits, int64_t i, __m512 sv, __m512 zv,
                        __m512 table) {
  if (bits == 8) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + 16 * i));
    return dequant_vec(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b)), sv, zv);
  }
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + 8 * i));
  const __m512i odd = _mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4);
  const __m512i codes = _mm512_srlv_epi32(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(b, b)), odd);
  return _mm512_permutexvar_ps(codes, table);
}

template <int NV>
inline void dequant_row(const uint8_t* c, int64_t bits, float scale, float zero, Vec* out) {
  const __m512 sv = _mm512_set1_ps(scale), zv = _mm512_set1_ps(zero);
  const __m512 table = bits == 4 ? int4_table(sv, zv) : sv;
  for (int i = 0; i < NV; ++i) out[i] = Vec(dequant16(c, bits, i, sv, zv, table));
}
#endif

template <typename T>
struct KVReader {
  const uint8_t* codes;  // bits 8 / 4
  const T* plain;        // bits 0
  const T* params;       // (.., 2) scale, zero
  int64_t bits, hkv, d, block_size;
  // Prefetch (into L2) what row(slot, h) reads: its codes' first line and its scale/zero.
  void prefetch(int64_t slot, int64_t h) const {
    const int64_t idx = slot * hkv + h;
    if (bits == 0) {
      prefetch_l2(plain + idx * d);
      return;
    }
    prefetch_l2(codes + idx * (bits == 8 ? d : d / 2));
    prefetch_l2(params + idx * 2);
  }
  // One cached token's row for KV head h as fp32: out (D,).
  void row(int64_t slot, int64_t h, float* out) const {
    const int64_t idx = slot * hkv + h;
    if (bits == 0) {
      const T* x = plain + idx * d;
      for (int64_t i = 0; i < d; ++i) out[i] = to_f(x[i]);
      return;
    }
    const float scale = to_f(params[idx * 2]), zero = to_f(params[idx * 2 + 1]);
    const uint8_t* c = codes + idx * (bits == 8 ? d : d / 2);
#if defined(CPU_CAPABILITY_AVX512)
    if (d % kVec == 0) {  // dequant_row's vectors (the loops below: other sizes and CPUs)
      const __m512 sv = _mm512_set1_ps(scale), zv = _mm512_set1_ps(zero);
      const __m512 table = bits == 4 ? int4_table(sv, zv) : sv;
      for (int64_t i = 0; i < d / kVec; ++i)
        _mm512_storeu_ps(out + i * kVec, dequant16(c, bits, i, sv, zv, table));
      return;
    }
#endif
    // One fused multiply-add, written out (dequant_vec's, bit for bit, not left to GCC's
    // contraction).
    auto dq = [&](float c) { return std::fma(c, scale, zero); };
    if (bits == 8) {
      for (int64_t i = 0; i < d; ++i) out[i] = dq(static_cast<float>(c[i]));
    } else {
      for (int64_t i = 0; i < d / 2; ++i) {
        out[2 * i] = dq(static_cast<float>(c[i] & 0xF));
        out[2 * i + 1] = dq(static_cast<float>(c[i] >> 4));
      }
    }
  }
};

#if defined(CPU_CAPABILITY_AVX512)
// A prefill tile's scores with the keys in the lanes: the span's fp32 key rows transposed
// (kt[d * ldt + x]), each query vector's 16 lane partials of score_pass become 16 vectors of
// 16 keys (partial l: q[l] k[l] + q[l + 16] k[l + 16] + ..., the same multiply and FMAs in
// the same order), summed in lane_sums' tree ((t0 + t2) + (t1 + t3), t_g = (p_4g + p_4g+2) +
// (p_4g+1 + p_4g+3)) by plain vector adds: the same bits as score_rows and the decode row's
// score_codes, without their partial stores and shuffles, and each key row's loads shared by
// two query vectors.
inline void transpose16(const float* src, int64_t lds, float* dst, int64_t ldd) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src + i * lds);
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 16; i += 8)
    for (int j = 0; j < 4; ++j) {
      t[i + j] = _mm512_shuffle_f32x4(r[i + j], r[i + j + 4], 0x88);
      t[i + j + 4] = _mm512_shuffle_f32x4(r[i + j], r[i + j + 4], 0xdd);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0x88);
    r[j + 8] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0xdd);
  }
  for (int i = 0; i < 16; ++i) _mm512_storeu_ps(dst + i * ldd, r[i]);
}

// kt[d * ldt + x] = k[x * D + d] for x below n rounded up to 16 (k has those rows).
inline void transpose_rows(const float* k, int64_t D, int64_t n, float* kt, int64_t ldt) {
  for (int64_t x0 = 0; x0 < n; x0 += 16)
    for (int64_t d0 = 0; d0 < D; d0 += 16) transpose16(k + x0 * D + d0, D, kt + d0 * ldt + x0, ldt);
}

// Query vectors m < R (q + m * D, D = NV * 16): their scores against KG groups of 16 keys
// (kt's lanes from kt + 16 kg), out[m * KG + kg]. Each q element's broadcast serves the KG
// groups and each key vector the R queries: a load per FMA.
template <int NV, int R, int KG>
inline void score_lanes(const float* q, int64_t D, const float* kt, int64_t ldt, __m512* out) {
  constexpr int N = R * KG;
  auto partial = [&](int l, __m512* a) __attribute__((always_inline)) {
#pragma GCC unroll 16
    for (int i = 0; i < NV; ++i) {
      __m512 k[KG];
#pragma GCC unroll 16
      for (int g = 0; g < KG; ++g) k[g] = _mm512_loadu_ps(kt + (l + 16 * i) * ldt + 16 * g);
#pragma GCC unroll 16
      for (int m = 0; m < R; ++m) {
        const __m512 qb = _mm512_set1_ps(q[m * D + l + 16 * i]);
#pragma GCC unroll 16
        for (int g = 0; g < KG; ++g)
          a[m * KG + g] =
              i == 0 ? _mm512_mul_ps(qb, k[g]) : _mm512_fmadd_ps(qb, k[g], a[m * KG + g]);
      }
    }
    // With one vector of q a partial is a bare product, which GCC would fuse into the tree's
    // first add (-ffp-contract=fast): the opaque asm keeps it rounded, as lane_sums has it.
    if constexpr (NV == 1)
#pragma GCC unroll 16
      for (int j = 0; j < N; ++j) asm("" : "+v"(a[j]));
  };
  // t = (p_4g + p_4g+2) + (p_4g+1 + p_4g+3); inlined, or the arrays go through memory
  auto group = [&](int g4, __m512* t) __attribute__((always_inline)) {
    __m512 x[N], y[N];
    partial(4 * g4, x);
    partial(4 * g4 + 2, y);
#pragma GCC unroll 16
    for (int j = 0; j < N; ++j) t[j] = _mm512_add_ps(x[j], y[j]);
    partial(4 * g4 + 1, x);
    partial(4 * g4 + 3, y);
#pragma GCC unroll 16
    for (int j = 0; j < N; ++j) t[j] = _mm512_add_ps(t[j], _mm512_add_ps(x[j], y[j]));
  };
  __m512 t[N], u[N];  // (t0 + t2) + (t1 + t3)
  group(0, t);
  group(2, u);
#pragma GCC unroll 16
  for (int j = 0; j < N; ++j) out[j] = _mm512_add_ps(t[j], u[j]);
  group(1, t);
  group(3, u);
#pragma GCC unroll 16
  for (int j = 0; j < N; ++j) out[j] = _mm512_add_ps(out[j], _mm512_add_ps(t[j], u[j]));
}

// p[m * ldp + x] = q_m . key x for the M query vectors and the n keys of kt (from kt's first
// lane; lanes past n are computed and not stored). Query pairs outside, keys inside: the
// caller passes a block of keys that stays in L1 (kL1Keys).
template <int NV>
inline void score_rows_t(const float* q, int64_t M, const float* kt, int64_t ldt, int64_t n,
                         float* p, int64_t ldp) {
  constexpr int64_t D = NV * 16;
  auto mask_of = [&](int64_t x) {
    return n - x >= 16 ? __mmask16(0xFFFF)
                       : static_cast<__mmask16>((1u << std::max<int64_t>(n - x, 0)) - 1);
  };
  auto rows = [&](auto r, int64_t m) {
    constexpr int R = decltype(r)::value;
    int64_t x0 = 0;
    for (; x0 + 16 < n; x0 += 32) {  // two key groups (the second may be partial)
      const __mmask16 m1 = mask_of(x0 + 16);
      __m512 s[2 * R];
      score_lanes<NV, R, 2>(q + m * D, D, kt + x0, ldt, s);
      for (int j = 0; j < R; ++j) {
        _mm512_storeu_ps(p + (m + j) * ldp + x0, s[2 * j]);
        _mm512_mask_storeu_ps(p + (m + j) * ldp + x0 + 16, m1, s[2 * j + 1]);
      }
    }
    if (x0 < n) {  // one last group of at most 16 keys
      const __mmask16 m0 = mask_of(x0);
      __m512 s[R];
      score_lanes<NV, R, 1>(q + m * D, D, kt + x0, ldt, s);
      for (int j = 0; j < R; ++j) _mm512_mask_storeu_ps(p + (m + j) * ldp + x0, m0, s[j]);
    }
  };
  int64_t m = 0;
  for (; m + 2 <= M; m += 2) rows(std::integral_constant<int, 2>{}, m);
  if (m < M) rows(std::integral_constant<int, 1>{}, m);
}
#endif

#if defined(CPU_CAPABILITY_AVX512)
// One decode row over a quantized span without the fp32 buffers (int8 or int4 codes): each
// key's row is dequantized into registers, to the values KVReader::row writes (dequant16),
// and goes straight into score_pass's / value_pass's arithmetic in the same order, so the
// scores, weights and outputs are the buffered path's bit for bit (a test compares them). It
// saves writing and re-reading 2 x 64 KiB of fp32 rows per (span, KV head) for the one row a
// decode tile has; a prefill tile's rows share the buffers instead. 16k context, 12 layers,
// 12 query / 4 KV heads of 64, 2 threads, Zen 4 VM, alternating builds: int8 12.03 -> 10.64
// ms, int4 13.70 -> 11.04 (a read of their bytes: 3.4 and 1.5 ms; still compute-bound); a
// bf16 model int8 19.53 -> 16.53, int4 22.95 -> 18.61.
//
// score_rows (one KV head, its G <= kAccRegs / NV query heads in one pass) with key t's row
// from row_of(t) -> (codes, scale, zero). This and value_codes are noinline on purpose:
// inlined into the tile loop, a 16k int8 decode step of 12 layers took 15.0-15.5 ms against
// 13.8-14.0 (GCC 12, Intel Xeon, alternating builds).
template <typename T, int NV, int G, typename RowOf>
__attribute__((noinline)) void score_codes(const float* qf, int64_t n, int64_t bits,
                                           float* part, float* p, int64_t ldp, RowOf&& row_of) {
  Vec qv[G][NV];
  for (int j = 0; j < G; ++j)
    for (int i = 0; i < NV; ++i) qv[j][i] = Vec::loadu(qf + j * NV * kVec + i * kVec);
  for (int64_t t0 = 0; t0 < n; t0 += kVec) {
    const int64_t t1 = std::min<int64_t>(t0 + kVec, n);
    for (int64_t t = t0; t < t1; ++t) {
      const auto [c, sc, z] = row_of(t);
      Vec kv[NV];
      dequant_row<NV>(c, bits, to_f(sc), to_f(z), kv);
      for (int j = 0; j < G; ++j) {
        Vec a = qv[j][0] * kv[0];
        for (int i = 1; i < NV; ++i) a = at::vec::fmadd(qv[j][i], kv[i], a);
        a.store(part + ((t - t0) * G + j) * kVec);
      }
    }
    for (int64_t h = 0; h < G; ++h) {
      float sums[kVec];
      lane_sums(part + h * kVec, G * kVec, sums);
      std::memcpy(p + h * ldp + t0, sums, (t1 - t0) * sizeof(float));
    }
  }
}

// value_rows (one KV head, G heads in one pass, acc starting at zero) with value t's row
// from row_of(t).
template <typename T, int NV, int G, typename RowOf>
__attribute__((noinline)) void value_codes(float* acc, const float* p, int64_t ldp, int64_t n,
                                           int64_t bits, RowOf&& row_of) {
  VReg a[G][NV];
  for (int j = 0; j < G; ++j)
    for (int i = 0; i < NV; ++i) a[j][i] = Vec(0.f);
  for (int64_t t = 0; t < n; ++t) {
    const auto [c, sc, z] = row_of(t);
    Vec vv[NV];
    dequant_row<NV>(c, bits, to_f(sc), to_f(z), vv);
    for (int j = 0; j < G; ++j) {
      const Vec w(p[j * ldp + t]);
      for (int i = 0; i < NV; ++i) a[j][i] = at::vec::fmadd(w, vv[i], Vec(a[j][i]));
    }
  }
  for (int j = 0; j < G; ++j)
    for (int i = 0; i < NV; ++i) Vec(a[j][i]).store(acc + j * NV * kVec + i * kVec);
}

#endif

// Calls f(std::integral_constant<int, G>{}) for a G in [1, Max] (none for any other).
template <int Max, typename F>
inline void with_heads(int64_t G, F&& f) {
  if constexpr (Max >= 1) {
    if (G == Max) f(std::integral_constant<int, Max>{});
    else with_heads<Max - 1>(G, f);
  }
}

// The rows of a paged_attention / prefill_attention call (token_seq sp, context_lens lp):
// row t's first key (a window W > 0 keeps the last W positions) and its tiles, runs of up to
// max_rows consecutive rows of one sequence (their starts, then T).
struct RowKeys {
  const int64_t* sp;
  const int64_t* lp;
  int64_t window;
  int64_t first(int64_t t) const { return window > 0 ? std::max<int64_t>(0, lp[t] - window) : 0; }
  std::vector<int64_t> tiles(int64_t T, int64_t max_rows) const {
    std::vector<int64_t> start;
    for (int64_t t = 0; t < T; ++t)
      if (t == 0 || sp[t] != sp[t - 1] || t - start.back() == max_rows) start.push_back(t);
    start.push_back(T);
    return start;
  }
  // prefill_attention: the (row, head) pairs [p0, p1) of a tile from row t0 (G heads a row):
  // the union of their rows' keys in whole units of `align` at absolute positions, relative
  // to x0 ([n, 0): none).
  std::pair<int64_t, int64_t> pair_keys(int64_t t0, int64_t G, int64_t p0, int64_t p1,
                                        int64_t align, int64_t x0, int64_t n) const {
    int64_t a = n, b = 0;
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t t = t0 + p / G, f = first(t);
      if (f >= lp[t]) continue;
      a = std::min(a, f / align * align - x0);
      b = std::max(b, (lp[t] + align - 1) / align * align - x0);
    }
    return {a, b};
  }
};

template <typename T>
void paged_attention_impl(const at::Tensor& q, const KVReader<T>& kr, const KVReader<T>& vr,
                          const at::Tensor& tables, const at::Tensor& token_seq,
                          const at::Tensor& lens, double scale, int64_t window, at::Tensor& out) {
  const int64_t T_ = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t hkv = kr.hkv, G = H / hkv, bs = kr.block_size;
  const int64_t max_blocks = tables.size(1), qs = q.stride(0);
  const T* qp = q.data_ptr<T>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* sp = token_seq.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const float sc = static_cast<float>(scale);
  const RowKeys keys{sp, lp, window};
  const std::vector<int64_t> tile_start = keys.tiles(T_, kQTile);
  const int64_t ntiles = static_cast<int64_t>(tile_start.size()) - 1;
  int64_t max_span = 0;
  for (int64_t t = 0; t < T_; ++t) max_span = std::max(max_span, (lp[t] - 1) / kSpan + 1);
  // A decode row's span goes through score_codes / value_codes (AVX-512, a quantized cache
  // whose rows fill whole vectors, int4 in pairs of them, and G heads that fit one register
  // pass). Its bits are the buffered path's, so there is no switch:
  // test_paged_attention_row_is_independent_of_its_batch compares a row alone (this path)
  // with the same row inside a prefill chunk (the buffers).
  bool fused = false;
#if defined(CPU_CAPABILITY_AVX512)
  const int64_t nv = D / kVec;
  fused = kr.bits != 0 && D % kVec == 0 && (kr.bits == 8 || nv % 2 == 0) &&
          G <= kAccRegs / std::max<int64_t>(nv, 1) && (nv <= 8 || nv == 10 || nv == 12 || nv == 16);
#endif
  // Passes over whole tiles bound the partials' memory: (rows x spans) <= kPassRowSpans.
  constexpr int64_t kPassRowSpans = 1024;
  const int64_t pass_rows = std::max(kQTile, kPassRowSpans / max_span);
  std::vector<float> pmax, psum, pacc;
  // Each thread's buffers, sized once for the call (not per pass: fresh pages each time).
  struct Scratch {
    std::vector<float> kbuf, vbuf, qf, p, acc, accr, part, kt;
  };
  // Sized for this call's tiles: decode rows over a quantized cache (`fused`) use none of
  // the fp32 row buffers, and the per-row buffers hold the largest tile (zeroing 64 rows'
  // worth for every decode call cost a 16k int4 decode step ~6%).
  int64_t max_rows = 1;
  for (int64_t i = 0; i < ntiles; ++i)
    max_rows = std::max(max_rows, tile_start[i + 1] - tile_start[i]);
  const bool rows_buffered = !fused || max_rows > 1;
  const int64_t threads = std::max(1, at::get_num_threads());
  std::vector<Scratch> scratch(threads);
  for (Scratch& w : scratch) {
    w.kbuf.resize(rows_buffered ? kSpan * D : 0);
    w.vbuf.resize(rows_buffered ? kSpan * D : 0);
    w.qf.resize(max_rows * G * D);
    w.p.resize(max_rows * G * kSpan);
    w.acc.resize(G * D);
    w.accr.resize(max_rows * G * D);
    w.part.resize(std::max<int64_t>(G, kRunRegs) * kVec * kVec);
    w.kt.resize(rows_buffered ? D * kLdt : 0);  // the span's keys transposed (score_rows_t)
  }
  for (int64_t tile0 = 0; tile0 < ntiles;) {
    int64_t tile1 = tile0 + 1;
    while (tile1 < ntiles && tile_start[tile1 + 1] - tile_start[tile0] <= pass_rows) ++tile1;
    const int64_t r0 = tile_start[tile0], rows = tile_start[tile1] - r0;
    // Partials per (row, head, span): running max, sum of exp, unnormalised output.
    const int64_t P = rows * H * max_span;
    pmax.assign(P, -std::numeric_limits<float>::infinity());
    psum.assign(P, 0.f);
    pacc.resize(P * D);  // each entry whose psum is set is written whole; the rest are not read
    // Threads take (tile, span) groups of hkv items as they finish the last (items differ in
    // cost: a span past a row's keys is skipped, a diagonal span is short).
    const int64_t groups = (tile1 - tile0) * max_span;
    std::atomic<int64_t> next_group{0};
    at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
      Scratch& w = scratch[at::get_thread_num() % threads];
      std::vector<float> &kbuf = w.kbuf, &vbuf = w.vbuf, &qf = w.qf, &p = w.p, &acc = w.acc,
                         &accr = w.accr, &part = w.part, &kt = w.kt;
      for (int64_t grp; (grp = next_group.fetch_add(1, std::memory_order_relaxed)) < groups;)
        for (int64_t item = grp * hkv; item < (grp + 1) * hkv; ++item) {
        const int64_t hk = item % hkv, span = (item / hkv) % max_span;
        const int64_t tile = tile0 + item / max_span / hkv;
        const int64_t t0 = tile_start[tile], t1 = tile_start[tile + 1];
        const int64_t s_lo = span * kSpan;
        int64_t ra[kQTile], rb[kQTile];  // each row's keys in this span: [ra, rb)
        int64_t lo = s_lo + kSpan, hi = s_lo;  // their union
        int64_t seq_end = 0;                    // the tile's last cached position + 1
        for (int64_t t = t0; t < t1; ++t) {
          seq_end = std::max(seq_end, lp[t]);
          ra[t - t0] = std::max(s_lo, keys.first(t));
          rb[t - t0] = std::min(s_lo + kSpan, lp[t]);
          lo = std::min(lo, ra[t - t0]);
          hi = std::max(hi, rb[t - t0]);
        }
        if (lo >= hi) continue;
        const int64_t* table = tp + sp[t0] * max_blocks;
        auto slot_of = [&](int64_t pos) { return table[pos / bs] * bs + pos % bs; };
        // A decode row (`fused`) takes its keys and values from the codes into the passes
        // (score_codes / value_codes); every other tile's rows share the fp32 buffers.
        const bool in_regs = fused && t1 - t0 == 1;
#if defined(CPU_CAPABILITY_AVX512)
        const int64_t width = kr.bits == 8 ? D : D / 2;
        auto codes_of = [&](const KVReader<T>& rd, int64_t slot) {
          const int64_t idx = slot * hkv + hk;
          return std::make_tuple(rd.codes + idx * width, rd.params[idx * 2],
                                 rd.params[idx * 2 + 1]);
        };
#endif
        for (int64_t pos = lo; pos < hi && !in_regs; ++pos) {
          const int64_t ahead = slot_of(std::min(pos + kRowsAhead, seq_end - 1));
          kr.prefetch(ahead, hk);
          vr.prefetch(ahead, hk);
          const int64_t slot = slot_of(pos);
          kr.row(slot, hk, kbuf.data() + (pos - lo) * D);
          vr.row(slot, hk, vbuf.data() + (pos - lo) * D);
        }
        for (int64_t t = t0; t < t1; ++t)
          for (int64_t g = 0; g < G; ++g)
            for (int64_t d = 0; d < D; ++d)
              qf[((t - t0) * G + g) * D + d] = to_f(qp[t * qs + (hk * G + g) * D + d]) * sc;
        // tile_rows: a tile of prefill rows. The keys every row has ([cl, ch)) go through
        // passes over several rows' query heads at once (kRunRegs for the values, all rows
        // for the transposed scores), so each buffered row is loaded once for them; each
        // row's own keys before and after them go alone. A key's
        // score and a value's weight still take the same arithmetic in the same order (a
        // row's values in key order: before, shared, after), so the bits are the per-row
        // passes' and the decode row's.
        if (!in_regs &&
            scores_and_values(D, [&](auto nv) {
              constexpr int NV = decltype(nv)::value;
              const int64_t R = std::max<int64_t>(1, std::max(1, kRunRegs / NV) / G);
              const int64_t nr = t1 - t0;
              int64_t cl = s_lo, ch = s_lo + kSpan;
              for (int64_t r = 0; r < nr; ++r)
                if (ra[r] < rb[r]) cl = std::max(cl, ra[r]), ch = std::min(ch, rb[r]);
              if (cl >= ch) cl = ch = s_lo + kSpan;  // nothing shared: each row alone
              auto pass = [&](bool values, int64_t r, int64_t rows_, int64_t a, int64_t b) {
                if (b <= a) return;
                float* pr = p.data() + r * G * kSpan + a - s_lo;
                if (values)
                  value_rows<NV, kRunRegs>(accr.data() + r * G * D, pr, kSpan,
                                           vbuf.data() + (a - lo) * D, D, b - a, 1, rows_ * G,
                                           nullptr, 0);
                else
#if defined(CPU_CAPABILITY_AVX512)
                  score_rows_t<NV>(qf.data() + r * G * D, rows_ * G, kt.data() + (a - lo), kLdt,
                                   b - a, pr, kSpan);
#else
                  score_rows<NV, kRunRegs>(qf.data() + r * G * D, kbuf.data() + (a - lo) * D, D,
                                           b - a, 1, rows_ * G, part.data(), pr, kSpan, nullptr,
                                           0);
#endif
              };
              auto phases = [&](bool values) {
                for (int64_t r = 0; r < nr; ++r)
                  if (ra[r] < rb[r]) pass(values, r, 1, ra[r], std::min(rb[r], cl));
                // The shared keys in blocks that stay in L1 while runs of rows take them (the
                // transposed scores take every row at once: no registers to bound them).
                const int64_t cap = values || !kTransposedScores ? R : nr;
                for (int64_t k0 = cl; k0 < ch; k0 += kL1Keys)
                  for (int64_t r = 0; r < nr;) {  // runs of rows with keys here
                    if (ra[r] >= rb[r]) {
                      ++r;
                      continue;
                    }
                    int64_t e = r + 1;
                    while (e < nr && e - r < cap && ra[e] < rb[e]) ++e;
                    pass(values, r, e - r, k0, std::min(ch, k0 + kL1Keys));
                    r = e;
                  }
                for (int64_t r = 0; r < nr; ++r)
                  if (ra[r] < rb[r]) pass(values, r, 1, std::max(ra[r], ch), rb[r]);
              };
#if defined(CPU_CAPABILITY_AVX512)
              transpose_rows(kbuf.data(), D, hi - lo, kt.data(), kLdt);
#endif
              phases(false);
              for (int64_t r = 0; r < nr; ++r) {
                if (ra[r] >= rb[r]) continue;
                const int64_t at0 = ((t0 + r - r0) * H + hk * G) * max_span + span;
                for (int64_t g = 0; g < G; ++g) {
                  float* pg = p.data() + (r * G + g) * kSpan + ra[r] - s_lo;
                  const int64_t i = at0 + g * max_span;
                  pmax[i] = max_of(pg, rb[r] - ra[r]);
                  psum[i] = exp_sum(pg, rb[r] - ra[r], pmax[i]);
                }
              }
              std::fill(accr.begin(), accr.begin() + nr * G * D, 0.f);
              phases(true);
              for (int64_t r = 0; r < nr; ++r) {
                if (ra[r] >= rb[r]) continue;
                const int64_t at0 = ((t0 + r - r0) * H + hk * G) * max_span + span;
                for (int64_t g = 0; g < G; ++g)
                  std::memcpy(pacc.data() + (at0 + g * max_span) * D,
                              accr.data() + (r * G + g) * D, D * sizeof(float));
              }
            }))
          continue;
        // What tile_rows leaves, row by row: a decode row over a quantized cache (`in_regs`:
        // its keys and values from the codes into score_codes / value_codes, the passes'
        // arithmetic) and head sizes the vector passes do not take (key by key over the
        // buffers). A key's score and a value's weight cost the same arithmetic whatever
        // rows, keys or heads surround them.
        for (int64_t r = 0; r < t1 - t0; ++r) {
          if (ra[r] >= rb[r]) continue;
          const int64_t n = rb[r] - ra[r];
          const float* qr = qf.data() + r * G * D;
          float* pr = p.data() + r * G * kSpan + ra[r] - s_lo;  // head g's at g * kSpan
          // head g's partials at at0 + g * max_span
          const int64_t at0 = ((t0 + r - r0) * H + hk * G) * max_span + span;
          if (in_regs) {
#if defined(CPU_CAPABILITY_AVX512)
            scores_and_values(D, [&](auto nv) {
              constexpr int NV = decltype(nv)::value;
              with_heads<std::max(1, kAccRegs / NV)>(G, [&](auto g) {
                score_codes<T, NV, decltype(g)::value>(
                    qr, n, kr.bits, part.data(), pr, kSpan, [&](int64_t x) {
                      const int64_t pos = ra[r] + x;
                      const int64_t ahead = slot_of(std::min(pos + kRowsAhead, seq_end - 1));
                      kr.prefetch(ahead, hk);
                      vr.prefetch(ahead, hk);
                      return codes_of(kr, slot_of(pos));
                    });
              });
            });
#endif
          } else {
            const float* k = kbuf.data() + (ra[r] - lo) * D;
            for (int64_t g = 0; g < G; ++g)
              for (int64_t x = 0; x < n; ++x) pr[g * kSpan + x] = dot(qr + g * D, k + x * D, D);
          }
          for (int64_t g = 0; g < G; ++g) {
            const int64_t i = at0 + g * max_span;
            pmax[i] = max_of(pr + g * kSpan, n);
            psum[i] = exp_sum(pr + g * kSpan, n, pmax[i]);
          }
          std::fill(acc.begin(), acc.end(), 0.f);
          if (in_regs) {
#if defined(CPU_CAPABILITY_AVX512)
            scores_and_values(D, [&](auto nv) {
              constexpr int NV = decltype(nv)::value;
              with_heads<std::max(1, kAccRegs / NV)>(G, [&](auto g) {
                value_codes<T, NV, decltype(g)::value>(
                    acc.data(), pr, kSpan, n, vr.bits,
                    [&](int64_t x) { return codes_of(vr, slot_of(ra[r] + x)); });
              });
            });
#endif
          } else {
            const float* v = vbuf.data() + (ra[r] - lo) * D;
            for (int64_t g = 0; g < G; ++g)
              weighted_values_head(acc.data() + g * D, pr + g * kSpan, v, D, n, D);
          }
          for (int64_t g = 0; g < G; ++g)
            std::memcpy(pacc.data() + (at0 + g * max_span) * D, acc.data() + g * D,
                        D * sizeof(float));
        }
      }
    });
    // Merge each (row, head)'s spans in position order, each rescaled by exp(max_span - max).
    at::parallel_for(0, rows * H, 64, [&](int64_t j0, int64_t j1) {
      std::vector<float> o(D);
      for (int64_t j = j0; j < j1; ++j) {
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t s = 0; s < max_span; ++s) m = std::max(m, pmax[j * max_span + s]);
        float total = 0.f;
        std::fill(o.begin(), o.end(), 0.f);
        for (int64_t s = 0; s < max_span; ++s) {
          const int64_t i = j * max_span + s;
          if (psum[i] == 0.f) continue;  // a span outside this row's keys
          const float f = std::exp(pmax[i] - m);
          total += psum[i] * f;
          axpy_fixed(f, pacc.data() + i * D, o.data(), D);
        }
        const float inv = 1.f / total;
        T* dst = op + (r0 * H + j) * D;
        for (int64_t d = 0; d < D; ++d) dst[d] = from_f<T>(o[d] * inv);
      }
    });
    tile0 = tile1;
  }
}

// paged_attention's (and prefill_attention's) inputs, checked before any is read.
void check_paged_attention(const at::Tensor& q, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const c10::optional<at::Tensor>& k_scale_zero,
                           const c10::optional<at::Tensor>& v_scale_zero,
                           const at::Tensor& block_tables, const at::Tensor& token_seq,
                           const at::Tensor& context_lens, int64_t bits) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2),
              "paged_attention: q (T, H, D) with contiguous rows");
  TORCH_CHECK(bits == 0 || bits == 8 || bits == 4, "paged_attention: bits must be 0, 8 or 4");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes(),
              "paged_attention: k/v cache (num_blocks, block_size, Hkv, D) contiguous");
  const int64_t D = q.size(2), width = bits == 4 ? D / 2 : D;
  TORCH_CHECK(k_cache.size(3) == width && q.size(1) % k_cache.size(2) == 0 && D % 2 == 0,
              "paged_attention: head_dim must match the cache and H divide by Hkv");
  if (bits == 0) {
    TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
                "paged_attention: cache dtype must equal q's");
  } else {
    TORCH_CHECK(k_cache.scalar_type() == at::kByte && v_cache.scalar_type() == at::kByte &&
                    k_scale_zero.has_value() && v_scale_zero.has_value(),
                "paged_attention: a quantized cache is uint8 codes with scale_zero tensors");
    for (const auto* t : {&*k_scale_zero, &*v_scale_zero})
      TORCH_CHECK(t->is_contiguous() && t->scalar_type() == q.scalar_type() && t->dim() == 4 &&
                      t->size(3) == 2 && t->size(0) == k_cache.size(0) &&
                      t->size(1) == k_cache.size(1) && t->size(2) == k_cache.size(2),
                  "paged_attention: scale_zero (num_blocks, block_size, Hkv, 2) of q's dtype");
  }
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong &&
                  token_seq.scalar_type() == at::kLong && block_tables.is_contiguous() &&
                  context_lens.is_contiguous() && token_seq.is_contiguous() &&
                  context_lens.size(0) == q.size(0) && token_seq.size(0) == q.size(0),
              "paged_attention: int64 block_tables (S, B), token_seq (T,) and context_lens (T,)");
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const c10::optional<at::Tensor>& k_scale_zero,
                           const c10::optional<at::Tensor>& v_scale_zero,
                           const at::Tensor& block_tables, const at::Tensor& token_seq,
                           const at::Tensor& context_lens, double scale, int64_t window,
                           int64_t bits) {
  check_paged_attention(q, k_cache, v_cache, k_scale_zero, v_scale_zero, block_tables, token_seq,
                        context_lens, bits);
  const int64_t D = q.size(2);
  auto out = at::empty(q.sizes(), q.options());
  if (q.size(0) == 0) return out;
  SL_DISPATCH(q.scalar_type(), "paged_attention", [&] {
    auto reader = [&](const at::Tensor& c, const c10::optional<at::Tensor>& sz) {
      KVReader<scalar_t> r{};
      r.bits = bits;
      r.hkv = c.size(2);
      r.d = D;
      r.block_size = c.size(1);
      if (bits == 0) r.plain = c.data_ptr<scalar_t>();
      else {
        r.codes = c.data_ptr<uint8_t>();
        r.params = sz->data_ptr<scalar_t>();
      }
      return r;
    };
    paged_attention_impl<scalar_t>(q, reader(k_cache, k_scale_zero), reader(v_cache, v_scale_zero),
                                   block_tables, token_seq, context_lens, scale, window, out);
  });
  return out;
}

// ---- Prefill attention over an unquantized cache -----------------------------------------
// Prefill rows over an fp32 / bf16 cache at short context, the same inputs as paged_attention
// with bits 0: q (T, H, D), row t attends to keys [first_t, ctx_t) of sequence token_seq[t].
// paged_attention computes every score as a decode row does (16 lane partials and a tree),
// which keeps a quantized cache's codes independent of scheduling; an unquantized cache needs
// no such match with decode (SDPA runs its longer prefills), so here each score is a plain
// dot product and the tile's work is two register-blocked matrix products:
// - an item is (tile of up to kPrefillRows consecutive rows of one sequence, KV head): its
//   keys, transposed to fp32 once (kt, d-major), serve all of the tile's rows and G query
//   heads; its values are read in place (bf16 widened as they load);
// - scores: MQ (row, head) pairs at a time against blocks of up to 64 keys, MQ x 4
//   accumulators, a broadcast of q and a key vector per FMA's operands (prefill_scores);
// - the softmax of each pair over its whole key range at once (a row's scores fit: the
//   caller keeps this kernel to short contexts), exponentials stored in place;
// - values: the same MQ pairs' outputs in registers over the keys (prefill_values).
// A group of pairs computes the union of its rows' keys (in whole vectors); what lies outside
// a row's own range gets weight 0, which leaves its sums' bits as they are, and every sum runs
// in key order over vectors aligned to absolute positions. So a row's bits depend on its q,
// keys and values only, not on the rows, tile or thread it came with: a chunked prefill gives
// the unchunked one's bits (test_prefill_attention_row_is_independent_of_its_batch).
// A tile's scores are at most kPrefillScores floats: past ~1k keys its rows get few (the keys'
// transposition then serves few rows) and SDPA's flash blocks win (torch_ref.py's limit).
// (12 layers of 12 query / 4 KV heads of 64, fp32, 2 threads of an Intel Xeon with AMX: 16
// prompts of 256 tokens 217 ms with paged_attention, 127 ms here, SDPA 203; the first token
// of W1 (16 x 256, the bench model) 2.24 -> 2.15 s.)
constexpr int64_t kPrefillRows = 64;
constexpr int64_t kPrefillScores = 128 * 1024;  // floats of a tile's score buffer (512 KiB)
#if defined(CPU_CAPABILITY_AVX512)
constexpr int kPrefillAcc = 24;  // accumulators of a register block (of 32 vector registers)
#else
constexpr int kPrefillAcc = 12;  // of AVX2's 16
#endif

// s[m * lds + x] = q_m . key x for the MQ query vectors q + m * D (D = NV * kVec) and the
// KN * kVec keys of kt (d-major, ldt floats a row): from d = 0's product, FMAs in d order.
template <int NV, int MQ, int KN>
__attribute__((noinline)) void prefill_scores(const float* q, const float* kt, int64_t ldt,
                                               float* s, int64_t lds) {
  constexpr int64_t D = NV * kVec;
  VReg acc[MQ][KN];
  for (int j = 0; j < KN; ++j) {
    const Vec k = Vec::loadu(kt + j * kVec);
    for (int m = 0; m < MQ; ++m) acc[m][j] = Vec(q[m * D]) * k;
  }
#pragma GCC unroll 4
  for (int64_t d = 1; d < D; ++d) {
    Vec k[KN];
    for (int j = 0; j < KN; ++j) k[j] = Vec::loadu(kt + d * ldt + j * kVec);
    for (int m = 0; m < MQ; ++m) {
      const Vec qb(q[m * D + d]);
      for (int j = 0; j < KN; ++j) acc[m][j] = at::vec::fmadd(qb, k[j], Vec(acc[m][j]));
    }
  }
  for (int m = 0; m < MQ; ++m)
    for (int j = 0; j < KN; ++j) Vec(acc[m][j]).store(s + m * lds + j * kVec);
}

// o[m * D + .] = sum over keys x < n of p[m * lds + x] * v_x for MQ pairs, in key order from
// zero; v_x at vrow[x] (KT: float, or bf16 widened as it loads).
template <int NV, int MQ, typename KT>
__attribute__((noinline)) void prefill_values(const float* p, int64_t lds, const KT* const* vrow,
                                               int64_t n, float* o) {
  constexpr int64_t D = NV * kVec;
  VReg acc[MQ][NV];
  for (int m = 0; m < MQ; ++m)
    for (int i = 0; i < NV; ++i) acc[m][i] = Vec(0.f);
  for (int64_t x = 0; x < n; ++x) {
    Vec v[NV];
    for (int i = 0; i < NV; ++i) v[i] = loadv(vrow[x] + i * kVec);
    for (int m = 0; m < MQ; ++m) {
      const Vec w(p[m * lds + x]);
      for (int i = 0; i < NV; ++i) acc[m][i] = at::vec::fmadd(w, v[i], Vec(acc[m][i]));
    }
  }
  for (int m = 0; m < MQ; ++m)
    for (int i = 0; i < NV; ++i) Vec(acc[m][i]).store(o + m * D + i * kVec);
}

// The softmax weights of one pair over its group's keys [0, n) of s (vectors aligned to
// absolute positions): exp((s - max) * scale) for its own keys [f, c), 0 for the rest;
// returns 1 / sum. (scale > 0: scores not yet scaled; 1, exact, where they are.)
// Only the vectors that straddle f or c take a lane mask.
inline float prefill_softmax(float* s, int64_t n, int64_t f, int64_t c, float scale = 1.f) {
  const Vec ninf(-std::numeric_limits<float>::infinity()), zero(0.f);
  const Vec lanes = Vec::arange(0.f, 1.f);
  const Vec lo(static_cast<float>(f)), hi(static_cast<float>(c));
  auto mine = [&](int64_t x) {  // lanes whose key is the pair's own
    const Vec at = lanes + Vec(static_cast<float>(x));
    return (at >= lo) & (at < hi);
  };
  const int64_t f0 = f / kVec * kVec;
  Vec mx = ninf;
  for (int64_t x = f0; x < c; x += kVec) {
    const Vec v = Vec::loadu(s + x);
    mx = at::vec::maximum(mx, x < f || x + kVec > c ? Vec::blendv(ninf, v, mine(x)) : v);
  }
  const Vec m(at::vec::vec_reduce_all<float>(
      [](const Vec& a, const Vec& b) { return at::vec::maximum(a, b); }, mx));
  Vec sum = zero;
  for (int64_t x = 0; x < n; x += kVec) {
    if (x + kVec <= f0 || x >= c) {
      zero.store(s + x);
      continue;
    }
    Vec e = ((Vec::loadu(s + x) - m) * Vec(scale)).exp_u20();
    if (x < f || x + kVec > c) e = Vec::blendv(zero, e, mine(x));
    e.store(s + x);
    sum = sum + e;
  }
  return 1.f / at::vec::vec_reduce_all<float>([](const Vec& a, const Vec& b) { return a + b; },
                                             sum);
}

// A prefill_attention call's tiles: runs of up to tile_rows rows of one sequence (as many as
// keep a tile's scores within kPrefillScores floats), their starts (then T), each tile's keys
// [lo, hi) (the union of its rows'; empty: lo >= hi), and the most keys any tile spans in
// whole units of `align` aligned to absolute positions (the buffers' size).
struct PrefillPlan {
  int64_t tile_rows, width;
  std::vector<int64_t> start, lo, hi;
  int64_t tiles() const { return static_cast<int64_t>(start.size()) - 1; }
};

PrefillPlan prefill_plan(const RowKeys& keys, int64_t T, int64_t G, int64_t align) {
  const auto up = [&](int64_t x) { return (x + align - 1) / align * align; };
  int64_t widest = 1;  // the most keys a row's range spans
  for (int64_t t = 0; t < T; ++t)
    widest = std::max(widest, up(keys.lp[t]) - keys.first(t) / align * align);
  PrefillPlan plan;
  plan.tile_rows = std::clamp<int64_t>(kPrefillScores / (G * (widest + align)), 1, kPrefillRows);
  plan.start = keys.tiles(T, plan.tile_rows);
  plan.width = align;
  for (int64_t i = 0; i < plan.tiles(); ++i) {
    int64_t lo = std::numeric_limits<int64_t>::max(), hi = 0;
    for (int64_t t = plan.start[i]; t < plan.start[i + 1]; ++t)
      if (keys.first(t) < keys.lp[t])
        lo = std::min(lo, keys.first(t)), hi = std::max(hi, keys.lp[t]);
    plan.lo.push_back(lo);
    plan.hi.push_back(hi);
    if (lo < hi) plan.width = std::max(plan.width, up(hi) - lo / align * align);
  }
  return plan;
}

// prefill_attention's outputs of pairs [p0, p1) of a tile from row t0 (G heads a row, KV head
// hk): o's rows (D floats each, from pair p0) times inv; inv nullptr: zeros (no keys).
template <typename T>
void store_pairs(T* out, int64_t H, int64_t D, int64_t G, int64_t hk, int64_t t0, int64_t p0,
                 int64_t p1, const float* o, const float* inv) {
  for (int64_t p = p0; p < p1; ++p) {
    T* dst = out + ((t0 + p / G) * H + hk * G + p % G) * D;
    for (int64_t d = 0; d < D; ++d)
      dst[d] = inv ? from_f<T>(o[(p - p0) * D + d] * inv[p - p0]) : T(0.f);
  }
}

// False (nothing computed) for a head size the register blocks do not take.
template <typename T>
bool prefill_attention_impl(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
                            const at::Tensor& tables, const at::Tensor& token_seq,
                            const at::Tensor& lens, double scale, int64_t window,
                            at::Tensor& out) {
  const int64_t T_ = q.size(0), H = q.size(1), D = q.size(2), qs = q.stride(0);
  const int64_t hkv = kc.size(2), G = H / hkv, bs = kc.size(1), max_blocks = tables.size(1);
  const T* qp = q.data_ptr<T>();
  const T* kp = kc.data_ptr<T>();
  const T* vp = vc.data_ptr<T>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* sp = token_seq.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const float sc = static_cast<float>(scale);
  const RowKeys keys{sp, lp, window};
  const PrefillPlan plan = prefill_plan(keys, T_, G, kVec);
  const int64_t tile_rows = plan.tile_rows, ntiles = plan.tiles(), width = plan.width;
  const std::vector<int64_t>&tile_start = plan.start, &tile_lo = plan.lo, &tile_hi = plan.hi;
  std::atomic<int64_t> next{0};
  const int64_t threads = std::max(1, at::get_num_threads());
  const std::vector<T> zeros(D, T(0.f));  // the value row of a key past the tile's last
  return scores_and_values(D, [&](auto nv) {
    constexpr int NV = decltype(nv)::value;
    constexpr int MQ = std::clamp(kPrefillAcc / NV, 1, 6);  // pairs a value block holds
    constexpr int SQ = kPrefillAcc / 4;                     // pairs a score block holds
    at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
      std::vector<float> qf(tile_rows * G * D), kt(D * (width + kVec)),
          s(tile_rows * G * (width + kVec)), o(MQ * D), rowbuf(kVec * D);
      std::vector<const T*> vrow(width);
      for (int64_t item; (item = next.fetch_add(1, std::memory_order_relaxed)) < ntiles * hkv;) {
        const int64_t tile = item / hkv, hk = item % hkv;
        const int64_t t0 = tile_start[tile], rows = tile_start[tile + 1] - t0;
        const int64_t lo = tile_lo[tile], hi = tile_hi[tile];  // the rows' union of keys
        if (lo >= hi) {  // no keys (contexts of 0): zeros
          store_pairs(op, H, D, G, hk, t0, 0, rows * G, nullptr, nullptr);
          continue;
        }
        const int64_t x0 = lo / kVec * kVec, n = (hi + kVec - 1) / kVec * kVec - x0;
        const int64_t ldt = n % 256 == 0 ? n + kVec : n;  // rows 1 KiB apart alias in L1
        const int64_t* table = tp + sp[t0] * max_blocks;
        auto row_of = [&](const T* c, int64_t pos) {
          return c + ((table[pos / bs] * bs + pos % bs) * hkv + hk) * D;
        };
        // The keys, transposed kVec at a time through rowbuf; values' rows in place.
        for (int64_t xb = 0; xb < n; xb += kVec) {
          for (int64_t i = 0; i < kVec; ++i) {
            const int64_t pos = x0 + xb + i;
            const bool have = pos >= lo && pos < hi;
            float* dst = rowbuf.data() + i * D;
            if (have) {
              const T* src = row_of(kp, pos);
              for (int64_t d = 0; d < D; d += kVec) loadv(src + d).store(dst + d);
            } else {
              std::fill_n(dst, D, 0.f);
            }
            vrow[xb + i] = have ? row_of(vp, pos) : zeros.data();
          }
#if defined(CPU_CAPABILITY_AVX512)
          for (int64_t d0 = 0; d0 < D; d0 += 16)
            transpose16(rowbuf.data() + d0, D, kt.data() + d0 * ldt + xb, ldt);
#else
          for (int64_t d = 0; d < D; ++d)
            for (int64_t i = 0; i < kVec; ++i) kt[d * ldt + xb + i] = rowbuf[i * D + d];
#endif
        }
        const int64_t pairs = rows * G, lds = ldt;
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t g = 0; g < G; ++g)
            for (int64_t d = 0; d < D; ++d)
              qf[(r * G + g) * D + d] = to_f(qp[(t0 + r) * qs + (hk * G + g) * D + d]) * sc;
        // A group of pairs: its keys [a, b) of the buffer (whole vectors).
        auto range_of = [&](int64_t p0, int64_t p1) {
          return keys.pair_keys(t0, G, p0, p1, kVec, x0, n);
        };
        for (int64_t p0 = 0; p0 < pairs; p0 += SQ) {
          const int64_t p1 = std::min(pairs, p0 + SQ);
          const auto [a, b] = range_of(p0, p1);
          for (int64_t x = a; x < b;) {
            const int64_t kn = std::min<int64_t>(4, (b - x) / kVec);
            with_heads<SQ>(p1 - p0, [&](auto mq) {
              with_heads<4>(kn, [&](auto k) {
                prefill_scores<NV, decltype(mq)::value, decltype(k)::value>(
                    qf.data() + p0 * D, kt.data() + x, ldt, s.data() + p0 * lds + x, lds);
              });
            });
            x += kn * kVec;
          }
        }
        for (int64_t p0 = 0; p0 < pairs; p0 += MQ) {
          const int64_t p1 = std::min(pairs, p0 + MQ);
          const auto [a, b] = range_of(p0, p1);
          float inv[MQ];
          for (int64_t p = p0; p < p1; ++p) {
            const int64_t t = t0 + p / G, f = keys.first(t);
            if (f >= lp[t]) {
              inv[p - p0] = 0.f;
              std::fill_n(s.data() + p * lds + a, b - a, 0.f);
              continue;
            }
            inv[p - p0] = prefill_softmax(s.data() + p * lds + a, b - a, f - x0 - a, lp[t] - x0 - a);
          }
          with_heads<MQ>(p1 - p0, [&](auto mq) {
            prefill_values<NV, decltype(mq)::value>(s.data() + p0 * lds + a, lds,
                                                    vrow.data() + a, b - a, o.data());
          });
          store_pairs(op, H, D, G, hk, t0, p0, p1, o.data(), inv);
        }
      }
    });
  });
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
bool amx_prefill_attention(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
                           const at::Tensor& tables, const at::Tensor& token_seq,
                           const at::Tensor& lens, double scale, int64_t window, at::Tensor& out);
#endif

// amx: the bf16 products on AMX's tiles where the build and process have them (false: the
// vector kernel, for the tests).
at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const at::Tensor& block_tables,
                             const at::Tensor& token_seq, const at::Tensor& context_lens,
                             double scale, int64_t window, bool amx) {
  check_paged_attention(q, k_cache, v_cache, c10::nullopt, c10::nullopt, block_tables, token_seq,
                        context_lens, 0);
  auto out = at::empty(q.sizes(), q.options());
  if (q.size(0) == 0) return out;
  bool done = false;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  done = amx && amx_prefill_attention(q, k_cache, v_cache, block_tables, token_seq, context_lens,
                                      scale, window, out);
  if (done) return out;
#endif
  SL_DISPATCH(q.scalar_type(), "prefill_attention", [&] {
    done = prefill_attention_impl<scalar_t>(q, k_cache, v_cache, block_tables, token_seq,
                                            context_lens, scale, window, out);
  });
  if (done) return out;
  return paged_attention(q, k_cache, v_cache, c10::nullopt, c10::nullopt, block_tables,
                         token_seq, context_lens, scale, window, 0);
}

// ---- small-batch linear over oneDNN's packed weight -------------------------------------
// A decode step at batch 1-4 is a chain of GEMVs bound by how fast the weights stream from
// memory; oneDNN's matmul read them at 0.43-0.81 of a plain torch.sum's rate on the VMs here,
// this loop at 0.79-0.98 (benchmarks/gemv_share.py, docs/benchmarks.md). Up to 64 rows
// (batched decode) it also beats oneDNN's matmul on AVX-512 (packed_linear_max_rows; above
// that oneDNN's blocking catches up, so the caller keeps oneDNN there). It reads the weight
// oneDNN reordered at load time, in place, so the model keeps one copy: the caller
// (layers/linear.py) checks the layout exactly once per layer and passes the buffer's address.
// Layouts read here, with N a multiple of 64:
//   fp32: (N / 64, K, 64)          w[n, k] at ((n / 64) * K + k) * 64 + n % 64
//   bf16: (N / 64, K / 2, 64, 2)   w[n, k] at (((n / 64) * K + k - k % 2) * 64 + n % 64 * 2 + k % 2)
//   bf16 where oneDNN runs AMX (Intel Xeon 4th gen on): (N / 32, K / 2, 32, 2), blocks of 32
//         columns. A task still takes 64 columns, as two streams of 32 (Tile::half: the second
//         32 columns' offset); its address comes tagged (kLayout32, the low bit), and
//         where up to 16 rows run AMX's tiles (amx_gemv) tagged kAmx too (the next bit).
// One 64-row block per task: its K * 64 weights are one sequential stream, and every x value
// is broadcast against 64 outputs (4 AVX-512 accumulators per batch row; AVX2 below). oneDNN
// packs fp32 weights in the same (N / 64, K, 64) blocks on AVX2 as on AVX-512 (checked per
// layer all the same).
//
// A tile is noinline on purpose: inlined into packed_gemm's loop, GCC 12 kept the 2-5 row
// tiles' accumulators on the stack (a load and a store around every FMA): the bf16 step at 4
// rows ran at 0.83x of oneDNN that way, 1.16-1.24x now.

// What one row tile computes: M rows of x (row stride k) against one 64-column block of
// weights wb, over the K steps [i0, i1). Its accumulators start at zero (i0 == 0) or from
// `part` (the rows' fp32 sums over the K chunks before, M * 64 floats) and are stored back
// there, unless i1 == k: then the rows' outputs (+ bias) go to y.
template <typename T>
struct Tile {
  const T* x;
  const T* wb;
  const T* bias;
  T* y;
  int64_t n, k, col, i0, i1;
  float* part;
  const char* pf;  // Fetch > 0: the lines this tile prefetches, Fetch of them per K step
  // bf16 only: elements a K step takes in a block's stream (64 x 2 / 2: 64; 32-column blocks:
  // 32) and where columns 32-63 start from columns 0-31 (64; 32-column blocks: 32 * K);
  // the next chunk's lines past pf_split are at pf_b (32-column blocks: the second stream).
  int64_t step = 64, half = 64;
  const char* pf_b = nullptr;
  int64_t pf_split = std::numeric_limits<int64_t>::max();
  int64_t ldp = 64;  // part's row stride (floats): a block's 64, or y's n (blocked_gemm)
};
constexpr int64_t kLayout32 = 1;  // tags a weight address whose bf16 blocks are 32 columns
constexpr int64_t kAmx = 2;  // tags one (32-column blocks) whose GEMV runs AMX's tiles

// A bf16 GEMV's outputs for m rows of one 64-column block at col: sums (fp32, row stride ld)
// + bias in fp32, one rounding to bf16, into y (row stride n).
inline void store_bf16_outputs(const float* sums, int64_t ld, int64_t m,
                               const c10::BFloat16* bias, int64_t col, c10::BFloat16* y,
                               int64_t n) {
  for (int64_t r = 0; r < m; ++r)
    for (int64_t j = 0; j < 64; ++j) {
      float v = sums[r * ld + j];
      if (bias) v += static_cast<float>(bias[col + j]);
      y[r * n + col + j] = static_cast<c10::BFloat16>(v);
    }
}

// A tile's software prefetch into L2 (the Fetch template argument): kAhead, kPrefetch elements
// ahead of its own weights (a block's only tile, which streams them from memory once); n > 0,
// n lines of Tile::pf per K step (its share of the next K chunk, see packed_gemm); 0, none.
constexpr int kAhead = -1;

#if defined(__AVX512F__)
constexpr int64_t kPackBlock = 64;
// Software prefetch 16 KiB ahead into L2 (T1). Into L1 (T0) at 8 KiB it cost a third of the
// rate on a Zen 4 VM: the step's 49 GEMVs read at 0.74 of a torch.sum against 0.98 with T1 at
// 16 or 32 KiB (T2 the same, no prefetch 0.88; docs/benchmarks.md, 2026-12-04 fourth session).
constexpr int64_t kPrefetch = 4096;  // floats ahead
constexpr auto kPrefetchHint = _MM_HINT_T1;
constexpr bool kChunkedTiles = true;

template <int M>
inline void start_acc(__m512 (&acc)[M][4], const float* part, int64_t ldp) {
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < 4; ++v)
      acc[m][v] = part ? _mm512_loadu_ps(part + m * ldp + 16 * v) : _mm512_setzero_ps();
}

template <int M>
inline void keep_acc(const __m512 (&acc)[M][4], float* part, int64_t ldp) {
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < 4; ++v) _mm512_storeu_ps(part + m * ldp + 16 * v, acc[m][v]);
}

// One K step i of an fp32 tile (below): the block's four weight vectors of the step loaded
// once into registers and broadcast-multiplied by each of the M rows.
template <int M, int Fetch>
__attribute__((always_inline)) inline void gemv_step(__m512 (&acc)[M][4], const float* x,
                                                     int64_t k, const float* wb, const char* pf,
                                                     int64_t i, int64_t i0) {
  const float* wr = wb + i * kPackBlock;
  if constexpr (Fetch == kAhead) {
    _mm_prefetch(reinterpret_cast<const char*>(wr + kPrefetch), kPrefetchHint);
    _mm_prefetch(reinterpret_cast<const char*>(wr + kPrefetch + 32), kPrefetchHint);
  }
  for (int l = 0; l < Fetch; ++l) _mm_prefetch(pf + ((i - i0) * Fetch + l) * 64, kPrefetchHint);
  __m512 wv[4];
  for (int v = 0; v < 4; ++v) {
    wv[v] = _mm512_loadu_ps(wr + 16 * v);
    asm("" : "+v"(wv[v]));  // kept in a register: GCC 12 folds a load into each row's FMA
  }
  for (int m = 0; m < M; ++m) {
    __m512 xv = _mm512_set1_ps(x[m * k + i]);
    for (int v = 0; v < 4; ++v) acc[m][v] = _mm512_fmadd_ps(xv, wv[v], acc[m][v]);
  }
}

// A pass over a 64-column block's K steps [i0, i1) for M <= kRowTile rows: M * 4 accumulators.
// A tile that prefetches nothing (blocked_gemm's, and the GEMV's past the first four of a
// chunk) runs its K loop unrolled by 4: a step's 24 FMAs are 12 cycles of the two FMA ports,
// and the loop's own counter, compare and pointer updates took FMA slots between them
// (blocked_gemm at 4096 rows 293-308 -> 310-329 GFLOP/s on an Intel Xeon with AMX, 2
// threads, oneDNN's matmul 291-317 alongside; the GEMV at 1-256 rows level within the noise;
// by 8: no better, and the prefetching tiles of 1-16 rows measured no faster unrolled).
template <int M, int Fetch>
__attribute__((noinline)) void gemv_tile(const Tile<float>& a) {
  const float* x = a.x;
  const float* wb = a.wb;
  const char* pf = a.pf;
  const int64_t k = a.k, i0 = a.i0, i1 = a.i1;
  __m512 acc[M][4];
  start_acc<M>(acc, i0 == 0 ? nullptr : a.part, a.ldp);
  if constexpr (Fetch == 0) {
#pragma GCC unroll 4
    for (int64_t i = i0; i < i1; ++i) gemv_step<M, Fetch>(acc, x, k, wb, pf, i, i0);
  } else {
    for (int64_t i = i0; i < i1; ++i) gemv_step<M, Fetch>(acc, x, k, wb, pf, i, i0);
  }
  if (i1 < k) return keep_acc<M>(acc, a.part, a.ldp);
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < 4; ++v) {
      __m512 r = acc[m][v];
      if (a.bias) r = _mm512_add_ps(r, _mm512_loadu_ps(a.bias + a.col + 16 * v));
      _mm512_storeu_ps(a.y + m * a.n + a.col + 16 * v, r);
    }
}

#if defined(__AVX512BF16__)
constexpr bool kPackedBf16 = true;
// bf16 pairs (k, k+1) per output: vdpbf16ps multiplies them exactly and accumulates in fp32,
// as oneDNN's own bf16 matmul does on this ISA; bias in fp32, one rounding to bf16 at the end.
// A K step is a pair: 64 columns * 2 * 2 bytes, four lines, as an fp32 step.
template <int M, int Fetch>
__attribute__((noinline)) void gemv_tile(const Tile<c10::BFloat16>& a) {
  const c10::BFloat16* x = a.x;
  const c10::BFloat16* wb = a.wb;
  const char* pf = a.pf;
  const int64_t k = a.k, i0 = a.i0, i1 = a.i1;
  __m512 acc[M][4];
  start_acc<M>(acc, i0 == 0 ? nullptr : a.part, a.ldp);
  const int64_t step = a.step, half = a.half;
  for (int64_t i = i0; i < i1; i += 2) {
    const c10::BFloat16* wr = wb + i * step;  // columns 0-31; 32-63 at wr + half
    if constexpr (Fetch == kAhead) {
      // the same distance ahead in K steps for either layout: 2 lines of a 64-column step's
      // 4, or 1 of each 32-column stream's 2
      const int64_t ahead = 2 * kPrefetch * step / kPackBlock;
      const int64_t second = half == kPackBlock ? 64 : half;  // the next line, or stream
      _mm_prefetch(reinterpret_cast<const char*>(wr + ahead), kPrefetchHint);
      _mm_prefetch(reinterpret_cast<const char*>(wr + ahead + second), kPrefetchHint);
    }
    for (int l = 0; l < Fetch; ++l) {
      const int64_t line = (i - i0) / 2 * Fetch + l;
      _mm_prefetch(line < a.pf_split ? pf + line * 64 : a.pf_b + (line - a.pf_split) * 64,
                   kPrefetchHint);
    }
    __m512 wv[4];
    for (int v = 0; v < 4; ++v) {
      wv[v] = _mm512_loadu_ps(reinterpret_cast<const float*>(wr + 32 * (v % 2) + half * (v / 2)));
      asm("" : "+v"(wv[v]));  // as in the fp32 tile: one load per weight vector, not per row
    }
    for (int m = 0; m < M; ++m) {
      float pair;  // the bf16 pair (k, k + 1) of row m, broadcast as one 32-bit lane
      std::memcpy(&pair, x + m * k + i, sizeof(pair));
      const __m512bh xv = (__m512bh)_mm512_set1_ps(pair);
      for (int v = 0; v < 4; ++v) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], (__m512bh)wv[v], xv);
    }
  }
  if (i1 < k) return keep_acc<M>(acc, a.part, a.ldp);
  float buf[M * kPackBlock];
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < 4; ++v) _mm512_storeu_ps(buf + m * kPackBlock + 16 * v, acc[m][v]);
  store_bf16_outputs(buf, kPackBlock, M, a.bias, a.col, a.y, a.n);
}
#else
constexpr bool kPackedBf16 = false;
#endif
#elif defined(__AVX2__)
// AVX2 (16 vector registers): a pass covers V of the block's eight 8-wide column vectors for
// all M rows (M * V accumulators, the weights read as FMA memory operands); more rows take
// more passes over the block, whose K * 64 weights are still in L2 for the passes after the
// first. Its tiles take the whole of K (no chunks).
constexpr int64_t kPackBlock = 64;
constexpr int64_t kPrefetch = 2048;
constexpr bool kPackedBf16 = false;
constexpr bool kChunkedTiles = false;

template <int M, int Fetch>
__attribute__((noinline)) void gemv_tile(const Tile<float>& a) {
  const float* x = a.x;
  const float* wb = a.wb;
  const int64_t k = a.k;
  constexpr int V = M == 1 ? 8 : (M <= 3 ? 4 : 2);
  for (int64_t c0 = 0; c0 < kPackBlock; c0 += 8 * V) {
    __m256 acc[M][V];
    for (int m = 0; m < M; ++m)
      for (int v = 0; v < V; ++v) acc[m][v] = _mm256_setzero_ps();
    for (int64_t i = 0; i < k; ++i) {
      const float* wr = wb + i * kPackBlock + c0;
      if (Fetch == kAhead && c0 == 0) {
        _mm_prefetch(reinterpret_cast<const char*>(wr + kPrefetch), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(wr + kPrefetch + 32), _MM_HINT_T0);
      }
      for (int m = 0; m < M; ++m) {
        const __m256 xv = _mm256_broadcast_ss(x + m * k + i);
        for (int v = 0; v < V; ++v)
          acc[m][v] = _mm256_fmadd_ps(xv, _mm256_loadu_ps(wr + 8 * v), acc[m][v]);
      }
    }
    for (int m = 0; m < M; ++m)
      for (int v = 0; v < V; ++v) {
        const int64_t c = a.col + c0 + 8 * v;
        __m256 r = acc[m][v];
        if (a.bias) r = _mm256_add_ps(r, _mm256_loadu_ps(a.bias + c));
        _mm256_storeu_ps(a.y + m * a.n + c, r);
      }
  }
}
#endif  // __AVX512F__ / __AVX2__

#if defined(__AVX512F__)
constexpr int kRowTile = 6;  // 24 accumulators + 4 weight vectors of AVX-512's 32 registers
#else
constexpr int kRowTile = 4;
#endif

// Calls f(std::integral_constant<int, m>) for m in 1..kRowTile (a tile's row count is a
// template parameter: its accumulators live in registers).
template <typename F>
void by_rows(int64_t m, F&& f) {
  switch (m) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    default:
      if constexpr (kRowTile >= 6) {
        if (m == 5) f(std::integral_constant<int, 5>{});
        else f(std::integral_constant<int, 6>{});
      }
  }
}

#if defined(__AVX512F__) || defined(__AVX2__)
// y (m, n) = x (m, k) @ W^T (+ bias). One 64-column block per task. The m rows are split into
// the fewest tiles of at most kRowTile, as even as they go (8 rows: 4 + 4, 16: 6 + 5 + 5).
//
// One row: the block's K * 64 weights are one sequential stream from memory, prefetched
// ahead of itself. More rows (AVX-512): the block goes in K chunks of kChunkBytes, each tile
// in turn over a chunk (the first from memory, the rest from L1 / L2), and while they
// compute, they prefetch the next chunk (the rest of the block, or the next block's first),
// each tile its share of its lines at an even rate. Without that the weights streamed only
// during the first tile and the FMAs of the others waited on nothing but themselves: the
// memory stood idle for 10 of 16 rows' compute. (49 linears of a decode step at 16 rows on a
// Zen 4 VM: 20.5-23.0 -> 17.4-18.1 ms; 24 and 32 rows now also ahead of oneDNN's matmul.)
// A lone tile of 2-6 rows goes in chunks too, prefetching the whole next chunk: streaming
// ahead of itself it fell behind the memory as its FMAs grew (fp32 on an Intel Xeon with AMX,
// 2 threads: 1 / 4 / 6 rows 17.3 / 21.1 / 23.1 ms, now 4 and 6 rows 17.6-18.4; bf16 at 2 and
// 4 rows 11.0 / 12.9 -> 8.9 / 10.3).
//
// kChunkBytes: 32 KiB (128 fp32 steps), within L1, so the tiles after the first read it from
// there. On the AMX Xeon, 16 / 32 rows 26.1-27.4 / 34.5-36.5 ms at 96 KiB, 21.0-23.1 /
// 30.9-32.2 at 32 KiB; on the Zen 4 VM 32 KiB and 96 KiB measured level (17.8 / 17.4-18.1 ms).
//
// Each output is the same K-ordered chain of FMAs whatever m is (a chunk's sums wait in
// `part` in fp32, exactly), so a row's result does not depend on the rows batched with it.
constexpr int64_t kChunkBytes = 32 * 1024;

// Tile t's share of the next K chunk's 4 * steps lines, as (lines a K step, first line): a
// lone tile, all 4; 2 tiles, 2 lines a step each; 3, the first 2 and the others 1; 4 or more,
// the first four 1.
inline std::pair<int, int64_t> next_chunk_share(int64_t tiles, int64_t t, int64_t steps) {
  if (tiles == 1) return {4, 0};
  if (tiles == 2) return {2, 2 * t * steps};
  if (tiles == 3 && t == 0) return {2, 0};
  if (tiles == 3) return {1, (t + 1) * steps};
  if (t < 4) return {1, t * steps};
  return {0, 0};
}

// Runs body(claim) once on each of up to `threads` pool threads (fewer for a short range);
// claim(b0, b1) hands out the next chunk [b0, b1) of [0, n), false once none is left. Chunks
// shrink as the range drains (guided: a share of what is left, at least 1), so the threads
// end within about one item of each other. A static split of a memory-bound GEMV's blocks
// left each of 2 threads waiting ~10% of a decode step at the regions' end barriers (each
// got the same bytes, not the same share of the memory's rate); the chunk a thread takes
// is still consecutive blocks, and an item's result does not depend on the thread.
template <typename F>
void parallel_claims(int64_t n, F&& body) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  if (threads <= 1 || at::in_parallel_region()) {
    bool given = false;
    body([&](int64_t& b0, int64_t& b1) {
      if (given || n <= 0) return false;
      given = true, b0 = 0, b1 = n;
      return true;
    });
    return;
  }
  std::atomic<int64_t> next{0};
  const auto claim = [&](int64_t& b0, int64_t& b1) {
    int64_t cur = next.load(std::memory_order_relaxed), take;
    do {
      if (cur >= n) return false;
      take = std::max<int64_t>(1, (n - cur) / (2 * threads));
    } while (!next.compare_exchange_weak(cur, cur + take, std::memory_order_relaxed));
    b0 = cur, b1 = cur + take;
    return true;
  };
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) { body(claim); });
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// ---- bf16 in AMX's 32-column blocks, through AMX's tiles -----------------------------------
// oneDNN's AMX matmul costs about the same from 1 to 16 rows but streamed a decode step's
// weights at ~60% of the memory's rate, and the vector GEMV above runs out of dot-product
// throughput past ~6 rows (vdpbf16ps issues at a quarter of an FMA's rate there: 1.6 against
// 6.5 G instructions/s a core). Here up to 16 rows are one A tile (x's rows, 32 K values
// each); each 32-column stream is two B tiles (16 K pairs x 16 columns x 2, read in place:
// its rows of 32 pairs at a 128-byte stride), and a 64-column block's four C tiles (m x 16
// fp32) sum over the whole of K. With 16 x 16 x 32 products an instruction the loop is bound
// by the weights' stream alone. The hardware prefetcher keeps up with the two sequential
// streams; software prefetches as the vector GEMV's (32 lines of each stream a K step)
// made it slower (151 MB: 7.3-8.2 ms without, 8.8-9.8 with, on 2 threads). A row's result does
// not depend on the rows beside it (each C row is its A row's own sums); its sums round in
// the tile unit's order, which differs from vdpbf16ps's in ~1 output of 2,000 by one bf16 ulp.
constexpr int64_t kAmxRows = 16;  // an A tile's rows
constexpr int64_t kAmxK = 32;     // an A tile's K values (64 bytes a row)

// Whether this process may use the tile registers: Linux grants them on request, once per
// process (oneDNN asks as well); asked here once. Without them the vector GEMV runs.
bool amx_ready() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};  // bytes a row
  uint8_t rows[16] = {};
};

// ldtilecfg with the whole 64-byte configuration as its operand. GCC 12's _tile_loadconfig
// tells the optimiser it reads the first 8 bytes only (`"m" (*(const void **)config)`), so
// the stores of the rows and widths before it are dead to GCC and may be dropped: a
// configuration filled through a lambda faulted at ldtilecfg with only its palette written
// (docs/benchmarks.md, nineteenth session). Every tile configuration loads through here.
inline void load_tile_config(const TileConfig& cfg) {
  asm volatile("ldtilecfg %0" : : "m"(cfg));
}

// y (m, n) = x (m, k) @ W^T (+ bias), m <= kAmxRows, k % kAmxK == 0, W in 32-column blocks.
// Tiles: 0 A, 1-2 B, 3-6 C.
void amx_gemv(const c10::BFloat16* x, const c10::BFloat16* w, const c10::BFloat16* bias,
              c10::BFloat16* y, int64_t m, int64_t n, int64_t k) {
  parallel_claims(n / kPackBlock, [&](auto&& claim) {
    TileConfig cfg;
    cfg.rows[0] = static_cast<uint8_t>(m);
    cfg.colsb[0] = kAmxK * 2;
    for (int t = 1; t <= 2; ++t) {
      cfg.rows[t] = kAmxK / 2;
      cfg.colsb[t] = 64;
    }
    for (int t = 3; t <= 6; ++t) {
      cfg.rows[t] = static_cast<uint8_t>(m);
      cfg.colsb[t] = 64;
    }
    load_tile_config(cfg);
    alignas(64) float buf[kAmxRows * kPackBlock];
    for (int64_t b0, b1; claim(b0, b1);) {
      for (int64_t b = b0; b < b1; ++b) {
        const c10::BFloat16* s0 = w + b * k * kPackBlock;  // columns 0-31: (K / 2, 32, 2)
        const c10::BFloat16* s1 = s0 + 32 * k;             // columns 32-63
        _tile_zero(3);
        _tile_zero(4);
        _tile_zero(5);
        _tile_zero(6);
        for (int64_t i = 0; i < k; i += kAmxK) {
          const int64_t off = i * 32;  // K pair i / 2's row of 32 pairs
          _tile_loadd(0, x + i, k * 2);
          _tile_loadd(1, s0 + off, 128);
          _tile_dpbf16ps(3, 0, 1);
          _tile_loadd(2, s0 + off + 32, 128);
          _tile_dpbf16ps(4, 0, 2);
          _tile_loadd(1, s1 + off, 128);
          _tile_dpbf16ps(5, 0, 1);
          _tile_loadd(2, s1 + off + 32, 128);
          _tile_dpbf16ps(6, 0, 2);
        }
        _tile_stored(3, buf, kPackBlock * 4);
        _tile_stored(4, buf + 16, kPackBlock * 4);
        _tile_stored(5, buf + 32, kPackBlock * 4);
        _tile_stored(6, buf + 48, kPackBlock * 4);
        store_bf16_outputs(buf, kPackBlock, m, bias, b * kPackBlock, y, n);
      }
    }
    _tile_release();
  });
}

// ---- bf16 prefill attention on AMX's tiles ------------------------------------------------
// prefill_attention's work for a bf16 cache where the process has AMX (head_dim a multiple of
// 32): the same tiles, items and softmax, with the two products on the tile unit, as
// oneDNN's SDPA runs them there. Scores: C (16 (row, head) pairs x 16 keys, fp32) = A (the
// pairs' q, 32 dims a tile) x B (16 dim pairs x 16 keys: the keys' rows transposed as 32-bit
// pairs); the scale goes on the fp32 scores. Outputs: C (16 pairs x 16 dims) = A (the
// weights rounded to bf16, 32 keys) x B (16 key pairs x 16 dims: two keys' rows interleaved),
// summed over the keys in blocks of 32 aligned to absolute positions. As in the vector
// kernel, a row's bits do not depend on the rows beside it (each C row is its A row's; zero
// weights add exact zeros). (12 layers of 12 query / 4 KV heads of 64, 2 threads of an Intel
// Xeon with AMX, against SDPA's bf16 on the same tiles: 16 prompts of 256 tokens 73 / 76 ms,
// 8 x 512 123 / 129, 4 x 1k 220 / 201, 2 x 2k 481 / 324; the vector kernel's 16 x 256: 128.
// In the engine SDPA also gathers the blocks: W1's bf16 first token 0.495 -> 0.46 s.)
bool amx_prefill_attention(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
                           const at::Tensor& tables, const at::Tensor& token_seq,
                           const at::Tensor& lens, double scale, int64_t window,
                           at::Tensor& out) {
  using T = c10::BFloat16;
  const int64_t T_ = q.size(0), H = q.size(1), D = q.size(2), qs = q.stride(0);
  if (q.scalar_type() != at::kBFloat16 || D % 32 != 0 || D > 256 || !amx_ready()) return false;
  const int64_t hkv = kc.size(2), G = H / hkv, bs = kc.size(1), max_blocks = tables.size(1);
  const T* qp = q.data_ptr<T>();
  const T* kp = kc.data_ptr<T>();
  const T* vp = vc.data_ptr<T>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const RowKeys keys{token_seq.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), window};
  const int64_t* sp = keys.sp;
  const int64_t* lp = keys.lp;
  constexpr int64_t kKeys = 32;  // a weight tile's keys (and the alignment of every range)
  const PrefillPlan plan = prefill_plan(keys, T_, G, kKeys);
  const int64_t dp = D / 32, dv = D / 16;  // score tiles' dim blocks; output tiles' dim blocks
  const int64_t pairs_max = (plan.tile_rows * G + 15) / 16 * 16;
  const int64_t lds = plan.width + 16;  // a score row (floats) and a weight row (bf16)
  std::atomic<int64_t> next{0};
  const int64_t threads = std::max(1, at::get_num_threads());
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    TileConfig cfg;  // tiles of 16 rows x 64 bytes: 0-1 A / B of the scores, 2 C, 3-4 A / B of the values
    for (int t = 0; t < 5; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    load_tile_config(cfg);
    std::vector<T> qb(pairs_max * D), kb(plan.width * D), vb(plan.width * D), pb(pairs_max * lds),
        rowbuf(16 * D);
    std::vector<float> s(pairs_max * lds), ob(16 * D);
    const std::vector<T> zeros(D, T(0.f));
    for (int64_t item; (item = next.fetch_add(1, std::memory_order_relaxed)) < plan.tiles() * hkv;) {
      const int64_t tile = item / hkv, hk = item % hkv;
      const int64_t t0 = plan.start[tile], rows = plan.start[tile + 1] - t0;
      const int64_t lo = plan.lo[tile], hi = plan.hi[tile];
      if (lo >= hi) {
        store_pairs(op, H, D, G, hk, t0, 0, rows * G, nullptr, nullptr);
        continue;
      }
      const int64_t x0 = lo / kKeys * kKeys, n = (hi + kKeys - 1) / kKeys * kKeys - x0;
      const int64_t* table = tp + sp[t0] * max_blocks;
      auto row_of = [&](const T* c, int64_t pos) {
        return pos >= lo && pos < hi ? c + ((table[pos / bs] * bs + pos % bs) * hkv + hk) * D
                                     : zeros.data();
      };
      // K: 16 keys' rows at a time into rowbuf, transposed as 32-bit pairs into B tiles
      // (block of 16 keys x1, dim block j: 16 pairs x 16 keys).
      for (int64_t x1 = 0; x1 < n; x1 += 16) {
        for (int64_t i = 0; i < 16; ++i)
          std::memcpy(rowbuf.data() + i * D, row_of(kp, x0 + x1 + i), D * sizeof(T));
        for (int64_t j = 0; j < dp; ++j)
          transpose16(reinterpret_cast<const float*>(rowbuf.data()) + j * 16, D / 2,
                      reinterpret_cast<float*>(kb.data() + (x1 / 16 * dp + j) * 512), 16);
      }
      // V: two keys' rows interleaved into B tiles (block of 32 keys, dim block c: 16 key
      // pairs x 16 dims x 2).
      for (int64_t x1 = 0; x1 < n; x1 += kKeys)
        for (int64_t j = 0; j < 16; ++j) {
          const T* a = row_of(vp, x0 + x1 + 2 * j);
          const T* b = row_of(vp, x0 + x1 + 2 * j + 1);
          for (int64_t c = 0; c < dv; ++c) {
            const __m256i av = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + c * 16));
            const __m256i bv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + c * 16));
            const __m256i l = _mm256_unpacklo_epi16(av, bv), h = _mm256_unpackhi_epi16(av, bv);
            T* dst = vb.data() + ((x1 / kKeys * dv + c) * 16 + j) * 32;
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm256_permute2x128_si256(l, h, 0x20));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16),
                                _mm256_permute2x128_si256(l, h, 0x31));
          }
        }
      const int64_t pairs = rows * G;
      for (int64_t p = 0; p < (pairs + 15) / 16 * 16; ++p) {
        T* dst = qb.data() + p * D;
        if (p < pairs) std::memcpy(dst, qp + (t0 + p / G) * qs + (hk * G + p % G) * D, D * sizeof(T));
        else std::fill_n(dst, D, T(0.f));
      }
      for (int64_t p0 = 0; p0 < pairs; p0 += 16) {
        const int64_t p1 = std::min(pairs, p0 + 16);
        // the block's keys in the buffers, whole tiles of kKeys
        const auto [a, b] = keys.pair_keys(t0, G, p0, p1, kKeys, x0, n);
        float* sb = s.data() + p0 * lds;
        T* wb = pb.data() + p0 * lds;
        for (int64_t x = a; x < b; x += 16) {
          _tile_zero(2);
          for (int64_t j = 0; j < dp; ++j) {
            _tile_loadd(0, qb.data() + p0 * D + j * 32, D * 2);
            _tile_loadd(1, kb.data() + (x / 16 * dp + j) * 512, 64);
            _tile_dpbf16ps(2, 0, 1);
          }
          _tile_stored(2, sb + x, lds * 4);
        }
        float inv[16] = {};
        for (int64_t p = p0; p < p0 + 16; ++p) {
          float* sr = s.data() + p * lds + a;
          const int64_t t = t0 + p / G;
          if (p < p1 && keys.first(t) < lp[t])
            inv[p - p0] = prefill_softmax(sr, b - a, keys.first(t) - x0 - a, lp[t] - x0 - a,
                                          static_cast<float>(scale));
          else
            std::fill_n(sr, b - a, 0.f);
          T* wr = pb.data() + p * lds + a;
          for (int64_t x = 0; x < b - a; x += 32) store2(wr + x, Vec::loadu(sr + x), Vec::loadu(sr + x + 16));
        }
        for (int64_t c = 0; c < dv; ++c) {
          _tile_zero(2);
          for (int64_t x = a; x < b; x += kKeys) {
            _tile_loadd(3, wb + x, lds * 2);
            _tile_loadd(4, vb.data() + ((x / kKeys * dv + c) * 16) * 32, 64);
            _tile_dpbf16ps(2, 3, 4);
          }
          _tile_stored(2, ob.data() + c * 16, D * 4);
        }
        store_pairs(op, H, D, G, hk, t0, p0, p1, ob.data(), inv);
      }
    }
    _tile_release();
  });
  return true;
}
#endif

// kGemvRows: the most rows at which the GEMV (the loops above) measured ahead of oneDNN's
// matmul; the caller keeps oneDNN's above it, except for fp32 where blocked_gemm is built
// (AVX-512). There the GEMV still takes up to kBlockedRows rows: its tiles stream a block's
// next K chunk while they compute, where the blocked GEMM's groups wait for their weights
// to come from memory (a decode step's 48 linears, 2 threads of an Intel Xeon with AMX, GEMV
// / blocked: 50.7-53.5 / 68.3-70.3 ms at 64 rows, 62-79 / 79-80 at 80, 72-74 / 88-89 at 96,
// 120 / 128-131 at 160, 139-140 / 148-152 at 192, 185-192 / 187-189 at 256).
constexpr int64_t kGemvRows = 64;
constexpr int64_t kBlockedRows = 256;

#if defined(__AVX512F__)
// ---- fp32 at prefill sizes: the same row tiles, blocked for the caches ---------------------
// More than kBlockedRows rows (a prefill) is bound by the FMAs, not the memory: what counts
// is how often each operand comes from memory or L2 rather than L1. Threads claim groups of
// kGemmGroup 64-column blocks; a group walks K in passes of up to kGemmPass steps (its
// weights, 2 x 1024 x 64 floats, 512 KiB, stay in L2 across the pass), and each row tile
// in turn takes the group's blocks one after another: its x values come from memory or L2
// for the first block and from L1 for the other. The partial sums between passes wait in y
// itself (fp32, exact), so every output is the GEMV's chain of FMAs in K order: its bits do
// not depend on the row count or the path. Before a tile, the next tile's output lines are
// fetched for writing (each a row of its own, y's rows n floats apart).
// Measured on 2 threads of an Intel Xeon with AMX, a layer's four linears at 4096 rows with
// their operands in 2 MiB pages (platform.torch_huge_pages): 259-265 GFLOP/s, oneDNN's
// matmul 257-271, the GEMV loops above ~180-210; two copies of the 6 x 64 tile alone on data
// in L1 reach ~305, the FMA peak is 370. A 16 x 256 fp32 prefill of the bench model: 2.87
// against 2.97 s with oneDNN's matmul (medians of 8 alternating).
constexpr int64_t kGemmGroup = 2;
constexpr int64_t kGemmPass = 1024;
constexpr int64_t kGemmItems = 24;

void blocked_gemm(const float* x, const float* w, const float* bias, float* y, int64_t m,
                  int64_t n, int64_t k) {
  const int64_t blocks = n / kPackBlock, groups = (blocks + kGemmGroup - 1) / kGemmGroup;
  const int64_t tiles = (m + kRowTile - 1) / kRowTile;
  // Work items: a group's rows in `slabs` slabs of whole tiles, a group's slabs consecutive
  // (its weights stay in L2 from one to the next), at least kGemmItems of them a thread so
  // the threads end within a small item of each other.
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t slabs =
      std::clamp<int64_t>((kGemmItems * threads + groups - 1) / groups, 1, tiles);
  parallel_claims(groups * slabs, [&](auto&& claim) {
    for (int64_t e0, e1; claim(e0, e1);)
      for (int64_t e = e0; e < e1; ++e) {
        const int64_t g = e / slabs, s = e % slabs;
        const int64_t b0 = g * kGemmGroup, b1 = std::min(blocks, b0 + kGemmGroup);
        const int64_t t0 = tiles * s / slabs, t1 = tiles * (s + 1) / slabs;
        for (int64_t i0 = 0; i0 < k; i0 += kGemmPass) {
          const int64_t i1 = std::min(k, i0 + kGemmPass);
          int64_t r0 = m * t0 / tiles;  // tile t: rows [m * t / tiles, m * (t + 1) / tiles)
          for (int64_t t = t0; t < t1; ++t) {
            const int64_t rows = m * (t + 1) / tiles - r0;
            for (int64_t r = r0 + rows; r < std::min(m, r0 + 2 * rows); ++r)
              for (int64_t l = b0 * 4; l < b1 * 4; ++l)
                __builtin_prefetch(y + r * n + 16 * l, 1, 3);  // for writing, into L1
            for (int64_t b = b0; b < b1; ++b) {
              Tile<float> a{x + r0 * k, w + b * k * kPackBlock, bias, y + r0 * n, n, k,
                            b * kPackBlock, i0, i1, y + r0 * n + b * kPackBlock, nullptr};
              a.ldp = n;
              by_rows(rows, [&](auto r) { gemv_tile<decltype(r)::value, 0>(a); });
            }
            r0 += rows;
          }
        }
      }
  });
}
#endif

template <typename T>
void packed_gemm(const T* x, const T* w, const T* bias, T* y, int64_t m, int64_t n, int64_t k,
                 bool cols32, bool amx) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (amx && m <= kAmxRows) return amx_gemv(x, w, bias, y, m, n, k);
  }
#endif
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float>) {
    if (m > kBlockedRows) return blocked_gemm(x, w, bias, y, m, n, k);
  }
#endif
  const int64_t tiles = (m + kRowTile - 1) / kRowTile;
  const bool chunked = kChunkedTiles && m > 1;
  const int64_t kc = chunked ? kChunkBytes / (kPackBlock * int64_t(sizeof(T))) : k;
  const int64_t per_step = 4 / int64_t(sizeof(T));  // K elements a step takes (lines: 4)
  parallel_claims(n / kPackBlock, [&](auto&& claim) {
    std::vector<float> part(chunked ? m * kPackBlock : 0);
    for (int64_t b0, b1; claim(b0, b1);) {
      for (int64_t b = b0; b < b1; ++b) {
        for (int64_t i0 = 0; i0 < k; i0 += kc) {
          const int64_t i1 = std::min(k, i0 + kc), steps = (i1 - i0) / per_step;
          // The next chunk (none past the claim's last block), shared out among the tiles.
          const bool next = chunked && !(b + 1 == b1 && i1 == k);
          const char* pf = reinterpret_cast<const char*>(w + (b * k + i1) * kPackBlock);
          int64_t r0 = 0;
          for (int64_t t = 0; t < tiles; ++t) {
            const int64_t rows = (m - r0 + tiles - t - 1) / (tiles - t);
            const auto share = next ? next_chunk_share(tiles, t, steps)
                                    : std::pair<int, int64_t>{!chunked && t == 0 ? kAhead : 0, 0};
            const int fetch = share.first;
            const int64_t line = share.second;
            Tile<T> a{x + r0 * k, w + b * k * kPackBlock, bias, y + r0 * n, n, k,
                      b * kPackBlock, i0, i1, part.data() + r0 * kPackBlock,
                      pf + line * 64};
            if (cols32) {  // two streams of 32 columns; the next chunk's lines in both
              const int64_t nb = i1 < k ? b : b + 1, ni = i1 < k ? i1 : 0;
              const T* next_a = w + nb * k * kPackBlock + ni * 32;
              a.step = 32;
              a.half = 32 * k;
              a.pf = reinterpret_cast<const char*>(next_a) + line * 64;
              a.pf_b = reinterpret_cast<const char*>(next_a + 32 * k);
              a.pf_split = 2 * steps - line;
            }
            by_rows(rows, [&](auto r) {
              constexpr int R = decltype(r)::value;
              if (fetch == kAhead) gemv_tile<R, kAhead>(a);
              else if constexpr (kChunkedTiles) {
                if (fetch == 4) gemv_tile<R, 4>(a);
                else if (fetch == 2) gemv_tile<R, 2>(a);
                else if (fetch == 1) gemv_tile<R, 1>(a);
                else gemv_tile<R, 0>(a);
              } else gemv_tile<R, 0>(a);
            });
            r0 += rows;
          }
        }
      }
    }
  });
}

// y = x @ W^T (+ bias) through the gemv_tile overloads for T.
template <typename T>
at::Tensor run_packed(const at::Tensor& x, int64_t weight, const at::Tensor* bias, at::Tensor y,
                      int64_t n) {
  packed_gemm<T>(x.data_ptr<T>(), reinterpret_cast<const T*>(weight & ~(kLayout32 | kAmx)),
                 bias ? bias->data_ptr<T>() : nullptr, y.data_ptr<T>(), x.size(0), n, x.size(1),
                 (weight & kLayout32) != 0, (weight & kAmx) != 0);
  return y;
}
#endif

// Pins the OpenMP threads of the calling thread's team, one CPU each: thread i (1 to n - 1)
// to cpus[i], and the calling thread itself to cpus[0] only when `calling` (left free, the
// processes it starts later inherit its affinity, not one CPU). torch's parallel regions reuse
// the same team, thread for thread, so each keeps its CPU and its caches from step to step.
// Returns the threads pinned (0 off Linux).
int64_t bind_omp_threads(c10::IntArrayRef cpus, bool calling) {
#if defined(__linux__)
  const int64_t n = at::get_num_threads();
  TORCH_CHECK(static_cast<int64_t>(cpus.size()) >= n, "bind_omp_threads: ", cpus.size(),
              " CPUs for ", n, " threads");
  for (int64_t c : cpus) TORCH_CHECK(c >= 0 && c < CPU_SETSIZE, "bind_omp_threads: CPU ", c);
  const std::vector<int64_t> ids(cpus.begin(), cpus.end());
  std::atomic<int64_t> pinned{0};
#pragma omp parallel num_threads(n)
  {
    const int i = omp_get_thread_num();
    if (i > 0 || calling) {
      cpu_set_t set;
      CPU_ZERO(&set);
      CPU_SET(ids[i], &set);
      if (sched_setaffinity(0, sizeof(set), &set) == 0) pinned.fetch_add(1);
    }
  }
  return pinned.load();
#else
  return 0;
#endif
}

// The most rows packed_linear should be given: where it measured at least as fast as oneDNN's
// matmul (AVX-512: 64 rows: over a decode step's 49 linears on a Zen 4 VM, fp32 and bf16,
// 1.3-1.6x at 8-16 rows, 1.04-1.09x at 64, 0.97-1.04x at 80-128; AVX2, whose tiles are 4 rows
// of 16 registers and take K whole: 4), 0 without.
int64_t packed_linear_max_rows() {
#if defined(__AVX512F__)
  return kGemvRows;
#elif defined(__AVX2__)
  return 4;
#else
  return 0;
#endif
}

// The most rows the GEMV takes through AMX's tiles for a bf16 weight in 32-column blocks
// with k columns: kAmxRows where this build and process run them and K is whole A tiles,
// else 0 (the vector GEMV's row tiles then, packed_linear_max_rows).
int64_t packed_linear_amx_rows(int64_t k) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  return k > 0 && k % kAmxK == 0 && amx_ready() ? kAmxRows : 0;
#else
  (void)k;
  return 0;
#endif
}

// Whether fp32 linears of any row count beyond packed_linear_max_rows() run here too
// (blocked_gemm: AVX-512 builds), where they measured ahead of oneDNN's matmul.
bool packed_linear_blocked() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

// The layouts this build reads: "" when none (neither AVX-512 nor AVX2), else e.g. "f32,bf16".
std::string packed_linear_layouts() {
#if defined(__AVX512F__) || defined(__AVX2__)
  return kPackedBf16 ? "f32,bf16" : "f32";
#else
  return "";
#endif
}

// y (M, N) = x (M, K) @ W^T (+ bias), W in oneDNN's packed layout above at address `weight`.
at::Tensor packed_linear(const at::Tensor& x, int64_t weight, int64_t n,
                         const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.device().is_cpu(),
              "packed_linear: x must be a contiguous 2-D CPU tensor");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(m >= 1, "packed_linear: x has no rows");
  TORCH_CHECK(n > 0 && n % 64 == 0 && k % 16 == 0, "packed_linear: N % 64 and K % 16 must be 0");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias)
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == n && bias->scalar_type() == x.scalar_type(),
                "packed_linear: bias must be a contiguous (N,) tensor of x's dtype");
  TORCH_CHECK(!(weight & kLayout32) || x.scalar_type() == at::kBFloat16,
              "packed_linear: 32-column blocks are a bf16 layout");
  TORCH_CHECK(!(weight & kAmx) || ((weight & kLayout32) && packed_linear_amx_rows(k) > 0),
              "packed_linear: AMX tiles take 32-column blocks, K % 32 == 0, and AMX (see "
              "packed_linear_amx_rows)");
  auto y = at::empty({m, n}, x.options());
#if defined(__AVX512F__) || defined(__AVX2__)
  const at::Tensor* b = has_bias ? &*bias : nullptr;
  if (x.scalar_type() == at::kFloat) return run_packed<float>(x, weight, b, y, n);
#if defined(__AVX512BF16__)
  if (x.scalar_type() == at::kBFloat16) return run_packed<c10::BFloat16>(x, weight, b, y, n);
#endif
#endif
  TORCH_CHECK(false, "packed_linear: dtype ", x.scalar_type(), " not built (layouts: '",
              packed_linear_layouts(), "')");
}


// ---- greedy tokens through an int8 copy of the LM head, checked exactly -------------------
// A greedy step needs each row's argmax of x @ W^T, not the logits. The LM head is the
// step's largest read at batch 1 (a quarter of the bench model's fp32 bytes), so the rows
// first take approximate logits from an int8 copy of W (per-row scale s_v, codes q_v: a
// quarter of fp32's bytes, half of bf16's) against x quantized per row (s_h, h'), on AMX's
// int8 tiles (exact int32 sums). For every vocabulary row the gap to the exact logit y_v (the
// full path's: packed_linear's bits) is bounded: with e_v = w_v - s_v q_v and d = h - s_h h',
//   |h.w_v - s_h s_v h'.q_v| <= |h| |e_v| + |d| |s_v q_v|   (Cauchy-Schwarz, exact math)
// plus the roundings of both sums (K products, 2^-24 each, <= K 2^-24 |h| |w_v|), of the
// approximation's scaling and, for a bf16 model, of y to bf16 (2^-9 relative); eps_v takes
// each with a margin. The argmax v* has y_v* >= y_u >= l_u - eps_u for every u, so it is
// among the candidates {v : l_v + eps_v >= max_u (l_u - eps_u)}, with every v tied with it.
// They are recomputed on the full path's arithmetic (a column's bits do not depend on the
// columns beside it: fp32 as the GEMV's FMA chain, bf16 as AMX's 16-column tiles or the vector
// GEMV's 64-column blocks), and the first maximum among them is the token the full logits'
// argmax gives. Where the bound leaves too many columns to recompute, or x is not finite, the
// caller runs the full head. q8 holds W's codes as AMX's B tiles want them, 16 columns of
// K / 4 groups of 4 codes: (V / 16, K / 4, 16, 4); stats (3, V): s_v, |e_v|, |s_v q_v|
// (norms rounded up). x is quantized in two int8 parts (the second its residual's), so the
// bound's |d| term is ~1/254 of a single part's and |h| |e_v| is most of eps.
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AMX_BF16__)
constexpr int64_t kScreenK = 64;  // an int8 A tile's K values (64 bytes a row)

// The screen of m rows: hq's two parts . q8's codes on AMX's int8 tiles, 32 columns a pass
// (tiles: 0-1 A, 2-3 B, 4-7 C), the rows in groups of R (R = m up to 16, else 16 with the
// last group's missing rows zero; a group's parts (2, R, k int8, k apart) one after the
// other), each group of a pass reading the pass's codes from L1 after the first: q8 is
// read once whatever m. From each group's sums at once, its rows' approximate logits and
// bounds (below). Per row it returns the best lower bound, best[r], and every v whose upper
// bound reaches it, hi_v >= best[r], in ascending order. A thread keeps the v whose upper
// bound reaches its running best (a superset); the final best then filters them.
struct ScreenRow {
  float s1, s2, h, d;  // x's two parts' scales, |h| and |d| (rounded up)
};

template <bool kBf16>
void screen_bounds(const int8_t* hq, const int8_t* q8, const float* stats, const ScreenRow* row,
                   int64_t m, int64_t R, int64_t vp, int64_t k, float* best,
                   std::vector<int64_t>* cand) {
  const float* sv = stats;
  const float* en = stats + vp;
  const float* wn = stats + 2 * vp;
  const int64_t groups = (m + R - 1) / R;
  std::mutex merge;
  std::fill_n(best, m, -std::numeric_limits<float>::infinity());
  std::vector<std::vector<std::pair<int64_t, float>>> found(m);  // (v, hi_v), every thread's
  parallel_claims(vp / 32, [&](auto&& claim) {
    TileConfig cfg;
    for (int t = 0; t < 8; ++t) cfg.rows[t] = static_cast<uint8_t>(R), cfg.colsb[t] = 64;
    cfg.rows[2] = cfg.rows[3] = kScreenK / 4;
    load_tile_config(cfg);
    const __m512 fp = _mm512_set1_ps(static_cast<float>(k) * 0x1p-23f);
    const __m512 margin = _mm512_set1_ps(1.f + 0x1p-16f), rel = _mm512_set1_ps(0x1p-20f);
    const __m512 bf16_rel = _mm512_set1_ps(0x1p-7f);
    alignas(64) int32_t c[2][16][32];
    alignas(64) float hv[16], ew[32], qw[32];
    // Per row: the running maximum of lo lane by lane, and the threshold its candidates are
    // kept against, the lanes' maximum as of a few passes ago (below the final best).
    std::vector<__m512> lo_run(m, _mm512_set1_ps(-std::numeric_limits<float>::infinity()));
    std::vector<float> thr(m, -std::numeric_limits<float>::infinity());
    std::vector<std::vector<std::pair<int64_t, float>>> mine(m);
    int64_t passes = 0;
    for (int64_t b0, b1; claim(b0, b1);)
      for (int64_t b = b0; b < b1; ++b, ++passes) {
        // The pass's columns' weights of |h| and |d| in eps, the margin in them (each 2^-16
        // against the few 2^-24 roundings of the products and sums it covers):
        // eps = h ew_v + d qw_v + 2^-20 |l|, ew_v = (|e_v| + K 2^-23 (|e_v| + |s_v q_v|))
        // (1 + 2^-16), qw_v = |s_v q_v| (1 + 2^-16).
        for (int half = 0; half < 2; ++half) {
          const int64_t v = b * 32 + half * 16;
          const __m512 e = _mm512_loadu_ps(en + v), q = _mm512_loadu_ps(wn + v);
          _mm512_store_ps(ew + half * 16,
                          _mm512_mul_ps(_mm512_fmadd_ps(fp, _mm512_add_ps(q, e), e), margin));
          _mm512_store_ps(qw + half * 16, _mm512_mul_ps(q, margin));
        }
        for (int64_t g = 0; g < groups; ++g) {
          const int8_t* h1 = hq + g * 2 * R * k;
          const int8_t* h2 = h1 + R * k;
          const int8_t* s = q8 + b * 32 * k;  // two 16-column blocks, 16 * k bytes each
          _tile_zero(4);
          _tile_zero(5);
          _tile_zero(6);
          _tile_zero(7);
          for (int64_t i = 0; i < k; i += kScreenK) {
            _tile_loadd(0, h1 + i, k);
            _tile_loadd(1, h2 + i, k);
            _tile_loadd(2, s + i * 16, 64);
            _tile_dpbssd(4, 0, 2);
            _tile_dpbssd(6, 1, 2);
            _tile_loadd(3, s + 16 * k + i * 16, 64);
            _tile_dpbssd(5, 0, 3);
            _tile_dpbssd(7, 1, 3);
          }
          _tile_stored(4, &c[0][0][0], 128);
          _tile_stored(5, &c[0][0][16], 128);
          _tile_stored(6, &c[1][0][0], 128);
          _tile_stored(7, &c[1][0][16], 128);
          // l = (s1 h1.q_v + s2 h2.q_v) s_v, and for bf16 eps + 2^-7 (|l| + eps):
          // lo = l - eps, hi = l + eps.
          for (int64_t j = 0, r = g * R; j < R && r < m; ++j, ++r) {
            const __m512 a1 = _mm512_set1_ps(row[r].s1), a2 = _mm512_set1_ps(row[r].s2);
            const __m512 h = _mm512_set1_ps(row[r].h), d = _mm512_set1_ps(row[r].d);
            const __m512 th = _mm512_set1_ps(thr[r]);
            __m512 lo_max = lo_run[r];
            for (int half = 0; half < 2; ++half) {
              const int64_t v = b * 32 + half * 16;
              const __m512 l = _mm512_mul_ps(
                  _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(&c[0][j][half * 16])), a1,
                                  _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(
                                                    &c[1][j][half * 16])),
                                                a2)),
                  _mm512_loadu_ps(sv + v));
              const __m512 al = _mm512_abs_ps(l);
              __m512 eps = _mm512_fmadd_ps(h, _mm512_load_ps(ew + half * 16),
                                           _mm512_mul_ps(d, _mm512_load_ps(qw + half * 16)));
              eps = _mm512_fmadd_ps(rel, al, eps);
              if constexpr (kBf16) eps = _mm512_fmadd_ps(bf16_rel, _mm512_add_ps(al, eps), eps);
              const __m512 hi = _mm512_add_ps(l, eps);
              lo_max = _mm512_max_ps(lo_max, _mm512_sub_ps(l, eps));
              __mmask16 hit = _mm512_cmp_ps_mask(hi, th, _CMP_GE_OQ);
              if (hit) _mm512_store_ps(hv, hi);
              for (; hit; hit &= hit - 1) {
                const int bit = __builtin_ctz(hit);
                mine[r].emplace_back(v + bit, hv[bit]);
              }
            }
            lo_run[r] = lo_max;
            if (passes % 8 == 0) thr[r] = _mm512_reduce_max_ps(lo_max);
          }
        }
      }
    _tile_release();
    std::lock_guard<std::mutex> lock(merge);
    for (int64_t r = 0; r < m; ++r) {
      best[r] = std::max(best[r], _mm512_reduce_max_ps(lo_run[r]));
      found[r].insert(found[r].end(), mine[r].begin(), mine[r].end());
    }
  });
  for (int64_t r = 0; r < m; ++r) {
    cand[r].clear();
    for (const auto& [v, hi] : found[r])
      if (hi >= best[r]) cand[r].push_back(v);
    std::sort(cand[r].begin(), cand[r].end());
  }
}

// The first maximum among a row's candidates (ascending) by value(v): the full logits'
// argmax; -1 where a value is NaN (the caller declines).
template <typename F>
int64_t first_max(const std::vector<int64_t>& cand, F&& value) {
  int64_t arg = -1;
  float top = 0.f;
  for (int64_t v : cand) {
    const float val = value(v);
    if (std::isnan(val)) return -1;
    if (arg < 0 || val > top) arg = v, top = val;
  }
  return arg;
}

inline at::Tensor declined(const at::Tensor& x) { return at::empty({0}, x.options().dtype(at::kLong)); }

template <typename T>
at::Tensor screened_argmax_impl(const at::Tensor& x, const at::Tensor& q8, const at::Tensor& stats,
                                int64_t weight, int64_t max_blocks) {
  const int64_t m = x.size(0), k = x.size(1), vp = stats.size(1);
  const T* xp = x.data_ptr<T>();
  const float* st = stats.data_ptr<float>();
  constexpr bool kBf16 = std::is_same<T, c10::BFloat16>::value;
  // bf16 past AMX's rows: the full head is oneDNN's matmul, whose sums the screen cannot
  // reproduce.
  if (kBf16 && (weight & kAmx) && m > kAmxRows) return declined(x);
  // Per row: h ~ s1 h1 + s2 h2 (h2 the residual's codes, so |d| = |h - s1 h1 - s2 h2| is ~1/254
  // of one part's), |h| and |d| (rounded up); the parts as int8 rows, in screen_bounds' groups
  // of R rows (the last group's missing rows zero).
  const int64_t R = std::min<int64_t>(m, 16), groups = (m + R - 1) / R;
  std::vector<int8_t> hq(groups * 2 * R * k, 0);
  std::vector<ScreenRow> row(m);
  std::atomic<bool> finite{true};
  at::parallel_for(0, m, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      int8_t* p1 = hq.data() + (r / R) * 2 * R * k + (r % R) * k;
      int8_t* p2 = p1 + R * k;
      double amax = 0, ss = 0;
      for (int64_t i = 0; i < k; ++i) {
        const double v = static_cast<float>(xp[r * k + i]);
        amax = std::max(amax, std::fabs(v));
        ss += v * v;
      }
      if (!std::isfinite(amax) || !std::isfinite(ss)) {
        finite = false;
        continue;
      }
      const float a = amax > 0 ? static_cast<float>(amax / 127.0) : 1.f;
      double rmax = 0;
      for (int64_t i = 0; i < k; ++i) {
        const double v = static_cast<float>(xp[r * k + i]);
        const double c = std::clamp(std::nearbyint(v / a), -127.0, 127.0);
        p1[i] = static_cast<int8_t>(c);
        rmax = std::max(rmax, std::fabs(v - c * a));
      }
      const float b = rmax > 0 ? static_cast<float>(rmax / 127.0) : 1.f;
      double ds = 0;
      for (int64_t i = 0; i < k; ++i) {
        const double v = static_cast<float>(xp[r * k + i]);
        const double res = v - p1[i] * static_cast<double>(a);
        const double c = std::clamp(std::nearbyint(res / b), -127.0, 127.0);
        p2[i] = static_cast<int8_t>(c);
        ds += (res - c * b) * (res - c * b);
      }
      row[r] = {a, b, static_cast<float>(std::sqrt(ss) * (1 + 1e-6)),
                static_cast<float>(std::sqrt(ds) * (1 + 1e-6))};
    }
  });
  if (!finite) return declined(x);
  // Each row's best lower bound and candidates (screen_bounds).
  std::vector<std::vector<int64_t>> cand(m);
  std::vector<float> best(m);
  screen_bounds<kBf16>(hq.data(), q8.data_ptr<int8_t>(), st, row.data(), m, R, vp, k,
                       best.data(), cand.data());
  // The columns the candidates' recompute reads, in units: 16 columns (an fp32 column's
  // lines hold its 15 neighbours'; an AMX B tile's), or a bf16 head's 64-column blocks where
  // its GEMV is not AMX's. Past max_blocks 64-column blocks' worth, the full head.
  const bool amx = (weight & kAmx) != 0;
  const int64_t unit = kBf16 && !amx ? 64 : 16;
  std::vector<char> need(vp / unit, 0);
  int64_t units = 0;
  for (int64_t r = 0; r < m; ++r) {
    if (!std::isfinite(best[r])) return declined(x);
    for (int64_t v : cand[r])
      if (!need[v / unit]) need[v / unit] = 1, ++units;
    if (units * unit > max_blocks * 64) return declined(x);
  }
  const T* w = reinterpret_cast<const T*>(weight & ~(kLayout32 | kAmx));
  auto out = at::empty({m}, x.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  if constexpr (std::is_same<T, float>::value) {
    // fp32: a column's logit is the GEMV's chain of FMAs in K order from zero (gemv_step and
    // blocked_gemm alike: partial sums kept in fp32 between K chunks), so each candidate is
    // recomputed alone, reading its own weights (one lane of its block) and not the block's.
    std::atomic<bool> bad{false};
    at::parallel_for(0, m, 1, [&](int64_t a, int64_t b) {
      for (int64_t r = a; r < b; ++r) {
        op[r] = first_max(cand[r], [&](int64_t v) {
          const float* col = w + (v / 64) * k * 64 + v % 64;
          float val = 0.f;
          for (int64_t i = 0; i < k; ++i) val = __builtin_fmaf(xp[r * k + i], col[i * 64], val);
          return val;
        });
        if (op[r] < 0) bad = true;
      }
    });
    return bad ? declined(x) : out;
  }
  // bf16: the full path's sums over the candidates' units, then each row's first maximum
  // among them.
  std::vector<int64_t> which;
  for (int64_t u = 0; u < vp / unit; ++u)
    if (need[u]) which.push_back(u);
  std::vector<T> y(which.size() * m * unit);
  if (amx) {
    // amx_gemv's sums, 16 columns at a time: a C tile per 16 columns, zeroed, then one
    // TDPBF16PS per 32 K values in K order, each column's sum its own (the unit computes a C
    // element from its A row and B column alone), so a 16-column tile alone gives the bits
    // the full GEMV's four side by side give. Then the same one rounding to bf16.
    at::parallel_for(0, static_cast<int64_t>(which.size()), 1, [&](int64_t i0, int64_t i1) {
      TileConfig cfg;
      cfg.rows[0] = cfg.rows[3] = static_cast<uint8_t>(m);
      cfg.colsb[0] = cfg.colsb[3] = 64;
      cfg.rows[1] = kAmxK / 2;
      cfg.colsb[1] = 64;
      load_tile_config(cfg);
      alignas(64) float buf[kAmxRows * 16];
      // unit i's first column c: block c / 64, its 32-column half ((K / 2, 32, 2)), and the
      // half's first or second 16 columns (pairs) in each K pair's row
      const auto unit_at = [&](int64_t i) {
        const int64_t c = which[i] * 16;
        return w + (c / 64) * k * 64 + (c % 64 / 32) * 32 * k + (c % 32) * 2;
      };
      for (int64_t i = i0; i < i1; ++i) {
        const T* s = unit_at(i);
        // the next unit's lines (K / 2 of them, 128 bytes apart) into L2 meanwhile, a K
        // step's share (16) a step: the units are scattered (the head at batch 16, bf16,
        // alternating builds: 1.74-1.78 ms with, 1.77-1.78 without)
        const char* next = i + 1 < i1 ? reinterpret_cast<const char*>(unit_at(i + 1)) : nullptr;
        _tile_zero(3);
        for (int64_t j = 0; j < k; j += kAmxK) {
          if (next)
            for (int64_t p = j / 2; p < j / 2 + kAmxK / 2; ++p)
              _mm_prefetch(next + p * 128, _MM_HINT_T1);
          _tile_loadd(0, xp + j, k * 2);
          _tile_loadd(1, s + j * 32, 128);
          _tile_dpbf16ps(3, 0, 1);
        }
        _tile_stored(3, buf, 64);
        for (int64_t r = 0; r < m * 16; ++r) y[i * m * 16 + r] = static_cast<T>(buf[r]);
      }
      _tile_release();
    });
  } else {
    // One block a call (a one-block packed_gemm runs on its calling thread), the blocks
    // shared out among the threads.
    at::parallel_for(0, static_cast<int64_t>(which.size()), 1, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i)
        packed_gemm<T>(xp, w + which[i] * k * 64, nullptr, y.data() + i * m * 64, m, 64, k,
                       (weight & kLayout32) != 0, false);
    });
  }
  std::vector<int64_t> slot(vp / unit, -1);
  for (size_t i = 0; i < which.size(); ++i) slot[which[i]] = static_cast<int64_t>(i);
  for (int64_t r = 0; r < m; ++r) {
    op[r] = first_max(cand[r], [&](int64_t v) {
      return static_cast<float>(y[(slot[v / unit] * m + r) * unit + v % unit]);
    });
    if (op[r] < 0) return declined(x);
  }
  return out;
}
#endif

// Whether this build and process take screened_argmax (AMX's int8 tiles).
bool screened_argmax_available() {
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AMX_BF16__)
  return amx_ready();
#else
  return false;
#endif
}

// Each row's argmax of x (m, K) @ W^T, W the packed weight at `weight` (packed_linear's, no
// bias, N = stats.size(1)): the greedy tokens, bit for bit those of packed_linear's logits,
// through the int8 copy above (q8, stats). An empty result where the screen declines (x not
// finite, the candidates' units past max_blocks 64-column blocks' worth): the caller runs
// the full head.
at::Tensor screened_argmax(const at::Tensor& x, const at::Tensor& q8, const at::Tensor& stats,
                           int64_t weight, int64_t max_blocks) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.device().is_cpu() && x.size(0) >= 1,
              "screened_argmax: x must be a contiguous 2-D CPU tensor with rows");
  const int64_t k = x.size(1), vp = stats.size(1);
  TORCH_CHECK(stats.dim() == 2 && stats.size(0) == 3 && stats.scalar_type() == at::kFloat &&
                  stats.is_contiguous() && vp > 0 && vp % 64 == 0,
              "screened_argmax: stats must be a contiguous float (3, N), N % 64 == 0");
  TORCH_CHECK(k % 64 == 0 && q8.scalar_type() == at::kChar && q8.is_contiguous() &&
                  q8.numel() == vp * k,
              "screened_argmax: q8 must hold N * K int8 codes, K % 64 == 0");
  TORCH_CHECK(!(weight & kLayout32) || x.scalar_type() == at::kBFloat16,
              "screened_argmax: 32-column blocks are a bf16 layout");
  TORCH_CHECK(screened_argmax_available(), "screened_argmax: no AMX int8 tiles here");
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AMX_BF16__)
  if (x.scalar_type() == at::kFloat)
    return screened_argmax_impl<float>(x, q8, stats, weight, max_blocks);
  if (x.scalar_type() == at::kBFloat16)
    return screened_argmax_impl<c10::BFloat16>(x, q8, stats, weight, max_blocks);
#endif
  TORCH_CHECK(false, "screened_argmax: dtype ", x.scalar_type(), " not built");
}

// ---- A decode step's decoder layers in one call -------------------------------------------
// Llama's layer (Qwen2 / Mistral alike: an optional qkv bias, no q/k norm) for T decode rows
// over the paged cache, calling the ops above in the order and with the arguments
// the Python modules give them (models/llama.py), so every bit is the same; what goes is the
// Python between them: ~12 dispatches a layer, 2-3 ms of an 11-17 ms step at batch 1 on a
// Zen 4 VM, during which the other thread only spins. x: the embedding rows (T, C); the
// weights are packed_linear addresses; k/v caches (L, blocks, block_size, Hkv, D or codes)
// with, for bits 8 / 4, their (L, ..., 2) scale_zero and each row's sequence (token_seq);
// cos/sin (T, 1, D). Returns (the last layer's MLP output, the residual stream), as the loop.
// oneDNN's matmul on its packed weight w, as layers/linear.py calls it (the rows padded to
// row_bucket's count: one primitive per bucket, not per row count). decode_layers runs it
// above gemv_rows where oneDNN's packing is one the GEMV should leave to it (bf16 in AMX's
// 32-column blocks: its matmul costs the same from 1 to 16 rows, the GEMV's grows).
int64_t row_bucket(int64_t rows) {
  if (rows <= 16) return rows;
  int64_t bits = 0;
  for (int64_t r = rows; r; r >>= 1) ++bits;
  const int64_t step = int64_t(1) << (bits - 4);
  return (rows + step - 1) / step * step;
}

at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& w,
                         const c10::optional<at::Tensor>& bias) {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  const int64_t rows = x.size(0), padded = row_bucket(rows);
  at::Tensor in = padded == rows ? x : at::constant_pad_nd(x, {0, 0, 0, padded - rows});
  std::vector<c10::IValue> stack{in, w, bias, std::string("none"),
                                 c10::List<c10::optional<at::Scalar>>(), std::string("")};
  op.callBoxed(&stack);
  const at::Tensor y = stack[0].toTensor();
  return padded == rows ? y : y.narrow(0, 0, rows);
}

std::tuple<at::Tensor, at::Tensor> decode_layers(
    const at::Tensor& x, at::TensorList norm1, at::TensorList norm2, at::IntArrayRef qkv,
    const c10::List<c10::optional<at::Tensor>>& qkv_bias, at::IntArrayRef o_proj,
    at::IntArrayRef gate_up, at::IntArrayRef down, const at::Tensor& k_cache,
    const at::Tensor& v_cache, const at::Tensor& cos, const at::Tensor& sin,
    const at::Tensor& slots, const at::Tensor& block_tables, const at::Tensor& context_lens,
    const c10::optional<at::Tensor>& k_scale_zero, const c10::optional<at::Tensor>& v_scale_zero,
    const c10::optional<at::Tensor>& token_seq, int64_t bits, int64_t heads, int64_t kv_heads,
    int64_t head_dim, int64_t intermediate, double eps, double scale, int64_t window,
    at::TensorList onednn, int64_t gemv_rows) {
  const int64_t L = norm1.size(), T = x.size(0), C = x.size(1), D = head_dim;
  TORCH_CHECK(onednn.empty() || onednn.size() == size_t(4 * L),
              "decode_layers: onednn holds 4 packed weights a layer (qkv, o, gate_up, down)");
  // Linear j (0-3) of layer l: the GEMV, or oneDNN's matmul above gemv_rows rows.
  auto linear = [&](const at::Tensor& in, int64_t l, int j, int64_t address, int64_t n,
                    const c10::optional<at::Tensor>& b) {
    if (onednn.empty() || T <= gemv_rows) return packed_linear(in, address, n, b);
    return onednn_linear(in, onednn[4 * l + j], b);
  };
  const int64_t qkv_n = (heads + 2 * kv_heads) * D;
  TORCH_CHECK(norm2.size() == size_t(L) && qkv.size() == size_t(L) &&
                  qkv_bias.size() == size_t(L) && o_proj.size() == size_t(L) &&
                  gate_up.size() == size_t(L) && down.size() == size_t(L) &&
                  k_cache.size(0) == L && v_cache.size(0) == L,
              "decode_layers: one entry per layer in every list and cache");
  TORCH_CHECK(bits == 0 || (k_scale_zero && v_scale_zero && token_seq),
              "decode_layers: a quantized cache needs its scale_zero tensors and token_seq");
  at::Tensor h, residual = x, out = x;
  for (int64_t l = 0; l < L; ++l) {
    h = l == 0 ? rms_norm(out, norm1[l], eps) : fused_add_rms_norm(out, residual, norm1[l], eps);
    const at::Tensor fused =
        linear(h, l, 0, qkv[l], qkv_n, qkv_bias.get(l)).view({T, heads + 2 * kv_heads, D});
    rotary_(fused.narrow(1, 0, heads + kv_heads), cos, sin);
    const at::Tensor kc = k_cache.select(0, l), vc = v_cache.select(0, l);
    c10::optional<at::Tensor> ksz, vsz;
    if (bits) ksz = k_scale_zero->select(0, l), vsz = v_scale_zero->select(0, l);
    store_kv_(kc, ksz, fused.narrow(1, heads, kv_heads), slots, bits);
    store_kv_(vc, vsz, fused.narrow(1, heads + kv_heads, kv_heads), slots, bits);
    const at::Tensor q = fused.narrow(1, 0, heads);
    // An int8 / int4 cache: the per-row kernel (each row's context is its length: decode).
    const at::Tensor o = bits ? paged_attention(q, kc, vc, ksz, vsz, block_tables, *token_seq,
                                                context_lens, scale, window, bits)
                              : paged_decode_attention(q, kc, vc, block_tables, context_lens,
                                                       scale, window);
    const at::Tensor a = linear(o.view({T, heads * D}), l, 1, o_proj[l], C, c10::nullopt);
    h = fused_add_rms_norm(a, residual, norm2[l], eps);
    out = linear(silu_and_mul(linear(h, l, 2, gate_up[l], 2 * intermediate, c10::nullopt)), l, 3,
                 down[l], C, c10::nullopt);
  }
  return {out, residual};
}

}  // namespace

TORCH_LIBRARY(steadylm_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &rms_norm);
  m.def("fused_add_rms_norm(Tensor x, Tensor(a!) residual, Tensor weight, float eps) -> Tensor",
        &fused_add_rms_norm);
  m.def("silu_and_mul(Tensor x) -> Tensor", &silu_and_mul);
  m.def("argmax(Tensor x) -> Tensor", &argmax);
  m.def("rotary_(Tensor(a!) x, Tensor cos, Tensor sin) -> Tensor(a!)", &rotary_);
  m.def(
      "store_kv_(Tensor(a!) cache, Tensor(b!)? scale_zero, Tensor x, Tensor slots, int bits) "
      "-> ()",
      &store_kv_);
  m.def(
      "paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor context_lens, float scale, int window) -> Tensor",
      &paged_decode_attention);
  m.def(
      "paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor? k_scale_zero, "
      "Tensor? v_scale_zero, Tensor block_tables, Tensor token_seq, Tensor context_lens, "
      "float scale, int window, int bits) -> Tensor",
      &paged_attention);
  m.def(
      "prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor token_seq, Tensor context_lens, float scale, int window, bool amx=True) -> Tensor",
      &prefill_attention);
  m.def("packed_linear(Tensor x, int weight, int n, Tensor? bias) -> Tensor", &packed_linear);
  m.def("screened_argmax(Tensor x, Tensor q8, Tensor stats, int weight, int max_blocks) -> Tensor",
        &screened_argmax);
  m.def("screened_argmax_available() -> bool", &screened_argmax_available);
  m.def("packed_linear_layouts() -> str", &packed_linear_layouts);
  m.def("packed_linear_max_rows() -> int", &packed_linear_max_rows);
  m.def("bind_omp_threads(int[] cpus, bool calling) -> int", &bind_omp_threads);
  m.def("packed_linear_amx_rows(int k) -> int", &packed_linear_amx_rows);
  m.def("packed_linear_blocked() -> bool", &packed_linear_blocked);
  m.def(
      "decode_layers(Tensor(e!) x, Tensor[] norm1, Tensor[] norm2, int[] qkv, Tensor?[] qkv_bias, "
      "int[] o_proj, int[] gate_up, int[] down, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "Tensor cos, Tensor sin, Tensor slots, Tensor block_tables, Tensor context_lens, "
      "Tensor(c!)? k_scale_zero, Tensor(d!)? v_scale_zero, Tensor? token_seq, int bits, "
      "int heads, int kv_heads, int head_dim, int intermediate, float eps, float scale, "
      "int window, Tensor[] onednn, int gemv_rows) "
      "-> (Tensor, Tensor)",
      &decode_layers);
}
