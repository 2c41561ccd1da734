// Decode attention that reads the paged KV cache in place.
//
// Each request has one query token, which attends over the request's cached
// context: fixed-size blocks listed by its block-table row. The PyTorch path
// gathers those blocks into a contiguous copy and then calls SDPA; on a CPU
// the copy and SDPA's per-call set-up cost more than the arithmetic (a decode
// row is a few hundred dot products per head). Here one task per request walks
// its blocks directly, token by token (all KV heads of a token are adjacent in
// memory): scores, softmax, weighted sum of values.
//
// Plain C ABI, no torch headers, so it builds in about a second; built and
// called by decode_kernel.py.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

extern "C" void decode_attention_f32(
    const float* query,           // [rows, heads, dim]
    const float* key_cache,       // [num_blocks, block_size, kv_heads, dim]
    const float* value_cache,     // [num_blocks, block_size, kv_heads, dim]
    const int64_t* block_table,   // [rows, width]
    const int64_t* context_lens,  // [rows], each <= width * block_size
    float* out,                   // [rows, heads, dim]
    int64_t rows, int64_t heads, int64_t kv_heads, int64_t dim,
    int64_t block_size, int64_t width, float scale, int num_threads) {
  const int64_t group = heads / kv_heads;  // query heads per KV head
#pragma omp parallel for schedule(dynamic) num_threads(num_threads)
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t len = context_lens[r];
    const float* q = query + r * heads * dim;
    float* o = out + r * heads * dim;
    std::fill(o, o + heads * dim, 0.0f);
    if (len <= 0) continue;
    const int64_t* blocks = block_table + r * width;
    // Where context token t's keys (or values) of every KV head start.
    auto token = [&](const float* cache, int64_t t) {
      const int64_t slot = blocks[t / block_size] * block_size + t % block_size;
      return cache + slot * kv_heads * dim;
    };

    std::vector<float> scores(heads * len);  // [heads, len]
    for (int64_t t = 0; t < len; ++t) {
      const float* k = token(key_cache, t);
      for (int64_t h = 0; h < heads; ++h) {
        const float* qh = q + h * dim;
        const float* kh = k + (h / group) * dim;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < dim; ++d) dot += qh[d] * kh[d];
        scores[h * len + t] = dot * scale;
      }
    }

    std::vector<float> inv_sum(heads);  // softmax of each head's scores
    for (int64_t h = 0; h < heads; ++h) {
      float* s = scores.data() + h * len;
      const float max = *std::max_element(s, s + len);
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t t = 0; t < len; ++t) {
        s[t] = std::exp(s[t] - max);
        sum += s[t];
      }
      inv_sum[h] = 1.0f / sum;
    }

    for (int64_t t = 0; t < len; ++t) {
      const float* v = token(value_cache, t);
      for (int64_t h = 0; h < heads; ++h) {
        const float p = scores[h * len + t];
        const float* vh = v + (h / group) * dim;
        float* oh = o + h * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) oh[d] += p * vh[d];
      }
    }
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t d = 0; d < dim; ++d) o[h * dim + d] *= inv_sum[h];
  }
}
