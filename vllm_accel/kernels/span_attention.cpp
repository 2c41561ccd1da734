// Attention over a call's own tokens on CPUs with AVX-512: bfloat16 (by
// AVX-512 BF16, or widened to float32 in registers without it) and float32.
//
// q, out: [batch, n, heads, dim]; k, v: [batch, n_keys, kv_heads, dim] (a
// group of heads / kv_heads query heads shares a KV head); heads and dim
// contiguous (the projections' own layout; a token's row may be longer, as in
// a fused qkv). Query row r of a batch entry attends to keys
// ranges[r][0] .. ranges[r][1] - 1 (an image, a frame or a window of a packed
// call), or without ranges to all keys, or, causal, to keys
// 0 .. n_keys - n + r (a prompt's chunk after n_keys - n earlier tokens).
//
// PyTorch's CPU flash kernel runs the vision towers' attention far below its
// matmuls' rate. Per (batch entry, KV head) the keys are packed once in groups
// of P along the head dimension, a score block's 32 keys contiguous (gathered
// 16 tokens at a time), and the values in groups of P along tokens (P = 2 for
// bfloat16: the pairs vdpbf16ps reads, 16 float32 sums of two products each;
// P = 1 for float32, plain FMAs). Each block of query rows then computes its
// scores (float32), their softmax (float32, a polynomial exp in base 2), and
// the weighted values; bfloat16 rounds the probabilities to bfloat16 first,
// as PyTorch's flash kernel does. Key blocks outside every row's span are skipped
// (a causal prompt does half the work).
//
// Where the build has AMX, bfloat16 multiplies on its tiles instead (the dot
// products above lose to torch's flash kernel on such a CPU): blocks of 32
// query rows; keys packed once per KV head as B tiles (16 keys' pairs along the
// head dimension, transposed 16 x 16 in registers), values as above; the
// probabilities as above, their exp to bfloat16's precision. Each path runs
// the towers' and prompts' attention faster than torch's flash kernel on the
// CPUs it serves, with errors against float64 as SDPA's
// (benchmarks/span_attention.py); the softmax is the largest part of a call.
//
// Plain C ABI, no torch headers; built and called by span_attention.py.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>

#include "amx_tiles.h"
#include "vector_math.h"

#ifdef __AVX512F__
namespace {

constexpr int kRows = 8;      // query rows per block: 8 x 32 score accumulators
constexpr int64_t kKeys = 32; // keys per score block (two vectors)

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// score_block, value_block and softmax_row stay out of line: inlined into the
// task loop, the bfloat16 kernel ran slower.

// What differs between the element types: P elements per 32-bit lane, the
// multiply-accumulate over them, and how a float32 is stored.
struct Float32 {
  using E = float;
  using Vec = __m512;
  static constexpr int P = 1;
  static Vec load(const E* p) { return _mm512_loadu_ps(p); }
  static Vec broadcast(const E* p) { return _mm512_set1_ps(*p); }
  static __m512 mac(__m512 acc, Vec a, Vec b) { return _mm512_fmadd_ps(a, b, acc); }
  static E from_float(float x) { return x; }
  static void store32(E* p, __m512 low, __m512 high) {  // 32 probabilities
    _mm512_storeu_ps(p, low);
    _mm512_storeu_ps(p + 16, high);
  }
};

#ifdef __AVX512BF16__
struct BFloat16 {
  using E = uint16_t;
  using Vec = __m512i;
  static constexpr int P = 2;
  static Vec load(const E* p) { return _mm512_loadu_si512(p); }
  static Vec broadcast(const E* p) {  // two bfloat16 in every 32-bit lane
    int32_t pair;
    std::memcpy(&pair, p, sizeof pair);
    return _mm512_set1_epi32(pair);
  }
  static __m512 mac(__m512 acc, Vec a, Vec b) {
    return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
  }
  static E from_float(float x) { return bf16_bits(x); }
  static void store32(E* p, __m512 low, __m512 high) {
    _mm512_storeu_si512(p, (__m512i)_mm512_cvtne2ps_pbh(high, low));
  }
};
#elif defined(__AVX512BW__)
#define SPAN_BF16_WIDENED 1
// Without AVX-512 BF16 (Skylake, Cascade Lake): the same layout of pairs,
// each pair widened to float32 in registers (its low half, shifted up, and
// its high half, masked) and multiplied by two FMAs.
struct BFloat16 {
  using E = uint16_t;
  using Vec = __m512i;
  static constexpr int P = 2;
  static Vec load(const E* p) { return _mm512_loadu_si512(p); }
  static Vec broadcast(const E* p) {
    int32_t pair;
    std::memcpy(&pair, p, sizeof pair);
    return _mm512_set1_epi32(pair);
  }
  static __m512 mac(__m512 acc, Vec a, Vec b) {
    return _mm512_fmadd_ps(bf16_high_halves(a), bf16_high_halves(b),
                           _mm512_fmadd_ps(bf16_low_halves(a), bf16_low_halves(b), acc));
  }
  static E from_float(float x) { return bf16_bits(x); }
  static void store32(E* p, __m512 low, __m512 high) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_nearest(low)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + 16),
                        _mm512_cvtepi32_epi16(bf16_nearest(high)));
  }
};
#endif

// keys [n][dim] (token stride ks) -> [n_pad/kKeys][dim/P][kKeys][P], zeros
// past n: a score block's keys are contiguous. A key's P elements (a float32
// or a pair of bfloat16) are one 32-bit lane: 16 tokens' lane p are gathered
// into one vector.
template <typename T>
void pack_keys(const typename T::E* k, int64_t ks, int64_t n, int64_t n_pad, int64_t dim,
               typename T::E* out) {
  constexpr int P = T::P;
  const int64_t lanes = dim / P;
  const __m512i rows = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_epi32(static_cast<int32_t>(ks * sizeof(typename T::E))));
  auto* packed = reinterpret_cast<int32_t*>(out);
  for (int64_t j0 = 0; j0 < n_pad; j0 += kKeys)
    for (int64_t p = 0; p < lanes; ++p)
      for (int64_t j = j0; j < j0 + kKeys; j += 16, packed += 16) {
        const __mmask16 valid = j + 16 <= n ? 0xffff
                                : j >= n   ? 0
                                           : static_cast<__mmask16>((1u << (n - j)) - 1);
        const auto* first = reinterpret_cast<const char*>(k + j * ks + p * P);
        _mm512_storeu_si512(packed, _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), valid,
                                                                rows, first, 1));
      }
}

// values [n][dim] -> [n_pad/P][dim_pad][P], zeros past n and dim (bfloat16:
// two tokens' rows interleaved element by element)
template <typename T>
void pack_values(const typename T::E* v, int64_t vs, int64_t n, int64_t n_pad, int64_t dim,
                 int64_t dim_pad, typename T::E* out) {
  using E = typename T::E;
  constexpr int P = T::P;
  for (int64_t p = 0; p < n_pad / P; ++p) {
    E* group = out + p * dim_pad * P;
    if constexpr (P == 1) {
      const int64_t copied = p < n ? dim : 0;
      if (copied) std::memcpy(group, v + p * vs, dim * sizeof(E));
      std::memset(group + copied, 0, (dim_pad - copied) * sizeof(E));
    } else {
      // out[2d] = a[d], out[2d + 1] = b[d]: 16 of each per vector (vpermt2w)
      const __m512i low = _mm512_setr_epi32(0x200000, 0x210001, 0x220002, 0x230003, 0x240004,
                                            0x250005, 0x260006, 0x270007, 0x280008, 0x290009,
                                            0x2a000a, 0x2b000b, 0x2c000c, 0x2d000d, 0x2e000e,
                                            0x2f000f);
      const E* a = 2 * p < n ? v + 2 * p * vs : nullptr;
      const E* b = 2 * p + 1 < n ? v + (2 * p + 1) * vs : nullptr;
      for (int64_t d = 0; d < dim_pad; d += 16) {
        const __mmask32 m = d + 16 <= dim ? 0xffff : d >= dim ? 0 : (1u << (dim - d)) - 1;
        const __m512i ra = a ? _mm512_maskz_loadu_epi16(m, a + d) : _mm512_setzero_si512();
        const __m512i rb = b ? _mm512_maskz_loadu_epi16(m, b + d) : _mm512_setzero_si512();
        _mm512_storeu_si512(group + 2 * d, _mm512_permutex2var_epi16(ra, low, rb));
      }
    }
  }
}

// scores[r][j] = q[r] . key[j] for kRows rows and keys lo..hi (multiples of kKeys)
template <typename T>
__attribute__((noinline)) void score_block(const typename T::E* q, int64_t qs, int rows, const typename T::E* keys,
                 int64_t n_pad, int64_t dim, int64_t lo, int64_t hi, float* scores) {
  constexpr int P = T::P;
  for (int64_t j = lo; j < hi; j += kKeys) {
    __m512 acc[kRows][2];
    for (auto& a : acc) a[0] = a[1] = _mm512_setzero_ps();
    for (int64_t p = 0; p < dim / P; ++p) {
      const typename T::E* b = keys + j * dim + p * kKeys * P;
      const typename T::Vec b0 = T::load(b), b1 = T::load(b + 16 * P);
      for (int r = 0; r < kRows; ++r) {
        const typename T::Vec a = T::broadcast(q + std::min(r, rows - 1) * qs + P * p);
        acc[r][0] = T::mac(acc[r][0], a, b0);
        acc[r][1] = T::mac(acc[r][1], a, b1);
      }
    }
    for (int r = 0; r < kRows; ++r) {
      _mm512_storeu_ps(scores + r * n_pad + j, acc[r][0]);
      _mm512_storeu_ps(scores + r * n_pad + j + 16, acc[r][1]);
    }
  }
}

// out[r] = sum_j probs[r][j] value[j] over keys lo..hi; VECS = dim_pad / 16
template <typename T, int VECS>
__attribute__((noinline)) void value_block(const typename T::E* probs, int64_t n_pad, const typename T::E* values,
                 int64_t lo, int64_t hi, float* out) {
  constexpr int P = T::P;
  constexpr int R = VECS <= 3 ? kRows : kRows / 2;  // R x VECS accumulators
  for (int r0 = 0; r0 < kRows; r0 += R) {
    __m512 acc[R][VECS];
    for (auto& row : acc)
      for (auto& a : row) a = _mm512_setzero_ps();
    for (int64_t p = lo / P; p < hi / P; ++p) {
      typename T::Vec b[VECS];
      for (int z = 0; z < VECS; ++z) b[z] = T::load(values + (p * VECS + z) * 16 * P);
      for (int r = 0; r < R; ++r) {
        const typename T::Vec a = T::broadcast(probs + (r0 + r) * n_pad + P * p);
        for (int z = 0; z < VECS; ++z) acc[r][z] = T::mac(acc[r][z], a, b[z]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int z = 0; z < VECS; ++z) _mm512_storeu_ps(out + ((r0 + r) * VECS + z) * 16, acc[r][z]);
  }
}

// One row's softmax over its keys first..last - 1 of lo..hi (multiples of 32
// apart): p[j] = exp((s[j] - max) * scale) (as T), 0 outside the keys;
// returns the sum of the (unrounded) exponentials. Exp: 2^t for t <= 0.
template <typename T, __m512 (*Exp)(__m512) = exp2_nonpositive>
__attribute__((noinline)) float softmax_row(const float* s, int64_t lo, int64_t hi, int64_t first, int64_t last,
                  float scale, typename T::E* p) {
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i begin = _mm512_set1_epi32(static_cast<int32_t>(first));
  const __m512i end = _mm512_set1_epi32(static_cast<int32_t>(last));
  auto in_range = [&](int64_t j) {
    const __m512i index = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int32_t>(j)));
    return _mm512_cmpge_epi32_mask(index, begin) & _mm512_cmplt_epi32_mask(index, end);
  };
  auto lanes = [&](int64_t j) -> __mmask16 {  // only a span's edges need comparing
    return j >= first && j + 16 <= last ? 0xffff : in_range(j);
  };
  __m512 max = _mm512_set1_ps(-INFINITY);
  for (int64_t j = lo; j < hi; j += 16)
    max = _mm512_mask_max_ps(max, lanes(j), max, _mm512_loadu_ps(s + j));
  const float scale2 = scale * kLog2E;  // exp(x) = 2^(x log2 e)
  const __m512 shift = _mm512_set1_ps(_mm512_reduce_max_ps(max) * scale2);
  const __m512 scales = _mm512_set1_ps(scale2);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = lo; j < hi; j += 32) {
    __m512 low = Exp(_mm512_fmsub_ps(_mm512_loadu_ps(s + j), scales, shift));
    __m512 high = Exp(_mm512_fmsub_ps(_mm512_loadu_ps(s + j + 16), scales, shift));
    const __mmask16 low_lanes = lanes(j), high_lanes = lanes(j + 16);
    if ((low_lanes & high_lanes) != 0xffff) {  // zeros outside the keys
      low = _mm512_maskz_mov_ps(low_lanes, low);
      high = _mm512_maskz_mov_ps(high_lanes, high);
    }
    sum = _mm512_add_ps(sum, _mm512_add_ps(low, high));
    T::store32(p + j, low, high);
  }
  return _mm512_reduce_add_ps(sum);
}

template <typename T>
using ValueBlock = void (*)(const typename T::E*, int64_t, const typename T::E*, int64_t,
                            int64_t, float*);
template <typename T>
constexpr ValueBlock<T> kValueBlocks[] = {
    nullptr, value_block<T, 1>, value_block<T, 2>, value_block<T, 3>, value_block<T, 4>,
    value_block<T, 5>, value_block<T, 6>, value_block<T, 7>, value_block<T, 8>};

// The keys each of a block's R query rows r0.. attends to, first[r] ..
// last[r] - 1 (rows past the call's n: the last row again, not written), and
// the span of key blocks lo .. hi (multiples of kKeys) that covers them all.
template <int R>
struct RowSpans {
  int64_t first[R], last[R], lo, hi;
  RowSpans(const int32_t* ranges, int causal, int64_t b, int64_t n, int64_t n_keys, int64_t r0,
           int rows)
      : lo(n_keys), hi(0) {
    for (int r = 0; r < R; ++r) {
      const int64_t row = r0 + std::min(r, rows - 1);
      const int32_t* range = ranges ? ranges + (b * n + row) * 2 : nullptr;
      first[r] = range ? range[0] : 0;
      last[r] = range ? range[1] : causal ? n_keys - n + row + 1 : n_keys;
      lo = std::min(lo, first[r]);
      hi = std::max(hi, last[r]);
    }
    lo = lo / kKeys * kKeys;
    hi = round_up(hi, kKeys);
  }
};

// Keys and values packed once per batch entry and KV head (the query heads of
// a group share them), in parallel: [batch * kv_heads][key_size + value_size],
// keys first; pack(b, h, keys, values) fills one.
template <typename E, typename Pack>
AlignedArray<E> pack_kv_heads(int64_t batch, int64_t kv_heads, int64_t key_size,
                              int64_t value_size, int num_threads, Pack pack) {
  AlignedArray<E> packed = aligned_array<E>(batch * kv_heads * (key_size + value_size));
#pragma omp parallel for num_threads(num_threads)
  for (int64_t bk = 0; bk < batch * kv_heads; ++bk) {
    E* keys = packed.get() + bk * (key_size + value_size);
    pack(bk / kv_heads, bk % kv_heads, keys, keys + key_size);
  }
  return packed;
}

template <typename T>
int span_attention(const typename T::E* q, const typename T::E* k, const typename T::E* v,
                   typename T::E* out, int64_t q_batch_stride, int64_t q_token_stride,
                   int64_t k_batch_stride, int64_t k_token_stride, int64_t v_batch_stride,
                   int64_t v_token_stride, const int32_t* ranges, int causal, int64_t batch,
                   int64_t n, int64_t n_keys, int64_t heads, int64_t kv_heads, int64_t dim,
                   float scale, int num_threads) {
  using E = typename T::E;
  constexpr int P = T::P;
  const int64_t n_pad = round_up(n_keys, kKeys), dim_pad = round_up(dim, 16);
  if (dim % P || dim_pad > 128) return 1;
  if (kv_heads < 1 || heads % kv_heads || n_keys < (causal ? n : 1)) return 3;
  if (15 * k_token_stride * static_cast<int64_t>(sizeof(E)) > INT32_MAX) return 4;  // gathers' offsets
  const ValueBlock<T> values = kValueBlocks<T>[dim_pad / 16];
  const int64_t out_row = heads * dim, pairs = batch * heads, group = heads / kv_heads;
  const int64_t key_size = dim * n_pad, value_size = n_pad * dim_pad;
  const auto packed = pack_kv_heads<E>(
      batch, kv_heads, key_size, value_size, num_threads,
      [&](int64_t b, int64_t h, E* keys, E* values) {
        pack_keys<T>(k + b * k_batch_stride + h * dim, k_token_stride, n_keys, n_pad, dim, keys);
        pack_values<T>(v + b * v_batch_stride + h * dim, v_token_stride, n_keys, n_pad, dim,
                       dim_pad, values);
      });
  const int64_t blocks = (n + kRows - 1) / kRows;
#pragma omp parallel num_threads(num_threads)
  {
    std::unique_ptr<float[]> scores(new float[kRows * n_pad]), o(new float[kRows * dim_pad]);
    std::unique_ptr<E[]> probs(new E[kRows * n_pad]);
#pragma omp for schedule(static)
    for (int64_t task = 0; task < pairs * blocks; ++task) {
      const int64_t bh = task / blocks, r0 = task % blocks * kRows;
      const int64_t b = bh / heads, h = bh % heads;
      const int rows = static_cast<int>(std::min<int64_t>(kRows, n - r0));
      const RowSpans<kRows> spans(ranges, causal, b, n, n_keys, r0, rows);
      const int64_t lo = spans.lo, hi = spans.hi;
      const E* keys = packed.get() + (b * kv_heads + h / group) * (key_size + value_size);
      score_block<T>(q + b * q_batch_stride + r0 * q_token_stride + h * dim, q_token_stride,
                     rows, keys, n_pad, dim, lo, hi, scores.get());
      float inv_sum[kRows];
      for (int r = 0; r < kRows; ++r)
        inv_sum[r] = 1.0f / softmax_row<T>(scores.get() + r * n_pad, lo, hi, spans.first[r],
                                           spans.last[r], scale, probs.get() + r * n_pad);
      values(probs.get(), n_pad, keys + key_size, lo, hi, o.get());
      E* result = out + (b * n + r0) * out_row + h * dim;
      for (int r = 0; r < rows; ++r)
        for (int64_t d = 0; d < dim; ++d)
          result[r * out_row + d] = T::from_float(o[r * dim_pad + d] * inv_sum[r]);
    }
  }
  return 0;
}

#if defined(VLLM_ACCEL_AMX)
// bfloat16 on AMX tiles (where the build has them): the same three steps for
// blocks of 32 query rows (two row tiles), each product one row tile by two
// column tiles at a time (tdpbf16ps: exact products, float32 sums), the
// softmax as above. One row tile a pass, as the linear kernel's
// (zero_pass_sums: amx_tiles.h): faster than two row tiles a pass in most
// runs at the towers' and a prompt's shapes.
constexpr int kAmxRows = 32;

// 2^t for finite t <= 0, to the precision bfloat16 probabilities need: a
// degree-4 polynomial (relative error under 3e-6; vector_math.h's is degree 5,
// under 1e-7) and no clamp (scores of finite bfloat16 inputs are finite; 2^n
// underflows to zero by itself): cheaper in the softmax, a call's largest part.
inline __m512 exp2_for_bfloat16(__m512 t) {
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(9.5701087e-3f);
  for (float c : {5.5917867e-2f, 2.4024744e-1f, 6.9312179e-1f, 9.9999928e-1f})
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}

// Lane i of r[p] <- lane p of r[i]: a 16 x 16 transpose of 32-bit lanes.
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4)
    for (int j = 0; j < 2; ++j) {
      r[i + 2 * j] = _mm512_unpacklo_epi64(t[i + j], t[i + j + 2]);
      r[i + 2 * j + 1] = _mm512_unpackhi_epi64(t[i + j], t[i + j + 2]);
    }
  for (int i = 0; i < 16; i += 8)
    for (int j = 0; j < 4; ++j) {
      t[i + j] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0x88);
      t[i + j + 4] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0xdd);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
    r[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xdd);
  }
}

// keys [n][dim] (token stride ks) -> [n_pad/16][dim32/2][16][2]: 16 keys x 32
// along the head dimension (16 pairs x 16 keys, a B tile) are 1 KB in a row;
// zeros past n and dim. 16 keys' pairs at a time, transposed in registers.
void pack_keys_amx(const uint16_t* k, int64_t ks, int64_t n, int64_t n_pad, int64_t dim,
                   int64_t dim32, uint16_t* out) {
  const int64_t pairs = dim32 / 2, used = dim / 2;
  for (int64_t j0 = 0; j0 < n_pad; j0 += 16) {
    auto* block = reinterpret_cast<int32_t*>(out) + j0 * pairs;
    for (int64_t p0 = 0; p0 < pairs; p0 += 16) {
      const __mmask16 m = p0 + 16 <= used ? 0xffff : p0 >= used ? 0 : (1u << (used - p0)) - 1;
      __m512i r[16];
      for (int i = 0; i < 16; ++i)
        r[i] = j0 + i < n ? _mm512_maskz_loadu_epi32(m, k + (j0 + i) * ks + 2 * p0)
                          : _mm512_setzero_si512();
      transpose16(r);
      for (int p = 0; p < 16 && p0 + p < pairs; ++p) _mm512_storeu_si512(block + (p0 + p) * 16, r[p]);
    }
  }
}

int span_attention_amx(const uint16_t* q, const uint16_t* k, const uint16_t* v, uint16_t* out,
                       int64_t q_batch_stride, int64_t q_token_stride, int64_t k_batch_stride,
                       int64_t k_token_stride, int64_t v_batch_stride, int64_t v_token_stride,
                       const int32_t* ranges, int causal, int64_t batch, int64_t n,
                       int64_t n_keys, int64_t heads, int64_t kv_heads, int64_t dim, float scale,
                       int num_threads) {
  using E = uint16_t;
  const int64_t n_pad = round_up(n_keys, kKeys), dim_pad = round_up(dim, 16);
  const int64_t dim32 = round_up(dim, 32), pairs = dim32 / 2;
  if (dim % 2 || dim_pad > 128) return 1;
  if (kv_heads < 1 || heads % kv_heads || n_keys < (causal ? n : 1)) return 3;
  if (!amx_permitted()) return 5;
  const int64_t out_row = heads * dim, group = heads / kv_heads;
  const int64_t key_size = n_pad * dim32, value_size = n_pad * dim_pad;
  const auto packed = pack_kv_heads<E>(
      batch, kv_heads, key_size, value_size, num_threads,
      [&](int64_t b, int64_t h, E* keys, E* values) {
        pack_keys_amx(k + b * k_batch_stride + h * dim, k_token_stride, n_keys, n_pad, dim,
                      dim32, keys);
        pack_values<BFloat16>(v + b * v_batch_stride + h * dim, v_token_stride, n_keys, n_pad,
                              dim, dim_pad, values);
      });
  const int64_t blocks = (n + kAmxRows - 1) / kAmxRows;
#pragma omp parallel num_threads(num_threads)
  {
    configure_tiles();
    // Each row of these a whole number of 64-byte lines from an aligned start,
    // as the packed keys and values: a tile row straddling two lines loads
    // about half as fast (amx_tiles.h).
    const AlignedArray<float> scores = aligned_array<float>(kAmxRows * n_pad),
                              o = aligned_array<float>(kAmxRows * dim_pad);
    const AlignedArray<E> probs = aligned_array<E>(kAmxRows * n_pad),
                          query = aligned_array<E>(kAmxRows * dim32, /*zeroed=*/true);
#pragma omp for schedule(static)
    for (int64_t task = 0; task < batch * heads * blocks; ++task) {
      const int64_t bh = task / blocks, r0 = task % blocks * kAmxRows;
      const int64_t b = bh / heads, h = bh % heads;
      const int rows = static_cast<int>(std::min<int64_t>(kAmxRows, n - r0));
      const int row_tiles = rows > 16 ? 2 : 1;  // a last block of 16 rows or fewer: one
      const RowSpans<kAmxRows> spans(ranges, causal, b, n, n_keys, r0, rows);
      const int64_t lo = spans.lo, hi = spans.hi;
      for (int r = 0; r < row_tiles * 16; ++r)  // past dim: zeros since allocation
        std::memcpy(query.get() + r * dim32,
                    q + b * q_batch_stride + (r0 + std::min(r, rows - 1)) * q_token_stride + h * dim,
                    dim * sizeof(E));
      const E* keys = packed.get() + (b * kv_heads + h / group) * (key_size + value_size);
      const E* values = keys + key_size;
      // Scores, 32 keys a step for one group of 16 rows a pass (tiles 0-1),
      // its rows 4, keys 6-7.
      for (int64_t j = lo; j < hi; j += kKeys) {
        const E* key_tiles = keys + j / 16 * pairs * 32;
        float* s = scores.get() + j;
        for (int g = 0; g < row_tiles; ++g) {
          zero_pass_sums();
          for (int64_t d = 0; d < dim32; d += 32) {
            _tile_loadd(4, query.get() + g * 16 * dim32 + d, dim32 * 2);
            _tile_loadd(6, key_tiles + d * 16, 64);
            _tile_loadd(7, key_tiles + pairs * 32 + d * 16, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
          }
          _tile_stored(0, s + g * 16 * n_pad, n_pad * 4);
          _tile_stored(1, s + g * 16 * n_pad + 16, n_pad * 4);
        }
      }
      float inv_sum[kAmxRows];
      for (int r = 0; r < row_tiles * 16; ++r)
        inv_sum[r] = 1.0f / softmax_row<BFloat16, exp2_for_bfloat16>(
            scores.get() + r * n_pad, lo, hi, spans.first[r], spans.last[r], scale,
            probs.get() + r * n_pad);
      // Weighted values, one group of 16 rows x 32 of the head dimension a
      // pass (tiles 0-1), its probabilities 4 (32 keys a step), values 6-7
      // (16 pairs of keys x 16 of the head dimension).
      for (int64_t d = 0; d < dim_pad; d += 32) {
        const bool two = d + 16 < dim_pad;
        for (int g = 0; g < row_tiles; ++g) {
          zero_pass_sums();
          for (int64_t j = lo; j < hi; j += kKeys) {
            const E* value_tiles = values + (j / 2 * dim_pad + d) * 2;
            _tile_loadd(4, probs.get() + g * 16 * n_pad + j, n_pad * 2);
            _tile_loadd(6, value_tiles, dim_pad * 4);
            _tile_dpbf16ps(0, 4, 6);
            if (two) {
              _tile_loadd(7, value_tiles + 32, dim_pad * 4);
              _tile_dpbf16ps(1, 4, 7);
            }
          }
          _tile_stored(0, o.get() + g * 16 * dim_pad + d, dim_pad * 4);
          if (two) _tile_stored(1, o.get() + g * 16 * dim_pad + d + 16, dim_pad * 4);
        }
      }
      E* result = out + (b * n + r0) * out_row + h * dim;
      for (int r = 0; r < rows; ++r)
        for (int64_t d = 0; d < dim; d += 16) {
          const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(o.get() + r * dim_pad + d),
                                         _mm512_set1_ps(inv_sum[r]));
          _mm256_mask_storeu_epi16(result + r * out_row + d, first_lanes(dim - d),
                                   (__m256i)_mm512_cvtneps_pbh(x));
        }
    }
    _tile_release();
  }
  return 0;
}
#endif  // AMX
}  // namespace
#endif

// Each returns 0, or 1 when the head size is above 128 (or odd, bfloat16;
// callers check first), 2 when built without the instructions it needs
// (AVX-512; bfloat16 also AVX-512 BF16), 3 when heads is not a multiple of
// kv_heads or there are fewer keys than causal rows need, 4 when a key's
// token stride is too long for the packing's 32-bit gather offsets (> 2 GB / 15),
// 5 when the OS refuses this process AMX.
#define SPAN_ATTENTION_ARGS(E)                                                                \
  const E *q, const E *k, const E *v, E *out, int64_t q_batch_stride, int64_t q_token_stride, \
      int64_t k_batch_stride, int64_t k_token_stride, int64_t v_batch_stride,                 \
      int64_t v_token_stride, const int32_t *ranges, int causal, int64_t batch, int64_t n,    \
      int64_t n_keys, int64_t heads, int64_t kv_heads, int64_t dim, float scale,              \
      int num_threads
#define SPAN_ATTENTION_CALL(T)                                                               \
  span_attention<T>(q, k, v, out, q_batch_stride, q_token_stride, k_batch_stride,            \
                    k_token_stride, v_batch_stride, v_token_stride, ranges, causal, batch, n, \
                    n_keys, heads, kv_heads, dim, scale, num_threads)

extern "C" int span_attention_f32(SPAN_ATTENTION_ARGS(float)) {
#ifdef __AVX512F__
  return SPAN_ATTENTION_CALL(Float32);
#else
  return 2;
#endif
}

extern "C" int span_attention_bf16(SPAN_ATTENTION_ARGS(uint16_t)) {
#if defined(VLLM_ACCEL_AMX)
  return span_attention_amx(q, k, v, out, q_batch_stride, q_token_stride, k_batch_stride,
                            k_token_stride, v_batch_stride, v_token_stride, ranges, causal,
                            batch, n, n_keys, heads, kv_heads, dim, scale, num_threads);
#elif defined(__AVX512F__) && (defined(__AVX512BF16__) || defined(SPAN_BF16_WIDENED))
  return SPAN_ATTENTION_CALL(BFloat16);
#else
  return 2;
#endif
}
