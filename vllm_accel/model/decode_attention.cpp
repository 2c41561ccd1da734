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
// The cache may hold float32, bfloat16 or float16 values; the arithmetic is
// float32 in every case. Plain C ABI, no torch headers, so it builds in about a
// second; built and called by decode_kernel.py.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

// bfloat16: the top half of a float32.
struct bf16 {
  uint16_t bits;
};
static inline float to_float(float x) { return x; }
static inline float to_float(_Float16 x) { return static_cast<float>(x); }
static inline float to_float(bf16 x) {
  const uint32_t wide = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &wide, sizeof f);
  return f;
}
template <typename T> static inline T from_float(float x) { return static_cast<T>(x); }
template <> inline bf16 from_float<bf16>(float x) {  // round to nearest even (finite x)
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  bits += 0x7fff + ((bits >> 16) & 1);
  return bf16{static_cast<uint16_t>(bits >> 16)};
}

template <typename T>
static void decode_attention(
    const T* query,               // [rows, heads, dim]
    const T* key_cache,           // [num_blocks, block_size, kv_heads, dim]
    const T* value_cache,         // [num_blocks, block_size, kv_heads, dim]
    const int64_t* block_table,   // [rows, width]
    const int64_t* context_lens,  // [rows], each <= width * block_size
    T* out,                       // [rows, heads, dim]
    int64_t rows, int64_t heads, int64_t kv_heads, int64_t dim,
    int64_t block_size, int64_t width, float scale, int num_threads) {
  const int64_t group = heads / kv_heads;  // query heads per KV head
#pragma omp parallel for schedule(dynamic) num_threads(num_threads)
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t len = context_lens[r];
    T* result = out + r * heads * dim;
    if (len <= 0) {  // nothing to attend to (the runner never asks for this)
      std::fill(result, result + heads * dim, from_float<T>(0.0f));
      continue;
    }
    std::vector<float> q(heads * dim), o(heads * dim, 0.0f);
    for (int64_t i = 0; i < heads * dim; ++i) q[i] = to_float(query[r * heads * dim + i]);
    const int64_t* blocks = block_table + r * width;
    // Where context token t's keys (or values) of every KV head start.
    auto token = [&](const T* cache, int64_t t) {
      const int64_t slot = blocks[t / block_size] * block_size + t % block_size;
      return cache + slot * kv_heads * dim;
    };

    std::vector<float> scores(heads * len);  // [heads, len]
    for (int64_t t = 0; t < len; ++t) {
      const T* k = token(key_cache, t);
      for (int64_t h = 0; h < heads; ++h) {
        const float* qh = q.data() + h * dim;
        const T* kh = k + (h / group) * dim;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < dim; ++d) dot += qh[d] * to_float(kh[d]);
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
      const T* v = token(value_cache, t);
      for (int64_t h = 0; h < heads; ++h) {
        const float p = scores[h * len + t];
        const T* vh = v + (h / group) * dim;
        float* oh = o.data() + h * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) oh[d] += p * to_float(vh[d]);
      }
    }
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t d = 0; d < dim; ++d)
        result[h * dim + d] = from_float<T>(o[h * dim + d] * inv_sum[h]);
  }
}

#define DECODE_ATTENTION(suffix, T)                                                    \
  extern "C" void decode_attention_##suffix(                                           \
      const T* query, const T* key_cache, const T* value_cache,                        \
      const int64_t* block_table, const int64_t* context_lens, T* out, int64_t rows,   \
      int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size, int64_t width, \
      float scale, int num_threads) {                                                  \
    decode_attention(query, key_cache, value_cache, block_table, context_lens, out,    \
                     rows, heads, kv_heads, dim, block_size, width, scale, num_threads); \
  }
DECODE_ATTENTION(f32, float)
DECODE_ATTENTION(bf16, bf16)
DECODE_ATTENTION(f16, _Float16)
