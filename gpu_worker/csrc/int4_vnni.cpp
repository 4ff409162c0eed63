// int4 weights times 8-bit activations with AVX512-VNNI integer dot products
// (docs/benchmarks.md#quantized-weights): what llama.cpp does for a Q4 file, here for every
// row count. `vpdpbusd` multiplies 64 byte pairs per instruction, twice the pairs of
// AVX512-BF16's `vdpbf16ps`, and the 4-bit codes enter it as they are (a mask and a shift),
// with no widening to bfloat16 first. The avx2 build computes the same integer dot products
// with `vpmaddubsw` + `vpmaddwd` (below) and gives the same bits.
//
// Weights, in the layout `int4_vnni_layout` (gpu_worker/quant/linear.py) writes: one stream of
// bytes per block of 16 output columns, in k order, each group of k as its 16 (scale, zero)
// bfloat16 pairs (64 bytes) followed by its codes, 256 bytes per 32 k: four 64-byte vectors
// p = 0..3, byte 4c + i of vector p holding column c's codes for k = 4p + i (low nibble) and
// k = 16 + 4p + i (high nibble): one vector and a nibble are one `vpdpbusd` operand, 16
// columns x 4 k. A column block's scales travel with its codes (as in a GGUF Q4 block), so one
// row of x reads the weights in one sequential pass; kept apart, [K / group, N] scales were a
// strided read, a page apart for every block of 32 k, which the hardware prefetcher did not
// follow.
//
// Activations: each row of x quantized in blocks of 32 k (`quantize_row`): d = max|x| / 127,
// q = round(x / d) in int8, and the block's sum of q. With the file's w = (c - 8) s + z per
// group, one block's contribution to out[m][n] is
//     d (s sum(q c) + (z - 8 s) sum q)
// (s, z the block's group's scale and zero for column n), summed over the blocks in k order in
// float32. A row's output depends on that row alone, whatever the batch.
//
//   x            [M, K] bfloat16
//   w            [N / 16, K / group, 64 + 8 group] uint8 (scales, zeros and codes)
//   out          [M, N] bfloat16
//
// int8 weights with one scale per output column (the LM head, `--quantization int8`) the same
// way (`int8_mm_vnni`): codes in the order [N / 16, K / 4, 16, 4] (one 64-byte vector is 16
// columns x 4 k, a `vpdpbusd` operand), the same 8-bit rows of x, and per block the exact
// integer sum sum(q c) turned into float32: out[m][n] = s_n sum_b d_b sum(q c). `vpdpbusd`
// multiplies unsigned by signed bytes: the codes enter as c + 128 (a flipped sign bit) and
// 128 sum q comes off the integer sum; AVX2 moves c's sign onto q instead (`vpsignb`, as
// llama.cpp's Q8 kernels do). Both sums are exact, and the float steps are the same: both
// builds give the same bits, and a row's output depends on that row alone.
//
//   w8           [N / 16, K / 4, 16, 4] int8, scale [N] bfloat16, out [M, N] float32 or bf16
#include <algorithm>
#include <memory>
#include <type_traits>

#include "kernels.h"

namespace pacer {

#if defined(__AVX512F__)
namespace {

constexpr int64_t kBlock = 32;

// one row of x [K]: codes q [K] int8, per block d [K / 32] and sum q [K / 32]
void quantize_row(const bf16* x, int64_t K, int8_t* q, float* d, float* sum) {
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const bf16* xb = x + b * kBlock;
    const __m512 lo = load16(xb), hi = load16(xb + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    // (this file is compiled without -ffast-math: kernel_build.EXACT_MATH)
    const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    const __m512i ql = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inv));   // nearest, ties even
    const __m512i qh = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * kBlock), _mm512_cvtsepi32_epi8(ql));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * kBlock + 16), _mm512_cvtsepi32_epi8(qh));
    d[b] = amax / 127.f;
    sum[b] = static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(ql, qh)));
  }
}

// R rows of x against one block of 16 columns; each k block's integer sums turned into
// float32 and added in k order
template <int R>
__attribute__((target("avx512vnni"))) inline void vnni_rows(
    const int8_t* q, const float* d, const float* sum, int64_t K, const uint8_t* w,
    int64_t N, int64_t group, bf16* out) {
  const int64_t nb = K / kBlock, per_group = group / kBlock;
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const uint8_t* gp = w;            // the block's group (no division per block)
  for (int64_t b = 0, in_group = 0; b < nb; ++b) {
    __m512i dot[R];
    for (int r = 0; r < R; ++r) dot[r] = _mm512_setzero_si512();
    const __m512i* wb = reinterpret_cast<const __m512i*>(gp + 64 + in_group * 256);
    for (int p = 0; p < 4; ++p) {
      const __m512i v = _mm512_loadu_si512(wb + p);
      const __m512i lo = _mm512_and_si512(v, nibble);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
      for (int r = 0; r < R; ++r) {
        const int32_t* qr = reinterpret_cast<const int32_t*>(q + r * K + b * kBlock);
        dot[r] = _mm512_dpbusd_epi32(dot[r], lo, _mm512_set1_epi32(qr[p]));
        dot[r] = _mm512_dpbusd_epi32(dot[r], hi, _mm512_set1_epi32(qr[p + 4]));
      }
    }
    __m512 s, z;
    load16_pairs(gp, s, z);
    const __m512 bias = _mm512_fnmadd_ps(_mm512_set1_ps(8.f), s, z);       // z - 8 s
    for (int r = 0; r < R; ++r) {
      const __m512 block = _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(dot[r]),
                                           _mm512_mul_ps(bias, _mm512_set1_ps(sum[r * nb + b])));
      acc[r] = _mm512_fmadd_ps(block, _mm512_set1_ps(d[r * nb + b]), acc[r]);
    }
    if (++in_group == per_group) {
      in_group = 0;
      gp += 64 + 8 * group;
    }
  }
  for (int r = 0; r < R; ++r)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * N), round_bf16(acc[r]));
}

// R rows of x against one block of 16 int8 columns (`w8`: its K / 4 vectors of 64 bytes)
template <int R, typename O>
__attribute__((target("avx512vnni"))) inline void vnni8_rows(
    const int8_t* q, const float* d, const float* sum, int64_t K, const int8_t* w8,
    const bf16* scale, int64_t N, O* out) {
  const int64_t nb = K / kBlock;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));     // c + 128, unsigned
  // one row: two integer chains per block (the sum is exact in any order) for the latency
  constexpr int C = R < 4 ? 2 : 1;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512i dot[C][R];
    for (int c = 0; c < C; ++c)
      for (int r = 0; r < R; ++r) dot[c][r] = _mm512_setzero_si512();
    const __m512i* wb = reinterpret_cast<const __m512i*>(w8 + b * 512);
    for (int p = 0; p < 8; ++p) {
      const __m512i u = _mm512_xor_si512(_mm512_loadu_si512(wb + p), flip);
      for (int r = 0; r < R; ++r) {
        const int32_t* qr = reinterpret_cast<const int32_t*>(q + r * K + b * kBlock);
        dot[p % C][r] = _mm512_dpbusd_epi32(dot[p % C][r], u, _mm512_set1_epi32(qr[p]));
      }
    }
    for (int r = 0; r < R; ++r) {
      __m512i total = dot[0][r];
      if constexpr (C == 2) total = _mm512_add_epi32(total, dot[1][r]);
      total = _mm512_sub_epi32(total, _mm512_set1_epi32(128 * static_cast<int32_t>(sum[r * nb + b])));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), _mm512_set1_ps(d[r * nb + b]), acc[r]);
    }
  }
  const __m512 s = load16(scale);
  for (int r = 0; r < R; ++r) {
    const __m512 y = _mm512_mul_ps(acc[r], s);
    if constexpr (std::is_same_v<O, float>)
      _mm512_storeu_ps(out + r * N, y);
    else
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * N), round_bf16(y));
  }
}

constexpr int kTile = 8;           // rows a microkernel holds (16 of 32 zmm registers)

}  // namespace

bool vnni_ready() { return __builtin_cpu_supports("avx512vnni"); }

#elif defined(__AVX2__) && defined(__FMA__)
// The same product on AVX2 (the avx2 build): `vpdpbusd` does not exist there, so each of its
// 4-byte dot products is `vpmaddubsw` (byte pairs to 16 bits), and a block's 16-bit pair sums
// are widened by one `vpmaddwd` by ones (pairs of those to 32 bits). No 16-bit sum saturates or
// wraps: a pair of products is at most 2 * 15 * 127 = 3810 and a block adds 8 of them per lane
// (30480 < 32767), so the integer sums equal vpdpbusd's and the float steps are the same
// operations in the same order: both builds give the same bits. 16 columns are two halves of
// 8 (the first and last 32 bytes of each 64-byte vector).
namespace {

constexpr int64_t kBlock = 32;
constexpr int kTile = 4;           // rows a microkernel holds (AVX2 has 16 ymm registers)

float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

void quantize_row(const bf16* x, int64_t K, int8_t* q, float* d, float* sum) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const bf16* xb = x + b * kBlock;
    __m256 v[4], m = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = load8(xb + 8 * i);
      m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
    }
    const float amax = hmax8(m);
    // (this file is compiled without -ffast-math: kernel_build.EXACT_MATH)
    const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    alignas(32) int32_t c[32];
    int32_t total = 0;
    for (int i = 0; i < 4; ++i)     // nearest, ties even (|c| <= 127: no clamp needed)
      _mm256_store_si256(reinterpret_cast<__m256i*>(c + 8 * i),
                         _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv)));
    for (int i = 0; i < 32; ++i) {
      q[b * kBlock + i] = static_cast<int8_t>(c[i]);
      total += c[i];
    }
    d[b] = amax / 127.f;
    sum[b] = static_cast<float>(total);
  }
}

template <int R>
inline void vnni_rows(const int8_t* q, const float* d, const float* sum, int64_t K,
                      const uint8_t* w, int64_t N, int64_t group, bf16* out) {
  const int64_t nb = K / kBlock, per_group = group / kBlock;
  const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  for (int half = 0; half < 2; ++half) {
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    const uint8_t* gp = w;            // the block's group (no division per block)
    for (int64_t b = 0, in_group = 0; b < nb; ++b) {
      const uint8_t* wb = gp + 64 + in_group * 256 + 32 * half;
      // the block's pairs summed in 16 bits, widened once: 4 vectors x 2 nibbles of pairs
      // are at most 8 * 3810 = 30480 < 32767 in magnitude, so no sum wraps
      __m256i pairs[R];
      for (int r = 0; r < R; ++r) pairs[r] = _mm256_setzero_si256();
      for (int p = 0; p < 4; ++p) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 64 * p));
        const __m256i lo = _mm256_and_si256(v, nibble);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
        for (int r = 0; r < R; ++r) {
          const int32_t* qr = reinterpret_cast<const int32_t*>(q + r * K + b * kBlock);
          pairs[r] = _mm256_add_epi16(pairs[r], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(qr[p])));
          pairs[r] = _mm256_add_epi16(pairs[r],
                                      _mm256_maddubs_epi16(hi, _mm256_set1_epi32(qr[p + 4])));
          // keep the sum a chain: reassociated into a tree, every product stays live at
          // once and spills to the stack (the integer sum is the same either way)
          asm("" : "+x"(pairs[r]));
        }
      }
      __m256 s, z;
      load8_pairs(gp + 32 * half, s, z);
      const __m256 bias = _mm256_fnmadd_ps(_mm256_set1_ps(8.f), s, z);       // z - 8 s
      for (int r = 0; r < R; ++r) {
        const __m256i dot = _mm256_madd_epi16(pairs[r], ones);
        const __m256 block = _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(dot),
                                             _mm256_mul_ps(bias, _mm256_set1_ps(sum[r * nb + b])));
        acc[r] = _mm256_fmadd_ps(block, _mm256_set1_ps(d[r * nb + b]), acc[r]);
      }
      if (++in_group == per_group) {
        in_group = 0;
        gp += 64 + 8 * group;
      }
    }
    for (int r = 0; r < R; ++r)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + r * N + 8 * half), round8_bf16(acc[r]));
  }
}

// int8: c's sign moved onto q (`vpsignb`), |c| the unsigned operand; a pair of products is at
// most 2 * 128 * 127 < 32767, so `vpmaddubsw` never saturates and the sums are vpdpbusd's
template <int R, typename O>
inline void vnni8_rows(const int8_t* q, const float* d, const float* sum, int64_t K,
                       const int8_t* w8, const bf16* scale, int64_t N, O* out) {
  (void)sum;                       // (the unsigned operand is |c|: nothing to take off)
  const int64_t nb = K / kBlock;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int half = 0; half < 2; ++half) {
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      __m256i dot[R];
      for (int r = 0; r < R; ++r) dot[r] = _mm256_setzero_si256();
      const int8_t* wb = w8 + b * 512 + 32 * half;
      for (int p = 0; p < 8; ++p) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 64 * p));
        const __m256i a = _mm256_abs_epi8(v);
        for (int r = 0; r < R; ++r) {
          const int32_t* qr = reinterpret_cast<const int32_t*>(q + r * K + b * kBlock);
          const __m256i sq = _mm256_sign_epi8(_mm256_set1_epi32(qr[p]), v);
          dot[r] = _mm256_add_epi32(dot[r], _mm256_madd_epi16(_mm256_maddubs_epi16(a, sq), ones));
          asm("" : "+x"(dot[r]));      // a chain, as in vnni_rows
        }
      }
      for (int r = 0; r < R; ++r)
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r]), _mm256_set1_ps(d[r * nb + b]), acc[r]);
    }
    const __m256 s = load8(scale + 8 * half);
    for (int r = 0; r < R; ++r) {
      const __m256 y = _mm256_mul_ps(acc[r], s);
      if constexpr (std::is_same_v<O, float>)
        _mm256_storeu_ps(out + r * N + 8 * half, y);
      else
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + r * N + 8 * half), round8_bf16(y));
    }
  }
}

}  // namespace

bool vnni_ready() { return true; }    // the avx2 build runs only where AVX2 and FMA are
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
namespace {

// x's rows quantized once, then every (row tile, block of 16 columns) pair handed to
// tile<T>(q, d, sum, m, cb): T rows from row m against column block cb
template <typename Tile>
void vnni_product(const bf16* x, int64_t M, int64_t N, int64_t K, Tile&& tile) {
  constexpr int64_t kRowChunk = 64;      // rows whose codes stay in L1/L2 while columns pass
  constexpr int64_t kFewRows = 4;
  const int64_t nb = K / kBlock;
  // every element is written before it is read: no zero-filling
  const std::unique_ptr<int8_t[]> q(new int8_t[M * K]);
  const std::unique_ptr<float[]> d(new float[M * nb]), sum(new float[M * nb]);
  const int64_t chunks = (M + kRowChunk - 1) / kRowChunk, cblocks = N / 16;
#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; ++m)
      quantize_row(x + m * K, K, q.get() + m * K, d.get() + m * nb, sum.get() + m * nb);
    // the rows of chunk c against column block cb
    auto rows_by_columns = [&](int64_t c, int64_t cb) {
      const int64_t m0 = c * kRowChunk;
      in_row_tiles<kTile>(std::min(M, m0 + kRowChunk) - m0, [&]<int T>(int64_t i) {
        const int64_t m = m0 + i;
        tile.template operator()<T>(q.get() + m * K, d.get() + m * nb, sum.get() + m * nb, m,
                                    cb);
      });
    };
    if (M <= kFewRows) {
      // few rows (one chunk) read the weights once: each thread one contiguous range of
      // columns, a sequential read the hardware prefetcher follows (chunks handed out in turn
      // interleave the threads' reads: docs/benchmarks.md#one-stream-contiguous-columns)
#pragma omp for schedule(static)
      for (int64_t cb = 0; cb < cblocks; ++cb) rows_by_columns(0, cb);
    } else {
#pragma omp for schedule(dynamic, 4) collapse(2)
      for (int64_t c = 0; c < chunks; ++c)
        for (int64_t cb = 0; cb < cblocks; ++cb) rows_by_columns(c, cb);
    }
  }
}

}  // namespace

void int4_mm_vnni(const bf16* x, int64_t M, const uint8_t* w, int64_t N, int64_t K,
                  int64_t group, bf16* out) {
  const int64_t cstride = (K / group) * (64 + 8 * group);      // bytes per 16 columns
  vnni_product(x, M, N, K, [&]<int T>(const int8_t* q, const float* d, const float* sum,
                                      int64_t m, int64_t cb) {
    vnni_rows<T>(q, d, sum, K, w + cb * cstride, N, group, out + m * N + cb * 16);
  });
}

template <typename O>
void int8_mm_vnni(const bf16* x, int64_t M, const int8_t* w8, const bf16* scale, int64_t N,
                  int64_t K, O* out) {
  vnni_product(x, M, N, K, [&]<int T>(const int8_t* q, const float* d, const float* sum,
                                      int64_t m, int64_t cb) {
    vnni8_rows<T>(q, d, sum, K, w8 + cb * 16 * K, scale + cb * 16, N, out + m * N + cb * 16);
  });
}
#else
bool vnni_ready() { return false; }
void int4_mm_vnni(const bf16*, int64_t, const uint8_t*, int64_t, int64_t, int64_t, bf16*) {}
template <typename O>
void int8_mm_vnni(const bf16*, int64_t, const int8_t*, const bf16*, int64_t, int64_t, O*) {}
#endif
template void int8_mm_vnni<float>(const bf16*, int64_t, const int8_t*, const bf16*, int64_t,
                                  int64_t, float*);
template void int8_mm_vnni<bf16>(const bf16*, int64_t, const int8_t*, const bf16*, int64_t,
                                 int64_t, bf16*);

}  // namespace pacer
