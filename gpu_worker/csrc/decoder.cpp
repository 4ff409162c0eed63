// The decoder's layers for an iteration of decodes alone, in one call from Python
// (docs/design.md#one-call-per-decode-step): per layer the residual add and RMSNorm, the fused
// qkv GEMM, RoPE + K/V store + attention, o_proj, the second norm, gate/up, SwiGLU and down —
// the same kernels, in the same order and on the same dtypes as the op-by-op path of
// gpu_worker/model/llama.py, so the bits are the same. What it removes is the host work between
// them: ~300 Python calls, their checks and tensors per step, which cost one request's decode
// more than its attention did.
//
// Torch glue like bindings.cpp (compiled once, for baseline x86-64); the kernels are the
// level's. Offered where every layer's four matrices are int4 in the VNNI layout
// (csrc/int4_vnni.cpp) and nothing is sharded; gpu_worker/model/llama.py decides.
#include <torch/extension.h>

#include <memory>
#include <vector>

#include "kernels.h"

namespace {

using pacer::bf16;

bf16* bf16_ptr(torch::Tensor& t) { return reinterpret_cast<bf16*>(t.data_ptr<c10::BFloat16>()); }

// int4 weights in the VNNI layout: [N / 16, K / group, 64 + 8 group] bytes
struct Int4Matrix {
  torch::Tensor w;
  int64_t n = 0, k = 0;
};

struct Layer {
  torch::Tensor norm1, norm2;           // float32 [hidden]
  Int4Matrix qkv, o, gate_up, down;
  torch::Tensor k_cache, v_cache;       // [blocks, block_size, KVH, D], float32 or bfloat16
};

class DecoderStack {
 public:
  DecoderStack(int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t ffn,
               int64_t group, double eps, double scale, torch::Tensor cos, torch::Tensor sin,
               int64_t tiles_from_rows)
      : hidden_(hidden), heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), ffn_(ffn),
        group_(group), eps_(static_cast<float>(eps)), scale_(static_cast<float>(scale)),
        cos_(std::move(cos)), sin_(std::move(sin)), tiles_from_rows_(tiles_from_rows) {
    TORCH_CHECK(pacer::vnni_ready(), "DecoderStack: no AVX512-VNNI here (an AVX-512 build)");
    TORCH_CHECK(tiles_from_rows < 0 || pacer::amx_ready(),
                "DecoderStack: tiles_from_rows given, but no AMX here (see amx_ready)");
    TORCH_CHECK(group > 0 && group % 32 == 0 && hidden % group == 0 && ffn % group == 0,
                "DecoderStack: the hidden and FFN sizes in groups of a multiple of 32");
    TORCH_CHECK(heads % kv_heads == 0 && head_dim % 2 == 0, "DecoderStack: heads");
    TORCH_CHECK(cos_.dtype() == torch::kFloat32 && sin_.dtype() == torch::kFloat32 &&
                    cos_.is_contiguous() && sin_.is_contiguous() && cos_.dim() == 2 &&
                    cos_.sizes() == sin_.sizes() && cos_.size(1) == head_dim,
                "DecoderStack: float32 RoPE tables [positions, head_dim]");
  }

  void add_layer(torch::Tensor norm1, torch::Tensor qkv, torch::Tensor o, torch::Tensor norm2,
                 torch::Tensor gate_up, torch::Tensor down, torch::Tensor k_cache,
                 torch::Tensor v_cache) {
    const int64_t q = heads_ * head_dim_, kv = kv_heads_ * head_dim_;
    Layer l;
    l.norm1 = norm(std::move(norm1));
    l.norm2 = norm(std::move(norm2));
    l.qkv = matrix(std::move(qkv), q + 2 * kv, hidden_, "qkv");
    l.o = matrix(std::move(o), hidden_, q, "o");
    l.gate_up = matrix(std::move(gate_up), 2 * ffn_, hidden_, "gate_up");
    l.down = matrix(std::move(down), hidden_, ffn_, "down");
    TORCH_CHECK(k_cache.dtype() == v_cache.dtype() && k_cache.sizes() == v_cache.sizes() &&
                    k_cache.dim() == 4 && k_cache.size(2) == kv_heads_ &&
                    k_cache.size(3) == head_dim_ && k_cache.is_contiguous() &&
                    v_cache.is_contiguous() &&
                    (k_cache.dtype() == torch::kFloat32 || k_cache.dtype() == torch::kBFloat16),
                "DecoderStack: K and V caches [blocks, block_size, KVH, D], float32 or bf16");
    l.k_cache = std::move(k_cache);
    l.v_cache = std::move(v_cache);
    layers_.push_back(std::move(l));
  }

  // x [G, hidden] float32, the embedded rows: the residual stream (updated in place). Returns
  // the last layer's MLP output (bfloat16), not added to x yet.
  torch::Tensor decode(torch::Tensor& x, const torch::Tensor& positions, const torch::Tensor& slots,
                       const torch::Tensor& block_tables, const torch::Tensor& kv_lens) {
    TORCH_CHECK(!layers_.empty(), "DecoderStack: no layers");
    TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.size(1) == hidden_ &&
                    x.is_contiguous(), "DecoderStack.decode: x [G, hidden] float32");
    const int64_t G = x.size(0);
    for (const torch::Tensor* t : {&positions, &slots, &block_tables, &kv_lens})
      TORCH_CHECK(t->dtype() == torch::kInt64 && t->is_contiguous(),
                  "DecoderStack.decode: contiguous int64 positions, slots, block tables, lengths");
    TORCH_CHECK(positions.numel() == G && slots.numel() == G && kv_lens.numel() == G &&
                    block_tables.dim() == 2 && block_tables.size(0) == G,
                "DecoderStack.decode: one position, slot, block-table row and length per row");
    const torch::Tensor& k0 = layers_[0].k_cache;
    const int64_t BS = k0.size(1), num_slots = k0.size(0) * BS, max_blocks = block_tables.size(1);
    const int64_t* pos = positions.data_ptr<int64_t>();
    const int64_t* slot = slots.data_ptr<int64_t>();
    const int64_t* bt = block_tables.data_ptr<int64_t>();
    const int64_t* lens = kv_lens.data_ptr<int64_t>();
    for (int64_t g = 0; g < G; ++g) {
      TORCH_CHECK(pos[g] >= 0 && pos[g] < cos_.size(0) && slot[g] >= 0 && slot[g] < num_slots,
                  "DecoderStack.decode: a position or slot out of range");
      TORCH_CHECK(lens[g] >= 1 && lens[g] <= max_blocks * BS,
                  "DecoderStack.decode: a length beyond its block table");
      for (int64_t b = 0; b < (lens[g] + BS - 1) / BS; ++b)
        TORCH_CHECK(bt[g * max_blocks + b] >= 0 && bt[g * max_blocks + b] < k0.size(0),
                    "DecoderStack.decode: a block id out of the pool");
    }
    return run(x, [&](Layer& l, const bf16* qkv, bf16* attn) {
      attend(l, qkv, pos, slot, bt, lens, G, BS, max_blocks, attn);
    });
  }

  // An iteration with prompt chunks (docs/design.md#one-call-per-decode-step): the same layers,
  // with each chunk's rows attended by the kernel the layers' own path gives them — the prefill
  // kernel for chunks of two or more rows and for single rows at prompt positions, the decode
  // kernel for decodes — so the bits are the layers' path's. x [T, hidden] float32 in place;
  // positions, slots [T] int64; the flash-attn form of the chunks: block_table [R, blocks],
  // cu_seqlens_q [R + 1], kv_lens [R] (int32); by_prefill [T] uint8: 1 where a row is
  // attended by the prefill kernel (the same for every row of a chunk; a decode's chunk is one row).
  torch::Tensor mixed(torch::Tensor& x, const torch::Tensor& positions, const torch::Tensor& slots,
                      const torch::Tensor& block_table, const torch::Tensor& cu_seqlens_q,
                      const torch::Tensor& kv_lens, const torch::Tensor& by_prefill) {
    TORCH_CHECK(!layers_.empty(), "DecoderStack: no layers");
    TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.size(1) == hidden_ &&
                    x.is_contiguous(), "DecoderStack.mixed: x [T, hidden] float32");
    TORCH_CHECK(pacer::paged_prefill_supported(head_dim_, heads_ / kv_heads_),
                "DecoderStack.mixed: this build has no prefill kernel for the head size");
    const int64_t T = x.size(0);
    for (const torch::Tensor* t : {&positions, &slots})
      TORCH_CHECK(t->dtype() == torch::kInt64 && t->is_contiguous() && t->numel() == T,
                  "DecoderStack.mixed: contiguous int64 positions and slots, one per row");
    for (const torch::Tensor* t : {&block_table, &cu_seqlens_q, &kv_lens})
      TORCH_CHECK(t->dtype() == torch::kInt32 && t->is_contiguous(),
                  "DecoderStack.mixed: contiguous int32 block table, cu_seqlens_q and lengths");
    TORCH_CHECK(by_prefill.dtype() == torch::kUInt8 && by_prefill.is_contiguous() &&
                    by_prefill.numel() == T, "DecoderStack.mixed: by_prefill [T] uint8");
    const int64_t R = kv_lens.numel();
    TORCH_CHECK(block_table.dim() == 2 && block_table.size(0) == R && cu_seqlens_q.numel() == R + 1,
                "DecoderStack.mixed: one block-table row, length and cu_seqlens step per chunk");
    const torch::Tensor& k0 = layers_[0].k_cache;
    const int64_t BS = k0.size(1), num_slots = k0.size(0) * BS, MB = block_table.size(1);
    const int64_t* pos = positions.data_ptr<int64_t>();
    const int64_t* slot = slots.data_ptr<int64_t>();
    const int32_t* bt = block_table.data_ptr<int32_t>();
    const int32_t* cu = cu_seqlens_q.data_ptr<int32_t>();
    const int32_t* lens = kv_lens.data_ptr<int32_t>();
    const uint8_t* pre = by_prefill.data_ptr<uint8_t>();
    TORCH_CHECK(cu[0] == 0 && cu[R] == T, "DecoderStack.mixed: cu_seqlens_q from 0 to the rows");
    // the decode kernel's requests, and the prefill kernel's chunks gathered into a batch of
    // their own (whole chunks: the kernel's tiles start at each chunk's first row)
    Split split;
    split.pre_cu.push_back(0);
    for (int64_t r = 0; r < R; ++r) {
      const int64_t rows = cu[r + 1] - cu[r];
      TORCH_CHECK(rows >= 1 && lens[r] >= rows && lens[r] <= MB * BS,
                  "DecoderStack.mixed: a chunk of no rows, or a length beyond its block table");
      for (int64_t b = 0; b < (lens[r] + BS - 1) / BS; ++b)
        TORCH_CHECK(bt[r * MB + b] >= 0 && bt[r * MB + b] < k0.size(0),
                    "DecoderStack.mixed: a block id out of the pool");
      for (int64_t t = cu[r]; t < cu[r + 1]; ++t) {
        TORCH_CHECK(pos[t] == lens[r] - rows + (t - cu[r]) && pos[t] < cos_.size(0) &&
                        slot[t] >= 0 && slot[t] < num_slots,
                    "DecoderStack.mixed: a position or slot out of range");
        TORCH_CHECK(pre[t] == pre[cu[r]], "DecoderStack.mixed: a chunk's rows of two kernels");
      }
      if (pre[cu[r]]) {
        for (int64_t t = cu[r]; t < cu[r + 1]; ++t) split.pre_rows.push_back(t);
        split.pre_cu.push_back(static_cast<int32_t>(split.pre_rows.size()));
        split.pre_lens.push_back(lens[r]);
        split.pre_bt.insert(split.pre_bt.end(), bt + r * MB, bt + (r + 1) * MB);
      } else {
        TORCH_CHECK(rows == 1, "DecoderStack.mixed: a decode of more than one row");
        split.dec_rows.push_back(cu[r]);
        split.dec_lens.push_back(lens[r]);
        split.dec_bt.insert(split.dec_bt.end(), bt + r * MB, bt + (r + 1) * MB);
      }
    }
    return run(x, [&](Layer& l, const bf16* qkv, bf16* attn) {
      attend_mixed(l, qkv, pos, slot, split, T, BS, MB, attn);
    });
  }

 private:
  struct Split {
    std::vector<int64_t> dec_rows, dec_lens, dec_bt, pre_rows;
    std::vector<int32_t> pre_cu, pre_lens, pre_bt;
  };

  // every layer over G rows, attention by `attend(layer, qkv, out)`; returns the last layer's
  // MLP output (bfloat16), not added to x yet
  template <typename Attend>
  torch::Tensor run(torch::Tensor& x, const Attend& attend_rows) {
    const int64_t G = x.size(0);
    const int64_t q = heads_ * head_dim_, kv = kv_heads_ * head_dim_;
    auto opts = x.options().dtype(torch::kBFloat16);
    torch::Tensor out = torch::empty({G, hidden_}, opts);
    // every element is written before it is read: no zero-filling
    const auto buffer = [G](int64_t per_row) { return std::unique_ptr<bf16[]>(new bf16[G * per_row]); };
    const auto h = buffer(hidden_), qkv = buffer(q + 2 * kv), attn = buffer(q), a = buffer(hidden_),
               gu = buffer(2 * ffn_), act = buffer(ffn_);
    float* xp = x.data_ptr<float>();
    const bf16* d = nullptr;          // the previous layer's MLP output (none before the first)
    bf16* dp = bf16_ptr(out);
    {
      pybind11::gil_scoped_release unlocked;      // no Python object is touched below
      for (Layer& l : layers_) {
        if (d)
          pacer::add_rms_norm(xp, d, l.norm1.data_ptr<float>(), h.get(), G, hidden_, eps_);
        else
          pacer::add_rms_norm(xp, static_cast<const float*>(nullptr), l.norm1.data_ptr<float>(),
                              h.get(), G, hidden_, eps_);
        mm(h.get(), G, l.qkv, qkv.get());
        attend_rows(l, qkv.get(), attn.get());
        mm(attn.get(), G, l.o, a.get());
        pacer::add_rms_norm(xp, static_cast<const bf16*>(a.get()), l.norm2.data_ptr<float>(),
                            h.get(), G, hidden_, eps_);
        mm(h.get(), G, l.gate_up, gu.get());
        pacer::silu_and_mul(gu.get(), act.get(), G, ffn_);
        mm(act.get(), G, l.down, dp);
        d = dp;
      }
    }
    return out;
  }

  torch::Tensor norm(torch::Tensor w) const {
    TORCH_CHECK(w.dtype() == torch::kFloat32 && w.is_contiguous() && w.dim() == 1 &&
                    w.size(0) == hidden_, "DecoderStack: float32 norm weights [hidden]");
    return w;
  }

  Int4Matrix matrix(torch::Tensor w, int64_t n, int64_t k, const char* name) const {
    TORCH_CHECK(w.dtype() == torch::kUInt8 && w.is_contiguous() && w.dim() == 3 &&
                    w.size(0) * 16 == n && w.size(1) * group_ == k &&
                    w.size(2) == 64 + 8 * group_,
                "DecoderStack: ", name, " must be int4 in the VNNI layout, [", n / 16, ", ",
                k / group_, ", ", 64 + 8 * group_, "] bytes, unpadded");
    return Int4Matrix{std::move(w), n, k};
  }

  // as Int4Weight.mm chooses (gpu_worker/quant/linear.py): from `tiles_from_rows` rows on,
  // the VNNI layout widened onto AMX tiles (the matrices are unpadded: N a multiple of 64)
  void mm(const bf16* in, int64_t G, const Int4Matrix& m, bf16* out) const {
    if (tiles_from_rows_ >= 0 && G >= tiles_from_rows_)
      pacer::int4vnni_mm_amx(in, G, m.w.data_ptr<uint8_t>(), m.n, m.k, group_, out);
    else
      pacer::int4_mm_vnni(in, G, m.w.data_ptr<uint8_t>(), m.n, m.k, group_, out);
  }

  void attend(Layer& l, const bf16* qkv, const int64_t* pos, const int64_t* slot,
              const int64_t* bt, const int64_t* lens, int64_t G, int64_t BS, int64_t max_blocks,
              bf16* out) const {
    const float* c = cos_.data_ptr<float>();
    const float* s = sin_.data_ptr<float>();
    if (l.k_cache.dtype() == torch::kBFloat16)
      pacer::decode_attention_block<bf16>(qkv, pos, c, s, bf16_ptr(l.k_cache),
                                          bf16_ptr(l.v_cache), slot, bt, lens, G, heads_,
                                          kv_heads_, head_dim_, BS, max_blocks, scale_, out);
    else
      pacer::decode_attention_block<float>(qkv, pos, c, s, l.k_cache.data_ptr<float>(),
                                           l.v_cache.data_ptr<float>(), slot, bt, lens, G,
                                           heads_, kv_heads_, head_dim_, BS, max_blocks, scale_,
                                           out);
  }

  // RoPE and the K/V store for every row as decode_attention_block does them (rotary's bits),
  // then the decode kernel over the decodes and the prefill kernel over the chunks
  template <typename T>
  void attend_split(const bf16* qkv, const int64_t* pos, const int64_t* slot, const Split& sp,
                    int64_t T_rows, int64_t BS, int64_t MB, T* k_cache, T* v_cache,
                    bf16* out) const {
    pacer::mixed_attention_block<T>(
        qkv, pos, cos_.data_ptr<float>(), sin_.data_ptr<float>(), k_cache, v_cache, slot, T_rows,
        sp.dec_rows.data(), sp.dec_bt.data(), sp.dec_lens.data(),
        static_cast<int64_t>(sp.dec_rows.size()), sp.pre_rows.data(),
        static_cast<int64_t>(sp.pre_rows.size()), sp.pre_bt.data(), sp.pre_cu.data(),
        sp.pre_lens.data(), static_cast<int64_t>(sp.pre_lens.size()), heads_, kv_heads_,
        head_dim_, BS, MB, scale_, out);
  }

  void attend_mixed(Layer& l, const bf16* qkv, const int64_t* pos, const int64_t* slot,
                    const Split& sp, int64_t T_rows, int64_t BS, int64_t MB, bf16* out) const {
    if (l.k_cache.dtype() == torch::kBFloat16)
      attend_split<bf16>(qkv, pos, slot, sp, T_rows, BS, MB, bf16_ptr(l.k_cache),
                         bf16_ptr(l.v_cache), out);
    else
      attend_split<float>(qkv, pos, slot, sp, T_rows, BS, MB, l.k_cache.data_ptr<float>(),
                          l.v_cache.data_ptr<float>(), out);
  }

  int64_t hidden_, heads_, kv_heads_, head_dim_, ffn_, group_;
  float eps_, scale_;
  torch::Tensor cos_, sin_;
  int64_t tiles_from_rows_;     // < 0: never
  std::vector<Layer> layers_;
};

}  // namespace

void pacer_bind_decoder(pybind11::module_& m) {
  namespace py = pybind11;
  py::class_<DecoderStack>(m, "DecoderStack",
                           "the decoder's layers for an iteration of decodes alone, one call")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, double, double,
                    torch::Tensor, torch::Tensor, int64_t>(),
           py::arg("hidden"), py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"),
           py::arg("ffn"), py::arg("group"), py::arg("eps"), py::arg("scale"), py::arg("cos"),
           py::arg("sin"), py::arg("tiles_from_rows") = -1)
      .def("add_layer", &DecoderStack::add_layer,
           "norm1, qkv, o, norm2, gate_up, down (int4, VNNI layout), k_cache, v_cache")
      .def("decode", &DecoderStack::decode,
           "x (float32, in place), positions, slots, block tables, lengths -> the last "
           "layer's MLP output (bf16)")
      .def("mixed", &DecoderStack::mixed,
           "x (float32, in place), positions, slots, block_table, cu_seqlens_q, kv_lens "
           "(int32), by_prefill (uint8 per row) -> the last layer's MLP output (bf16)");
}
