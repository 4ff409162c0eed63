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
//
// Where the CPU has AMX, int4pack_mm_amx does better than widen-then-GEMM: it widens 64
// output columns at a time into a buffer that stays in cache, laid out as AMX's bf16 tiles
// want (pairs of K interleaved), and multiplies it there with the tile unit at once, so the
// widened weight never reaches memory and no GEMM library reorders it again. The weights it
// multiplies are the very bf16 values dequantize_int4pack writes.
// (bindings.cpp checks the tensors; this file sees raw pointers.)
#include <algorithm>
#include <vector>

#if defined(__AVX512F__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "kernels.h"

namespace pacer {
namespace {

#if defined(__AVX512F__)
// 16 rows' (q - 8) · scale + zero: the (scale, zero) bfloat16 pairs read as one 32-bit word
// each, scale in its low half, zero in its high half
inline __m512 widen16f(__m128i codes, __m512 s, __m512 z) {
  const __m512 q = _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(codes)),
                                 _mm512_set1_ps(8.f));
  return _mm512_fmadd_ps(q, s, z);
}
inline __m256i widen16(__m128i codes, const bf16* pairs) {
  __m512 s, z;
  load16_pairs(pairs, s, z);
  return round_bf16(widen16f(codes, s, z));
}

// Columns [64b, 64b + 64) of W (all K rows) widened to bfloat16 in AMX's B-tile order:
// w[p][n][2] = (W[2p][n], W[2p + 1][n]) for p < K / 2, n < 64 (a tile row is 16 such pairs).
// (AMX CPUs all have AVX512-BF16, whose one instruction rounds 32 floats to bfloat16 as
// round_bf16 does, finite weights flushed below 2^-126: none in a checkpoint's scales' range)
__attribute__((target("avx512bf16"))) void widen_block_vnni(const uint8_t* packed,
                                                            const bf16* sz, int64_t N, int64_t K,
                                                            int64_t group, int64_t b, bf16* w) {
  // interleave two 16-lane rows (k in the low half, k + 1 in the high): lane i of the result
  // takes element i / 2 of the low half when i is even, of the high half when odd
  alignas(64) static const uint16_t kZip[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,
                                                21, 6, 22, 7, 23, 8,  24, 9,  25, 10, 26,
                                                11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i zip = _mm512_load_si512(kZip);
  for (int64_t k = 0; k < K; k += 2) {
    const bf16* sk = sz + ((k / group) * N + b * 64) * 2;   // k + 1 in k's group (even sizes)
    __m256i lo[2], hi[2];
    for (int r = 0; r < 2; ++r) {
      const __m256i bytes = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(packed + (b * K + k + r) * 32));
      lo[r] = _mm256_and_si256(bytes, _mm256_set1_epi8(0x0F));
      hi[r] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), _mm256_set1_epi8(0x0F));
    }
    const __m128i codes[2][4] = {
        {_mm256_castsi256_si128(lo[0]), _mm256_extracti128_si256(lo[0], 1),
         _mm256_castsi256_si128(hi[0]), _mm256_extracti128_si256(hi[0], 1)},
        {_mm256_castsi256_si128(lo[1]), _mm256_extracti128_si256(lo[1], 1),
         _mm256_castsi256_si128(hi[1]), _mm256_extracti128_si256(hi[1], 1)}};
    bf16* row = w + (k / 2) * 128;
    for (int q = 0; q < 4; ++q) {
      __m512 s, z;
      load16_pairs(sk + q * 32, s, z);
      const __m512bh both = _mm512_cvtne2ps_pbh(widen16f(codes[1][q], s, z),
                                                widen16f(codes[0][q], s, z));
      _mm512_storeu_si512(row + q * 32, _mm512_permutexvar_epi16(zip, (__m512i)both));
    }
  }
}

// The same 64 columns of W widened from the VNNI layout instead (csrc/int4_vnni.cpp: per 16
// columns and group, the 16 (scale, zero) pairs, then per 32 k four 64-byte vectors whose
// byte 4c + i holds column c's codes for k = 4p + i and, high nibble, k = 16 + 4p + i) into
// the same pair order, to the same bf16 values: one vector's nibble is 16 columns x 4 k,
// whose pairs (k, k + 1) and (k + 2, k + 3) are two tile rows of 16 columns.
__attribute__((target("avx512bf16"))) void widen_block_from_vnni(const uint8_t* w, int64_t K,
                                                                 int64_t group, int64_t b,
                                                                 bf16* out) {
  const int64_t gbytes = 64 + 8 * group, cstride = (K / group) * gbytes;
  // element e of part j is column 4j + e / 4: its scale and zero spread to match
  __m512i spread[4];
  for (int j = 0; j < 4; ++j)
    spread[j] = _mm512_add_epi32(_mm512_set1_epi32(4 * j),
                                 _mm512_srli_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9,
                                                                    8, 7, 6, 5, 4, 3, 2, 1, 0),
                                                   2));
  // 32-bit pairs (k, k + 1) of columns 0-15, and (k + 2, k + 3): the even and odd words of
  // two halves of 8 columns
  const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  for (int64_t c = 0; c < 4; ++c) {
    const uint8_t* wc = w + (4 * b + c) * cstride;
    for (int64_t g = 0; g < K / group; ++g) {
      const uint8_t* gp = wc + g * gbytes;
      __m512 s, z, sj[4], zj[4];
      load16_pairs(gp, s, z);
      for (int j = 0; j < 4; ++j) {
        sj[j] = _mm512_permutexvar_ps(spread[j], s);
        zj[j] = _mm512_permutexvar_ps(spread[j], z);
      }
      for (int64_t v = 0; v < group / 8; ++v) {      // the group's vectors, 4 per 32 k
        const __m512i bytes = _mm512_loadu_si512(gp + 64 + 64 * v);
        for (int h = 0; h < 2; ++h) {
          const __m512i codes = h ? _mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibble)
                                  : _mm512_and_si512(bytes, nibble);
          __m512 f[4];
          for (int j = 0; j < 4; ++j) {
            const __m128i part = j == 0   ? _mm512_castsi512_si128(codes)
                                 : j == 1 ? _mm512_extracti32x4_epi32(codes, 1)
                                 : j == 2 ? _mm512_extracti32x4_epi32(codes, 2)
                                          : _mm512_extracti32x4_epi32(codes, 3);
            f[j] = widen16f(part, sj[j], zj[j]);
          }
          const __m512i lo = (__m512i)_mm512_cvtne2ps_pbh(f[1], f[0]);    // columns 0-7
          const __m512i hi = (__m512i)_mm512_cvtne2ps_pbh(f[3], f[2]);    // columns 8-15
          const int64_t k = g * group + (v / 4) * 32 + 16 * h + 4 * (v % 4);
          bf16* row = out + (k / 2) * 128 + 16 * c * 2;
          _mm512_storeu_si512(row, _mm512_permutex2var_epi32(lo, even, hi));
          _mm512_storeu_si512(row + 128, _mm512_permutex2var_epi32(lo, odd, hi));
        }
      }
    }
  }
}

// n int8 codes (a multiple of 16), exactly, to bfloat16
inline void widen_code_rows(const int8_t* codes, int64_t n, bf16* out) {
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 c = _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i))));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i),
                        _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(c), 16)));
  }
}

struct alignas(64) TileConfig {
  uint8_t palette;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// The calling thread's tiles 0-6, each 16 rows of 64 bytes (16 floats, or 32 bfloat16)
__attribute__((target("amx-tile"))) void load_tiles_16x64() {
  TileConfig cfg{};
  cfg.palette = 1;
  for (int t = 0; t < 7; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
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

#if defined(__AVX512F__)
bool amx_ready() {
  // Linux hands a process the AMX tile state only once asked (arch_prctl ARCH_REQ_XCOMP_PERM
  // for XFEATURE_XTILEDATA); the request fails where the CPU or the kernel has no AMX.
  static const bool ready = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ready;
}

// x [M, K] bf16 times W into out [M, N] bf16: per thread, 64 columns of W widened into a
// cached buffer (`widen(b, w)`: columns [64b, 64b + 64) in pair order), then 16 rows of x at a
// time against it on the tile unit (tiles 0-3: the 16 x 64 float accumulators; 4: x; 5, 6: W).
namespace {
template <typename Widen>
__attribute__((target("amx-tile,amx-bf16"))) void widened_mm_amx(const bf16* x, int64_t M,
                                                                 int64_t N, int64_t K,
                                                                 bf16* out, Widen widen) {
  const int64_t Mp = (M + 15) / 16 * 16;
  std::vector<bf16> xpad;
  const bf16* xa = x;
  if (Mp != M) {     // whole tiles of rows: the last one padded with zeros
    xpad.assign(Mp * K, bf16{0});
    std::memcpy(xpad.data(), x, M * K * sizeof(bf16));
    xa = xpad.data();
  }
#pragma omp parallel
  {
    load_tiles_16x64();
    std::vector<bf16> w(K * 64);
    alignas(64) float acc[16 * 64];
    // blocks handed out one at a time: a thread the OS takes away for a while (other
    // processes share a server's cores) leaves its share to the others, not to a barrier
#pragma omp for schedule(dynamic, 1)
    for (int64_t b = 0; b < N / 64; ++b) {
      widen(b, w.data());
      for (int64_t m0 = 0; m0 < Mp; m0 += 16) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t k0 = 0; k0 < K; k0 += 32) {
          const bf16* wk = w.data() + (k0 / 2) * 128;
          _tile_loadd(4, xa + m0 * K + k0, K * sizeof(bf16));
          _tile_loadd(5, wk, 256);
          _tile_dpbf16ps(0, 4, 5);
          _tile_loadd(6, wk + 32, 256);
          _tile_dpbf16ps(1, 4, 6);
          _tile_loadd(5, wk + 64, 256);
          _tile_dpbf16ps(2, 4, 5);
          _tile_loadd(6, wk + 96, 256);
          _tile_dpbf16ps(3, 4, 6);
        }
        _tile_stored(0, acc, 256);
        _tile_stored(1, acc + 16, 256);
        _tile_stored(2, acc + 32, 256);
        _tile_stored(3, acc + 48, 256);
        for (int64_t r = 0; r < 16 && m0 + r < M; ++r) {
          bf16* o = out + (m0 + r) * N + b * 64;
          for (int j = 0; j < 4; ++j)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 16 * j),
                                round_bf16(_mm512_load_ps(acc + r * 64 + 16 * j)));
        }
      }
    }
    _tile_release();
  }
}

}  // namespace

// torch's int4 layout (see above)
void int4pack_mm_amx(const bf16* x, int64_t M, const uint8_t* packed, const bf16* sz, int64_t N,
                     int64_t K, int64_t group, bf16* out) {
  widened_mm_amx(x, M, N, K, out, [&](int64_t b, bf16* w) {
    widen_block_vnni(packed, sz, N, K, group, b, w);
  });
}

// the VNNI layout: the same products, from the same bf16 weights
void int4vnni_mm_amx(const bf16* x, int64_t M, const uint8_t* w, int64_t N, int64_t K,
                     int64_t group, bf16* out) {
  widened_mm_amx(x, M, N, K, out, [&](int64_t b, bf16* wide) {
    widen_block_from_vnni(w, K, group, b, wide);
  });
}

// The int8 LM head on AMX, computed transposed so that the codes' rows need no reordering:
// out^T [N, M] = W [N, K] x^T, W's rows (16 at a time, widened to bfloat16: integers up to
// 127 are exact there) as the A tile and x^T in pair order as the B tile; each output is
// scaled by its row's scale as it is written back into out [M, N].
__attribute__((target("amx-tile,amx-bf16"))) void int8_mm_amx(const bf16* x, int64_t M,
                                                               const int8_t* codes,
                                                               const bf16* scale, int64_t N,
                                                               int64_t K, bf16* out) {
  const int64_t Mp = (M + 15) / 16 * 16;
  // x^T in pair order: xt[p][m] = (x[m][2p], x[m][2p + 1]) as one 32-bit word; rows m >= M zero
  std::vector<uint32_t> xt(K / 2 * Mp, 0);
  const uint32_t* x32 = reinterpret_cast<const uint32_t*>(x);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t p = 0; p < K / 2; ++p) xt[p * Mp + m] = x32[m * (K / 2) + p];
  const __m512i column = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7,
                                                             6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(16));
#pragma omp parallel
  {
    load_tiles_16x64();
    std::vector<bf16> a(16 * K);
    alignas(64) float acc[4][16 * 16];
#pragma omp for schedule(dynamic, 8)   // as above
    for (int64_t n0 = 0; n0 < N; n0 += 16) {
      widen_code_rows(codes + n0 * K, 16 * K, a.data());
      const __m512 s = load16(scale + n0);
      for (int64_t mt0 = 0; mt0 < Mp / 16; mt0 += 4) {
        const int64_t tiles = std::min<int64_t>(4, Mp / 16 - mt0);
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t k0 = 0; k0 < K; k0 += 32) {
          const uint32_t* xk = xt.data() + (k0 / 2) * Mp + mt0 * 16;
          const int64_t stride = Mp * 4;
          _tile_loadd(4, a.data() + k0, K * sizeof(bf16));
          _tile_loadd(5, xk, stride);
          _tile_dpbf16ps(0, 4, 5);
          if (tiles > 1) {
            _tile_loadd(6, xk + 16, stride);
            _tile_dpbf16ps(1, 4, 6);
          }
          if (tiles > 2) {
            _tile_loadd(5, xk + 32, stride);
            _tile_dpbf16ps(2, 4, 5);
          }
          if (tiles > 3) {
            _tile_loadd(6, xk + 48, stride);
            _tile_dpbf16ps(3, 4, 6);
          }
        }
        _tile_stored(0, acc[0], 64);
        _tile_stored(1, acc[1], 64);
        _tile_stored(2, acc[2], 64);
        _tile_stored(3, acc[3], 64);
        for (int64_t t = 0; t < tiles; ++t)   // acc[t][n][m]: row m of out is column m here
          for (int64_t m = 0; m < 16 && (mt0 + t) * 16 + m < M; ++m) {
            const __m512 col = _mm512_i32gather_ps(column, acc[t] + m, 4);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + ((mt0 + t) * 16 + m) * N + n0),
                                round_bf16(_mm512_mul_ps(col, s)));
          }
      }
    }
    _tile_release();
  }
}

// Where the CPU has AVX512-BF16 but no AMX: the same in-cache widening as int4pack_mm_amx
// (widen_block_vnni, the very bf16 weights), multiplied by `vdpbf16ps` instead of tiles:
// six rows of x at a time, each (x[2p], x[2p + 1]) pair broadcast against 16 columns' pairs,
// 24 float32 accumulators for 6 rows x 64 columns.
namespace {
template <int R>
__attribute__((target("avx512bf16"))) inline void dpbf16_rows(const uint32_t* x32, int64_t K,
                                                              const bf16* w, bf16* out,
                                                              int64_t N) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t p = 0; p < K / 2; ++p) {
    const bf16* wp = w + p * 128;
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wp), w1 = (__m512bh)_mm512_loadu_si512(wp + 32),
                   w2 = (__m512bh)_mm512_loadu_si512(wp + 64), w3 = (__m512bh)_mm512_loadu_si512(wp + 96);
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(x32[r * (K / 2) + p]));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xv, w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xv, w1);
      acc[r][2] = _mm512_dpbf16_ps(acc[r][2], xv, w2);
      acc[r][3] = _mm512_dpbf16_ps(acc[r][3], xv, w3);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * N + 16 * c), round_bf16(acc[r][c]));
}

// Lane j of the result: the sum of a_j's 16 lanes (four horizontal sums for the price of
// about one: pairs interleaved and added, then the 128-bit quarters)
inline __m128 sum4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const __m512d t0 = _mm512_castps_pd(
      _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1)));
  const __m512d t1 = _mm512_castps_pd(
      _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3)));
  const __m512d t = _mm512_castps_pd(_mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(t0, t1)),
                                                   _mm512_castpd_ps(_mm512_unpackhi_pd(t0, t1))));
  const __m256 h = _mm256_add_ps(_mm256_castpd_ps(_mm512_castpd512_pd256(t)),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(t, 1)));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

inline void store4(float* out, __m128 v) { _mm_storeu_ps(out, v); }
inline void store4(bf16* out, __m128 v) {
  alignas(16) float f[4];
  _mm_store_ps(f, v);
  for (int j = 0; j < 4; ++j) out[j] = to_bf16(f[j]);
}

// The int8 LM head the same way, transposed as int8_mm_amx is: out[m][n] = s[n] sum_k
// c[n][k] x[m][k], four code rows (widened to bfloat16: exact) against R rows of x, 32 k at a
// time, each product a 16-lane vector of partial sums reduced four at a time at the end. Each
// output's sums run in one order whatever R is: a row's logits do not depend on the batch.
template <int R, typename O>
__attribute__((target("avx512bf16"))) inline void dpbf16_t_rows(const bf16* a, const bf16* x,
                                                                int64_t K, const float* s,
                                                                O* out, int64_t N) {
  __m512 acc[4][R];
  for (int j = 0; j < 4; ++j)
    for (int r = 0; r < R; ++r) acc[j][r] = _mm512_setzero_ps();
  for (int64_t k0 = 0; k0 < K; k0 += 32) {
    __m512bh c[4];
    for (int j = 0; j < 4; ++j) c[j] = (__m512bh)_mm512_loadu_si512(a + j * K + k0);
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + r * K + k0);
      for (int j = 0; j < 4; ++j) acc[j][r] = _mm512_dpbf16_ps(acc[j][r], c[j], xv);
    }
  }
  const __m128 sv = _mm_loadu_ps(s);
  for (int r = 0; r < R; ++r)
    store4(out + r * N, _mm_mul_ps(sv, sum4(acc[0][r], acc[1][r], acc[2][r], acc[3][r])));
}
}  // namespace

bool dpbf16_ready() { return __builtin_cpu_supports("avx512bf16"); }

__attribute__((target("avx512bf16"))) void int4pack_mm_dpbf16(
    const bf16* x, int64_t M, const uint8_t* packed, const bf16* sz, int64_t N, int64_t K,
    int64_t group, bf16* out) {
  const uint32_t* x32 = reinterpret_cast<const uint32_t*>(x);   // (x[m][2p], x[m][2p + 1])
#pragma omp parallel
  {
    std::vector<bf16> w(K * 64);
    // blocks handed out one at a time, as int4pack_mm_amx does
#pragma omp for schedule(dynamic, 1)
    for (int64_t b = 0; b < N / 64; ++b) {
      widen_block_vnni(packed, sz, N, K, group, b, w.data());
      bf16* ob = out + b * 64;
      in_row_tiles<6>(M, [&]<int R>(int64_t m) {
        dpbf16_rows<R>(x32 + m * (K / 2), K, w.data(), ob + m * N, N);
      });
    }
  }
}

// The int8 LM head with vdpbf16ps (int8_mm_dpbf16): 16 code rows widened at a time, as
// int8_mm_amx does, then four of them against six rows of x; out in float32 (the logits,
// unrounded) or bfloat16.
template <typename O>
__attribute__((target("avx512bf16"))) void int8_mm_dpbf16(const bf16* x, int64_t M,
                                                           const int8_t* codes,
                                                           const bf16* scale, int64_t N,
                                                           int64_t K, O* out) {
#pragma omp parallel
  {
    std::vector<bf16> a(16 * K);
    float s[16];
#pragma omp for schedule(dynamic, 8)   // as int8_mm_amx
    for (int64_t n0 = 0; n0 < N; n0 += 16) {
      widen_code_rows(codes + n0 * K, 16 * K, a.data());
      for (int j = 0; j < 16; ++j) s[j] = to_float(scale[n0 + j]);
      for (int j = 0; j < 16; j += 4)
        in_row_tiles<6>(M, [&]<int R>(int64_t m) {
          dpbf16_t_rows<R, O>(a.data() + j * K, x + m * K, K, s + j, out + m * N + n0 + j, N);
        });
    }
  }
}
#else
bool amx_ready() { return false; }
void int8_mm_amx(const bf16*, int64_t, const int8_t*, const bf16*, int64_t, int64_t, bf16*) {}
void int4pack_mm_amx(const bf16*, int64_t, const uint8_t*, const bf16*, int64_t, int64_t, int64_t,
                     bf16*) {}
void int4vnni_mm_amx(const bf16*, int64_t, const uint8_t*, int64_t, int64_t, int64_t, bf16*) {}
bool dpbf16_ready() { return false; }
void int4pack_mm_dpbf16(const bf16*, int64_t, const uint8_t*, const bf16*, int64_t, int64_t,
                        int64_t, bf16*) {}
template <typename O>
void int8_mm_dpbf16(const bf16*, int64_t, const int8_t*, const bf16*, int64_t, int64_t, O*) {}
#endif
template void int8_mm_dpbf16<float>(const bf16*, int64_t, const int8_t*, const bf16*, int64_t,
                                    int64_t, float*);
template void int8_mm_dpbf16<bf16>(const bf16*, int64_t, const int8_t*, const bf16*, int64_t,
                                   int64_t, bf16*);


// Without AMX or native bf16 GEMMs (AVX2 + FMA CPUs, AVX-512 ones without AVX512-BF16), the
// many-row GEMMs widen the weights to float32 in cache and multiply there with FMA, the way the
// AMX kernels do on tiles: int4pack_mm_fma 64 output columns of W at a time ([K][64] floats,
// which stay in L2), int8_mm_fma 16 rows of the LM head's codes at a time ([16][K] floats).
// Neither writes a widened weight to memory. x and out are bfloat16 as for the other paths;
// the sums are float32 over the float32 weights.
#if defined(__AVX2__) && defined(__FMA__)
namespace {

// 8 rows' (q - 8) · scale + zero from 8 codes (the low 8 bytes) and 8 (scale, zero) pairs
inline __m256 widen8f(__m128i codes, const bf16* pairs) {
  __m256 s, z;
  load8_pairs(pairs, s, z);
  const __m256 q = _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(codes)),
                                 _mm256_set1_ps(8.f));
  return _mm256_fmadd_ps(q, s, z);
}

// Columns [64b, 64b + 64) of W, all K rows, widened to float32: w[k][64]
void widen_block_f32(const uint8_t* packed, const bf16* sz, int64_t N, int64_t K, int64_t group,
                     int64_t b, float* w) {
  for (int64_t k = 0; k < K; ++k) {
    const uint8_t* p = packed + (b * K + k) * 32;
    const bf16* s = sz + ((k / group) * N + b * 64) * 2;
    float* row = w + k * 64;
    for (int h = 0; h < 32; h += 8) {    // byte j: row j (low nibble), row 32 + j (high)
      const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + h));
      const __m128i lo = _mm_and_si128(bytes, _mm_set1_epi8(0x0F));
      const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), _mm_set1_epi8(0x0F));
      _mm256_storeu_ps(row + h, widen8f(lo, s + 2 * h));
      _mm256_storeu_ps(row + 32 + h, widen8f(hi, s + 2 * (32 + h)));
    }
  }
}

// R rows of x (float32, row stride K) times 16 columns of w (row stride ldw) into out (bf16,
// row stride N): 2R accumulators, each w load shared by the R rows
template <int R>
inline void rows_by_16(const float* x, int64_t K, const float* w, int64_t ldw, bf16* out,
                       int64_t N) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m256 w0 = _mm256_loadu_ps(w + k * ldw), w1 = _mm256_loadu_ps(w + k * ldw + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_broadcast_ss(x + r * K + k);
      acc[r][0] = _mm256_fmadd_ps(xv, w0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(xv, w1, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + r * N), round8_bf16(acc[r][0]));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + r * N + 8), round8_bf16(acc[r][1]));
  }
}

constexpr int kRows = 6;    // 12 accumulators + 2 weights + 1 broadcast of AVX2's 16 registers

// out[m0:M, 16 columns] for every row tile, R rows at a time
inline void all_rows_by_16(const float* xf, int64_t M, int64_t K, const float* w, int64_t ldw,
                           bf16* out, int64_t N) {
  in_row_tiles<kRows>(M, [&]<int R>(int64_t m) {
    rows_by_16<R>(xf + m * K, K, w, ldw, out + m * N, N);
  });
}

std::vector<float> widen_x(const bf16* x, int64_t M, int64_t K) {
  std::vector<float> xf(M * K);
  for (int64_t i = 0; i < M * K; ++i) xf[i] = to_float(x[i]);
  return xf;
}

}  // namespace

bool fma_ready() { return true; }

void int4pack_mm_fma(const bf16* x, int64_t M, const uint8_t* packed, const bf16* sz, int64_t N,
                     int64_t K, int64_t group, bf16* out) {
  const std::vector<float> xf = widen_x(x, M, K);
#pragma omp parallel
  {
    std::vector<float> w(K * 64);
    // dynamically, as the AMX kernel: a preempted thread leaves its blocks to the others
#pragma omp for schedule(dynamic, 1)
    for (int64_t b = 0; b < N / 64; ++b) {
      widen_block_f32(packed, sz, N, K, group, b, w.data());
      for (int c = 0; c < 64; c += 16)
        all_rows_by_16(xf.data(), M, K, w.data() + c, 64, out + b * 64 + c, N);
    }
  }
}

void int8_mm_fma(const bf16* x, int64_t M, const int8_t* codes, const bf16* scale, int64_t N,
                 int64_t K, bf16* out) {
  const std::vector<float> xf = widen_x(x, M, K);
#pragma omp parallel
  {
    std::vector<float> w(K * 16);      // 16 code rows, transposed and scaled: w[k][16]
#pragma omp for schedule(dynamic, 8)
    for (int64_t n0 = 0; n0 < N; n0 += 16) {
      for (int j = 0; j < 16; ++j) {
        const int8_t* c = codes + (n0 + j) * K;
        const float s = to_float(scale[n0 + j]);
        for (int64_t k = 0; k < K; ++k) w[k * 16 + j] = static_cast<float>(c[k]) * s;
      }
      all_rows_by_16(xf.data(), M, K, w.data(), 16, out + n0, N);
    }
  }
}
#else
bool fma_ready() { return false; }
void int4pack_mm_fma(const bf16*, int64_t, const uint8_t*, const bf16*, int64_t, int64_t, int64_t,
                     bf16*) {}
void int8_mm_fma(const bf16*, int64_t, const int8_t*, const bf16*, int64_t, int64_t, bf16*) {}
#endif

}  // namespace pacer
