// Prefill attention straight from the paged KV pool on CPU, for chunks of any length: query
// row i of a chunk sits at position kv_len - q_rows + i and sees keys 0..that position (its
// cached prefix fully, its own chunk causally; docs/design.md#chunks). The chunk's own K/V must be in
// the cache already (the backend writes them first), so a fresh prompt, a later chunk and a
// prefix of any length take the same path, with no gathered copy and no mask tensor.
//
// Flash-attention's scheme on AVX-512: a task is one chunk's KV head and a tile of up to 32
// query rows (all the query heads of that KV head: GQA). Keys stream past in blocks of 16,
// transposed once per block so that 16 scores come out of one vector FMA chain per query;
// an online softmax keeps a running max and sum per query. Float32 math; the cache float32 or
// bfloat16. Only head_dim 64 and 128 (NC = head_dim / 16 vectors per row).
//
//   q            [T, H, d]   float32, the iteration's flat batch
//   k/v_cache    [blocks, bs, KVH, d]
//   block_table  [R, max_blocks] int32
//   cu_seqlens_q [R + 1] int32, kv_lens [R] int32
//   out          [T, H, d]   float32; rows of chunks shorter than min_rows are left untouched
// (bindings.cpp checks the tensors; this file sees raw pointers.)
#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels.h"

namespace pacer {

#if defined(__AVX512F__)
namespace {

constexpr int64_t kTileRows = 32;
constexpr int64_t kKeys = 16;

struct Scratch {
  std::vector<float> q, acc, m, l, kt, vb;
};

template <int NC, typename T>
void prefill_tile(const float* q, float* out, int64_t rows, int64_t first_pos, int64_t H,
                  int64_t group, const T* kbase, const T* vbase, const int32_t* table,
                  int64_t BS, int64_t row, float scale, Scratch& s) {
  constexpr int64_t D = NC * 16;
  const int64_t nq = rows * group;                 // query vectors: row-major, head-minor
  s.q.resize(nq * D);
  s.acc.assign(nq * D, 0.f);
  s.m.assign(nq, -INFINITY);
  s.l.assign(nq, 0.f);
  s.kt.resize(D * kKeys);
  s.vb.resize(kKeys * D);
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t r = 0; r < rows; ++r)               // pre-scaled queries
    for (int64_t j = 0; j < group; ++j)
      for (int c = 0; c < NC; ++c)
        _mm512_storeu_ps(s.q.data() + (r * group + j) * D + c * 16,
                         _mm512_mul_ps(_mm512_loadu_ps(q + r * H * D + j * D + c * 16), vscale));
  const int64_t last = first_pos + rows - 1;       // the last key any row of the tile sees
  alignas(64) float p[kKeys];
  for (int64_t kb = 0; kb <= last; kb += kKeys) {
    const int64_t nk = std::min(kKeys, last + 1 - kb);
    for (int64_t k = 0; k < kKeys; ++k) {          // K block transposed, V block widened
      if (k < nk) {
        const int64_t t = kb + k;
        const T* kr = kbase + (table[t / BS] * BS + t % BS) * row;
        const T* vr = vbase + (table[t / BS] * BS + t % BS) * row;
        alignas(64) float tmp[D];
        for (int c = 0; c < NC; ++c) {
          _mm512_store_ps(tmp + c * 16, load16(kr + c * 16));
          _mm512_storeu_ps(s.vb.data() + k * D + c * 16, load16(vr + c * 16));
        }
        for (int64_t i = 0; i < D; ++i) s.kt[i * kKeys + k] = tmp[i];
      } else {
        for (int64_t i = 0; i < D; ++i) s.kt[i * kKeys + k] = 0.f;
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t pos = first_pos + r;
      if (kb > pos) continue;                      // the whole block is in this row's future
      const __mmask16 valid = first_lanes(std::min(nk, pos - kb + 1));
      for (int64_t j = 0; j < group; ++j) {
        const int64_t v = r * group + j;
        const float* qv = s.q.data() + v * D;
        __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
        __m512 a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
        for (int64_t i = 0; i < D; i += 4) {       // 16 scores, four independent chains
          a0 = _mm512_fmadd_ps(_mm512_set1_ps(qv[i]), _mm512_load_ps(&s.kt[i * kKeys]), a0);
          a1 = _mm512_fmadd_ps(_mm512_set1_ps(qv[i + 1]), _mm512_load_ps(&s.kt[(i + 1) * kKeys]), a1);
          a2 = _mm512_fmadd_ps(_mm512_set1_ps(qv[i + 2]), _mm512_load_ps(&s.kt[(i + 2) * kKeys]), a2);
          a3 = _mm512_fmadd_ps(_mm512_set1_ps(qv[i + 3]), _mm512_load_ps(&s.kt[(i + 3) * kKeys]), a3);
        }
        const __m512 sc = _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3));
        const float bmax = _mm512_mask_reduce_max_ps(valid, sc);
        const float m_new = std::max(s.m[v], bmax);
        const float corr = std::exp(s.m[v] - m_new);           // 0 on the first block
        const __m512 e = _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(sc, _mm512_set1_ps(m_new))));
        s.l[v] = s.l[v] * corr + _mm512_reduce_add_ps(e);
        s.m[v] = m_new;
        _mm512_store_ps(p, e);
        float* av = s.acc.data() + v * D;
        __m512 acc[NC];
        const __m512 vc = _mm512_set1_ps(corr);
        for (int c = 0; c < NC; ++c) acc[c] = _mm512_mul_ps(_mm512_loadu_ps(av + c * 16), vc);
        const int64_t nv = std::min(nk, pos - kb + 1);
        for (int64_t k = 0; k < nv; ++k) {
          const __m512 pk = _mm512_set1_ps(p[k]);
          for (int c = 0; c < NC; ++c)
            acc[c] = _mm512_fmadd_ps(pk, _mm512_loadu_ps(s.vb.data() + k * D + c * 16), acc[c]);
        }
        for (int c = 0; c < NC; ++c) _mm512_storeu_ps(av + c * 16, acc[c]);
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < group; ++j) {
      const int64_t v = r * group + j;
      const __m512 inv = _mm512_set1_ps(1.f / s.l[v]);
      for (int c = 0; c < NC; ++c)
        _mm512_storeu_ps(out + r * H * D + j * D + c * 16,
                         _mm512_mul_ps(_mm512_loadu_ps(s.acc.data() + v * D + c * 16), inv));
    }
}

template <int NC, typename T>
void prefill(const float* qp, const T* kp, const T* vp, const int32_t* bt, const int32_t* cu,
             const int32_t* lens, int64_t R, int64_t H, int64_t BS, int64_t KVH,
             int64_t max_blocks, int64_t min_rows, float fscale, float* op) {
  constexpr int64_t D = NC * 16;
  const int64_t group = H / KVH;
  struct Task { int64_t chunk, kvh, r0, rows; };
  std::vector<Task> tasks;
  for (int64_t g = 0; g < R; ++g) {
    const int64_t n = cu[g + 1] - cu[g];
    if (n < min_rows) continue;
    for (int64_t r0 = n; r0 > 0; r0 -= kTileRows)   // last tiles first: they cost the most
      for (int64_t h = 0; h < KVH; ++h)
        tasks.push_back({g, h, std::max<int64_t>(0, r0 - kTileRows), std::min(kTileRows, r0)});
  }
#pragma omp parallel
  {
    Scratch s;
#pragma omp for schedule(dynamic, 1)
    for (size_t i = 0; i < tasks.size(); ++i) {
      const Task& t = tasks[i];
      const int64_t n = cu[t.chunk + 1] - cu[t.chunk];
      const int64_t first_row = cu[t.chunk] + t.r0;
      const int64_t offset = (first_row * H + t.kvh * group) * D;
      prefill_tile<NC, T>(qp + offset, op + offset, t.rows, lens[t.chunk] - n + t.r0, H, group,
                          kp + t.kvh * D, vp + t.kvh * D, bt + t.chunk * max_blocks, BS, KVH * D,
                          fscale, s);
    }
  }
}

}  // namespace
#endif

bool paged_prefill_supported(int64_t head_dim, int64_t group) {
#if defined(__AVX512F__)
  return (head_dim == 64 || head_dim == 128) && group >= 1;
#else
  (void)head_dim;
  (void)group;
  return false;
#endif
}

template <typename T>
void paged_prefill(const float* q, const T* k_cache, const T* v_cache, const int32_t* block_table,
                   const int32_t* cu_seqlens_q, const int32_t* kv_lens, int64_t R, int64_t H,
                   int64_t D, int64_t BS, int64_t KVH, int64_t max_blocks, int64_t min_rows,
                   float scale, float* out) {
#if defined(__AVX512F__)
  if (D == 64)
    prefill<4, T>(q, k_cache, v_cache, block_table, cu_seqlens_q, kv_lens, R, H, BS, KVH,
                  max_blocks, min_rows, scale, out);
  if (D == 128)
    prefill<8, T>(q, k_cache, v_cache, block_table, cu_seqlens_q, kv_lens, R, H, BS, KVH,
                  max_blocks, min_rows, scale, out);
#else
  (void)q, (void)k_cache, (void)v_cache, (void)block_table, (void)cu_seqlens_q, (void)kv_lens;
  (void)R, (void)H, (void)D, (void)BS, (void)KVH, (void)max_blocks, (void)min_rows, (void)scale;
  (void)out;
#endif
}

template void paged_prefill<float>(const float*, const float*, const float*, const int32_t*,
                                   const int32_t*, const int32_t*, int64_t, int64_t, int64_t,
                                   int64_t, int64_t, int64_t, int64_t, float, float*);
template void paged_prefill<bf16>(const float*, const bf16*, const bf16*, const int32_t*,
                                  const int32_t*, const int32_t*, int64_t, int64_t, int64_t,
                                  int64_t, int64_t, int64_t, int64_t, float, float*);

}  // namespace pacer
