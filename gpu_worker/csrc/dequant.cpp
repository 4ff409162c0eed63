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
      for (int j = 0; j < 32; ++j) {
        const float lo = static_cast<float>(p[j] & 0x0F) - 8.f;
        const float hi = static_cast<float>(p[j] >> 4) - 8.f;
        ob[j] = to_bf16(lo * to_float(s[2 * j]) + to_float(s[2 * j + 1]));
        ob[j + 32] = to_bf16(hi * to_float(s[2 * (j + 32)]) + to_float(s[2 * (j + 32) + 1]));
      }
    }
  }
}

void dequantize_int8(const int8_t* codes, const bf16* scale, int64_t N, int64_t K, bf16* out) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float s = to_float(scale[n]);
    const int8_t* c = codes + n * K;
    bf16* o = out + n * K;
    for (int64_t k = 0; k < K; ++k) o[k] = to_bf16(static_cast<float>(c[k]) * s);
  }
}

}  // namespace pacer
