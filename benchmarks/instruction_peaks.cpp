// The scratch loops of benchmarks/instruction_peaks.py: what this machine's
// cores do at most, by instruction. Built by the engine's own kernel build
// (vllm_accel/kernels/build.py: the same compiler and flags).
#include <immintrin.h>
#include <omp.h>
#include <chrono>
#include <cstdint>
#include <vector>
#include "../vllm_accel/model/amx_tiles.h"
static double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
#ifdef __AVX512F__
using Vec = __m512;
static inline Vec splat(float x) { return _mm512_set1_ps(x); }
static inline Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline float first(Vec v) { return _mm512_cvtss_f32(v); }
#else
using Vec = __m256;
static inline Vec splat(float x) { return _mm256_set1_ps(x); }
static inline Vec fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline float first(Vec v) { return _mm256_cvtss_f32(v); }
#endif
extern "C" double fma_gflops(double seconds) {
  long total = 0;
  const double t0 = now();
#pragma omp parallel reduction(+ : total)
  {
    Vec acc[12];
    const Vec b = splat(1.0000001f), c = splat(1e-7f);
    for (int i = 0; i < 12; ++i) acc[i] = splat(static_cast<float>(i));
    long steps = 0;
    while (now() - t0 < seconds) {
      for (int rep = 0; rep < 100000; ++rep) {
#pragma GCC unroll 12
        for (int i = 0; i < 12; ++i) acc[i] = fma(acc[i], b, c);
      }
      steps += 100000;
    }
    float sink = 0;
    for (int i = 0; i < 12; ++i) sink += first(acc[i]);
    total += steps + (sink == 12345.f);
  }
  return total * 12.0 * (sizeof(Vec) / 4) * 2 / (now() - t0) / 1e9;
}
// AMX, in GFLOP/s (mode 3: GB/s of tile loads); -1 where this build or the
// OS has none. mode: 0 multiplies alone; 1 our kernel's loop with A and B
// loaded from L1; 2 the same with its sums stored (and zeroed) after every
// pass over K; 3 the loop's tile loads alone (returns GB/s); 4 the loop over
// x and weights from L2 (x [512 rows][K = 1,024], rows 2 KB apart, and 16
// blocks of weights: 1 MB each), every pass over K; 5 the same with x laid
// out in 1 KB tiles. two_groups: 0 one group of 16 rows a pass, as the
// kernel runs (tiles 0-1 sums, 4 x, 6-7 weights; zero_pass_sums each pass,
// as there); 1 two groups a pass (2 x 2: every tile), as it ran until the
// thirty-third session.
extern "C" double amx_rate(double seconds, int mode, int two_groups) {
#ifdef VLLM_ACCEL_AMX
  if (!amx_permitted()) return -1;
  const bool from_l2 = mode >= 4;
  const int K = from_l2 ? 1024 : 256, M = from_l2 ? 512 : 32, NB = from_l2 ? 16 : 1;
  long total = 0;  // tile multiplies (mode 3: tile loads)
  const double t0 = now();
#pragma omp parallel reduction(+ : total)
  {
    configure_tiles();
    std::vector<uint16_t> a(M * K, 0x3f80), w(NB * K * 32, 0x3c00);
    _tile_loadd(4, a.data(), K * 2); _tile_loadd(5, a.data() + 16 * K, K * 2);
    _tile_loadd(6, w.data(), 128); _tile_loadd(7, w.data() + 32, 128);
    alignas(64) float sums[4][256];
    // Group g's tile at step s: rows K apart, or (mode 5) 1 KB in a row.
    const long a_step = mode == 5 ? 512 : 32, a_row = mode == 5 ? 64 : K * 2;
    long count = 0;
    while (now() - t0 < seconds) {
      for (int rep = 0; rep < (from_l2 ? 1 : 1000); ++rep)
        for (int b = 0; b < NB; ++b)
          for (int g = 0; g < M / 16; g += two_groups ? 2 : 1) {
            const uint16_t *a0 = a.data() + g * 16 * K, *a1 = a0 + 16 * K, *wb = w.data() + b * K * 32;
            for (int s = 0; s < K / 32; ++s) {  // in the kernel's order (linear_amx)
              if (mode != 0) {
                _tile_loadd(6, wb + s * 1024, 128);
                _tile_loadd(7, wb + s * 1024 + 32, 128);
                _tile_loadd(4, a0 + s * a_step, a_row);
              }
              if (mode != 3) { _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); }
              if (!two_groups) continue;
              if (mode != 0) _tile_loadd(5, a1 + s * a_step, a_row);
              if (mode != 3) { _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7); }
            }
            if (mode == 2 || from_l2) {  // a store waits for its tile's multiplies to finish
              _tile_stored(0, sums[0], 64); _tile_stored(1, sums[1], 64);
              if (two_groups) { _tile_stored(2, sums[2], 64); _tile_stored(3, sums[3], 64); }
            }
            if (mode == 2 || from_l2 || !two_groups) zero_pass_sums();  // as the kernels start a pass
            count += K / 32 * (two_groups ? 4 : 2);
          }
    }
    _tile_release();
    total += count;
  }
  const double elapsed = now() - t0;
  return mode == 3 ? total * 1024.0 / elapsed / 1e9 : total * 16.0 * 16 * 32 * 2 / elapsed / 1e9;
#else
  return -1;
#endif
}
extern "C" double read_gbs(double seconds, long megabytes) {
  const long n = megabytes << 18;  // floats
  std::vector<float> data(n, 1.0f);
  long passes = 0;
  float sink = 0;
  const double t0 = now();
  while (now() - t0 < seconds) {
#pragma omp parallel for reduction(+ : sink)
    for (long c = 0; c < n; c += 4096) {
      Vec s0 = splat(0), s1 = s0;
      for (long i = c; i < c + 4096; i += 2 * sizeof(Vec) / 4) {
        s0 = s0 + *reinterpret_cast<const Vec*>(&data[i]);
        s1 = s1 + *reinterpret_cast<const Vec*>(&data[i + sizeof(Vec) / 4]);
      }
      sink += first(s0 + s1);
    }
    ++passes;
  }
  return (sink == -1.f) + passes * n * 4.0 / (now() - t0) / 1e9;
}
