// Attention over a call's own tokens: bfloat16 on CPUs with AVX-512 BF16.
//
// q, out: [batch, n, heads, dim]; k, v: [batch, n_keys, kv_heads, dim] (a
// group of heads / kv_heads query heads shares a KV head); heads and dim
// contiguous (the projections' own layout; a token's row may be longer, as in
// a fused qkv). Query row r of a batch entry attends to keys
// ranges[r][0] .. ranges[r][1] - 1 (an image, a frame or a window of a packed
// call), or without ranges to all keys, or, causal, to keys
// 0 .. n_keys - n + r (a prompt's chunk after n_keys - n earlier tokens).
//
// PyTorch's CPU flash kernel runs the vision towers' attention at ~160
// GFLOP/s on an AMD EPYC whose matmuls run at ~1,000; here it runs at 500-620.
// Per (batch entry, KV head) the keys are packed once in pairs along the head
// dimension and the values in pairs along tokens: the layouts vdpbf16ps reads
// (16 float32 sums of two bfloat16 products each). Each block of query rows
// then computes its scores (float32), their softmax (float32, a polynomial
// exp), and the weighted values from probabilities rounded to bfloat16, as
// PyTorch's flash kernel does. Key blocks outside every row's span are skipped
// (a causal prompt does half the work).
//
// Plain C ABI, no torch headers; built and called by span_attention.py.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>

#ifdef __AVX512BF16__
namespace {

constexpr int kRows = 8;      // query rows per block: 8 x 32 score accumulators
constexpr int64_t kKeys = 32; // keys per score block (two vectors)

inline uint16_t to_bf16(float x) {  // round to nearest even (finite x)
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  bits += 0x7fff + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}
inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
inline __m512i broadcast_pair(const uint16_t* p) {  // two bfloat16 in every 32-bit lane
  int32_t pair;
  std::memcpy(&pair, p, sizeof pair);
  return _mm512_set1_epi32(pair);
}
inline __m512 dot2(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}

// keys [n][dim] (token stride ks) -> [dim/2][n_pad][2], zeros past n
void pack_keys(const uint16_t* k, int64_t ks, int64_t n, int64_t n_pad, int64_t dim,
               uint16_t* out) {
  for (int64_t p = 0; p < dim / 2; ++p)
    for (int64_t j = 0; j < n_pad; ++j) {
      uint16_t* o = out + (p * n_pad + j) * 2;
      o[0] = j < n ? k[j * ks + 2 * p] : 0;
      o[1] = j < n ? k[j * ks + 2 * p + 1] : 0;
    }
}

// values [n][dim] -> [n_pad/2][dim_pad][2], zeros past n and dim
void pack_values(const uint16_t* v, int64_t vs, int64_t n, int64_t n_pad, int64_t dim,
                 int64_t dim_pad, uint16_t* out) {
  for (int64_t p = 0; p < n_pad / 2; ++p)
    for (int64_t d = 0; d < dim_pad; ++d)
      for (int64_t e = 0; e < 2; ++e) {
        const int64_t j = 2 * p + e;
        out[(p * dim_pad + d) * 2 + e] = (j < n && d < dim) ? v[j * vs + d] : 0;
      }
}

// scores[r][j] = q[r] . key[j] for kRows rows and keys lo..hi (multiples of kKeys)
void score_block(const uint16_t* q, int64_t qs, int rows, const uint16_t* keys, int64_t n_pad,
                 int64_t dim, int64_t lo, int64_t hi, float* scores) {
  for (int64_t j = lo; j < hi; j += kKeys) {
    __m512 acc[kRows][2];
    for (auto& a : acc) a[0] = a[1] = _mm512_setzero_ps();
    for (int64_t p = 0; p < dim / 2; ++p) {
      const uint16_t* b = keys + (p * n_pad + j) * 2;
      const __m512i b0 = _mm512_loadu_si512(b), b1 = _mm512_loadu_si512(b + 32);
      for (int r = 0; r < kRows; ++r) {
        const __m512i a = broadcast_pair(q + std::min(r, rows - 1) * qs + 2 * p);
        acc[r][0] = dot2(acc[r][0], a, b0);
        acc[r][1] = dot2(acc[r][1], a, b1);
      }
    }
    for (int r = 0; r < kRows; ++r) {
      _mm512_storeu_ps(scores + r * n_pad + j, acc[r][0]);
      _mm512_storeu_ps(scores + r * n_pad + j + 16, acc[r][1]);
    }
  }
}

// out[r] = sum_j probs[r][j] value[j] over keys lo..hi; VECS = dim_pad / 16
template <int VECS>
void value_block(const uint16_t* probs, int64_t n_pad, const uint16_t* values, int64_t lo,
                 int64_t hi, float* out) {
  constexpr int R = VECS <= 3 ? kRows : kRows / 2;  // R x VECS accumulators
  for (int r0 = 0; r0 < kRows; r0 += R) {
    __m512 acc[R][VECS];
    for (auto& row : acc)
      for (auto& a : row) a = _mm512_setzero_ps();
    for (int64_t p = lo / 2; p < hi / 2; ++p) {
      __m512i b[VECS];
      for (int z = 0; z < VECS; ++z) b[z] = _mm512_loadu_si512(values + (p * VECS + z) * 32);
      for (int r = 0; r < R; ++r) {
        const __m512i a = broadcast_pair(probs + (r0 + r) * n_pad + 2 * p);
        for (int z = 0; z < VECS; ++z) acc[r][z] = dot2(acc[r][z], a, b[z]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int z = 0; z < VECS; ++z) _mm512_storeu_ps(out + ((r0 + r) * VECS + z) * 16, acc[r][z]);
  }
}

// exp(x) for x <= 0 (Cephes' expf: a degree-5 polynomial on x - n ln 2, then
// times 2^n), a few ulps from std::exp; x below -87 gives about 0.
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504089f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  for (float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f,
                  5.0000001201e-1f})
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// One row's softmax over its keys first..last - 1 of lo..hi (multiples of 32
// apart): p[j] = bfloat16(exp((s[j] - max) * scale)), 0 outside the keys;
// returns the sum of the (unrounded) exponentials.
float softmax_row(const float* s, int64_t lo, int64_t hi, int64_t first, int64_t last,
                  float scale, uint16_t* p) {
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i begin = _mm512_set1_epi32(static_cast<int32_t>(first));
  const __m512i end = _mm512_set1_epi32(static_cast<int32_t>(last));
  auto in_range = [&](int64_t j) {
    const __m512i index = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int32_t>(j)));
    return _mm512_cmpge_epi32_mask(index, begin) & _mm512_cmplt_epi32_mask(index, end);
  };
  __m512 max = _mm512_set1_ps(-INFINITY);
  for (int64_t j = lo; j < hi; j += 16)
    max = _mm512_mask_max_ps(max, in_range(j), max, _mm512_loadu_ps(s + j));
  const __m512 shift = _mm512_set1_ps(_mm512_reduce_max_ps(max) * scale);
  const __m512 scales = _mm512_set1_ps(scale);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = lo; j < hi; j += 32) {
    const __m512 low = _mm512_maskz_mov_ps(
        in_range(j), exp_nonpositive(_mm512_fmsub_ps(_mm512_loadu_ps(s + j), scales, shift)));
    const __m512 high = _mm512_maskz_mov_ps(
        in_range(j + 16),
        exp_nonpositive(_mm512_fmsub_ps(_mm512_loadu_ps(s + j + 16), scales, shift)));
    sum = _mm512_add_ps(sum, _mm512_add_ps(low, high));
    _mm512_storeu_si512(p + j, (__m512i)_mm512_cvtne2ps_pbh(high, low));
  }
  return _mm512_reduce_add_ps(sum);
}

using ValueBlock = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, int64_t, float*);
constexpr ValueBlock kValueBlocks[] = {nullptr, value_block<1>, value_block<2>, value_block<3>,
                                       value_block<4>, value_block<5>, value_block<6>,
                                       value_block<7>, value_block<8>};

}  // namespace

// Returns 0, or 1 when the head size is odd or above 128 (callers check first),
// 2 when built without AVX-512 BF16 (below), 3 when heads is not a multiple of
// kv_heads or there are fewer keys than causal rows need.
extern "C" int span_attention_bf16(
    const uint16_t* q, const uint16_t* k, const uint16_t* v, uint16_t* out,
    int64_t q_batch_stride, int64_t q_token_stride, int64_t k_batch_stride,
    int64_t k_token_stride, int64_t v_batch_stride, int64_t v_token_stride,
    const int32_t* ranges,  // [batch][n][2] or null
    int causal,             // with ranges null: row r attends to keys 0..n_keys - n + r
    int64_t batch, int64_t n, int64_t n_keys, int64_t heads, int64_t kv_heads, int64_t dim,
    float scale, int num_threads) {
  const int64_t n_pad = round_up(n_keys, kKeys), dim_pad = round_up(dim, 16);
  if (dim % 2 || dim_pad > 128) return 1;
  if (kv_heads < 1 || heads % kv_heads || n_keys < (causal ? n : 1)) return 3;
  const ValueBlock values = kValueBlocks[dim_pad / 16];
  const int64_t out_row = heads * dim, pairs = batch * heads, group = heads / kv_heads;
  const int64_t key_size = dim / 2 * n_pad * 2, value_size = n_pad / 2 * dim_pad * 2;
  // Keys and values packed once per KV head (query heads of a group share them).
  std::unique_ptr<uint16_t[]> packed(new uint16_t[batch * kv_heads * (key_size + value_size)]);
#pragma omp parallel for num_threads(num_threads)
  for (int64_t bk = 0; bk < batch * kv_heads; ++bk) {
    const int64_t b = bk / kv_heads, h = bk % kv_heads;
    uint16_t* keys = packed.get() + bk * (key_size + value_size);
    pack_keys(k + b * k_batch_stride + h * dim, k_token_stride, n_keys, n_pad, dim, keys);
    pack_values(v + b * v_batch_stride + h * dim, v_token_stride, n_keys, n_pad, dim, dim_pad,
                keys + key_size);
  }
  const int64_t blocks = (n + kRows - 1) / kRows;
#pragma omp parallel num_threads(num_threads)
  {
    std::unique_ptr<float[]> scores(new float[kRows * n_pad]), o(new float[kRows * dim_pad]);
    std::unique_ptr<uint16_t[]> probs(new uint16_t[kRows * n_pad]);
#pragma omp for schedule(static)
    for (int64_t task = 0; task < pairs * blocks; ++task) {
      const int64_t bh = task / blocks, r0 = task % blocks * kRows;
      const int64_t b = bh / heads, h = bh % heads;
      const int rows = static_cast<int>(std::min<int64_t>(kRows, n - r0));
      // Each row's keys, and the span of key blocks that covers them all.
      int64_t first[kRows], last[kRows], lo = n_keys, hi = 0;
      for (int r = 0; r < kRows; ++r) {
        const int32_t* range = ranges ? ranges + (b * n + r0 + std::min(r, rows - 1)) * 2 : nullptr;
        first[r] = range ? range[0] : 0;
        last[r] = range ? range[1] : causal ? n_keys - n + r0 + std::min(r, rows - 1) + 1 : n_keys;
        lo = std::min(lo, first[r]);
        hi = std::max(hi, last[r]);
      }
      lo = lo / kKeys * kKeys;
      hi = round_up(hi, kKeys);
      const uint16_t* keys = packed.get() + (b * kv_heads + h / group) * (key_size + value_size);
      score_block(q + b * q_batch_stride + r0 * q_token_stride + h * dim, q_token_stride, rows,
                  keys, n_pad, dim, lo, hi, scores.get());
      float inv_sum[kRows];
      for (int r = 0; r < kRows; ++r)
        inv_sum[r] = 1.0f / softmax_row(scores.get() + r * n_pad, lo, hi, first[r], last[r],
                                        scale, probs.get() + r * n_pad);
      values(probs.get(), n_pad, keys + key_size, lo, hi, o.get());
      uint16_t* result = out + (b * n + r0) * out_row + h * dim;
      for (int r = 0; r < rows; ++r)
        for (int64_t d = 0; d < dim; ++d)
          result[r * out_row + d] = to_bf16(o[r * dim_pad + d] * inv_sum[r]);
    }
  }
  return 0;
}
#else
extern "C" int span_attention_bf16(const uint16_t*, const uint16_t*, const uint16_t*, uint16_t*,
                                     int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                                     const int32_t*, int, int64_t, int64_t, int64_t, int64_t,
                                     int64_t, int64_t, float, int) {
  return 2;  // built for a CPU without AVX-512 BF16
}
#endif
