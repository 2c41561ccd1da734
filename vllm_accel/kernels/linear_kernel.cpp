// A linear layer, y = x @ w.T (+ bias), over a weight packed once in blocks of
// 64 output columns, for the CPU with AVX-512 (float32; bfloat16 by AVX-512
// BF16, or widened to float32 in registers where the CPU lacks it); or of 32
// columns for a CPU with AVX2 alone, where it runs bfloat16 widened too (see
// the AVX2 types below).
//
// Why ours: at the row counts decodes run (8-64), oneDNN's packed matmul reads
// each block of weights from DRAM while it computes the first rows, and the
// block's other rows then come from L2 with DRAM idle. Here the weights stream
// in while the arithmetic runs (software prefetch), which is what a decode's
// few rows are bound by (benchmarks/README.md).
//
// At up to kChunkRows rows, each block is walked along K in chunks of
// kChunkSteps steps (32 KB of weights): every tile of rows multiplies the
// chunk while it sits in L1 (their sums parked in a per-thread buffer between
// chunks), and each asks for its share of the next chunk's lines: tiles each
// reading a whole block from L2 keep the core's line-fill buffers busy with L2
// traffic, leaving few for DRAM, and the arithmetic and the stream then run
// nearly one after the other. More rows keep a block's whole K per tile
// (chunks ran slower there).
//
// Layout of a packed weight [N, K]: blocks of 64 columns (the last zero-padded),
// each [K / P][64][P] with P = 1 (float32) or 2 (bfloat16: the pairs along K
// that one vdpbf16ps multiplies). A tile of R rows keeps R x 64 sums in 4R
// registers over the whole K (or a chunk), so each weight load feeds R
// multiply-adds per lane; rows split into as few tiles as fit, of near-equal
// sizes. With AVX2 the same with 8 lanes a vector: blocks of 32 columns,
// [K / P][32][P].
//
// Where the CPU has AMX (built with its instructions), bfloat16 multiplies on
// AMX tiles instead, over another layout: blocks of 32 columns, each
// [kp / 2][32][2] with kp = K rounded up to 32 (zeros past K), so that one
// step along K of a block (16 pairs) is 2 KB in a row: two B tiles side by
// side. Same reason to be ours for decodes (the next block prefetched while
// the tiles multiply); with one group of rows a pass (linear_amx) it beats
// oneDNN at the vision towers' thousands of rows too, so on AMX an encoder's
// layers are ours as well (packed_linear.py; benchmarks/README.md).
//
// Gated (a gated MLP's gate and up projections as one weight, each block
// half gate and half up columns): the sums are stored as silu(gate) * up, so
// the [rows, 2 x hidden] projection is never written (packed_linear.GatedUnit).
// GELU (tanh): the sums (+ bias), rounded to the dtype as the layer's output
// was, are stored through GELU's tanh approximation: a feed-forward block's
// first layer with its activation (packed_linear.PackedLinear).
//
// Plain C ABI, no torch headers (builds in about a second); returns 2 where it
// was built without the instructions a dtype needs, 3 where the OS refuses
// this process AMX. Called by linear.py.

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>

#include "amx_tiles.h"
#include "vector_math.h"

namespace {

#ifdef __AVX512F__
#define VECTOR_KERNEL 1

// A dtype's arithmetic on 16 lanes: 4 vectors a row make a block of 64 columns.
struct Float32 {
  using T = float;
  using V = __m512;
  using W = __m512;  // weights as loaded
  static constexpr int kPair = 1, kLanes = 16;
  static constexpr int kMaxRows = 7;  // 28 sums + 4 weights: every register
  static constexpr bool kBroadcastFirst = false;  // a step's 4 weights, then row by row
  static inline W load_weights(const float* w) { return _mm512_loadu_ps(w); }
  static inline V madd(V sum, const float* x, W w) {
    return _mm512_fmadd_ps(_mm512_set1_ps(*x), w, sum);
  }
  static inline V load(int64_t n, const float* p) { return _mm512_maskz_loadu_ps(first_lanes(n), p); }
  static inline void store(float* p, int64_t n, V v) { _mm512_mask_storeu_ps(p, first_lanes(n), v); }
  static inline V round(V v) { return v; }
};

#ifdef __AVX512BF16__
#define VECTOR_BF16 1
struct BFloat16 {
  using T = uint16_t;
  using V = __m512;
  using W = __m512bh;
  static constexpr int kPair = 2, kLanes = 16;
  static constexpr int kMaxRows = 6;  // 7 rows ran slower in bfloat16
  static constexpr bool kBroadcastFirst = false;
  static inline W load_weights(const uint16_t* w) { return (__m512bh)_mm512_loadu_si512(w); }
  static inline V madd(V sum, const uint16_t* x, W w) {
    uint32_t pair;
    std::memcpy(&pair, x, sizeof pair);
    return _mm512_dpbf16_ps(sum, (__m512bh)_mm512_set1_epi32(static_cast<int>(pair)), w);
  }
  static inline V load(int64_t n, const uint16_t* p) {
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(first_lanes(n), p)), 16));
  }
  static inline void store(uint16_t* p, int64_t n, V v) {
    _mm256_mask_storeu_epi16(p, first_lanes(n), (__m256i)_mm512_cvtneps_pbh(v));
  }
  // To the nearest bfloat16, as float32.
  static inline V round(V v) {
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
  }
};
#elif defined(__AVX512BW__) && defined(__AVX512VL__)
#define VECTOR_BF16 1
// AVX-512 without BF16 (Skylake, Cascade Lake): bfloat16 widened to float32
// in registers, as the AVX2 types below do, on 16 lanes: oneDNN's bfloat16
// is emulated on such a CPU, several times slower (benchmarks/README.md).
struct BFloat16 {
  using T = uint16_t;
  using V = __m512;
  using W = __m512i;  // 16 columns' pairs
  static constexpr int kPair = 2, kLanes = 16;
  static constexpr int kMaxRows = 4;  // 16 sums, 4 rows' even and odd x, a weight's halves
  static constexpr bool kBroadcastFirst = true;
  struct X { __m512 even, odd; };  // a row's pair along K, each broadcast
  static inline X broadcast(const uint16_t* x) {
    uint32_t pair;
    std::memcpy(&pair, x, sizeof pair);
    const __m512i both = _mm512_set1_epi32(static_cast<int>(pair));
    return {bf16_low_halves(both), bf16_high_halves(both)};
  }
  static inline W load_weights(const uint16_t* w) { return _mm512_loadu_si512(w); }
  static inline V madd(V sum, X x, W w) {
    return _mm512_fmadd_ps(x.odd, bf16_high_halves(w),
                           _mm512_fmadd_ps(x.even, bf16_low_halves(w), sum));
  }
  static inline V load(int64_t n, const uint16_t* p) {
    return bf16_low_halves(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(first_lanes(n), p)));
  }
  static inline void store(uint16_t* p, int64_t n, V v) {
    _mm256_mask_storeu_epi16(p, first_lanes(n), _mm512_cvtepi32_epi16(bf16_nearest(v)));
  }
  static inline V round(V v) { return bf16_low_halves(bf16_nearest(v)); }
};
#endif


#elif defined(__AVX2__) && defined(__FMA__)
#define VECTOR_KERNEL 1
#define VECTOR_BF16 1

// CPUs with AVX2 alone (AMD's Zen 2 and 3, older Xeons): 8 lanes, so a block
// of 4 vectors is 32 columns; 16 registers hold 3 rows' sums. bfloat16 is
// widened to float32 in registers (a pair's low half: the even k, shifted
// up; its high half: the odd k, masked): oneDNN has no bfloat16 matmul for
// such a CPU, and torch's runs several times slower than this. float32 stays
// oneDNN's there (linear.py: its jit sgemm beat ours at every row count).
// Tried: float32 tiles of 6 rows x 16 columns; a wash (benchmarks/README.md).
struct Float32 {
  using T = float;
  using V = __m256;
  using W = __m256;
  static constexpr int kPair = 1, kLanes = 8;
  static constexpr int kMaxRows = 3;  // 12 sums, 3 rows' x, a vector of weights
  // Rows' x broadcast once a step, then a vector of weights at a time
  // (tile()): with R x 4 sums in registers, the weights of a step no longer fit.
  static constexpr bool kBroadcastFirst = true;
  using X = __m256;
  static inline X broadcast(const float* x) { return _mm256_broadcast_ss(x); }
  static inline W load_weights(const float* w) { return _mm256_loadu_ps(w); }
  static inline V madd(V sum, X x, W w) { return _mm256_fmadd_ps(x, w, sum); }
  static inline V load(int64_t n, const float* p) {
    return n >= 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, first_lanes8(n));
  }
  static inline void store(float* p, int64_t n, V v) {
    if (n >= 8)
      _mm256_storeu_ps(p, v);
    else
      _mm256_maskstore_ps(p, first_lanes8(n), v);
  }
  static inline V round(V v) { return v; }
};

struct BFloat16 {
  using T = uint16_t;
  using V = __m256;
  using W = __m256i;  // 8 columns' pairs
  static constexpr int kPair = 2, kLanes = 8;
  static constexpr int kMaxRows = 3;  // some sums spill, yet 2 rows ran slower at 512
  static constexpr bool kBroadcastFirst = true;
  static inline __m256 low_halves(__m256i v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }
  static inline __m256 high_halves(__m256i v) {
    return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
  }
  struct X { __m256 even, odd; };  // a row's pair along K, each broadcast
  static inline X broadcast(const uint16_t* x) {
    uint32_t pair;
    std::memcpy(&pair, x, sizeof pair);
    const __m256i both = _mm256_set1_epi32(static_cast<int>(pair));
    return {low_halves(both), high_halves(both)};
  }
  static inline W load_weights(const uint16_t* w) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  }
  static inline V madd(V sum, X x, W w) {
    return _mm256_fmadd_ps(x.odd, high_halves(w), _mm256_fmadd_ps(x.even, low_halves(w), sum));
  }
  static inline V load(int64_t n, const uint16_t* p) {
    alignas(16) uint16_t lanes[8] = {};
    std::memcpy(lanes, p, std::min<int64_t>(n, 8) * sizeof(uint16_t));
    return low_halves(_mm256_cvtepu16_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(lanes))));
  }
  // float32 -> bfloat16 bits in each lane's low half, to nearest even (NaN stays NaN).
  static inline __m256i nearest(V v) {
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(
        _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7fc0), nan);
  }
  static inline void store(uint16_t* p, int64_t n, V v) {
    const __m256i bits = nearest(v);  // packed to 16 bits, the halves' lanes brought together
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(bits, bits), 0x08);
    alignas(16) uint16_t lanes[8];
    _mm_store_si128(reinterpret_cast<__m128i*>(lanes), _mm256_castsi256_si128(packed));
    std::memcpy(p, lanes, std::min<int64_t>(n, 8) * sizeof(uint16_t));
  }
  static inline V round(V v) { return low_halves(nearest(v)); }
};

#endif

#ifdef VECTOR_KERNEL

// Output columns per block: 4 vectors (64 with AVX-512, 32 with AVX2).
template <typename D>
constexpr int64_t kBlock = 4 * D::kLanes;

// silu(gate) * up of a gated block's sums (+ bias): each first rounded to the
// dtype, as the layer's output was before the graph's SiLU and product
// (float32, rounded once); so a bfloat16 model computes what it did unfused.
// (Sums are GCC vectors of float: + and * are the lanes'.)
template <typename D>
inline typename D::V silu_times(typename D::V gate, typename D::V up) {
  return silu(D::round(gate)) * D::round(up);
}

// What is stored of a block's sums (+ bias): see the top of the file.
enum Epilogue { kPlain = 0, kGatedSilu = 1, kGeluTanh = 2 };

// Where a block's sums go: `columns` columns of y (row stride n_size) from
// `y`, plus the bias (in the packed columns' order). Gated: the block's first
// half of columns are a gate's, its second half the matching up
// projection's, and y gets silu(gate) * up (half the columns).
template <typename T>
struct Output {
  T* y;
  int64_t n_size, columns;
  const T* bias;
  Epilogue epilogue;
};

// A block's sums -> `rows` rows of `out`: sum(r, j) is row r's vector j of
// D::kLanes columns, `vectors` of them (plain: one after another; gated: the
// first half gate, the second up, for the same columns).
template <typename D, typename Sum>
inline void store_block(const Output<typename D::T>& out, int rows, int vectors, Sum sum) {
  using V = typename D::V;
  constexpr int lanes = D::kLanes;
  const auto bias = [&](int j, int64_t n) { return out.bias ? D::load(n, out.bias + j * lanes) : V{}; };
  const bool gated = out.epilogue == kGatedSilu;
  const int outputs = gated ? vectors / 2 : vectors;
  for (int j = 0; j < outputs && j * lanes < out.columns; ++j) {
    const int64_t n = out.columns - j * lanes;  // columns left (all lanes where >= lanes)
    const V b = bias(j, n);
    if (gated) {
      const V b_up = bias(j + outputs, n);
      for (int r = 0; r < rows; ++r)
        D::store(out.y + r * out.n_size + j * lanes, n, silu_times<D>(sum(r, j) + b, sum(r, j + outputs) + b_up));
    } else if (out.epilogue == kGeluTanh) {
      // Rounded to the dtype first, as the layer's output was before the GELU.
      for (int r = 0; r < rows; ++r)
        D::store(out.y + r * out.n_size + j * lanes, n, gelu_tanh(D::round(sum(r, j) + b)));
    } else {
      for (int r = 0; r < rows; ++r) D::store(out.y + r * out.n_size + j * lanes, n, sum(r, j) + b);
    }
  }
}

// R rows of x times steps [k0, k1) along K of one block of weights, their
// sums started at zero (the first chunk) or from `parked`, and left there or
// (the last chunk) stored to `out`. While at it, asks for `prefetch_lines` cache
// lines from `prefetch`, one a step.
template <typename D, int R>
void tile(const typename D::T* x, int64_t k_size, const typename D::T* w,
          const Output<typename D::T>& out, int64_t k0, int64_t k1, float* parked,
          const char* prefetch, int64_t prefetch_lines) {
  using V = typename D::V;
  constexpr int lanes = D::kLanes;
  const bool first = k0 == 0, last = k1 == k_size / D::kPair;
  V sum[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j)
      sum[r][j] = first ? V{} : *reinterpret_cast<const V*>(parked + r * kBlock<D> + j * lanes);
  for (int64_t k = k0; k < k1; ++k) {
    if (k - k0 < prefetch_lines) _mm_prefetch(prefetch + (k - k0) * 64, _MM_HINT_T1);
    const typename D::T* wk = w + k * kBlock<D> * D::kPair;
    if constexpr (D::kBroadcastFirst) {
      typename D::X xk[R];
      for (int r = 0; r < R; ++r) xk[r] = D::broadcast(x + r * k_size + k * D::kPair);
      for (int j = 0; j < 4; ++j) {
        const auto wj = D::load_weights(wk + j * lanes * D::kPair);
        for (int r = 0; r < R; ++r) sum[r][j] = D::madd(sum[r][j], xk[r], wj);
      }
    } else {
      const auto w0 = D::load_weights(wk), w1 = D::load_weights(wk + lanes * D::kPair),
                 w2 = D::load_weights(wk + 2 * lanes * D::kPair),
                 w3 = D::load_weights(wk + 3 * lanes * D::kPair);
      for (int r = 0; r < R; ++r) {
        const typename D::T* xk = x + r * k_size + k * D::kPair;
        sum[r][0] = D::madd(sum[r][0], xk, w0);
        sum[r][1] = D::madd(sum[r][1], xk, w1);
        sum[r][2] = D::madd(sum[r][2], xk, w2);
        sum[r][3] = D::madd(sum[r][3], xk, w3);
      }
    }
  }
  // Through memory, where store_block picks them by row and vector: handed
  // the registers themselves, GCC kept them in memory in the loop above too.
  alignas(64) float done[R * kBlock<D>];
  float* to = last ? done : parked;
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) *reinterpret_cast<V*>(to + r * kBlock<D> + j * lanes) = sum[r][j];
  if (last)
    store_block<D>(out, R, 4, [&](int r, int j) {
      return *reinterpret_cast<const V*>(done + r * kBlock<D> + j * lanes);
    });
}

template <typename D, int R = D::kMaxRows>
void tile_of(int rows, const typename D::T* x, int64_t k_size, const typename D::T* w,
             const Output<typename D::T>& out, int64_t k0, int64_t k1, float* parked,
             const char* prefetch, int64_t prefetch_lines) {
  if constexpr (R > 1) {
    if (rows < R)
      return tile_of<D, R - 1>(rows, x, k_size, w, out, k0, k1, parked, prefetch, prefetch_lines);
  }
  tile<D, R>(x, k_size, w, out, k0, k1, parked, prefetch, prefetch_lines);
}

constexpr int64_t kChunkRows = 128;   // up to here, K in chunks
constexpr int64_t kChunkSteps = 128;  // 32 KB of weights with AVX-512, 16 KB with AVX2 (L1: 32 KB)

template <typename D>
int linear(const typename D::T* x, const typename D::T* w, const typename D::T* bias,
           typename D::T* y, int64_t m_size, int64_t n_size, int64_t k_size, Epilogue epilogue,
           int num_threads) {
  if (k_size % D::kPair) return 1;
  if (m_size == 0) return 0;
  const int64_t block_columns = epilogue == kGatedSilu ? kBlock<D> / 2 : kBlock<D>;  // of y
  const int64_t blocks = (n_size + block_columns - 1) / block_columns;
  const int64_t steps = k_size / D::kPair, step_bytes = kBlock<D> * D::kPair * sizeof(typename D::T);
  const int64_t block_elements = k_size * kBlock<D>;
  const int64_t tiles = (m_size + D::kMaxRows - 1) / D::kMaxRows;
  const int64_t rows = m_size / tiles, extra = m_size % tiles;
  const bool chunked = m_size <= kChunkRows;
  const int64_t chunk = chunked ? kChunkSteps : steps;
  const char* end = reinterpret_cast<const char*>(w + blocks * block_elements);
#pragma omp parallel num_threads(num_threads)
  {
    // Sums between chunks: a block's floats a row, in whole aligned vectors.
    struct alignas(64) Line { float lanes[16]; };
    std::unique_ptr<Line[]> parked(chunked ? new Line[m_size * kBlock<D> / 16] : nullptr);
#pragma omp for schedule(static)
    for (int64_t b = 0; b < blocks; ++b) {
      const typename D::T* wb = w + b * block_elements;
      const int64_t columns = std::min(block_columns, n_size - b * block_columns);
      for (int64_t k0 = 0; k0 < steps; k0 += chunk) {
        const int64_t k1 = std::min(steps, k0 + chunk);
        // The weights' next chunk (the next block's first, after the last):
        // its lines shared out among the tiles, at most one a step.
        const char* next = reinterpret_cast<const char*>(wb) + k1 * step_bytes;
        const int64_t next_lines = std::min(chunk * step_bytes, std::max<int64_t>(end - next, 0)) / 64;
        const int64_t share = std::min((next_lines + tiles - 1) / tiles, k1 - k0);
        int64_t m = 0;
        for (int64_t t = 0; t < tiles; ++t) {
          const int tile_rows = static_cast<int>(rows + (t < extra));
          const int64_t lines = std::clamp<int64_t>(next_lines - t * share, 0, share);
          const Output<typename D::T> out{y + m * n_size + b * block_columns, n_size, columns,
                                          bias ? bias + b * kBlock<D> : nullptr, epilogue};
          tile_of<D>(tile_rows, x + m * k_size, k_size, wb, out, k0, k1,
                     chunked ? parked[m * kBlock<D> / 16].lanes : nullptr, next + t * share * 64,
                     lines);
          m += tile_rows;
        }
      }
    }
  }
  return 0;
}

#if defined(VLLM_ACCEL_AMX)

constexpr int64_t kAmxBlock = 32;  // output columns per block: two 16-column B tiles
constexpr int64_t kAmxStep = 32;   // bfloat16 along K per tile multiply
// x read by one sweep over the blocks at most: more rows (a prompt's 512 at
// a K of 3,072: 3 MB, past L2) go in several sweeps, each over the weights
// again (from L3), instead of every pass reading its rows from L3. 1.25 MB
// rather than 1 so that a prompt's 512 rows at a K of 1,152 (1.2 MB) stay one
// sweep; 2 MB ran the towers' thousands of rows slower.
constexpr int64_t kSpanBytes = 1280 << 10;
// From this many rows (an encoder's thousands) x is first copied into its
// tiles, each 1 KB in a row (a group's 16 rows x 32 along K), so that a tile
// load reads 16 consecutive lines rather than 16 rows kp apart; each tile is
// read once per block, so the copy pays where the blocks are many (the
// towers' MLPs), not at fewer columns nor at a prompt's 512 rows
// (benchmarks/README.md).
constexpr int64_t kTiledRows = 1024, kTiledColumns = 2048;  // of the packed weight

// Output columns of y a block holds: a gated block's are half gate, half up.
inline int64_t amx_block_columns(Epilogue epilogue) {
  return epilogue == kGatedSilu ? kAmxBlock / 2 : kAmxBlock;
}

// Whether a call of m rows into n columns of y copies x into tiles first.
inline bool amx_copies_x(int64_t m_size, int64_t n_size, Epilogue epilogue) {
  const int64_t block_columns = amx_block_columns(epilogue);
  const int64_t packed_columns = (n_size + block_columns - 1) / block_columns * kAmxBlock;
  return m_size >= kTiledRows && packed_columns >= kTiledColumns;
}

// One group of 16 rows a pass: tiles 0-1 its sums (two 16-column halves), 4
// its x (16 rows x 32 along K), 6-7 weights (16 pairs along K x 16 columns).
// It reads each block's weights once a group, yet ran faster than two groups
// a pass (2 x 2 tiles: every weight tile multiplied twice) at decodes' and
// encoders' row counts alike (benchmarks/README.md); why is not settled
// (benchmarks/instruction_peaks.py runs both loops).
int linear_amx(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* y,
               int64_t m_size, int64_t n_size, int64_t k_size, Epilogue epilogue,
               int num_threads) {
  if (k_size % 2) return 1;
  if (!amx_permitted()) return 3;
  if (m_size == 0) return 0;
  const int64_t kp = (k_size + kAmxStep - 1) / kAmxStep * kAmxStep;
  const int64_t groups = (m_size + 15) / 16, steps = kp / kAmxStep;
  const int64_t block_columns = amx_block_columns(epilogue);  // of y
  const int64_t blocks = (n_size + block_columns - 1) / block_columns;
  // x as tiles read it: whole groups of 16 rows, K a multiple of 32 (zeros).
  // From kTiledRows rows and kTiledColumns columns every group is copied
  // tile by tile (in the parallel region below). Else x's whole groups are
  // read in place, but for their last step where K is not a multiple of 32
  // (it would run past each row's end): that step's x is copied first, a
  // tile a group (16 rows x 32, zeros past K). The rows of a last, partial
  // group are copied whole (zeros past K). Tried: copying every row of such
  // a K; the copy cost more than it saved (benchmarks/README.md).
  const bool tiled = amx_copies_x(m_size, n_size, epilogue);
  const int64_t in_place = tiled ? 0 : m_size / 16;
  const bool tails = in_place > 0 && kp != k_size;
  const int64_t tail_elements = tails ? in_place * 16 * kAmxStep : 0;
  // Kept from call to call (it only grows): allocating and zeroing it each
  // call was slower. Its tiles start on 64-byte lines (amx_tiles.h).
  static thread_local KeptArray<uint16_t> tile_buffer;
  const int64_t copied = tiled ? groups * 16 * kp : tail_elements + (groups - in_place) * 16 * kp;
  uint16_t* const buffer = tile_buffer.at_least(copied);
  uint16_t* const tiles = tiled ? buffer : nullptr;
  uint16_t* const tail_tiles = buffer;
  uint16_t* const padded = buffer + tail_elements;
  // Group g's x from step 0 (1 KB tiles of 16 rows x 32 along K, a_step
  // elements a step; or rows, read in place or copied whole), and how far
  // apart its rows are.
  const int64_t a_step = tiled ? 16 * kAmxStep : kAmxStep;
  auto group_x = [&](int64_t g, int64_t& row_bytes) -> const uint16_t* {
    row_bytes = tiled ? 64 : g < in_place ? k_size * 2 : kp * 2;
    if (tiled) return tiles + g * steps * 16 * kAmxStep;
    return g < in_place ? x + g * 16 * k_size : padded + (g - in_place) * 16 * kp;
  };
  // A tile's row: x's row `row` from k0 on, 32 along K (zeros past K, and
  // for rows past m: a masked load reads nothing there).
  auto copy_tile_row = [&](uint16_t* to, int64_t row, int64_t k0) {
    const int64_t n = row < m_size ? std::clamp<int64_t>(k_size - k0, 0, kAmxStep) : 0;
    const __mmask32 lanes = _cvtu32_mask32(n == kAmxStep ? ~0u : (1u << n) - 1);
    _mm512_storeu_si512(to, _mm512_maskz_loadu_epi16(lanes, x + row * k_size + k0));
  };
  const int64_t block_elements = kp * kAmxBlock, step_elements = kAmxStep * kAmxBlock;
  // Rows in spans of groups whose x fits in L2 (every block's passes read
  // their rows' whole K): all the weights are read once a span.
  const int64_t spans = (groups * 16 * kp * 2 + kSpanBytes - 1) / kSpanBytes;
  const int64_t span_groups = (groups + spans - 1) / spans;
  // The next block's lines, spread over this block's passes (one per group
  // of a span) and steps: the tiles multiply while DRAM streams.
  const int64_t block_lines = block_elements * 2 / 64;
  const int64_t lines_per_step = (block_lines + span_groups * steps - 1) / (span_groups * steps);
#pragma omp parallel num_threads(num_threads)
  {
    configure_tiles();
    if (tiled) {  // group g's tile s: its 16 rows' x from 32 s on
#pragma omp for schedule(static)
      for (int64_t g = 0; g < groups; ++g)
        for (int64_t s = 0; s < steps; ++s)
          for (int64_t r = 0; r < 16; ++r)
            copy_tile_row(tiles + (g * steps + s) * 16 * kAmxStep + r * kAmxStep, g * 16 + r,
                          s * kAmxStep);
    } else {
      if (tails) {  // each whole group's last step: its 16 rows' x from 32 (steps - 1) on
#pragma omp for schedule(static) nowait
        for (int64_t r = 0; r < in_place * 16; ++r)
          copy_tile_row(tail_tiles + r * kAmxStep, r, (steps - 1) * kAmxStep);
      }
#pragma omp for schedule(static)
      for (int64_t r = in_place * 16; r < groups * 16; ++r) {  // a last, partial group's
        uint16_t* to = padded + (r - in_place * 16) * kp;
        const int64_t n = r < m_size ? k_size : 0;
        if (n) std::memcpy(to, x + r * k_size, n * sizeof(uint16_t));
        std::fill(to + n, to + kp, uint16_t{0});
      }
    }  // (the loop's barrier: every tile copied before any is read)
    // A pass's sums wait in one of two buffers while the thread's next pass
    // multiplies and stores them, a few rows a step: the stores (and the
    // epilogue's arithmetic) run in the shadow of the tile multiplies, not
    // between them.
    alignas(64) float sums[2][2][256];  // [buffer][half]
    struct Pass {  // whose sums wait: block, group, real rows, rows stored
      int64_t block = 0, group = 0;
      int rows = 0, stored = 0, buffer = 0;
    };
    Pass pending;
    // steps x rows_per_step >= 16: a pass's rows are all stored by the end of the next.
    const int rows_per_step = static_cast<int>((16 + steps - 1) / steps);
    auto store_rows = [&](int upto) {  // the pending pass's rows [stored, upto)
      for (; pending.stored < upto; ++pending.stored) {
        const int r = pending.stored;
        const int64_t row = pending.group * 16 + r;
        const int64_t column = pending.block * block_columns;
        const Output<uint16_t> out{y + row * n_size + column, n_size,
                                   std::min(block_columns, n_size - column),
                                   bias ? bias + pending.block * kAmxBlock : nullptr, epilogue};
        const float(&tiles)[2][256] = sums[pending.buffer];  // two halves
        store_block<BFloat16>(out, 1, 2,
                              [&](int, int half) { return _mm512_load_ps(tiles[half] + r * 16); });
      }
    };
    for (int64_t span = 0; span < groups; span += span_groups) {
      const int64_t span_end = std::min(groups, span + span_groups);
      // No barrier between sweeps: a thread's blocks are the same in each,
      // and its last pass of a sweep is stored during its first of the next.
#pragma omp for schedule(static) nowait
      for (int64_t b = 0; b < blocks; ++b) {
        const uint16_t* wb = w + b * block_elements;
        const char* next = b + 1 < blocks ? reinterpret_cast<const char*>(wb + block_elements)
                                          : nullptr;
        for (int64_t g = span; g < span_end; ++g) {
          int64_t row_bytes;
          const uint16_t* xg = group_x(g, row_bytes);
          // The step read from its own tile (rows in place, K not a multiple of 32), or none.
          const int64_t tail_step = tails && g < in_place ? steps - 1 : -1;
          zero_pass_sums();
          for (int64_t s = 0; s < steps; ++s) {
            if (next) {
              const int64_t first = ((g - span) * steps + s) * lines_per_step;
              const int64_t last = std::min(first + lines_per_step, block_lines);
              for (int64_t line = first; line < last; ++line)
                _mm_prefetch(next + line * 64, _MM_HINT_T1);
            }
            const uint16_t* ws = wb + s * step_elements;
            _tile_loadd(6, ws, kAmxBlock * 4);
            _tile_loadd(7, ws + 32, kAmxBlock * 4);
            if (s != tail_step)
              _tile_loadd(4, xg + s * a_step, row_bytes);
            else
              _tile_loadd(4, tail_tiles + g * 16 * kAmxStep, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            if (pending.stored < pending.rows)
              store_rows(std::min(pending.rows, pending.stored + rows_per_step));
          }
          const int buffer = pending.buffer ^ 1;
          _tile_stored(0, sums[buffer][0], 64);
          _tile_stored(1, sums[buffer][1], 64);
          pending = Pass{b, g, static_cast<int>(std::min<int64_t>(16, m_size - g * 16)), 0, buffer};
        }
      }
    }
    store_rows(pending.rows);  // the thread's last pass
    _tile_release();
  }
  return 0;
}
#endif  // AMX

#endif  // VECTOR_KERNEL

}  // namespace

// x [m, k] and y [m, n] contiguous; w packed as above; bias [n] or null.
// epilogue: 0 plain; 1 gated (a gate and its up projection packed into each
// block, half and half): y [m, n] = silu(gate) * up, bias in the packed
// columns' order; 2 y = gelu(x @ w.T + bias), tanh's approximation.
// Returns 0, 1 (k odd in bfloat16), 2 (built without the instructions), 3
// (the OS refused AMX) or 4 (an epilogue not listed).
#define LINEAR_ARGS(E)                                                                    \
  const E *x, const E *w, const E *bias, E *y, int64_t m, int64_t n, int64_t k, int epilogue, \
      int num_threads

// The layout this build multiplies (linear.py packs weights to it):
// output columns per block, and the multiple K is padded to; 0 where it
// runs no such dtype.
extern "C" int packed_block_columns(int bfloat16) {
#if defined(VLLM_ACCEL_AMX)
  if (bfloat16) return static_cast<int>(kAmxBlock);
#endif
#ifdef VECTOR_BF16
  if (bfloat16) return static_cast<int>(kBlock<BFloat16>);
#endif
#ifdef VECTOR_KERNEL
  if (!bfloat16) return static_cast<int>(kBlock<Float32>);
#endif
  return 0;
}

// Float32 lanes of a vector in this build's kernel: 16 (AVX-512), 8 (AVX2), 0.
extern "C" int vector_lanes() {
#ifdef VECTOR_KERNEL
  return Float32::kLanes;
#else
  return 0;
#endif
}

// 1 where bfloat16 runs widened to float32 (no bfloat16 instructions), else 0.
extern "C" int bf16_widened() {
#if defined(VECTOR_BF16) && !defined(VLLM_ACCEL_AMX) && !defined(__AVX512BF16__)
  return 1;
#else
  return 0;
#endif
}

// 1 where the AMX kernel copies x into its tiles first for a call of m rows
// into n columns of y with this epilogue (0: it reads x's rows, or no AMX).
extern "C" int amx_copies_x(int64_t m, int64_t n, int epilogue) {
#if defined(VLLM_ACCEL_AMX)
  return amx_copies_x(m, n, Epilogue(epilogue));
#else
  return 0;
#endif
}

extern "C" int packed_k_multiple(int bfloat16) {
#if defined(VLLM_ACCEL_AMX)
  if (bfloat16) return static_cast<int>(kAmxStep);
#endif
  return bfloat16 ? 2 : 1;
}

extern "C" int linear_f32(LINEAR_ARGS(float)) {
  if (epilogue < 0 || epilogue > 2) return 4;
#ifdef VECTOR_KERNEL
  return linear<Float32>(x, w, bias, y, m, n, k, Epilogue(epilogue), num_threads);
#else
  return 2;
#endif
}

extern "C" int linear_bf16(LINEAR_ARGS(uint16_t)) {
  if (epilogue < 0 || epilogue > 2) return 4;
#if defined(VLLM_ACCEL_AMX)
  return linear_amx(x, w, bias, y, m, n, k, Epilogue(epilogue), num_threads);
#elif defined(VECTOR_BF16)
  return linear<BFloat16>(x, w, bias, y, m, n, k, Epilogue(epilogue), num_threads);
#else
  return 2;
#endif
}
