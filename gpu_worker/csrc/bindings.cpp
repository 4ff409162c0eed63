// The CPU kernels as one extension module (gpu_worker/cpu_kernels.py).
#include <torch/extension.h>

void paged_decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                            const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                            const torch::Tensor& kv_lens, double scale, torch::Tensor& out);
bool paged_prefill_supported(int64_t head_dim, int64_t group);
void paged_prefill_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                             const torch::Tensor& v_cache, const torch::Tensor& block_table,
                             const torch::Tensor& cu_seqlens_q, const torch::Tensor& kv_lens,
                             int64_t min_rows, double scale, torch::Tensor& out);
void add_rms_norm(torch::Tensor& x, const c10::optional<torch::Tensor>& delta,
                  const torch::Tensor& w, double eps, torch::Tensor& out);
void rotary_(torch::Tensor& qk, const torch::Tensor& positions, const torch::Tensor& cos,
             const torch::Tensor& sin);
void silu_and_mul(const torch::Tensor& gate_up, torch::Tensor& out);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "decode attention over a paged KV cache (CPU, float32 or bfloat16 cache)");
  m.def("paged_prefill_supported", &paged_prefill_supported,
        "whether this build has the prefill kernel for a head_dim and GQA group");
  m.def("paged_prefill_attention", &paged_prefill_attention,
        "varlen causal attention of chunks over a paged KV cache (CPU, AVX-512)");
  m.def("add_rms_norm", &add_rms_norm, "x += delta; out = RMSNorm(x) in out's dtype (CPU)");
  m.def("rotary_", &rotary_, "rotate-half RoPE in place (CPU, float32)");
  m.def("silu_and_mul", &silu_and_mul, "SwiGLU's silu(gate) * up, bfloat16 (CPU)");
}
