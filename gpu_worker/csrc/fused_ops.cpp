// Fused pointwise ops for the bfloat16-weight path on CPU, where the residual stream is
// float32 and the GEMMs read bfloat16: each replaces several torch ops (and their passes over
// memory) with one.
//
//   add_rms_norm(x, delta?, w, eps, out): x += delta (in place, when given), then
//       out = x * rsqrt(mean(x²) + eps) * w, rounded to out's dtype (bfloat16 or float32)
//   rotary_(qk, positions, cos, sin): rotate-half RoPE in place on qk [T, heads, d] (rows may
//       be strided: qk is a view into the fused qkv projection)
//   silu_and_mul(gate_up, out): out = silu(gate) * up for gate_up = [gate | up] [T, 2f],
//       bfloat16 in and out, computed in float32 and rounded once
#include <torch/extension.h>

#include <cmath>

#include "vec.h"

template <typename O>
static void norm_rows(float* xp, const float* dp, const float* wp, O* op, int64_t T, int64_t D,
                      float eps) {
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    float* xr = xp + t * D;
    float ss = 0.f;
    if (dp) {
      const float* dr = dp + t * D;
      for (int64_t i = 0; i < D; ++i) {
        xr[i] += dr[i];
        ss += xr[i] * xr[i];
      }
    } else {
      for (int64_t i = 0; i < D; ++i) ss += xr[i] * xr[i];
    }
    const float r = 1.f / std::sqrt(ss / D + eps);
    O* orow = op + t * D;
    for (int64_t i = 0; i < D; ++i) orow[i] = static_cast<O>(xr[i] * r * wp[i]);
  }
}

void add_rms_norm(torch::Tensor& x, const c10::optional<torch::Tensor>& delta,
                  const torch::Tensor& w, double eps, torch::Tensor& out) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && w.dtype() == torch::kFloat32 &&
                  (!delta || delta->dtype() == torch::kFloat32),
              "add_rms_norm: float32 input, delta and weight");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && out.is_contiguous() && w.is_contiguous() &&
                  (!delta || (delta->is_contiguous() && delta->sizes() == x.sizes())) &&
                  out.sizes() == x.sizes() && w.size(0) == x.size(1),
              "add_rms_norm: contiguous [T, d] tensors");
  const int64_t T = x.size(0), D = x.size(1);
  const float* dp = delta ? delta->data_ptr<float>() : nullptr;
  if (out.dtype() == torch::kBFloat16)
    norm_rows(x.data_ptr<float>(), dp, w.data_ptr<float>(), out.data_ptr<c10::BFloat16>(), T, D,
              static_cast<float>(eps));
  else if (out.dtype() == torch::kFloat32)
    norm_rows(x.data_ptr<float>(), dp, w.data_ptr<float>(), out.data_ptr<float>(), T, D,
              static_cast<float>(eps));
  else
    TORCH_CHECK(false, "add_rms_norm: bfloat16 or float32 output");
}

void rotary_(torch::Tensor& qk, const torch::Tensor& positions, const torch::Tensor& cos,
             const torch::Tensor& sin) {
  TORCH_CHECK(qk.dtype() == torch::kFloat32 && cos.dtype() == torch::kFloat32 &&
                  sin.dtype() == torch::kFloat32 && positions.dtype() == torch::kInt64,
              "rotary_: float32 qk and tables, int64 positions");
  TORCH_CHECK(qk.dim() == 3 && qk.stride(2) == 1 && qk.stride(1) == qk.size(2) &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.size(1) == qk.size(2),
              "rotary_: qk [T, heads, d] with contiguous heads, tables [positions, d]");
  const int64_t T = qk.size(0), heads = qk.size(1), D = qk.size(2), half = D / 2;
  const int64_t stride = qk.stride(0);
  float* p = qk.data_ptr<float>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t max_pos = cos.size(0);
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    const int64_t at = pos[t];
    TORCH_CHECK(at >= 0 && at < max_pos, "rotary_: position out of the table");
    const float* c = cp + at * D;
    const float* s = sp + at * D;
    for (int64_t h = 0; h < heads; ++h) {
      float* v = p + t * stride + h * D;
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = v[i], x2 = v[i + half];
        v[i] = x1 * c[i] - x2 * s[i];
        v[i + half] = x2 * c[i + half] + x1 * s[i + half];
      }
    }
  }
}

#if defined(__AVX512F__)
static inline __m512 load_bf16(const c10::BFloat16* p, __mmask16 k) {
  const __m256i raw = _mm256_maskz_loadu_epi16(k, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

static inline void store_bf16(c10::BFloat16* p, __m512 v, __mmask16 k) {
  // round to nearest even: add 0x7FFF + the lowest kept bit, keep the high half
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  _mm256_mask_storeu_epi16(p, k, _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
}
#endif

void silu_and_mul(const torch::Tensor& gate_up, torch::Tensor& out) {
  TORCH_CHECK(gate_up.dtype() == torch::kBFloat16 && out.dtype() == torch::kBFloat16,
              "silu_and_mul: bfloat16 in and out");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && out.is_contiguous() &&
                  out.size(0) == gate_up.size(0) && 2 * out.size(1) == gate_up.size(1),
              "silu_and_mul: contiguous [T, 2f] -> [T, f]");
  const int64_t T = out.size(0), F = out.size(1);
  const c10::BFloat16* in = gate_up.data_ptr<c10::BFloat16>();
  c10::BFloat16* op = out.data_ptr<c10::BFloat16>();
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    const c10::BFloat16* g = in + t * 2 * F;
    const c10::BFloat16* u = g + F;
    c10::BFloat16* o = op + t * F;
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
      const float x = static_cast<float>(g[i]);
      o[i] = static_cast<c10::BFloat16>(x / (1.f + std::exp(-x)) * static_cast<float>(u[i]));
    }
#endif
  }
}
