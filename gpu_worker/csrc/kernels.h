// The CPU kernels' compute entry points, on raw pointers. kernel_build.py compiles the files
// that define them once per ISA level; bindings.cpp checks the tensors and calls them.
// T is the KV cache's element type (float or bf16); every other float is float32.
#pragma once

#include <cstdint>

#include "vec.h"

namespace pacer {

// Decode attention: G requests, one query row each, over a paged cache [blocks, BS, KVH, D].
template <typename T>
void paged_decode(const float* q, const T* k_cache, const T* v_cache, const int64_t* block_tables,
                  const int64_t* kv_lens, int64_t G, int64_t H, int64_t D, int64_t BS,
                  int64_t KVH, int64_t max_blocks, float scale, float* out);

// RoPE + K/V store + decode attention for G single-row requests, from the fused projection's
// output qkv [G, (H + 2 KVH) D] (bf16) to out [G, H D] (bf16); slots [G] index cache rows.
template <typename T>
void decode_attention_block(const bf16* qkv, const int64_t* positions, const float* cos,
                            const float* sin, T* k_cache, T* v_cache, const int64_t* slots,
                            const int64_t* block_tables, const int64_t* kv_lens, int64_t G,
                            int64_t H, int64_t KVH, int64_t D, int64_t BS, int64_t max_blocks,
                            float scale, bf16* out);

// Whether this build has the prefill kernel for a head size and GQA group.
bool paged_prefill_supported(int64_t head_dim, int64_t group);

// Prefill attention for R chunks of the flat batch q [T, H, D] (rows of chunks shorter than
// min_rows untouched in out).
template <typename T>
void paged_prefill(const float* q, const T* k_cache, const T* v_cache, const int32_t* block_table,
                   const int32_t* cu_seqlens_q, const int32_t* kv_lens, int64_t R, int64_t H,
                   int64_t D, int64_t BS, int64_t KVH, int64_t max_blocks, int64_t min_rows,
                   float scale, float* out);

// x += delta (when not null; float or bf16); out = x * rsqrt(mean(x^2) + eps) * w in O
// (float or bf16).
template <typename O, typename Dl = float>
void add_rms_norm(float* x, const Dl* delta, const float* w, O* out, int64_t T, int64_t D,
                  float eps);

// Rotate-half RoPE in place on rows of `stride` floats holding `heads` heads of D; positions
// must lie in the tables (the caller checks). rotary_row: one row, on the calling thread (one
// compiled copy: every caller gets the same bits).
void rotary(float* qk, int64_t stride, const int64_t* positions, const float* cos,
            const float* sin, int64_t T, int64_t heads, int64_t D);
void rotary_row(float* v, int64_t position, const float* cos, const float* sin, int64_t heads,
                int64_t D);

// RoPE and the K/V store for `rows` rows of the fused projection's output qkv
// [rows, (H + 2 KVH) D] (bf16), as the op-by-op path does them: row t's rotated query (float32)
// to q_rows[t], its K and V to the cache row slots[t]; rows in parallel when there are many.
template <typename T>
void rope_and_store(const bf16* qkv, const int64_t* positions, const float* cos, const float* sin,
                    T* k_cache, T* v_cache, const int64_t* slots, int64_t rows, int64_t H,
                    int64_t KVH, int64_t D, float* const* q_rows);

// RoPE + K/V store + attention for an iteration with prompt chunks, from qkv as above to out
// [rows, H D] (bf16): the decode kernel over the rows dec_rows [Gd] (their block tables
// dec_bt [Gd, MB] int64, lengths dec_lens), the prefill kernel over the chunks whose rows are
// pre_rows [Tp] (whole chunks, in order: pre_cu [R + 1], pre_lens [R], pre_bt [R, MB] int32).
template <typename T>
void mixed_attention_block(const bf16* qkv, const int64_t* positions, const float* cos,
                           const float* sin, T* k_cache, T* v_cache, const int64_t* slots,
                           int64_t rows, const int64_t* dec_rows, const int64_t* dec_bt,
                           const int64_t* dec_lens, int64_t Gd, const int64_t* pre_rows,
                           int64_t Tp, const int32_t* pre_bt, const int32_t* pre_cu,
                           const int32_t* pre_lens, int64_t R, int64_t H, int64_t KVH, int64_t D,
                           int64_t BS, int64_t MB, float scale, bf16* out);

// out[t] = silu(gate[t]) * up[t] for gate_up = [gate | up] of [T, 2F].
void silu_and_mul(const bf16* gate_up, bf16* out, int64_t T, int64_t F);

// Quantized weights widened to bfloat16 (dequant.cpp: the layouts there): torch's CPU int4
// layout to W transposed, out [K, N]; int8 per-channel codes to W, out [N, K].
void dequantize_int4pack(const uint8_t* packed, const bf16* scales_zeros, int64_t N, int64_t K,
                         int64_t group, bf16* out);
void dequantize_int8(const int8_t* codes, const bf16* scale, int64_t N, int64_t K, bf16* out);

// Whether this build and CPU run int4pack_mm_amx (AVX-512 builds on a CPU with AMX-BF16, the OS
// permitting); out [M, N] = x [M, K] (bf16) times W in torch's int4 layout, widened in cache.
bool amx_ready();
void int4pack_mm_amx(const bf16* x, int64_t M, const uint8_t* packed, const bf16* scales_zeros,
                     int64_t N, int64_t K, int64_t group, bf16* out);
// The same for int4 weights in int4_vnni.cpp's layout: the same bf16 weights, the same sums.
void int4vnni_mm_amx(const bf16* x, int64_t M, const uint8_t* w, int64_t N, int64_t K,
                     int64_t group, bf16* out);
// out [M, N] = x [M, K] (bf16) times int8 codes [N, K] with one scale per row, on AMX.
void int8_mm_amx(const bf16* x, int64_t M, const int8_t* codes, const bf16* scale, int64_t N,
                 int64_t K, bf16* out);
// The int4 and int8 products on AVX512-BF16 without AMX: widened in cache as for AMX, multiplied with
// vdpbf16ps (dpbf16_ready: an AVX-512 build on a CPU with AVX512-BF16).
bool dpbf16_ready();
void int4pack_mm_dpbf16(const bf16* x, int64_t M, const uint8_t* packed, const bf16* scales_zeros,
                        int64_t N, int64_t K, int64_t group, bf16* out);
// (int8_mm_dpbf16: out in float32 or bfloat16)
template <typename O>
void int8_mm_dpbf16(const bf16* x, int64_t M, const int8_t* codes, const bf16* scale, int64_t N,
                    int64_t K, O* out);
// int4 weights (in int4_vnni.cpp's layout) times x quantized to 8 bits per block of 32, with
// integer dot products (vnni_ready: an AVX-512 build on a CPU with AVX512-VNNI, or an avx2 build).
bool vnni_ready();
void int4_mm_vnni(const bf16* x, int64_t M, const uint8_t* w, int64_t N, int64_t K,
                  int64_t group, bf16* out);
// int8 codes [N / 16, K / 4, 16, 4] (int4_vnni.cpp's order) with one scale per column, times x
// quantized the same way; out [M, N] float32 (the logits) or bfloat16
template <typename O>
void int8_mm_vnni(const bf16* x, int64_t M, const int8_t* w8, const bf16* scale, int64_t N,
                  int64_t K, O* out);
// out[s] = the first index of row s's largest value, a NaN counting as the largest
// (torch.argmax's answer); x [S, V] float32
void argmax_rows(const float* x, int64_t S, int64_t V, int64_t* out);
// The same two products with FMA on float32 weights widened in cache (AVX2 and AVX-512 builds;
// fma_ready says whether this build has them).
bool fma_ready();
void int4pack_mm_fma(const bf16* x, int64_t M, const uint8_t* packed, const bf16* scales_zeros,
                     int64_t N, int64_t K, int64_t group, bf16* out);
void int8_mm_fma(const bf16* x, int64_t M, const int8_t* codes, const bf16* scale, int64_t N,
                 int64_t K, bf16* out);

}  // namespace pacer
