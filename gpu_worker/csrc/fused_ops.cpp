// Fused pointwise ops for the bfloat16-weight path on CPU, where the residual stream is
// float32 and the GEMMs read bfloat16: each replaces several torch ops (and their passes over
// memory) with one.
//
//   add_rms_norm(x, delta?, w, eps, out): x += delta (in place, when given; float32 or
//       bfloat16 — a bfloat16 GEMM's output added without a cast of its own), then
//       out = x * rsqrt(mean(x²) + eps) * w, rounded to out's dtype (bfloat16 or float32)
//   rotary_(qk, positions, cos, sin): rotate-half RoPE in place on qk [T, heads, d] (rows may
//       be strided: qk is a view into the fused qkv projection)
//   silu_and_mul(gate_up, out): out = silu(gate) * up for gate_up = [gate | up] [T, 2f],
//       bfloat16 in and out, computed in float32 and rounded once
// (bindings.cpp checks the tensors; this file sees raw pointers.)
#include <cmath>

#include "kernels.h"

namespace pacer {

template <typename O, typename Dl>
void add_rms_norm(float* xp, const Dl* dp, const float* wp, O* op, int64_t T, int64_t D,
                  float eps) {
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    float* xr = xp + t * D;
    if (dp) {
      const Dl* dr = dp + t * D;
      for (int64_t i = 0; i < D; ++i) xr[i] += to_float(dr[i]);
    }
    // one loop for every variant (delta or not, float32 or bfloat16): the compiler orders the
    // sum the same way, so the norm's bits do not depend on how the delta arrived
    float ss = 0.f;
    for (int64_t i = 0; i < D; ++i) ss += xr[i] * xr[i];
    const float r = 1.f / std::sqrt(ss / D + eps);
    O* orow = op + t * D;
    for (int64_t i = 0; i < D; ++i) orow[i] = from_float<O>(xr[i] * r * wp[i]);
  }
}

template void add_rms_norm<float, float>(float*, const float*, const float*, float*, int64_t,
                                        int64_t, float);
template void add_rms_norm<bf16, float>(float*, const float*, const float*, bf16*, int64_t,
                                       int64_t, float);
template void add_rms_norm<float, bf16>(float*, const bf16*, const float*, float*, int64_t,
                                       int64_t, float);
template void add_rms_norm<bf16, bf16>(float*, const bf16*, const float*, bf16*, int64_t,
                                      int64_t, float);

__attribute__((noinline)) void rotary_row(float* v, int64_t position, const float* cp,
                                          const float* sp, int64_t heads, int64_t D) {
  const int64_t half = D / 2;
  const float* c = cp + position * D;
  const float* s = sp + position * D;
  for (int64_t h = 0; h < heads; ++h, v += D)
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = v[i], x2 = v[i + half];
      v[i] = x1 * c[i] - x2 * s[i];
      v[i + half] = x2 * c[i + half] + x1 * s[i + half];
    }
}

void rotary(float* p, int64_t stride, const int64_t* pos, const float* cp, const float* sp,
            int64_t T, int64_t heads, int64_t D) {
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < T; ++t) rotary_row(p + t * stride, pos[t], cp, sp, heads, D);
}

#if defined(__AVX512F__)
static inline __m512 load_bf16(const bf16* p, __mmask16 k) {
  const __m256i raw = _mm256_maskz_loadu_epi16(k, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

static inline void store_bf16(bf16* p, __m512 v, __mmask16 k) {
  _mm256_mask_storeu_epi16(p, k, round_bf16(v));
}
#endif

void silu_and_mul(const bf16* in, bf16* op, int64_t T, int64_t F) {
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    const bf16* g = in + t * 2 * F;
    const bf16* u = g + F;
    bf16* o = op + t * F;
#if defined(__AVX512F__)
    for (int64_t i = 0; i < F; i += 16) {
      const __mmask16 k = first_lanes(F - i);
      const __m512 gv = load_bf16(g + i, k);
      const __m512 sig = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.f),
                                                         exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
      store_bf16(o + i, _mm512_mul_ps(sig, load_bf16(u + i, k)), k);
    }
#else
    for (int64_t i = 0; i < F; ++i) {
      const float x = to_float(g[i]);
      o[i] = to_bf16(x / (1.f + std::exp(-x)) * to_float(u[i]));
    }
#endif
  }
}

}  // namespace pacer
