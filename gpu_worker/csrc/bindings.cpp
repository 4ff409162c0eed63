// The CPU kernels' Python functions (gpu_worker/cpu_kernels.py). This file is the only one that
// includes torch: it checks each call's tensors and hands raw pointers to the compute kernels
// (kernels.h). kernel_build.py compiles it once, for baseline x86-64, and links it with each ISA
// level's kernel objects and module.cpp (the module named for that level) into one library.
#include <torch/extension.h>

#include "kernels.h"

namespace {

using pacer::bf16;

template <typename T>
const T* ptr(const torch::Tensor& t) {
  if constexpr (std::is_same_v<T, bf16>)
    return reinterpret_cast<const bf16*>(t.data_ptr<c10::BFloat16>());
  else
    return t.data_ptr<T>();
}

template <typename T>
T* mut_ptr(torch::Tensor& t) {
  if constexpr (std::is_same_v<T, bf16>)
    return reinterpret_cast<bf16*>(t.data_ptr<c10::BFloat16>());
  else
    return t.data_ptr<T>();
}

bool all_contiguous(std::initializer_list<const torch::Tensor*> ts) {
  for (const torch::Tensor* t : ts)
    if (!t->is_contiguous()) return false;
  return true;
}

template <typename T>
void decode(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
            const torch::Tensor& block_tables, const torch::Tensor& kv_lens, double scale,
            torch::Tensor& out) {
  pacer::paged_decode<T>(q.data_ptr<float>(), ptr<T>(k_cache), ptr<T>(v_cache),
                         block_tables.data_ptr<int64_t>(), kv_lens.data_ptr<int64_t>(), q.size(0),
                         q.size(1), q.size(2), k_cache.size(1), k_cache.size(2),
                         block_tables.size(1), static_cast<float>(scale), out.data_ptr<float>());
}

void paged_decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                            const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                            const torch::Tensor& kv_lens, double scale, torch::Tensor& out) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && out.dtype() == torch::kFloat32,
              "paged_decode_attention: float32 queries and output only");
  TORCH_CHECK(k_cache.dtype() == v_cache.dtype(), "paged_decode_attention: K and V dtypes differ");
  TORCH_CHECK(block_tables.dtype() == torch::kInt64 && kv_lens.dtype() == torch::kInt64,
              "paged_decode_attention: int64 block tables and lengths");
  TORCH_CHECK(all_contiguous({&q, &k_cache, &v_cache, &out, &block_tables, &kv_lens}),
              "paged_decode_attention: contiguous tensors only");
  if (k_cache.dtype() == torch::kFloat32)
    decode<float>(q, k_cache, v_cache, block_tables, kv_lens, scale, out);
  else if (k_cache.dtype() == torch::kBFloat16)
    decode<bf16>(q, k_cache, v_cache, block_tables, kv_lens, scale, out);
  else
    TORCH_CHECK(false, "paged_decode_attention: a float32 or bfloat16 cache only");
}

template <typename T>
void prefill(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
             const torch::Tensor& block_table, const torch::Tensor& cu_q,
             const torch::Tensor& kv_lens, int64_t min_rows, double scale, torch::Tensor& out) {
  pacer::paged_prefill<T>(q.data_ptr<float>(), ptr<T>(k_cache), ptr<T>(v_cache),
                          block_table.data_ptr<int32_t>(), cu_q.data_ptr<int32_t>(),
                          kv_lens.data_ptr<int32_t>(), kv_lens.size(0), q.size(1), q.size(2),
                          k_cache.size(1), k_cache.size(2), block_table.size(1), min_rows,
                          static_cast<float>(scale), out.data_ptr<float>());
}

void paged_prefill_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                             const torch::Tensor& v_cache, const torch::Tensor& block_table,
                             const torch::Tensor& cu_seqlens_q, const torch::Tensor& kv_lens,
                             int64_t min_rows, double scale, torch::Tensor& out) {
  TORCH_CHECK(pacer::paged_prefill_supported(q.size(2), q.size(1) / k_cache.size(2)),
              "paged_prefill_attention: needs an AVX2 or AVX-512 build and head_dim 64 or 128");
  TORCH_CHECK(q.dtype() == torch::kFloat32 && out.dtype() == torch::kFloat32,
              "paged_prefill_attention: float32 queries and output only");
  TORCH_CHECK(k_cache.dtype() == v_cache.dtype(), "paged_prefill_attention: K and V dtypes differ");
  TORCH_CHECK(block_table.dtype() == torch::kInt32 && cu_seqlens_q.dtype() == torch::kInt32 &&
                  kv_lens.dtype() == torch::kInt32, "paged_prefill_attention: int32 metadata");
  TORCH_CHECK(all_contiguous({&q, &k_cache, &v_cache, &out, &block_table, &cu_seqlens_q, &kv_lens}),
              "paged_prefill_attention: contiguous tensors only");
  if (k_cache.dtype() == torch::kBFloat16)
    prefill<bf16>(q, k_cache, v_cache, block_table, cu_seqlens_q, kv_lens, min_rows, scale, out);
  else if (k_cache.dtype() == torch::kFloat32)
    prefill<float>(q, k_cache, v_cache, block_table, cu_seqlens_q, kv_lens, min_rows, scale, out);
  else
    TORCH_CHECK(false, "paged_prefill_attention: a float32 or bfloat16 cache only");
}

template <typename O>
void add_rms_norm_to(torch::Tensor& x, const c10::optional<torch::Tensor>& delta,
                     const torch::Tensor& w, float eps, O* out) {
  const int64_t T = x.size(0), D = x.size(1);
  if (delta && delta->dtype() == torch::kBFloat16)
    pacer::add_rms_norm(x.data_ptr<float>(), ptr<bf16>(*delta), w.data_ptr<float>(), out, T, D,
                        eps);
  else
    pacer::add_rms_norm(x.data_ptr<float>(), delta ? delta->data_ptr<float>() : nullptr,
                        w.data_ptr<float>(), out, T, D, eps);
}

void add_rms_norm(torch::Tensor& x, const c10::optional<torch::Tensor>& delta,
                  const torch::Tensor& w, double eps, torch::Tensor& out) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && w.dtype() == torch::kFloat32 &&
                  (!delta || delta->dtype() == torch::kFloat32 ||
                   delta->dtype() == torch::kBFloat16),
              "add_rms_norm: float32 input and weight, float32 or bfloat16 delta");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && out.is_contiguous() && w.is_contiguous() &&
                  (!delta || (delta->is_contiguous() && delta->sizes() == x.sizes())) &&
                  out.sizes() == x.sizes() && w.size(0) == x.size(1),
              "add_rms_norm: contiguous [T, d] tensors");
  const float e = static_cast<float>(eps);
  if (out.dtype() == torch::kBFloat16)
    add_rms_norm_to(x, delta, w, e, mut_ptr<bf16>(out));
  else if (out.dtype() == torch::kFloat32)
    add_rms_norm_to(x, delta, w, e, out.data_ptr<float>());
  else
    TORCH_CHECK(false, "add_rms_norm: bfloat16 or float32 output");
}

void rotary_(torch::Tensor& qk, const torch::Tensor& positions, const torch::Tensor& cos,
             const torch::Tensor& sin) {
  TORCH_CHECK(qk.dtype() == torch::kFloat32 && cos.dtype() == torch::kFloat32 &&
                  sin.dtype() == torch::kFloat32 && positions.dtype() == torch::kInt64,
              "rotary_: float32 qk and tables, int64 positions");
  TORCH_CHECK(qk.dim() == 3 && qk.stride(2) == 1 && qk.stride(1) == qk.size(2) &&
                  cos.is_contiguous() && sin.is_contiguous() && positions.is_contiguous() &&
                  cos.size(1) == qk.size(2) && positions.numel() == qk.size(0),
              "rotary_: qk [T, heads, d] with contiguous heads, tables [positions, d]");
  const int64_t T = qk.size(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0), "rotary_: position out of the table");
  pacer::rotary(qk.data_ptr<float>(), qk.stride(0), pos, cos.data_ptr<float>(),
                sin.data_ptr<float>(), T, qk.size(1), qk.size(2));
}

template <typename T>
void decode_block(const torch::Tensor& qkv, const torch::Tensor& positions, const torch::Tensor& cos,
                  const torch::Tensor& sin, torch::Tensor& k_cache, torch::Tensor& v_cache,
                  const torch::Tensor& slots, const torch::Tensor& block_tables,
                  const torch::Tensor& kv_lens, double scale, torch::Tensor& out) {
  const int64_t D = k_cache.size(3);
  pacer::decode_attention_block<T>(
      ptr<bf16>(qkv), positions.data_ptr<int64_t>(), cos.data_ptr<float>(), sin.data_ptr<float>(),
      mut_ptr<T>(k_cache), mut_ptr<T>(v_cache), slots.data_ptr<int64_t>(),
      block_tables.data_ptr<int64_t>(), kv_lens.data_ptr<int64_t>(), qkv.size(0),
      out.size(1) / D, k_cache.size(2), D, k_cache.size(1), block_tables.size(1),
      static_cast<float>(scale), mut_ptr<bf16>(out));
}

void decode_attention_block(const torch::Tensor& qkv, const torch::Tensor& positions,
                            const torch::Tensor& cos, const torch::Tensor& sin,
                            torch::Tensor& k_cache, torch::Tensor& v_cache,
                            const torch::Tensor& slots, const torch::Tensor& block_tables,
                            const torch::Tensor& kv_lens, double scale, torch::Tensor& out) {
  TORCH_CHECK(qkv.dtype() == torch::kBFloat16 && out.dtype() == torch::kBFloat16 &&
                  cos.dtype() == torch::kFloat32 && sin.dtype() == torch::kFloat32,
              "decode_attention_block: bfloat16 qkv and out, float32 RoPE tables");
  TORCH_CHECK(positions.dtype() == torch::kInt64 && slots.dtype() == torch::kInt64 &&
                  block_tables.dtype() == torch::kInt64 && kv_lens.dtype() == torch::kInt64,
              "decode_attention_block: int64 positions, slots, block tables and lengths");
  TORCH_CHECK(k_cache.dtype() == v_cache.dtype() && k_cache.dim() == 4 &&
                  k_cache.sizes() == v_cache.sizes(),
              "decode_attention_block: K and V caches [blocks, block_size, KVH, d] alike");
  TORCH_CHECK(all_contiguous({&qkv, &positions, &cos, &sin, &k_cache, &v_cache, &slots,
                              &block_tables, &kv_lens, &out}),
              "decode_attention_block: contiguous tensors only");
  const int64_t G = qkv.size(0), D = k_cache.size(3), KVH = k_cache.size(2);
  TORCH_CHECK(qkv.dim() == 2 && out.dim() == 2 && out.size(0) == G && out.size(1) % D == 0 &&
                  (out.size(1) / D) % KVH == 0 && qkv.size(1) == out.size(1) + 2 * KVH * D &&
                  cos.size(1) == D && D % 2 == 0 && positions.numel() == G &&
                  slots.numel() == G && kv_lens.numel() == G && block_tables.size(0) == G,
              "decode_attention_block: qkv [G, (H + 2 KVH) d], out [G, H d], one row each");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  for (int64_t g = 0; g < G; ++g)
    TORCH_CHECK(pos[g] >= 0 && pos[g] < cos.size(0) && slot[g] >= 0 && slot[g] < num_slots,
                "decode_attention_block: a position or slot out of range");
  if (k_cache.dtype() == torch::kBFloat16)
    decode_block<bf16>(qkv, positions, cos, sin, k_cache, v_cache, slots, block_tables, kv_lens,
                       scale, out);
  else if (k_cache.dtype() == torch::kFloat32)
    decode_block<float>(qkv, positions, cos, sin, k_cache, v_cache, slots, block_tables,
                        kv_lens, scale, out);
  else
    TORCH_CHECK(false, "decode_attention_block: a float32 or bfloat16 cache only");
}

void dequantize_int4pack(const torch::Tensor& packed, const torch::Tensor& scales_zeros,
                         int64_t group, torch::Tensor& out) {
  TORCH_CHECK(packed.dtype() == torch::kUInt8 && scales_zeros.dtype() == torch::kBFloat16 &&
                  out.dtype() == torch::kBFloat16,
              "dequantize_int4pack: uint8 packed, bfloat16 scales_and_zeros and out");
  TORCH_CHECK(all_contiguous({&packed, &scales_zeros, &out}) && out.dim() == 2 &&
                  scales_zeros.dim() == 3 && scales_zeros.size(2) == 2,
              "dequantize_int4pack: contiguous packed, scales_and_zeros [K / g, N, 2], out [K, N]");
  const int64_t K = out.size(0), N = out.size(1);
  TORCH_CHECK(N % 64 == 0 && group > 0 && K % group == 0 && packed.numel() * 2 == N * K &&
                  scales_zeros.size(0) == K / group && scales_zeros.size(1) == N,
              "dequantize_int4pack: N a multiple of 64, K of the group; sizes that agree");
  pacer::dequantize_int4pack(packed.data_ptr<uint8_t>(), ptr<bf16>(scales_zeros), N, K, group,
                             mut_ptr<bf16>(out));
}

using Int4Mm = void (*)(const bf16*, int64_t, const uint8_t*, const bf16*, int64_t, int64_t,
                       int64_t, bf16*);
template <typename O>
using Int8Mm = void (*)(const bf16*, int64_t, const int8_t*, const bf16*, int64_t, int64_t, O*);

// out [M, N] = x [M, K] times W in torch's int4 layout, by one of the kernels that widen W in
// cache (AMX tiles, or FMA)
void int4pack_mm(const char* name, Int4Mm kernel, const torch::Tensor& x,
                 const torch::Tensor& packed, const torch::Tensor& scales_zeros, int64_t group,
                 torch::Tensor& out) {
  TORCH_CHECK(x.dtype() == torch::kBFloat16 && packed.dtype() == torch::kUInt8 &&
                  scales_zeros.dtype() == torch::kBFloat16 && out.dtype() == torch::kBFloat16,
              name, ": bfloat16 x, uint8 packed, bfloat16 scales_and_zeros and out");
  TORCH_CHECK(all_contiguous({&x, &packed, &scales_zeros, &out}) && x.dim() == 2 &&
                  out.dim() == 2 && scales_zeros.dim() == 3 && scales_zeros.size(2) == 2,
              name, ": contiguous x [M, K], scales_and_zeros [K / g, N, 2], out [M, N]");
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1);
  TORCH_CHECK(out.size(0) == M && N % 64 == 0 && K % 32 == 0 && group > 0 && K % group == 0 &&
                  packed.numel() * 2 == N * K && scales_zeros.size(0) == K / group &&
                  scales_zeros.size(1) == N,
              name, ": N a multiple of 64, K of 32 and of the group; sizes that agree");
  kernel(ptr<bf16>(x), M, packed.data_ptr<uint8_t>(), ptr<bf16>(scales_zeros), N, K, group,
         mut_ptr<bf16>(out));
}

// out [M, N] = x [M, K] times int8 codes [N, K] with one scale per row (the LM head); out in
// bfloat16, or in float32 where the kernel has that variant (`f32`, else null)
void int8_mm(const char* name, Int8Mm<bf16> kernel, Int8Mm<float> f32, const torch::Tensor& x,
             const torch::Tensor& codes, const torch::Tensor& scale, torch::Tensor& out) {
  TORCH_CHECK(x.dtype() == torch::kBFloat16 && codes.dtype() == torch::kInt8 &&
                  scale.dtype() == torch::kBFloat16 &&
                  (out.dtype() == torch::kBFloat16 || f32 && out.dtype() == torch::kFloat32),
              name, ": bfloat16 x, int8 codes, bfloat16 scales, ",
              f32 ? "float32 or bfloat16 out" : "bfloat16 out");
  TORCH_CHECK(all_contiguous({&x, &codes, &scale, &out}) && x.dim() == 2 && codes.dim() == 2 &&
                  out.dim() == 2,
              name, ": contiguous x [M, K], codes [N, K], scales [N], out [M, N]");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  TORCH_CHECK(codes.size(1) == K && scale.numel() == N && out.size(0) == M && out.size(1) == N &&
                  N % 16 == 0 && K % 32 == 0,
              name, ": N a multiple of 16, K of 32; sizes that agree");
  if (out.dtype() == torch::kFloat32)
    f32(ptr<bf16>(x), M, codes.data_ptr<int8_t>(), ptr<bf16>(scale), N, K, out.data_ptr<float>());
  else
    kernel(ptr<bf16>(x), M, codes.data_ptr<int8_t>(), ptr<bf16>(scale), N, K, mut_ptr<bf16>(out));
}

// The bindings of the in-cache kernels: refused where `ready` says this build or CPU cannot
// run `kernel` (`missing` says why), then the shared checks above
auto int4_binding(const char* name, Int4Mm kernel, bool (*ready)(), const char* missing) {
  return [=](const torch::Tensor& x, const torch::Tensor& packed,
             const torch::Tensor& scales_zeros, int64_t group, torch::Tensor& out) {
    TORCH_CHECK(ready(), name, ": ", missing);
    int4pack_mm(name, kernel, x, packed, scales_zeros, group, out);
  };
}

auto int8_binding(const char* name, Int8Mm<bf16> kernel, bool (*ready)(), const char* missing,
                  Int8Mm<float> f32 = nullptr) {
  return [=](const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scale,
             torch::Tensor& out) {
    TORCH_CHECK(ready(), name, ": ", missing);
    int8_mm(name, kernel, f32, x, codes, scale, out);
  };
}

// out [M, N] = x [M, K] times int4 weights in the VNNI layout (csrc/int4_vnni.cpp), by
// `kernel` (int4_mm_vnni, or int4vnni_mm_amx: N a multiple of 64 there) where `ready`
using VnniMm = void (*)(const bf16*, int64_t, const uint8_t*, int64_t, int64_t, int64_t, bf16*);
auto vnni_binding(const char* name, VnniMm kernel, bool (*ready)(), const char* missing,
                  int64_t columns) {
  return [=](const torch::Tensor& x, const torch::Tensor& w, int64_t group, torch::Tensor& out) {
    TORCH_CHECK(ready(), name, ": ", missing);
    TORCH_CHECK(x.dtype() == torch::kBFloat16 && w.dtype() == torch::kUInt8 &&
                    out.dtype() == torch::kBFloat16,
                name, ": bfloat16 x and out, uint8 weights");
    TORCH_CHECK(all_contiguous({&x, &w, &out}) && x.dim() == 2 && w.dim() == 3 &&
                    out.dim() == 2,
                name, ": contiguous x [M, K], w [N / 16, K / group, 64 + 8 group], out [M, N]");
    const int64_t M = x.size(0), K = x.size(1), N = out.size(1);
    TORCH_CHECK(out.size(0) == M && N % columns == 0 && group > 0 && group % 32 == 0 &&
                    K % group == 0 && w.size(0) * 16 == N && w.size(1) * group == K &&
                    w.size(2) == 64 + 8 * group,
                name, ": N a multiple of ", columns, ", K of the group, the group of 32; sizes "
                "that agree");
    kernel(ptr<bf16>(x), M, w.data_ptr<uint8_t>(), N, K, group, mut_ptr<bf16>(out));
  };
}

// out [M, N] (float32 or bf16) = x [M, K] times int8 codes in the VNNI order [N / 16, K / 4,
// 16, 4] (csrc/int4_vnni.cpp) with one bfloat16 scale per column
void int8_mm_vnni(const torch::Tensor& x, const torch::Tensor& w8, const torch::Tensor& scale,
                  torch::Tensor& out) {
  TORCH_CHECK(pacer::vnni_ready(), "int8_mm_vnni: neither AVX512-VNNI nor an avx2 build here");
  TORCH_CHECK(x.dtype() == torch::kBFloat16 && w8.dtype() == torch::kInt8 &&
                  scale.dtype() == torch::kBFloat16 &&
                  (out.dtype() == torch::kBFloat16 || out.dtype() == torch::kFloat32),
              "int8_mm_vnni: bfloat16 x and scales, int8 codes, float32 or bfloat16 out");
  TORCH_CHECK(all_contiguous({&x, &w8, &scale, &out}) && x.dim() == 2 && w8.dim() == 4 &&
                  out.dim() == 2,
              "int8_mm_vnni: contiguous x [M, K], codes [N / 16, K / 4, 16, 4], out [M, N]");
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1);
  TORCH_CHECK(out.size(0) == M && K % 32 == 0 && w8.size(0) * 16 == N && w8.size(1) * 4 == K &&
                  w8.size(2) == 16 && w8.size(3) == 4 && scale.numel() == N,
              "int8_mm_vnni: K a multiple of 32; sizes that agree");
  if (out.dtype() == torch::kFloat32)
    pacer::int8_mm_vnni(ptr<bf16>(x), M, w8.data_ptr<int8_t>(), ptr<bf16>(scale), N, K,
                        out.data_ptr<float>());
  else
    pacer::int8_mm_vnni(ptr<bf16>(x), M, w8.data_ptr<int8_t>(), ptr<bf16>(scale), N, K,
                        mut_ptr<bf16>(out));
}

void argmax_rows(const torch::Tensor& x, torch::Tensor& out) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && out.dtype() == torch::kInt64,
              "argmax_rows: float32 x, int64 out");
  TORCH_CHECK(all_contiguous({&x, &out}) && x.dim() == 2 && x.size(1) > 0 && out.dim() == 1 &&
                  out.size(0) == x.size(0),
              "argmax_rows: contiguous x [S, V > 0], out [S]");
  pacer::argmax_rows(x.data_ptr<float>(), x.size(0), x.size(1), out.data_ptr<int64_t>());
}

constexpr const char* kNoAmx = "no AMX here (see amx_ready)";
constexpr const char* kNoDpbf16 = "no AVX512-BF16 here (an AVX-512 build)";
constexpr const char* kNoFma = "this build has no AVX2/FMA kernels";

void dequantize_int8(const torch::Tensor& codes, const torch::Tensor& scale, torch::Tensor& out) {
  TORCH_CHECK(codes.dtype() == torch::kInt8 && scale.dtype() == torch::kBFloat16 &&
                  out.dtype() == torch::kBFloat16,
              "dequantize_int8: int8 codes, bfloat16 scales and out");
  TORCH_CHECK(all_contiguous({&codes, &scale, &out}) && codes.dim() == 2 &&
                  out.sizes() == codes.sizes() && scale.numel() == codes.size(0),
              "dequantize_int8: contiguous codes [N, K], scales [N], out [N, K]");
  pacer::dequantize_int8(codes.data_ptr<int8_t>(), ptr<bf16>(scale), codes.size(0),
                         codes.size(1), mut_ptr<bf16>(out));
}

void silu_and_mul(const torch::Tensor& gate_up, torch::Tensor& out) {
  TORCH_CHECK(gate_up.dtype() == torch::kBFloat16 && out.dtype() == torch::kBFloat16,
              "silu_and_mul: bfloat16 in and out");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && out.is_contiguous() &&
                  out.size(0) == gate_up.size(0) && 2 * out.size(1) == gate_up.size(1),
              "silu_and_mul: contiguous [T, 2f] -> [T, f]");
  pacer::silu_and_mul(ptr<bf16>(gate_up), mut_ptr<bf16>(out), out.size(0), out.size(1));
}

}  // namespace

void pacer_bind_decoder(pybind11::module_& m);   // decoder.cpp

// Kernels that run long enough to matter let other Python threads run meanwhile (the
// worker's event loop sends the last step's tokens while this step computes): they touch no
// Python object. Elementwise ones of a few microseconds keep the GIL rather than hand it over.
const auto kReleaseGil = pybind11::call_guard<pybind11::gil_scoped_release>();

void pacer_bind(pybind11::module_& m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "decode attention over a paged KV cache (CPU, float32 or bfloat16 cache)",
        kReleaseGil);
  m.def("paged_prefill_supported", &pacer::paged_prefill_supported,
        "whether this build has the prefill kernel for a head_dim and GQA group");
  m.def("paged_prefill_attention", &paged_prefill_attention,
        "varlen causal attention of chunks over a paged KV cache (CPU, AVX-512)",
        kReleaseGil);
  m.def("add_rms_norm", &add_rms_norm, "x += delta; out = RMSNorm(x) in out's dtype (CPU)");
  m.def("dequantize_int4pack", &dequantize_int4pack,
        "torch's CPU int4 layout widened to bfloat16, transposed: out [K, N]",
        kReleaseGil);
  m.def("amx_ready", &pacer::amx_ready,
        "whether int4pack_mm_amx runs here (an AVX-512 build, a CPU and OS with AMX-BF16)");
  m.def("int4pack_mm_amx",
        int4_binding("int4pack_mm_amx", pacer::int4pack_mm_amx, pacer::amx_ready, kNoAmx),
        "x (bf16) times torch's CPU int4 layout, widened in cache and multiplied on AMX tiles",
        kReleaseGil);
  m.def("int8_mm_amx", int8_binding("int8_mm_amx", pacer::int8_mm_amx, pacer::amx_ready, kNoAmx),
        "x (bf16) times int8 per-row codes, on AMX tiles (the LM head at many rows)",
        kReleaseGil);
  m.def("dpbf16_ready", &pacer::dpbf16_ready,
        "whether this build and CPU run int4pack_mm_dpbf16 (AVX-512 build, AVX512-BF16)");
  m.def("int4pack_mm_dpbf16", int4_binding("int4pack_mm_dpbf16", pacer::int4pack_mm_dpbf16,
                                           pacer::dpbf16_ready, kNoDpbf16),
        "x (bf16) times torch's CPU int4 layout, widened in cache, AVX512-BF16 dot products",
        kReleaseGil);
  m.def("int8_mm_dpbf16", int8_binding("int8_mm_dpbf16", pacer::int8_mm_dpbf16<bf16>,
                                       pacer::dpbf16_ready, kNoDpbf16,
                                       pacer::int8_mm_dpbf16<float>),
        "x (bf16) times int8 per-row codes, AVX512-BF16 dot products (the LM head); out "
        "float32 or bf16",
        kReleaseGil);
  m.def("argmax_rows", &argmax_rows,
        "each row's first index of its largest value (a NaN the largest): torch.argmax(-1)",
        kReleaseGil);
  m.def("vnni_ready", &pacer::vnni_ready,
        "whether this build and CPU run int4_mm_vnni (AVX-512 build with AVX512-VNNI, or avx2)");
  m.def("int4_mm_vnni",
        vnni_binding("int4_mm_vnni", pacer::int4_mm_vnni, pacer::vnni_ready,
                     "neither AVX512-VNNI nor an avx2 build here", 16),
        "x (bf16, quantized to 8 bits per 32) times int4 weights in the VNNI layout",
        kReleaseGil);
  m.def("int8_mm_vnni", &int8_mm_vnni,
        "x (bf16, quantized to 8 bits per 32) times int8 per-column codes in the VNNI order; "
        "out float32 or bf16",
        kReleaseGil);
  m.def("int4vnni_mm_amx",
        vnni_binding("int4vnni_mm_amx", pacer::int4vnni_mm_amx, pacer::amx_ready, kNoAmx, 64),
        "x (bf16) times int4 weights in the VNNI layout, widened in cache, on AMX tiles",
        kReleaseGil);
  m.def("fma_ready", &pacer::fma_ready,
        "whether this build has int4pack_mm_fma and int8_mm_fma (AVX2 + FMA or above)");
  m.def("int4pack_mm_fma",
        int4_binding("int4pack_mm_fma", pacer::int4pack_mm_fma, pacer::fma_ready, kNoFma),
        "x (bf16) times torch's CPU int4 layout, widened to float32 in cache, FMA",
        kReleaseGil);
  m.def("int8_mm_fma", int8_binding("int8_mm_fma", pacer::int8_mm_fma, pacer::fma_ready, kNoFma),
        "x (bf16) times int8 per-row codes, widened to float32 in cache, FMA",
        kReleaseGil);
  m.def("dequantize_int8", &dequantize_int8, "int8 per-channel codes widened to bfloat16",
        kReleaseGil);
  m.def("decode_attention_block", &decode_attention_block,
        "RoPE + K/V store + decode attention from a bfloat16 fused qkv, one row per request",
        kReleaseGil);
  m.def("rotary_", &rotary_, "rotate-half RoPE in place (CPU, float32)");
  m.def("silu_and_mul", &silu_and_mul, "SwiGLU's silu(gate) * up, bfloat16 (CPU)");
  pacer_bind_decoder(m);
}
