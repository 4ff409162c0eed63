// The CPU attention kernels as one extension module (gpu_worker/attention/cpu_kernels.py).
#include <torch/extension.h>

void paged_decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                            const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                            const torch::Tensor& kv_lens, double scale, torch::Tensor& out);
bool paged_prefill_supported(int64_t head_dim, int64_t group);
void paged_prefill_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                             const torch::Tensor& v_cache, const torch::Tensor& block_table,
                             const torch::Tensor& cu_seqlens_q, const torch::Tensor& kv_lens,
                             int64_t min_rows, double scale, torch::Tensor& out);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "decode attention over a paged KV cache (CPU, float32 or bfloat16 cache)");
  m.def("paged_prefill_supported", &paged_prefill_supported,
        "whether this build has the prefill kernel for a head_dim and GQA group");
  m.def("paged_prefill_attention", &paged_prefill_attention,
        "varlen causal attention of chunks over a paged KV cache (CPU, AVX-512)");
}
