// Prefill attention straight from the paged KV pool on CPU, for chunks of any length: query
// row i of a chunk sits at position kv_len - q_rows + i and sees keys 0..that position (its
// cached prefix fully, its own chunk causally; docs/design.md#chunks). The chunk's own K/V must be in
// the cache already (the backend writes them first), so a fresh prompt, a later chunk and a
// prefix of any length take the same path, with no gathered copy and no mask tensor.
//
// Two phases per call (docs/design.md#prefill-attention-on-cpu):
// 1. pack: each chunk's keys, per KV head, widened to float32 and transposed into spans of 2W
//    keys ([D][2W]: lane = key), its values widened to [keys][D]; once per chunk, shared by
//    all of its row tiles (a few hundred keys of prefix are read once, not once per tile);
// 2. tiles: a task is one chunk's KV head and a tile of query rows (all the query heads of
//    that KV head: GQA). Its scores S = Q Kᵀ come from a register-blocked microkernel (MR
//    query vectors × 2W keys, one FMA chain per score over the head's dims), then an exact
//    softmax per row (max first, no running correction), then O = P V from a second
//    microkernel (MR query vectors × CV vectors of the head's dims, the value rows shared).
//    Tiles are sized so that every thread has several and the scores of one stay in L2.
//
// Each score, each row's sum and each output element is accumulated in one order that depends
// on the row's own position only (keys past it count as exact zeros), never on the tile, the
// microkernel's row count or the thread: a prompt's bits do not depend on where the budget cut
// its chunks. Float32 math (this file is compiled without -ffast-math: kernel_build.EXACT_MATH);
// the cache float32 or bfloat16. AVX-512 (W = 16) and AVX2 + FMA (W = 8) builds; head_dim 64
// and 128.
//
//   q            [T, H, d]   float32, the iteration's flat batch
//   k/v_cache    [blocks, bs, KVH, d]
//   block_table  [R, max_blocks] int32
//   cu_seqlens_q [R + 1] int32, kv_lens [R] int32
//   out          [T, H, d]   float32; rows of chunks shorter than min_rows are left untouched
// (bindings.cpp checks the tensors; this file sees raw pointers.)
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels.h"

namespace pacer {

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
namespace {

#if defined(__AVX512F__)
struct Isa {
  using V = __m512;
  static constexpr int W = 16;
  static constexpr int kScoreRows = 8;    // S microkernel: 8 query vectors x 2 key vectors
  static constexpr int kOutRows = 6;      // P V microkernel: 6 query vectors x 4 dim vectors
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  template <typename T> static V widen(const T* p) { return load16(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  static V exp(V x) { return exp16(x); }
  static V first(V v, int64_t n) { return _mm512_maskz_mov_ps(first_lanes(n), v); }
  static float hmax(V v) { return _mm512_reduce_max_ps(v); }
  static float hsum(V v) { return _mm512_reduce_add_ps(v); }
};
#else
struct Isa {
  using V = __m256;
  static constexpr int W = 8;
  static constexpr int kScoreRows = 6;    // 16 ymm registers: 12 accumulators, 2 keys, 1 query
  static constexpr int kOutRows = 2;      // 8 accumulators, 4 value vectors, 1 weight
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  template <typename T> static V widen(const T* p) { return load8(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static V exp(V x) { return exp8(x); }
  static V first(V v, int64_t n) {        // lanes [0, n) kept, the rest 0
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::min<int64_t>(n, 8))), lane);
    return _mm256_and_ps(v, _mm256_castsi256_ps(keep));
  }
  static float hmax(V v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
  }
  static float hsum(V v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
};
#endif

using V = Isa::V;
constexpr int64_t W = Isa::W;
constexpr int64_t kSpan = 2 * W;             // keys per packed span: the S microkernel's width
constexpr int64_t kOutVecs = 4;              // dim vectors per P V microkernel pass
constexpr int64_t kMaxTileRows = 32;
constexpr int64_t kScoresPerTile = 1 << 17;  // floats of S per tile (512 KiB: L2)
constexpr int64_t kPackFloats = 1 << 23;     // packed K/V per round of chunks (32 MiB)

int64_t spans(int64_t keys) { return (keys + kSpan - 1) / kSpan; }

// One chunk's KV head, packed: Kᵀ by spans [spans][D][kSpan], V [spans * kSpan][D]; keys past
// the chunk's last are zeros.
template <int D, typename T>
void pack_span(const T* kbase, const T* vbase, const int32_t* table, int64_t BS, int64_t row,
               int64_t keys, int64_t span, float* kt, float* vf) {
  alignas(64) float tmp[D];
  float* kspan = kt + span * D * kSpan;
  for (int64_t k = 0; k < kSpan; ++k) {
    const int64_t t = span * kSpan + k;
    float* vrow = vf + t * D;
    if (t < keys) {
      const int64_t slot = (static_cast<int64_t>(table[t / BS]) * BS + t % BS) * row;
      for (int64_t c = 0; c < D; c += W) {
        Isa::store(tmp + c, Isa::widen(kbase + slot + c));
        Isa::store(vrow + c, Isa::widen(vbase + slot + c));
      }
      for (int64_t i = 0; i < D; ++i) kspan[i * kSpan + k] = tmp[i];
    } else {
      for (int64_t c = 0; c < D; c += W) Isa::store(vrow + c, Isa::zero());
      for (int64_t i = 0; i < D; ++i) kspan[i * kSpan + k] = 0.f;
    }
  }
}

// S[r][0, kSpan) = q_r · the span's keys for R query vectors (rows of D floats)
template <int D>
struct ScoreTile {
  const float* q;
  const float* kspan;
  float* s;
  int64_t s_stride;
  template <int R>
  void operator()(int64_t r0) const {
    V a[R][2];
    for (int r = 0; r < R; ++r) a[r][0] = a[r][1] = Isa::zero();
    const float* qr = q + r0 * D;
    for (int64_t i = 0; i < D; ++i) {
      const V k0 = Isa::load(kspan + i * kSpan), k1 = Isa::load(kspan + i * kSpan + W);
      for (int r = 0; r < R; ++r) {
        const V qi = Isa::set1(qr[r * D + i]);
        a[r][0] = Isa::fma(qi, k0, a[r][0]);
        a[r][1] = Isa::fma(qi, k1, a[r][1]);
      }
    }
    for (int r = 0; r < R; ++r) {
      Isa::store(s + (r0 + r) * s_stride, a[r][0]);
      Isa::store(s + (r0 + r) * s_stride + W, a[r][1]);
    }
  }
};

// O[r][c0 W, (c0 + kOutVecs) W) = Σ_k P[r][k] V[k] over keys [0, nkeys) for R query vectors
template <int D>
struct OutTile {
  const float* p;
  int64_t p_stride;
  const float* vf;
  const int64_t* nkeys;      // per query vector: keys it sees
  const float* inv;          // per query vector: 1 / its softmax sum
  float* o;                  // per query vector: D floats
  int64_t c0;
  template <int R>
  void operator()(int64_t r0) const {
    V a[R][kOutVecs];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < kOutVecs; ++c) a[r][c] = Isa::zero();
    int64_t n = 0;
    for (int r = 0; r < R; ++r) n = std::max(n, nkeys[r0 + r]);   // zeros past each row's own
    const float* pr = p + r0 * p_stride;
    const float* vc = vf + c0 * W;
    for (int64_t k = 0; k < n; ++k) {
      V v[kOutVecs];
      for (int c = 0; c < kOutVecs; ++c) v[c] = Isa::load(vc + k * D + c * W);
      for (int r = 0; r < R; ++r) {
        const V pk = Isa::set1(pr[r * p_stride + k]);
        for (int c = 0; c < kOutVecs; ++c) a[r][c] = Isa::fma(pk, v[c], a[r][c]);
      }
    }
    for (int r = 0; r < R; ++r) {
      const V scale = Isa::set1(inv[r0 + r]);
      for (int c = 0; c < kOutVecs; ++c)
        Isa::store(o + (r0 + r) * D + (c0 + c) * W, Isa::mul(a[r][c], scale));
    }
  }
};

struct TileScratch {
  std::vector<float> q, s, inv, o;
  std::vector<int64_t> nkeys;
};

// The query vectors of `rows` rows from position first_pos on (one KV head's group each)
// against the packed keys: out rows written in place.
template <int D>
void tile(const float* q, float* out, int64_t rows, int64_t first_pos, int64_t H, int64_t group,
          const float* kt, const float* vf, float scale, TileScratch& ts) {
  const int64_t nq = rows * group, last = first_pos + rows - 1;
  const int64_t L = spans(last + 1) * kSpan;               // keys the tile's scores cover
  ts.q.resize(nq * D);
  ts.s.resize(nq * L);
  ts.inv.resize(nq);
  ts.nkeys.resize(nq);
  const V vscale = Isa::set1(scale);
  for (int64_t r = 0; r < rows; ++r)                        // pre-scaled, contiguous
    for (int64_t j = 0; j < group; ++j) {
      const int64_t v = r * group + j;
      for (int64_t c = 0; c < D; c += W)
        Isa::store(ts.q.data() + v * D + c, Isa::mul(Isa::load(q + (r * H + j) * D + c), vscale));
      ts.nkeys[v] = first_pos + r + 1;
    }
  float* s = ts.s.data();
  for (int64_t sp = 0; sp < L / kSpan; ++sp)                // S = Q Kᵀ, span by span
    in_row_tiles<Isa::kScoreRows>(nq, ScoreTile<D>{ts.q.data(), kt + sp * D * kSpan,
                                                   s + sp * kSpan, L});
  for (int64_t v = 0; v < nq; ++v) {                        // softmax, exact, row by row
    float* sv = s + v * L;
    const int64_t n = ts.nkeys[v], full = n / W, vecs = (n + W - 1) / W;
    V m = Isa::set1(-INFINITY);
    for (int64_t c = 0; c < full; ++c) m = Isa::max(m, Isa::load(sv + c * W));
    float mx = Isa::hmax(m);
    for (int64_t k = full * W; k < n; ++k) mx = std::max(mx, sv[k]);
    const V vm = Isa::set1(mx);
    V sum = Isa::zero();
    for (int64_t c = 0; c < vecs; ++c) {
      V e = Isa::exp(Isa::sub(Isa::load(sv + c * W), vm));
      if (c == full) e = Isa::first(e, n - full * W);       // keys past the row's own: 0
      Isa::store(sv + c * W, e);
      sum = Isa::add(sum, e);
    }
    for (int64_t k = vecs * W; k < L; ++k) sv[k] = 0.f;
    ts.inv[v] = 1.f / Isa::hsum(sum);
  }
  ts.o.resize(nq * D);
  for (int64_t c0 = 0; c0 < D / W; c0 += kOutVecs)          // O = P V / sum
    in_row_tiles<Isa::kOutRows>(nq, OutTile<D>{s, L, vf, ts.nkeys.data(), ts.inv.data(),
                                               ts.o.data(), c0});
  for (int64_t r = 0; r < rows; ++r)        // query vector r * group + j: out row r's head j
    std::copy(ts.o.data() + r * group * D, ts.o.data() + (r + 1) * group * D, out + r * H * D);
}

template <int D, typename T>
void prefill(const float* qp, const T* kp, const T* vp, const int32_t* bt, const int32_t* cu,
             const int32_t* lens, int64_t R, int64_t H, int64_t BS, int64_t KVH,
             int64_t max_blocks, int64_t min_rows, float fscale, float* op) {
  const int64_t group = H / KVH, row = KVH * D;
  const int64_t threads = omp_get_max_threads();
  static thread_local std::vector<float> pack;   // grows, never shrinks: no page faults per call
  struct Chunk { int64_t g, keys, offset; };     // offset: its packed K/V in `pack`
  struct Task { int64_t chunk, kvh, r0, rows; };
  for (int64_t g0 = 0; g0 < R;) {                // rounds of chunks whose packing fits kPackFloats
    std::vector<Chunk> chunks;
    int64_t floats = 0, rows_total = 0;
    int64_t g = g0;
    for (; g < R; ++g) {
      const int64_t n = cu[g + 1] - cu[g];
      if (n < min_rows) continue;
      const int64_t need = KVH * spans(lens[g]) * kSpan * D * 2;
      if (!chunks.empty() && floats + need > kPackFloats) break;
      chunks.push_back({g, lens[g], floats});
      floats += need;
      rows_total += n;
    }
    g0 = g;
    if (chunks.empty()) continue;
    if (static_cast<int64_t>(pack.size()) < floats) pack.resize(floats);
    float* packed = pack.data();
    // tiles: several per thread where the rows allow, scores within kScoresPerTile
    std::vector<Task> tasks;
    const int64_t tiles_wanted = (4 * threads + KVH - 1) / KVH;
    const int64_t min_tile = std::max<int64_t>(1, (Isa::kScoreRows + group - 1) / group);
    for (int64_t c = 0; c < static_cast<int64_t>(chunks.size()); ++c) {
      const int64_t n = cu[chunks[c].g + 1] - cu[chunks[c].g];
      const int64_t share = std::max<int64_t>(1, tiles_wanted * n / std::max<int64_t>(1, rows_total));
      const int64_t fit = kScoresPerTile / (group * spans(chunks[c].keys) * kSpan);
      const int64_t tr = std::clamp<int64_t>(std::min((n + share - 1) / share, fit), min_tile,
                                             kMaxTileRows);
      for (int64_t r0 = n; r0 > 0; r0 -= tr)     // last tiles first: they cost the most
        for (int64_t h = 0; h < KVH; ++h)
          tasks.push_back({c, h, std::max<int64_t>(0, r0 - tr), std::min(tr, r0)});
    }
    // pack tasks: (chunk, KV head, span)
    std::vector<int64_t> pack_first(chunks.size() + 1, 0);
    for (size_t c = 0; c < chunks.size(); ++c)
      pack_first[c + 1] = pack_first[c] + KVH * spans(chunks[c].keys);
#pragma omp parallel
    {
#pragma omp for schedule(dynamic, 4)
      for (int64_t i = 0; i < pack_first.back(); ++i) {
        const int64_t c = std::upper_bound(pack_first.begin(), pack_first.end(), i) -
                          pack_first.begin() - 1;
        const Chunk& ch = chunks[c];
        const int64_t ns = spans(ch.keys), h = (i - pack_first[c]) / ns, sp = (i - pack_first[c]) % ns;
        float* kt = packed + ch.offset + h * ns * kSpan * D * 2;
        pack_span<D, T>(kp + h * D, vp + h * D, bt + ch.g * max_blocks, BS, row, ch.keys, sp, kt,
                        kt + ns * kSpan * D);
      }
      static thread_local TileScratch ts;
#pragma omp for schedule(dynamic, 1)
      for (size_t i = 0; i < tasks.size(); ++i) {
        const Task& t = tasks[i];
        const Chunk& ch = chunks[t.chunk];
        const int64_t n = cu[ch.g + 1] - cu[ch.g], ns = spans(ch.keys);
        const float* kt = packed + ch.offset + t.kvh * ns * kSpan * D * 2;
        const int64_t offset = ((cu[ch.g] + t.r0) * H + t.kvh * group) * D;
        tile<D>(qp + offset, op + offset, t.rows, ch.keys - n + t.r0, H, group, kt,
                kt + ns * kSpan * D, fscale, ts);
      }
    }
  }
}

}  // namespace
#endif

bool paged_prefill_supported(int64_t head_dim, int64_t group) {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
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
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  if (D == 64)
    prefill<64, T>(q, k_cache, v_cache, block_table, cu_seqlens_q, kv_lens, R, H, BS, KVH,
                   max_blocks, min_rows, scale, out);
  if (D == 128)
    prefill<128, T>(q, k_cache, v_cache, block_table, cu_seqlens_q, kv_lens, R, H, BS, KVH,
                    max_blocks, min_rows, scale, out);
#else
  (void)q, (void)k_cache, (void)v_cache, (void)block_table, (void)cu_seqlens_q, (void)kv_lens;
  (void)R, (void)H, (void)D, (void)BS, (void)KVH, (void)max_blocks, (void)min_rows, (void)scale;
  (void)out;
#endif
}

template <typename T>
void mixed_attention_block(const bf16* qkv, const int64_t* positions, const float* cos,
                           const float* sin, T* k_cache, T* v_cache, const int64_t* slots,
                           int64_t rows, const int64_t* dec_rows, const int64_t* dec_bt,
                           const int64_t* dec_lens, int64_t Gd, const int64_t* pre_rows,
                           int64_t Tp, const int32_t* pre_bt, const int32_t* pre_cu,
                           const int32_t* pre_lens, int64_t R, int64_t H, int64_t KVH, int64_t D,
                           int64_t BS, int64_t MB, float scale, bf16* out) {
  const int64_t qn = H * D;
  // reused call after call (every layer of every iteration): no allocation, no page faults
  static thread_local std::vector<float> qd, od, qp, op;
  static thread_local std::vector<float*> q_rows, o_rows;
  for (auto* v : {&qd, &od}) v->resize(Gd * qn);
  for (auto* v : {&qp, &op}) v->resize(Tp * qn);
  q_rows.resize(rows);
  o_rows.resize(rows);
  for (int64_t i = 0; i < Gd; ++i) {
    q_rows[dec_rows[i]] = qd.data() + i * qn;
    o_rows[dec_rows[i]] = od.data() + i * qn;
  }
  for (int64_t i = 0; i < Tp; ++i) {
    q_rows[pre_rows[i]] = qp.data() + i * qn;
    o_rows[pre_rows[i]] = op.data() + i * qn;
  }
  rope_and_store<T>(qkv, positions, cos, sin, k_cache, v_cache, slots, rows, H, KVH, D,
                    q_rows.data());
  if (Gd)
    paged_decode<T>(qd.data(), k_cache, v_cache, dec_bt, dec_lens, Gd, H, D, BS, KVH, MB, scale,
                    od.data());
  if (Tp)
    paged_prefill<T>(qp.data(), k_cache, v_cache, pre_bt, pre_cu, pre_lens, R, H, D, BS, KVH, MB,
                     1, scale, op.data());
  float* const* src = o_rows.data();
#pragma omp parallel for schedule(static) if (rows >= 16)
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t j = 0; j < qn; ++j) out[t * qn + j] = to_bf16(src[t][j]);
}

template void mixed_attention_block<float>(const bf16*, const int64_t*, const float*,
                                           const float*, float*, float*, const int64_t*, int64_t,
                                           const int64_t*, const int64_t*, const int64_t*,
                                           int64_t, const int64_t*, int64_t, const int32_t*,
                                           const int32_t*, const int32_t*, int64_t, int64_t,
                                           int64_t, int64_t, int64_t, int64_t, float, bf16*);
template void mixed_attention_block<bf16>(const bf16*, const int64_t*, const float*, const float*,
                                          bf16*, bf16*, const int64_t*, int64_t, const int64_t*,
                                          const int64_t*, const int64_t*, int64_t, const int64_t*,
                                          int64_t, const int32_t*, const int32_t*, const int32_t*,
                                          int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                                          float, bf16*);

template void paged_prefill<float>(const float*, const float*, const float*, const int32_t*,
                                   const int32_t*, const int32_t*, int64_t, int64_t, int64_t,
                                   int64_t, int64_t, int64_t, int64_t, float, float*);
template void paged_prefill<bf16>(const float*, const bf16*, const bf16*, const int32_t*,
                                  const int32_t*, const int32_t*, int64_t, int64_t, int64_t,
                                  int64_t, int64_t, int64_t, int64_t, float, float*);

}  // namespace pacer
