// Decode attention that reads the paged KV cache in place.
//
// Each request has one query token, which attends over the request's cached
// context: fixed-size blocks listed by its block-table row. The PyTorch path
// gathers those blocks into a contiguous copy and then calls SDPA; on a CPU
// the copy and SDPA's per-call set-up cost more than the arithmetic (a decode
// row is a few hundred dot products per head). Here one task per request walks
// its blocks directly, one block after another (while asking for the next:
// blocks lie anywhere in the cache), in two passes: every head's scores, then
// the softmax-weighted sum of values.
//
// With AVX-512, float32 or bfloat16, and a head size of 64, 80, 96 or 128, a block
// is read 16 tokens at a time (kRun), KV head by KV head, and the query heads
// that share one (grouped query attention) use it while it is in L1:
// - scores: a head's query stays in registers; 16 tokens' dot products are
//   summed as 16 vectors of partial sums, reduced together (a transposing add
//   tree: ~3 instructions a token instead of a horizontal sum each);
//   bfloat16 with a head size that is a multiple of 32 multiplies pairs of
//   bfloat16 (vdpbf16ps: products exact, sums float32), others widen to
//   float32 first;
// - softmax: 16 scores at a time, a polynomial exp (base 2);
// - values: each token's value row is widened once and added into the
//   outputs of up to 16 vectors' worth of heads held in registers;
// - memory: the next block's lines (after the keys' last block the values'
//   first, after the values' last the next request's first keys) are asked
//   for a part at a time, spread over the work on the block before: the
//   blocks come from DRAM (a forward's weights pass through the L3 between
//   two layers), and asking for a whole block at once overlapped less. They
//   go to L2: a block of six float32 KV heads (48 KB) fills L1, and asked
//   into L1 the next block pushed out the one at work.
// Elsewhere (no AVX-512, float16, other head sizes) a portable loop does the
// same arithmetic one token at a time.
// Tried: the vector path on AVX2's 8 lanes; no faster than this loop, both
// bound by the bytes they read (benchmarks/README.md).
//
// The cache may hold float32, bfloat16 or float16 values; the arithmetic is
// float32 in every case. Plain C ABI, no torch headers, so it builds in a
// couple of seconds; built and called by decode_attention.py.

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "vector_math.h"

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
template <> inline bf16 from_float<bf16>(float x) { return bf16{bf16_bits(x)}; }

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

// The arguments every entry point takes.
template <typename T>
struct DecodeArgs {
  const T* query;               // [rows, heads, dim]
  const T* key_cache;           // [num_blocks, block_size, kv_heads, dim]
  const T* value_cache;         // [num_blocks, block_size, kv_heads, dim]
  const int64_t* block_table;   // [rows, width]
  const int64_t* context_lens;  // [rows], each <= width * block_size
  T* out;                       // [rows, heads, dim]
  int64_t rows, heads, kv_heads, dim, block_size, width;
  float scale;
  int num_threads;
};

// The portable loop: one token at a time, head by head within a block (a
// head's query or running output stays in registers over the block's
// tokens); DIM is the head size when known at compile time (loops of a fixed
// length become a few vector instructions), 0 when given at run time.
template <int DIM, typename T>
static void decode_attention_portable(const DecodeArgs<T>& a) {
  const int64_t dim = DIM ? DIM : a.dim, heads = a.heads;
  const int64_t group = heads / a.kv_heads;  // query heads per KV head
  const int64_t stride = a.kv_heads * dim;   // between a KV head's consecutive tokens
#pragma omp parallel for schedule(dynamic) num_threads(a.num_threads)
  for (int64_t r = 0; r < a.rows; ++r) {
    const int64_t len = a.context_lens[r];
    T* result = a.out + r * heads * dim;
    if (len <= 0) {  // nothing to attend to (the runner never asks for this)
      std::fill(result, result + heads * dim, from_float<T>(0.0f));
      continue;
    }
    const int64_t* blocks = a.block_table + r * a.width;
    std::vector<float> q(heads * dim), scores(heads * len), acc(heads * dim, 0.0f);
    for (int64_t i = 0; i < heads * dim; ++i) q[i] = to_float(a.query[r * heads * dim + i]) * a.scale;
    for_each_block(a.key_cache, blocks, len, a.block_size, stride,
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
    for_each_block(a.value_cache, blocks, len, a.block_size, stride,
                   [&](const T* block, int64_t start, int64_t n) {
      for (int64_t h = 0; h < heads; ++h) {
        const float* p = scores.data() + h * len + start;
        const T* v = block + (h / group) * dim;
        float local[DIM ? DIM : 1];  // a local array cannot alias the cache
        float* o = DIM ? std::copy_n(acc.data() + h * dim, dim, local) - dim : acc.data() + h * dim;
        for (int64_t t = 0; t < n; ++t, v += stride) {
          const float w = p[t];
#pragma omp simd
          for (int64_t d = 0; d < dim; ++d) o[d] += w * to_float(v[d]);
        }
        if (DIM) std::copy_n(local, dim, acc.data() + h * dim);
      }
    });
    for (int64_t i = 0; i < heads * dim; ++i) result[i] = from_float<T>(acc[i] * inv_sum[i / dim]);
  }
}

#ifdef __AVX512F__
namespace {

// How each element type is read as float32 (16 at a time) and written back.
struct Float32 {
  using E = float;
  static __m512 load16(const E* p) { return _mm512_loadu_ps(p); }
  static void store16(E* p, __m512 x) { _mm512_storeu_ps(p, x); }
};
struct BFloat16 {
  using E = bf16;
  static __m512 load16(const E* p) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
  static void store16(E* p, __m512 x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_nearest(x)));
  }
};
// A query head held in registers, and its dot product with one key row:
// float32 (widened) by default, bfloat16 pairs where the CPU multiplies them.
template <typename T, int DIM>
struct WideQuery {
  __m512 q[DIM / 16];
  explicit WideQuery(const typename T::E* p) {
    for (int c = 0; c < DIM / 16; ++c) q[c] = T::load16(p + 16 * c);
  }
  __m512 dot(const typename T::E* k) const {  // 16 partial sums
    __m512 sum = _mm512_mul_ps(q[0], T::load16(k));
    for (int c = 1; c < DIM / 16; ++c) sum = _mm512_fmadd_ps(q[c], T::load16(k + 16 * c), sum);
    return sum;
  }
};
#ifdef __AVX512BF16__
template <int DIM>
struct PairQuery {
  __m512bh q[DIM / 32];
  explicit PairQuery(const bf16* p) {
    for (int c = 0; c < DIM / 32; ++c) q[c] = (__m512bh)_mm512_loadu_si512(p + 32 * c);
  }
  __m512 dot(const bf16* k) const {
    __m512 sum = _mm512_setzero_ps();
    for (int c = 0; c < DIM / 32; ++c)
      sum = _mm512_dpbf16_ps(sum, q[c], (__m512bh)_mm512_loadu_si512(k + 32 * c));
    return sum;
  }
};
template <typename T, int DIM>
using Query = std::conditional_t<std::is_same_v<T, BFloat16> && DIM % 32 == 0, PairQuery<DIM>,
                                 WideQuery<T, DIM>>;
#else
template <typename T, int DIM>
using Query = WideQuery<T, DIM>;
#endif

// The token whose sums go in slot i of sum16's input, so that its result
// lands in lane i (the add tree below interleaves them this way).
constexpr int kSlotToken[16] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15};

// Lane i = the sum of all lanes of v[slot of token i].
inline __m512 sum16(const __m512 v[16]) {
  __m512 w[8], u[4], s[2];
  for (int i = 0; i < 8; ++i)  // 256-bit halves: [v_i | v_i+8], 8 sums each
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[i], v[i + 8], 0x44),
                         _mm512_shuffle_f32x4(v[i], v[i + 8], 0xee));
  for (int i = 0; i < 4; ++i)  // 128-bit quarters: 4 sums each of 4 vectors
    u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[i], w[i + 4], 0x88),
                         _mm512_shuffle_f32x4(w[i], w[i + 4], 0xdd));
  for (int i = 0; i < 2; ++i)  // pairs within each quarter
    s[i] = _mm512_add_ps(_mm512_unpacklo_ps(u[i], u[i + 2]), _mm512_unpackhi_ps(u[i], u[i + 2]));
  return _mm512_add_ps(_mm512_shuffle_ps(s[0], s[1], 0x44), _mm512_shuffle_ps(s[0], s[1], 0xee));
}

// scores[t] = q . key[t] for a block's n tokens of one KV head (token stride
// `stride`), 16 tokens at a time.
template <typename T, int DIM>
inline void head_scores(const Query<T, DIM>& q, const typename T::E* keys, int64_t stride,
                        int64_t n, float* scores) {
  for (int64_t t0 = 0; t0 < n; t0 += 16) {
    __m512 partial[16];
    for (int i = 0; i < 16; ++i)  // past the block's end: its last token again, not stored
      partial[i] = q.dot(keys + std::min<int64_t>(t0 + kSlotToken[i], n - 1) * stride);
    _mm512_mask_storeu_ps(scores + t0, first_lanes(n - t0), sum16(partial));
  }
}

// out[g] += sum over the block's n tokens of p[g][t] * value[t], for HEADS
// query heads (p[g] = probs + g * probs_stride) sharing one KV head.
template <typename T, int DIM, int HEADS>
inline void heads_values(const float* probs, int64_t probs_stride, const typename T::E* values,
                         int64_t stride, int64_t n, float* out) {
  __m512 o[HEADS][DIM / 16];
  for (int g = 0; g < HEADS; ++g)
    for (int c = 0; c < DIM / 16; ++c) o[g][c] = _mm512_loadu_ps(out + g * DIM + 16 * c);
  for (int64_t t = 0; t < n; ++t, values += stride) {
    __m512 v[DIM / 16];
    for (int c = 0; c < DIM / 16; ++c) v[c] = T::load16(values + 16 * c);
    for (int g = 0; g < HEADS; ++g) {
      const __m512 w = _mm512_set1_ps(probs[g * probs_stride + t]);
      for (int c = 0; c < DIM / 16; ++c) o[g][c] = _mm512_fmadd_ps(w, v[c], o[g][c]);
    }
  }
  for (int g = 0; g < HEADS; ++g)
    for (int c = 0; c < DIM / 16; ++c) _mm512_storeu_ps(out + g * DIM + 16 * c, o[g][c]);
}

// Query heads whose outputs fit in 16 vector registers at once.
template <int DIM>
constexpr int kValueHeads = std::min(8, std::max(1, 256 / DIM));

template <typename T, int DIM, int HEADS = kValueHeads<DIM>>
inline void group_values(int64_t heads, const float* probs, int64_t probs_stride,
                         const typename T::E* values, int64_t stride, int64_t n, float* out) {
  if constexpr (HEADS > 0) {
    for (; heads >= HEADS; heads -= HEADS, probs += HEADS * probs_stride, out += HEADS * DIM)
      heads_values<T, DIM, HEADS>(probs, probs_stride, values, stride, n, out);
    if (heads) group_values<T, DIM, HEADS - 1>(heads, probs, probs_stride, values, stride, n, out);
  }
}

// Asks for a block's lines (into L2) a part at a time, spread over the work
// on the block before it: a burst of a whole block's requests at once overlaps less.
struct Prefetch {
  const char* lines = nullptr;
  int64_t bytes = 0;
  void part(int64_t i, int64_t parts) const {
    for (int64_t at = bytes * i / parts / 64 * 64; at < bytes * (i + 1) / parts; at += 64)
      _mm_prefetch(lines + at, _MM_HINT_T1);
  }
};

// Tokens of a block read by every head before the next ones: 16 tokens of
// all KV heads lie in one run of memory (12 KB of bfloat16 at 6 KV heads of
// 64), read while in L1; a block read head by head (strides of a token's
// row) ran slower.
constexpr int64_t kRun = 16;

template <typename T, int DIM>
void decode_attention_avx512(const DecodeArgs<typename T::E>& a) {
  using E = typename T::E;
  const int64_t heads = a.heads, group = heads / a.kv_heads, stride = a.kv_heads * DIM;
  const int64_t block_size = a.block_size, block_elements = block_size * stride;
  // Block b of row r's keys or values (past the row's last: the next row's
  // first keys), and how many bytes of it the row uses.
  auto block = [&](const E* cache, int64_t r, int64_t b) -> Prefetch {
    const int64_t used = std::min(block_size, a.context_lens[r] - b * block_size);
    if (used <= 0) {
      if (r + 1 >= a.rows || a.context_lens[r + 1] <= 0) return {};
      return {reinterpret_cast<const char*>(a.key_cache + a.block_table[(r + 1) * a.width] * block_elements),
              static_cast<int64_t>(std::min(block_size, a.context_lens[r + 1]) * stride * sizeof(E))};
    }
    return {reinterpret_cast<const char*>(cache + a.block_table[r * a.width + b] * block_elements),
            static_cast<int64_t>(used * stride * sizeof(E))};
  };
#pragma omp parallel num_threads(a.num_threads)
  {
    std::vector<float> scores, acc(heads * DIM), inv_sum(heads);
#pragma omp for schedule(dynamic)
    for (int64_t r = 0; r < a.rows; ++r) {
      const int64_t len = a.context_lens[r], len_pad = (len + 15) / 16 * 16;
      const int64_t blocks = (len + block_size - 1) / block_size;
      E* result = a.out + r * heads * DIM;
      if (len <= 0) {  // nothing to attend to (the runner never asks for this)
        std::fill(result, result + heads * DIM, from_float<E>(0.0f));
        continue;
      }
      const int64_t* table = a.block_table + r * a.width;
      const E* query = a.query + r * heads * DIM;
      scores.resize(heads * len_pad);
      block(a.key_cache, r, 0).part(0, 1);
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t start = b * block_size, n = std::min(block_size, len - start);
        const E* keys = a.key_cache + table[b] * block_elements;
        const Prefetch next = b + 1 < blocks ? block(a.key_cache, r, b + 1) : block(a.value_cache, r, 0);
        const int64_t runs = (n + kRun - 1) / kRun;
        for (int64_t run = 0; run < runs; ++run) {
          const int64_t t0 = run * kRun, m = std::min(kRun, n - t0);
          for (int64_t h = 0; h < heads; ++h) {
            next.part(run * heads + h, runs * heads);
            head_scores<T, DIM>(Query<T, DIM>(query + h * DIM),
                                keys + t0 * stride + (h / group) * DIM, stride, m,
                                scores.data() + h * len_pad + start + t0);
          }
        }
      }
      // Softmax of each head's scores (times scale), unnormalised; 1/sum later.
      const float scale2 = a.scale * kLog2E;  // exp(x) = 2^(x log2 e)
      const __m512 scale = _mm512_set1_ps(scale2);
      for (int64_t h = 0; h < heads; ++h) {
        float* s = scores.data() + h * len_pad;
        __m512 max = _mm512_set1_ps(-INFINITY);
        for (int64_t t = 0; t < len; t += 16)
          max = _mm512_mask_max_ps(max, first_lanes(len - t), max, _mm512_loadu_ps(s + t));
        const __m512 shift = _mm512_set1_ps(_mm512_reduce_max_ps(max) * scale2);
        __m512 sum = _mm512_setzero_ps();
        for (int64_t t = 0; t < len; t += 16) {
          const __m512 p = _mm512_maskz_mov_ps(
              first_lanes(len - t), exp2_nonpositive(_mm512_fmsub_ps(_mm512_loadu_ps(s + t), scale, shift)));
          _mm512_storeu_ps(s + t, p);
          sum = _mm512_add_ps(sum, p);
        }
        inv_sum[h] = 1.0f / _mm512_reduce_add_ps(sum);
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t start = b * block_size, n = std::min(block_size, len - start);
        const E* values = a.value_cache + table[b] * block_elements;
        const Prefetch next = block(a.value_cache, r, b + 1);
        const int64_t runs = (n + kRun - 1) / kRun;
        for (int64_t run = 0; run < runs; ++run) {
          const int64_t t0 = run * kRun, m = std::min(kRun, n - t0);
          for (int64_t kv = 0; kv < a.kv_heads; ++kv) {
            next.part(run * a.kv_heads + kv, runs * a.kv_heads);
            group_values<T, DIM>(group, scores.data() + kv * group * len_pad + start + t0,
                                 len_pad, values + t0 * stride + kv * DIM, stride, m,
                                 acc.data() + kv * group * DIM);
          }
        }
      }
      for (int64_t h = 0; h < heads; ++h)
        for (int c = 0; c < DIM / 16; ++c)
          T::store16(result + h * DIM + 16 * c,
                     _mm512_mul_ps(_mm512_loadu_ps(acc.data() + h * DIM + 16 * c),
                                   _mm512_set1_ps(inv_sum[h])));
    }
  }
}

// The AVX-512 kernel for this head size, or nullptr. Only the common sizes:
// each is a few templates more to build at start-up (all eight multiples of
// 16 would more than triple the build's time).
template <typename T>
void (*avx512_kernel(int64_t dim))(const DecodeArgs<typename T::E>&) {
  switch (dim) {
    case 64: return decode_attention_avx512<T, 64>;
    case 80: return decode_attention_avx512<T, 80>;
    case 96: return decode_attention_avx512<T, 96>;
    case 128: return decode_attention_avx512<T, 128>;
    default: return nullptr;
  }
}

}  // namespace
#endif

// Vec: the AVX-512 element type, void for none (float16, or no AVX-512).
template <typename Vec, typename E>
static void run_decode_attention(const DecodeArgs<E>& args) {
#ifdef __AVX512F__
  if constexpr (!std::is_void_v<Vec>) {
    if (auto kernel = avx512_kernel<Vec>(args.dim)) return kernel(args);
    return decode_attention_portable<0>(args);  // a rare head size
  }
#endif
  switch (args.dim) {
    case 64: return decode_attention_portable<64>(args);
    case 80: return decode_attention_portable<80>(args);
    case 96: return decode_attention_portable<96>(args);
    case 128: return decode_attention_portable<128>(args);
    default: return decode_attention_portable<0>(args);
  }
}

// Returns -1, or (nothing computed) the first row whose context is longer
// than its block-table row holds: checked here once per call, not on the host
// (a reduction and a host read per layer).
template <typename Vec, typename E>
static int64_t decode_attention(const DecodeArgs<E>& args) {
  for (int64_t r = 0; r < args.rows; ++r)
    if (args.context_lens[r] > args.width * args.block_size) return r;
  run_decode_attention<Vec>(args);
  return -1;
}

#ifdef __AVX512F__
#define VEC(type) type
#else
#define VEC(type) void
#endif

#define DECODE_ATTENTION(suffix, E, Vec)                                                 \
  extern "C" int64_t decode_attention_##suffix(                                        \
      const E* query, const E* key_cache, const E* value_cache,                        \
      const int64_t* block_table, const int64_t* context_lens, E* out, int64_t rows,   \
      int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size, int64_t width, \
      float scale, int num_threads) {                                                  \
    return decode_attention<Vec>(DecodeArgs<E>{query, key_cache, value_cache, block_table, \
                                        context_lens, out, rows, heads, kv_heads, dim,  \
                                        block_size, width, scale, num_threads});        \
  }
DECODE_ATTENTION(f32, float, VEC(Float32))
DECODE_ATTENTION(bf16, bf16, VEC(BFloat16))
DECODE_ATTENTION(f16, _Float16, void)

// A step's new keys and values into their cache slots: token t's row
// (kv_heads x dim, `row_bytes`; strides in bytes, rows may be spaced as in a
// fused qkv) to slot slots[t] of each cache, which holds `cache_slots`: about
// a third of two index_copy_ calls' time. Returns -1, or (nothing written)
// the first token whose slot is outside the cache.
extern "C" int64_t store_kv(const char* key, const char* value, int64_t key_stride,
                            int64_t value_stride, char* key_cache, char* value_cache,
                            const int64_t* slots, int64_t tokens, int64_t row_bytes,
                            int64_t cache_slots) {
  for (int64_t t = 0; t < tokens; ++t)
    if (slots[t] < 0 || slots[t] >= cache_slots) return t;
  for (int64_t t = 0; t < tokens; ++t) {
    std::memcpy(key_cache + slots[t] * row_bytes, key + t * key_stride, row_bytes);
    std::memcpy(value_cache + slots[t] * row_bytes, value + t * value_stride, row_bytes);
  }
  return -1;
}
