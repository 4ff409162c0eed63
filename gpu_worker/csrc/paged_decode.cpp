// Decode attention straight from the paged KV pool on CPU: one query row per request, keys
// and values read in place through the block table (no gathered copy). The query heads that
// share a KV head (GQA) are scored together against each K row, so every K and V row is read
// from memory once. With AVX-512 and head_dim 64 or 128 the group's queries and outputs stay
// in registers and the softmax is vectorized. Queries, scores and output in float32;
// the cache in float32 or bfloat16 (widened on load: a bfloat16 cache halves the bytes read);
// softmax in two passes.
//
//   q            [G, H, d]          the decode rows
//   k/v_cache    [blocks, bs, KVH, d]
//   block_tables [G, max_blocks]    int64
//   kv_lens      [G]                int64, keys each request sees (its own included)
//   out          [G, H, d]
// (bindings.cpp checks the tensors; this file sees raw pointers.)

#include <algorithm>
#include <cmath>
#include <vector>

#include <xmmintrin.h>    // _mm_prefetch (SSE: every x86-64 level)

#include "kernels.h"

namespace pacer {
namespace {

// softmax of each of the `group` rows of L scores, in place (plain C++, vectorized by the
// compiler)
inline void softmax_rows(float* scores, int64_t group, int64_t L) {
  for (int64_t j = 0; j < group; ++j) {
    float* sh = scores + j * L;
    const float m = *std::max_element(sh, sh + L);
    float sum = 0.f;
    for (int64_t t = 0; t < L; ++t) {
      sh[t] = std::exp(sh[t] - m);
      sum += sh[t];
    }
    const float inv = 1.f / sum;
    for (int64_t t = 0; t < L; ++t) sh[t] *= inv;
  }
}

// each of L keys' offset in the pool, from the block table once (no division per key); the
// calling thread's buffer, valid until its next call
inline const std::vector<int64_t>& key_offsets(const int64_t* table, int64_t L, int64_t BS,
                                               int64_t row) {
  thread_local std::vector<int64_t> offsets;
  offsets.resize(L);
  for (int64_t t = 0, b = 0; t < L; ++b)
    for (int64_t i = 0; i < BS && t < L; ++i, ++t) offsets[t] = (table[b] * BS + i) * row;
  return offsets;
}

// Software prefetch of the K or V rows of keys t0 .. t1-1 (one row: `bytes` at
// base + offsets[t] elements of `elem` bytes) into L2, kPrefetchAhead keys before they are
// read. Into L2, not L1: a decode task's rows are scattered a block at a time, and an L1
// prefetch (or none) holds the core's few L1 miss slots, so each chunk's lines come a few at a
// time; L2 keeps many more in flight. 30 layers of 32 requests x 180 keys: 12.4-12.9 ->
// 6.8 ms (docs/benchmarks.md#decode-attention-the-prefetch-that-was-not-there). A plain
// function, called directly: GCC 12 drops a prefetch reached through a lambda, and the two
// kernels' pass-1 calls below, moved into one shared template, ran 45 % slower (9.8 against
// 6.7 ms, fewer prefetches left in the library): they stay written out in each kernel.
constexpr int64_t kPrefetchAhead = 32;

inline void prefetch_rows(const void* base, std::size_t elem, const int64_t* offsets,
                          int64_t t0, int64_t t1, int64_t bytes) {
  const char* b0 = static_cast<const char*>(base);
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t b = 0; b < bytes; b += 64)
      _mm_prefetch(b0 + offsets[t] * int64_t(elem) + b, _MM_HINT_T1);
}

#if defined(__AVX512F__)
// softmax of s[0..L) in place
inline void softmax_avx512(float* s, int64_t L) {
  __m512 mv = _mm512_set1_ps(-INFINITY);
  for (int64_t t = 0; t < L; t += 16) {
    const __mmask16 k = first_lanes(L - t);
    mv = _mm512_mask_max_ps(mv, k, mv, _mm512_maskz_loadu_ps(k, s + t));
  }
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
  __m512 sv = _mm512_setzero_ps();
  for (int64_t t = 0; t < L; t += 16) {
    const __mmask16 k = first_lanes(L - t);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + t), m));
    _mm512_mask_storeu_ps(s + t, k, e);
    sv = _mm512_mask_add_ps(sv, k, sv, e);
  }
  const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(sv));
  for (int64_t t = 0; t < L; t += 16) {
    const __mmask16 k = first_lanes(L - t);
    _mm512_mask_storeu_ps(s + t, k, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, s + t), inv));
  }
}

// lane i = the sum of v[i]'s 16 lanes: a tree of shuffles and adds, 45 + 1 operations for
// 16 sums where 16 reductions would take ~8 each (the tree's last step leaves the sums
// transposed by 4 x 4, which one permutation undoes)
inline __m512 sum16(const __m512* v) {
  __m512 w[8], x[4], y[2];
  for (int i = 0; i < 8; ++i)     // lanes 0-7: v[2i] halved, 8-15: v[2i + 1]
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)     // 128-bit chunk c: v[4i + c] in 4 lanes
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)     // chunk c: v[8i + c] and v[8i + 4 + c], 2 lanes each
    y[i] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0xEE));
  // lane 4c + r: v[4r + c]
  const __m512 t = _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], 0x88),
                                 _mm512_shuffle_ps(y[0], y[1], 0xDD));
  const __m512i back = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  return _mm512_permutexvar_ps(back, t);
}

// G query heads' outputs over the V rows: out[j] = sum over t of scores[j * L + t] v_t, the
// terms added in t order (head_dim = 16 * NC; row(t) is key t's V row)
template <int NC, int G, typename T>
inline void weighted_values(const float* scores, int64_t L, const int64_t* offsets,
                            const T* vp, float* oh) {
  __m512 acc[G][NC];
  for (int j = 0; j < G; ++j)
    for (int c = 0; c < NC; ++c) acc[j][c] = _mm512_setzero_ps();
  constexpr int64_t kRow = 16 * NC * int64_t(sizeof(T));
  for (int64_t t = 0; t < L; ++t) {
    if (t % 16 == 0)
      prefetch_rows(vp, sizeof(T), offsets, t + kPrefetchAhead,
                    std::min(L, t + kPrefetchAhead + 16), kRow);
    const T* vt = vp + offsets[t];
    __m512 vv[NC];
    for (int c = 0; c < NC; ++c) vv[c] = load16(vt + c * 16);
    for (int j = 0; j < G; ++j) {
      const __m512 p = _mm512_set1_ps(scores[j * L + t]);
      for (int c = 0; c < NC; ++c) acc[j][c] = _mm512_fmadd_ps(p, vv[c], acc[j][c]);
    }
  }
  for (int j = 0; j < G; ++j)
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(oh + j * NC * 16 + c * 16, acc[j][c]);
}

// f.template operator()<n>() for a run-time n in [1, N]. (vec.h's in_row_tiles, tried in its
// place for the passes over V, left their accumulators on the stack: 30 % slower)
template <int N, typename F>
inline void with_count(int64_t n, F&& f) {
  if constexpr (N > 1) {
    if (n < N) return with_count<N - 1>(n, f);
  }
  f.template operator()<N>();
}

// One request, one KV head and the `group` query heads that share it, head_dim = 16 * NC:
// the request's K and V rows of this head stream past once each, prefetched into L2 ahead
// (`prefetch_rows`). Scores 16 keys at a time: the chunk's K rows widened once into a float
// buffer, then per query head 16 partial products summed by one tree (`sum16`). Outputs stay
// in registers while the V rows pass. Against one key at a time with a reduction each: 30
// layers of 32 requests x 180 keys 16.6 -> 13.4 ms (bench/decode_attention.py).
template <int NC, typename T>
void decode_head_avx512(const float* qh, const T* kp, const T* vp, const int64_t* table,
                               int64_t L, int64_t BS, int64_t row, int64_t group, float scale,
                               float* scores, float* oh) {
  constexpr int MAXG = 8, D = 16 * NC;
  const std::vector<int64_t>& offsets = key_offsets(table, L, BS, row);
  const int64_t* off = offsets.data();
  alignas(64) float kf[16][D];
  const __m512 sv = _mm512_set1_ps(scale);
  prefetch_rows(kp, sizeof(T), off, 0, std::min(L, kPrefetchAhead), D * int64_t(sizeof(T)));
  prefetch_rows(vp, sizeof(T), off, 0, std::min(L, kPrefetchAhead - L), D * int64_t(sizeof(T)));
  for (int64_t t0 = 0; t0 < L; t0 += 16) {                      // pass 1: scores
    const int64_t n = std::min<int64_t>(16, L - t0);
    prefetch_rows(kp, sizeof(T), off, t0 + kPrefetchAhead, std::min(L, t0 + kPrefetchAhead + 16),
                  D * int64_t(sizeof(T)));
    if (t0 + kPrefetchAhead + 16 > L)    // V's first rows, for pass 2
      prefetch_rows(vp, sizeof(T), off, std::max<int64_t>(0, t0 + kPrefetchAhead - L),
                    std::min(L, t0 + kPrefetchAhead + 16 - L), D * int64_t(sizeof(T)));
    for (int64_t u = 0; u < n; ++u) {
      const T* kt = kp + off[t0 + u];
      for (int c = 0; c < NC; ++c) _mm512_store_ps(kf[u] + c * 16, load16(kt + c * 16));
    }
    for (int64_t u = n; u < 16; ++u)
      for (int c = 0; c < NC; ++c) _mm512_store_ps(kf[u] + c * 16, _mm512_setzero_ps());
    for (int64_t j = 0; j < group; ++j) {
      __m512 qv[NC], part[16];
      for (int c = 0; c < NC; ++c) qv[c] = _mm512_loadu_ps(qh + j * D + c * 16);
      for (int u = 0; u < 16; ++u) {
        __m512 acc = _mm512_mul_ps(qv[0], _mm512_load_ps(kf[u]));
        for (int c = 1; c < NC; ++c) acc = _mm512_fmadd_ps(qv[c], _mm512_load_ps(kf[u] + c * 16), acc);
        part[u] = acc;
      }
      _mm512_mask_storeu_ps(scores + j * L + t0, first_lanes(n),
                            _mm512_mul_ps(sum16(part), sv));
    }
  }
  for (int64_t j = 0; j < group; ++j) softmax_avx512(scores + j * L, L);
  // pass 2: out = P V, for as many query heads at a time as keep their outputs in registers
  // (a group-sized array of them spilled to the stack on every key)
  constexpr int kHeads = std::min(MAXG, 24 / NC);
  for (int64_t j0 = 0; j0 < group; j0 += kHeads)
    with_count<kHeads>(std::min<int64_t>(kHeads, group - j0), [&]<int G>() {
      weighted_values<NC, G>(scores + j0 * L, L, off, vp, oh + j0 * D);
    });
}

#elif defined(__AVX2__) && defined(__FMA__)
// lane i = the sum of v[i]'s 8 lanes (two rounds of pairwise adds within 128-bit halves,
// then the halves added)
inline __m256 sum8(const __m256* v) {
  const __m256 a = _mm256_hadd_ps(v[0], v[1]), b = _mm256_hadd_ps(v[2], v[3]);
  const __m256 c = _mm256_hadd_ps(v[4], v[5]), d = _mm256_hadd_ps(v[6], v[7]);
  const __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);   // v0..3, v4..7 by half
  return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}

// decode_head_avx512's scheme on AVX2 (the avx2 build), head_dim = 8 * NC: 8 keys at a time,
// widened once into a float buffer, each query head's 8 partial products summed by one tree
// (`sum8`); the output of one query head at a time stays in registers while the V rows pass
// (16 ymm registers do not hold a whole group's). Against the plain loops below, which leave
// each key's dot product to one lane: 40-53 -> 17-18 ms for 32 requests x 180 keys x 30 layers
// (docs/benchmarks.md#decode-attention-on-avx2).
template <int NC, typename T>
void decode_head_avx2(const float* qh, const T* kp, const T* vp, const int64_t* table,
                      int64_t L, int64_t BS, int64_t row, int64_t group, float scale,
                      float* scores, float* oh) {
  constexpr int D = 8 * NC;
  const std::vector<int64_t>& offsets = key_offsets(table, L, BS, row);
  alignas(32) float kf[8][D];
  alignas(32) float tail[8];
  const __m256 sv = _mm256_set1_ps(scale);
  const int64_t* off = offsets.data();
  prefetch_rows(kp, sizeof(T), off, 0, std::min(L, kPrefetchAhead), D * int64_t(sizeof(T)));
  prefetch_rows(vp, sizeof(T), off, 0, std::min(L, kPrefetchAhead - L), D * int64_t(sizeof(T)));
  for (int64_t t0 = 0; t0 < L; t0 += 8) {                       // pass 1: scores
    const int64_t n = std::min<int64_t>(8, L - t0);
    prefetch_rows(kp, sizeof(T), off, t0 + kPrefetchAhead, std::min(L, t0 + kPrefetchAhead + 8),
                  D * int64_t(sizeof(T)));
    if (t0 + kPrefetchAhead + 8 > L)    // V's first rows, for pass 2
      prefetch_rows(vp, sizeof(T), off, std::max<int64_t>(0, t0 + kPrefetchAhead - L),
                    std::min(L, t0 + kPrefetchAhead + 8 - L), D * int64_t(sizeof(T)));
    for (int64_t u = 0; u < n; ++u) {
      const T* kt = kp + offsets[t0 + u];
      for (int c = 0; c < NC; ++c) _mm256_store_ps(kf[u] + c * 8, load8(kt + c * 8));
    }
    for (int64_t u = n; u < 8; ++u)
      for (int c = 0; c < NC; ++c) _mm256_store_ps(kf[u] + c * 8, _mm256_setzero_ps());
    for (int64_t j = 0; j < group; ++j) {
      const float* qj = qh + j * D;
      __m256 part[8];
      for (int u = 0; u < 8; ++u) {
        __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(qj), _mm256_load_ps(kf[u]));
        for (int c = 1; c < NC; ++c)
          acc = _mm256_fmadd_ps(_mm256_loadu_ps(qj + c * 8), _mm256_load_ps(kf[u] + c * 8), acc);
        part[u] = acc;
      }
      const __m256 s = _mm256_mul_ps(sum8(part), sv);
      if (n == 8) {
        _mm256_storeu_ps(scores + j * L + t0, s);
      } else {
        _mm256_store_ps(tail, s);
        std::copy(tail, tail + n, scores + j * L + t0);
      }
    }
  }
  softmax_rows(scores, group, L);                              // per query head
  for (int64_t j = 0; j < group; ++j) {                         // pass 2: out = P V
    __m256 acc[NC];
    for (int c = 0; c < NC; ++c) acc[c] = _mm256_setzero_ps();
    const float* pj = scores + j * L;
    for (int64_t t = 0; t < L; ++t) {
      if (j == 0 && t % 8 == 0)
        prefetch_rows(vp, sizeof(T), off, t + kPrefetchAhead, std::min(L, t + kPrefetchAhead + 8),
                      D * int64_t(sizeof(T)));
      const T* vt = vp + offsets[t];
      const __m256 p = _mm256_set1_ps(pj[t]);
      for (int c = 0; c < NC; ++c) acc[c] = _mm256_fmadd_ps(p, load8(vt + c * 8), acc[c]);
    }
    for (int c = 0; c < NC; ++c) _mm256_storeu_ps(oh + j * D + c * 8, acc[c]);
  }
}
#endif

// The same for any head_dim, in plain C++ (what the compiler vectorizes).
template <typename T>
void decode_head(const float* qh, const T* kp, const T* vp, const int64_t* table,
                        int64_t L, int64_t BS, int64_t row, int64_t group, int64_t D,
                        float scale, float* scores, float* oh) {
  for (int64_t t = 0; t < L; ++t) {                             // pass 1: scores
    const T* kt = kp + (table[t / BS] * BS + t % BS) * row;
    for (int64_t j = 0; j < group; ++j) {
      const float* qj = qh + j * D;
      float s = 0.f;
      for (int64_t i = 0; i < D; ++i) s += qj[i] * to_float(kt[i]);
      scores[j * L + t] = s * scale;
    }
  }
  softmax_rows(scores, group, L);                              // per query head
  std::fill(oh, oh + group * D, 0.f);                           // pass 2: out = P V
  for (int64_t t = 0; t < L; ++t) {
    const T* vt = vp + (table[t / BS] * BS + t % BS) * row;
    for (int64_t j = 0; j < group; ++j) {
      const float p = scores[j * L + t];
      float* oj = oh + j * D;
      for (int64_t i = 0; i < D; ++i) oj[i] += p * to_float(vt[i]);
    }
  }
}

}  // namespace

// Every (request, KV head) pair is one task: its group of query heads against the request's
// K and V rows of that head, read in place through the block table.
template <typename T>
void paged_decode(const float* qp, const T* kp, const T* vp, const int64_t* bt,
                  const int64_t* lens, int64_t G, int64_t H, int64_t D, int64_t BS, int64_t KVH,
                  int64_t max_blocks, float fscale, float* op) {
  const int64_t group = H / KVH;
  const int64_t row = KVH * D;           // elements per token in one block
#pragma omp parallel
  {
    std::vector<float> scores;
#pragma omp for schedule(dynamic, 1) collapse(2)
    for (int64_t g = 0; g < G; ++g) {
      for (int64_t kvh = 0; kvh < KVH; ++kvh) {
        const int64_t L = lens[g], first = (g * H + kvh * group) * D;
        scores.resize(group * L);
        const T* k = kp + kvh * D;
        const T* v = vp + kvh * D;
        const int64_t* table = bt + g * max_blocks;
#if defined(__AVX512F__)
        if (group <= 8 && D == 64) {
          decode_head_avx512<4, T>(qp + first, k, v, table, L, BS, row, group, fscale,
                                   scores.data(), op + first);
          continue;
        }
        if (group <= 8 && D == 128) {
          decode_head_avx512<8, T>(qp + first, k, v, table, L, BS, row, group, fscale,
                                   scores.data(), op + first);
          continue;
        }
#elif defined(__AVX2__) && defined(__FMA__)
        if (D == 64) {
          decode_head_avx2<8, T>(qp + first, k, v, table, L, BS, row, group, fscale,
                                 scores.data(), op + first);
          continue;
        }
        if (D == 128) {
          decode_head_avx2<16, T>(qp + first, k, v, table, L, BS, row, group, fscale,
                                  scores.data(), op + first);
          continue;
        }
#endif
        decode_head<T>(qp + first, k, v, table, L, BS, row, group, D, fscale, scores.data(),
                       op + first);
      }
    }
  }
}

// A whole decode step of attention from the fused projection's bfloat16 output, for the
// single-row path where each of these used to be its own torch op (and tensor): widen q and k,
// rotate them (rotate-half RoPE at each row's position), store k and v in their cache slots,
// attend, round the output to bfloat16 for the next GEMM. Same arithmetic as those ops.
template <typename T>
void decode_attention_block(const bf16* qkv, const int64_t* positions, const float* cos,
                            const float* sin, T* k_cache, T* v_cache, const int64_t* slots,
                            const int64_t* bt, const int64_t* lens, int64_t G, int64_t H,
                            int64_t KVH, int64_t D, int64_t BS, int64_t max_blocks, float scale,
                            bf16* out) {
  const int64_t qn = H * D;
  std::vector<float> q(G * qn), o(G * qn);
  std::vector<float*> q_rows(G);
  for (int64_t g = 0; g < G; ++g) q_rows[g] = q.data() + g * qn;
  rope_and_store<T>(qkv, positions, cos, sin, k_cache, v_cache, slots, G, H, KVH, D,
                    q_rows.data());
  paged_decode<T>(q.data(), k_cache, v_cache, bt, lens, G, H, D, BS, KVH, max_blocks, scale,
                  o.data());
  for (int64_t i = 0; i < G * qn; ++i) out[i] = to_bf16(o[i]);
}

template <typename T>
void rope_and_store(const bf16* qkv, const int64_t* positions, const float* cos, const float* sin,
                    T* k_cache, T* v_cache, const int64_t* slots, int64_t rows, int64_t H,
                    int64_t KVH, int64_t D, float* const* q_rows) {
  const int64_t row = (H + 2 * KVH) * D, qn = H * D, kn = KVH * D;
#pragma omp parallel if (rows >= 16)
  {
    std::vector<float> k(kn);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < rows; ++t) {
      const bf16* r = qkv + t * row;
      float* qt = q_rows[t];
      for (int64_t i = 0; i < qn; ++i) qt[i] = to_float(r[i]);
      for (int64_t i = 0; i < kn; ++i) k[i] = to_float(r[qn + i]);
      // fused_ops.cpp's rotary itself: the bits of the op-by-op path
      rotary_row(qt, positions[t], cos, sin, H, D);
      rotary_row(k.data(), positions[t], cos, sin, KVH, D);
      T* kd = k_cache + slots[t] * kn;
      T* vd = v_cache + slots[t] * kn;
      for (int64_t i = 0; i < kn; ++i) {
        kd[i] = from_float<T>(k[i]);
        vd[i] = from_float<T>(to_float(r[qn + kn + i]));
      }
    }
  }
}

template void rope_and_store<float>(const bf16*, const int64_t*, const float*, const float*,
                                    float*, float*, const int64_t*, int64_t, int64_t, int64_t,
                                    int64_t, float* const*);
template void rope_and_store<bf16>(const bf16*, const int64_t*, const float*, const float*,
                                   bf16*, bf16*, const int64_t*, int64_t, int64_t, int64_t,
                                   int64_t, float* const*);

template void decode_attention_block<float>(const bf16*, const int64_t*, const float*,
                                            const float*, float*, float*, const int64_t*,
                                            const int64_t*, const int64_t*, int64_t, int64_t,
                                            int64_t, int64_t, int64_t, int64_t, float, bf16*);
template void decode_attention_block<bf16>(const bf16*, const int64_t*, const float*,
                                           const float*, bf16*, bf16*, const int64_t*,
                                           const int64_t*, const int64_t*, int64_t, int64_t,
                                           int64_t, int64_t, int64_t, int64_t, float, bf16*);

template void paged_decode<float>(const float*, const float*, const float*, const int64_t*,
                                  const int64_t*, int64_t, int64_t, int64_t, int64_t, int64_t,
                                  int64_t, float, float*);
template void paged_decode<bf16>(const float*, const bf16*, const bf16*, const int64_t*,
                                 const int64_t*, int64_t, int64_t, int64_t, int64_t, int64_t,
                                 int64_t, float, float*);

}  // namespace pacer
