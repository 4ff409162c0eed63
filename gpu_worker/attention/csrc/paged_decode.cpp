// Decode attention straight from the paged KV pool on CPU: one query row per request, keys
// and values read in place through the block table (no gathered copy). All of a request's
// query heads are scored against each token's row of K (every KV head, contiguous) in one
// pass, so each K and V row is read from memory once. Queries, scores and output in float32;
// the cache in float32 or bfloat16 (widened on load: a bfloat16 cache halves the bytes read);
// softmax in two passes.
//
//   q            [G, H, d]          the decode rows
//   k/v_cache    [blocks, bs, KVH, d]
//   block_tables [G, max_blocks]    int64
//   kv_lens      [G]                int64, keys each request sees (its own included)
//   out          [G, H, d]
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <vector>

template <typename T>
static void decode(const torch::Tensor& q, const torch::Tensor& k_cache,
                   const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                   const torch::Tensor& kv_lens, double scale, torch::Tensor& out) {
  const int64_t G = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t BS = k_cache.size(1), KVH = k_cache.size(2);
  const int64_t group = H / KVH, max_blocks = block_tables.size(1);
  const float* qp = q.data_ptr<float>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* lens = kv_lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const int64_t row = KVH * D;           // elements per token in one block
  const float fscale = static_cast<float>(scale);

#pragma omp parallel
  {
    std::vector<float> scores;
    std::vector<float> acc(H * D);
#pragma omp for schedule(dynamic, 1)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t L = lens[g];
      scores.assign(H * L, 0.f);
      const float* qg = qp + g * H * D;
      // pass 1: scores[h, t] = q_h · k_t[h / group]; each token's row of every KV head is
      // read once, contiguously
      for (int64_t t = 0; t < L; ++t) {
        const int64_t block = bt[g * max_blocks + t / BS];
        const T* kt = kp + (block * BS + t % BS) * row;
        for (int64_t h = 0; h < H; ++h) {
          const float* qh = qg + h * D;
          const T* kh = kt + (h / group) * D;
          float s = 0.f;
          for (int64_t i = 0; i < D; ++i) s += qh[i] * static_cast<float>(kh[i]);
          scores[h * L + t] = s * fscale;
        }
      }
      for (int64_t h = 0; h < H; ++h) {          // softmax per query head
        float* sh = scores.data() + h * L;
        const float m = *std::max_element(sh, sh + L);
        float sum = 0.f;
        for (int64_t t = 0; t < L; ++t) {
          sh[t] = std::exp(sh[t] - m);
          sum += sh[t];
        }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < L; ++t) sh[t] *= inv;
      }
      // pass 2: out_h = sum_t p[h, t] v_t[h / group]
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < L; ++t) {
        const int64_t block = bt[g * max_blocks + t / BS];
        const T* vt = vp + (block * BS + t % BS) * row;
        for (int64_t h = 0; h < H; ++h) {
          const float p = scores[h * L + t];
          const T* vh = vt + (h / group) * D;
          float* ah = acc.data() + h * D;
          for (int64_t i = 0; i < D; ++i) ah[i] += p * static_cast<float>(vh[i]);
        }
      }
      std::copy(acc.begin(), acc.end(), op + g * H * D);
    }
  }
}

void paged_decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                            const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                            const torch::Tensor& kv_lens, double scale, torch::Tensor& out) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && out.dtype() == torch::kFloat32,
              "paged_decode_attention: float32 queries and output only");
  TORCH_CHECK(k_cache.dtype() == v_cache.dtype(), "paged_decode_attention: K and V dtypes differ");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  out.is_contiguous() && block_tables.is_contiguous() && kv_lens.is_contiguous(),
              "paged_decode_attention: contiguous tensors only");
  if (k_cache.dtype() == torch::kFloat32) {
    decode<float>(q, k_cache, v_cache, block_tables, kv_lens, scale, out);
  } else if (k_cache.dtype() == torch::kBFloat16) {
    decode<c10::BFloat16>(q, k_cache, v_cache, block_tables, kv_lens, scale, out);
  } else {
    TORCH_CHECK(false, "paged_decode_attention: a float32 or bfloat16 cache only");
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "decode attention over a paged KV cache (CPU, float32 or bfloat16 cache)");
}
