// Quantized weights widened to bfloat16 for one GEMM, for batches of many rows: there the
// bfloat16 GEMM (AMX / AVX512-BF16 through oneDNN) beats torch's int4/int8 kernels, which are
// built for a few rows, by more than the widening costs (gpu_worker/quant/linear.py picks by
// rows). Nothing is kept: the widened copy lives for one GEMM.
//
//   dequantize_int4pack: torch's CPU int4 layout (`_convert_weight_to_int4pack_for_cpu`, N a
//       multiple of 64): bytes [N / 64, K, 32], byte (b, k, j) holding row 64b + j (low nibble)
//       and row 64b + 32 + j (high nibble) of column k; scales_and_zeros [K / group, N, 2]
//       bfloat16; w = (q - 8) · scale + zero, written transposed: out [K, N] (contiguous rows
//       of N, as the layout runs)
//   dequantize_int8: codes [N, K] int8, scales [N] bfloat16; out [N, K]
// (bindings.cpp checks the tensors; this file sees raw pointers.)
#include "kernels.h"

namespace pacer {
namespace {

#if defined(__AVX512F__)
// 16 floats to bfloat16, round to nearest even (finite values: these are weights)
inline __m256i round_bf16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}

// 16 rows' (q - 8) · scale + zero: the (scale, zero) bfloat16 pairs read as one 32-bit word
// each, scale in its low half, zero in its high half
inline __m256i widen16(__m128i codes, const bf16* pairs) {
  const __m512i sz = _mm512_loadu_si512(pairs);
  const __m512 s = _mm512_castsi512_ps(_mm512_slli_epi32(sz, 16));
  const __m512 z = _mm512_castsi512_ps(_mm512_and_si512(sz, _mm512_set1_epi32(0xFFFF0000)));
  const __m512 q = _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(codes)),
                                 _mm512_set1_ps(8.f));
  return round_bf16(_mm512_fmadd_ps(q, s, z));
}
#endif

}  // namespace

void dequantize_int4pack(const uint8_t* packed, const bf16* sz, int64_t N, int64_t K,
                         int64_t group, bf16* out) {
#pragma omp parallel for schedule(static)
  for (int64_t k = 0; k < K; ++k) {
    const bf16* szk = sz + (k / group) * N * 2;
    bf16* o = out + k * N;
    for (int64_t b = 0; b < N / 64; ++b) {
      const uint8_t* p = packed + (b * K + k) * 32;
      const bf16* s = szk + b * 64 * 2;
      bf16* ob = o + b * 64;
#if defined(__AVX512F__)
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
      const __m256i lo = _mm256_and_si256(bytes, _mm256_set1_epi8(0x0F));
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), _mm256_set1_epi8(0x0F));
      __m256i* dst = reinterpret_cast<__m256i*>(ob);
      _mm256_storeu_si256(dst + 0, widen16(_mm256_castsi256_si128(lo), s));
      _mm256_storeu_si256(dst + 1, widen16(_mm256_extracti128_si256(lo, 1), s + 32));
      _mm256_storeu_si256(dst + 2, widen16(_mm256_castsi256_si128(hi), s + 64));
      _mm256_storeu_si256(dst + 3, widen16(_mm256_extracti128_si256(hi, 1), s + 96));
#else
      for (int j = 0; j < 32; ++j) {
        const float lo = static_cast<float>(p[j] & 0x0F) - 8.f;
        const float hi = static_cast<float>(p[j] >> 4) - 8.f;
        ob[j] = to_bf16(lo * to_float(s[2 * j]) + to_float(s[2 * j + 1]));
        ob[j + 32] = to_bf16(hi * to_float(s[2 * (j + 32)]) + to_float(s[2 * (j + 32) + 1]));
      }
#endif
    }
  }
}

void dequantize_int8(const int8_t* codes, const bf16* scale, int64_t N, int64_t K, bf16* out) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float s = to_float(scale[n]);
    const int8_t* c = codes + n * K;
    bf16* o = out + n * K;
    int64_t k = 0;
#if defined(__AVX512F__)
    const __m512 sv = _mm512_set1_ps(s);
    for (; k + 16 <= K; k += 16) {
      const __m512 w = _mm512_cvtepi32_ps(
          _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + k))));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + k), round_bf16(_mm512_mul_ps(w, sv)));
    }
#endif
    for (; k < K; ++k) o[k] = to_bf16(static_cast<float>(c[k]) * s);
  }
}

}  // namespace pacer
