// Greedy sampling's argmax on CPU: torch's reduction over the vocabulary runs at ~1.2 G values
// a second here (1.3 ms for 32 rows of 49,152 logits, a few % of a decode step); this one
// reads them at memory speed. Same answer as torch.argmax: the first index of the row's
// largest value, a NaN counting as the largest (the first NaN then). Compiled without
// -ffast-math (kernel_build.EXACT_MATH): NaN tests must survive the compiler.
//
//   x    [S, V] float32
//   out  [S]    int64
#include <cmath>

#include "kernels.h"

namespace pacer {
namespace {

#if defined(__AVX512F__)
int64_t argmax_row(const float* x, int64_t V) {
  __m512 mv = _mm512_set1_ps(-INFINITY);
  __m512i iv = _mm512_setzero_si512();
  __m512i at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i step = _mm512_set1_epi32(16);
  for (int64_t i = 0; i < V; i += 16) {
    const __mmask16 k = first_lanes(V - i);
    const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), k, x + i);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);   // the first NaN wins
    if (nan) return i + __builtin_ctz(nan);
    const __mmask16 gt = _mm512_cmp_ps_mask(v, mv, _CMP_GT_OQ);   // later equal values lose
    mv = _mm512_mask_mov_ps(mv, gt, v);
    iv = _mm512_mask_mov_epi32(iv, gt, at);
    at = _mm512_add_epi32(at, step);
  }
  const float m = _mm512_reduce_max_ps(mv);
  // among the lanes holding the maximum, the smallest index (each lane's is its first)
  const __mmask16 top = _mm512_cmp_ps_mask(mv, _mm512_set1_ps(m), _CMP_EQ_OQ);
  return _mm512_mask_reduce_min_epi32(top, iv);
}
#else
int64_t argmax_row(const float* x, int64_t V) {
  int64_t best = 0;
  for (int64_t i = 0; i < V; ++i) {
    if (std::isnan(x[i])) return i;
    if (x[i] > x[best]) best = i;
  }
  return best;
}
#endif

}  // namespace

void argmax_rows(const float* x, int64_t S, int64_t V, int64_t* out) {
#pragma omp parallel for schedule(static) if (S > 1)
  for (int64_t s = 0; s < S; ++s) out[s] = argmax_row(x + s * V, V);
}

}  // namespace pacer
