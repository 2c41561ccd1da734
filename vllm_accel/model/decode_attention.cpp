// Decode attention that reads the paged KV cache in place.
//
// Each request has one query token, which attends over the request's cached
// context: fixed-size blocks listed by its block-table row. The PyTorch path
// gathers those blocks into a contiguous copy and then calls SDPA; on a CPU
// the copy and SDPA's per-call set-up cost more than the arithmetic (a decode
// row is a few hundred dot products per head). Here one task per request walks
// its blocks directly, one block after another (while asking for the next:
// blocks lie anywhere in the cache), in two passes: every head's scores, then
// the softmax-weighted sum of values. Within a block the loop runs head by
// head, so a head's query (or running output) stays in registers over the
// block's tokens; the head size is a compile-time constant for the common
// sizes, which makes each token's dot product a few vector instructions.
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

// One request's context, block by block: calls visit(block's first token,
// index of that token, tokens in the block), having asked for the next block.
template <typename T, typename Visit>
static inline void for_each_block(const T* cache, const int64_t* blocks, int64_t len,
                                  int64_t block_size, int64_t token_stride, Visit visit) {
  const int64_t block_bytes = block_size * token_stride * sizeof(T);
  for (int64_t b = 0, start = 0; start < len; ++b, start += block_size) {
    if (start + block_size < len) {
      const auto* next = reinterpret_cast<const char*>(cache + blocks[b + 1] * block_size * token_stride);
      const int64_t used = (len - start - block_size) * token_stride * sizeof(T);
      for (int64_t i = 0; i < std::min(block_bytes, used); i += 64) __builtin_prefetch(next + i);
    }
    visit(cache + blocks[b] * block_size * token_stride, start, std::min(block_size, len - start));
  }
}

// DIM: the head size when known at compile time (the common sizes: loops of a
// fixed length become a few vector instructions), 0 when given at run time.
template <int DIM, typename T>
static void decode_attention(
    const T* query,               // [rows, heads, dim]
    const T* key_cache,           // [num_blocks, block_size, kv_heads, dim]
    const T* value_cache,         // [num_blocks, block_size, kv_heads, dim]
    const int64_t* block_table,   // [rows, width]
    const int64_t* context_lens,  // [rows], each <= width * block_size
    T* out,                       // [rows, heads, dim]
    int64_t rows, int64_t heads, int64_t kv_heads, int64_t runtime_dim,
    int64_t block_size, int64_t width, float scale, int num_threads) {
  const int64_t dim = DIM ? DIM : runtime_dim;
  const int64_t group = heads / kv_heads;  // query heads per KV head
  const int64_t stride = kv_heads * dim;   // between a KV head's consecutive tokens
#pragma omp parallel for schedule(dynamic) num_threads(num_threads)
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t len = context_lens[r];
    T* result = out + r * heads * dim;
    if (len <= 0) {  // nothing to attend to (the runner never asks for this)
      std::fill(result, result + heads * dim, from_float<T>(0.0f));
      continue;
    }
    const int64_t* blocks = block_table + r * width;
    std::vector<float> q(heads * dim), scores(heads * len), acc(heads * dim, 0.0f);
    for (int64_t i = 0; i < heads * dim; ++i) q[i] = to_float(query[r * heads * dim + i]) * scale;

    // Scores, block by block; within a block head by head, so that a head's
    // query stays in registers over the block's tokens.
    for_each_block(key_cache, blocks, len, block_size, stride,
                   [&](const T* block, int64_t start, int64_t n) {
      for (int64_t h = 0; h < heads; ++h) {
        const float* qh = q.data() + h * dim;
        const T* k = block + (h / group) * dim;
        float* s = scores.data() + h * len + start;
        for (int64_t t = 0; t < n; ++t, k += stride) {
          float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < dim; ++d) dot += qh[d] * to_float(k[d]);
          s[t] = dot;
        }
      }
    });

    std::vector<float> inv_sum(heads);
    for (int64_t h = 0; h < heads; ++h) {
      float* p = scores.data() + h * len;
      const float max = *std::max_element(p, p + len);
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t t = 0; t < len; ++t) {
        p[t] = std::exp(p[t] - max);
        sum += p[t];
      }
      inv_sum[h] = 1.0f / sum;
    }

    // Weighted values, the same way: a head's output stays in registers over
    // a block (a local array for a compile-time size: it cannot alias the cache).
    for_each_block(value_cache, blocks, len, block_size, stride,
                   [&](const T* block, int64_t start, int64_t n) {
      for (int64_t h = 0; h < heads; ++h) {
        const float* p = scores.data() + h * len + start;
        const T* v = block + (h / group) * dim;
        float local[DIM ? DIM : 1];
        float* o = DIM ? std::copy_n(acc.data() + h * dim, dim, local) - dim : acc.data() + h * dim;
        for (int64_t t = 0; t < n; ++t, v += stride) {
          const float w = p[t];
#pragma omp simd
          for (int64_t d = 0; d < dim; ++d) o[d] += w * to_float(v[d]);
        }
        if (DIM) std::copy_n(local, dim, acc.data() + h * dim);
      }
    });
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t d = 0; d < dim; ++d)
        result[h * dim + d] = from_float<T>(acc[h * dim + d] * inv_sum[h]);
  }
}

template <typename T>
static void decode_attention_any_dim(const T* query, const T* key_cache, const T* value_cache,
                                     const int64_t* block_table, const int64_t* context_lens,
                                     T* out, int64_t rows, int64_t heads, int64_t kv_heads,
                                     int64_t dim, int64_t block_size, int64_t width,
                                     float scale, int num_threads) {
  auto run = [&](auto kernel) {
    kernel(query, key_cache, value_cache, block_table, context_lens, out, rows, heads,
           kv_heads, dim, block_size, width, scale, num_threads);
  };
  switch (dim) {
    case 64: return run(decode_attention<64, T>);
    case 80: return run(decode_attention<80, T>);
    case 96: return run(decode_attention<96, T>);
    case 128: return run(decode_attention<128, T>);
    default: return run(decode_attention<0, T>);
  }
}

#define DECODE_ATTENTION(suffix, T)                                                    \
  extern "C" void decode_attention_##suffix(                                           \
      const T* query, const T* key_cache, const T* value_cache,                        \
      const int64_t* block_table, const int64_t* context_lens, T* out, int64_t rows,   \
      int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size, int64_t width, \
      float scale, int num_threads) {                                                  \
    decode_attention_any_dim(query, key_cache, value_cache, block_table, context_lens, \
                             out, rows, heads, kv_heads, dim, block_size, width,       \
                             scale, num_threads);                                      \
  }
DECODE_ATTENTION(f32, float)
DECODE_ATTENTION(bf16, bf16)
DECODE_ATTENTION(f16, _Float16)
