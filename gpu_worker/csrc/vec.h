// Shared by the CPU kernels: the bfloat16 storage type and AVX-512 helpers. The kernel files
// include no torch header: they are compiled once per ISA level (gpu_worker/kernel_build.py),
// and only bindings.cpp, compiled once, speaks torch.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace pacer {

// bfloat16 as stored: the high half of a float32 (the same bits as c10::BFloat16)
struct bf16 {
  uint16_t bits;
};

static inline float to_float(float x) { return x; }
static inline float to_float(bf16 x) {
  const uint32_t u = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// round to nearest even, NaN to a quiet NaN: c10::BFloat16's conversion, bit for bit
static inline bf16 to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return bf16{0x7FC0};   // by its bits: -ffast-math safe
  u += 0x7FFF + ((u >> 16) & 1);
  return bf16{static_cast<uint16_t>(u >> 16)};
}

// tile.template operator()<R>(m) for rows [m, m + R) of [0, M): whole tiles of R rows, then
// one of the rows left (the microkernels below keep R rows' accumulators in registers)
template <int R, typename Tile>
inline void rest_of_rows(int64_t left, int64_t m, Tile& tile) {
  if constexpr (R > 0) {
    if (left == R)
      tile.template operator()<R>(m);
    else
      rest_of_rows<R - 1>(left, m, tile);
  }
}
template <int R, typename Tile>
inline void in_row_tiles(int64_t M, Tile&& tile) {
  int64_t m = 0;
  for (; m + R <= M; m += R) tile.template operator()<R>(m);
  rest_of_rows<R - 1>(M - m, m, tile);
}

template <typename O> static inline O from_float(float x);
template <> inline float from_float<float>(float x) { return x; }
template <> inline bf16 from_float<bf16>(float x) { return to_bf16(x); }

}  // namespace pacer

#if defined(__AVX2__)
#include <immintrin.h>

static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8(const pacer::bf16* p) {      // 8 bfloat16 -> float32
  return _mm256_castsi256_ps(_mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

// 8 (scale, zero) bfloat16 pairs of the int4 layouts, each read as one 32-bit word (scale in
// its low half, zero in its high half), as float32 scales and zeros
static inline void load8_pairs(const void* p, __m256& s, __m256& z) {
  const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  s = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  z = _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
}

static inline __m128i round8_bf16(__m256 v) {    // 8 floats to bfloat16, round to nearest even
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(
      _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  // per 128-bit lane r0-3 r0-3 | r4-7 r4-7; quadwords 0 and 2 are r0-7
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08));
}

#if defined(__FMA__)
// exp on 8 lanes for x <= 0 (softmax's exp(s - max)): exp16's polynomial, 2^n built in the
// exponent bits; 0 below -87.3
static inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                       _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
#endif
#endif

#if defined(__AVX512F__)

static inline __mmask16 first_lanes(int64_t n) {   // lanes [0, n), n clamped to 16
  return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1);
}

// 16 floats to bfloat16, round to nearest even (finite values: weights, sums)
static inline __m256i round_bf16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}

// 16 such pairs (load8_pairs)
static inline void load16_pairs(const void* p, __m512& s, __m512& z) {
  const __m512i w = _mm512_loadu_si512(p);
  s = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  z = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(0xFFFF0000)));
}

static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const pacer::bf16* p) {   // bfloat16 -> float32: shift left 16
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// exp on 16 lanes (Cephes' expf: range reduction by ln 2, degree-5 polynomial, relative
// error ~1e-7); 0 below -87.3, inf above ~88.7.
static inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), x);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(y, n);
}

#endif
