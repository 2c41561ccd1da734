// AMX tiles as our CPU kernels use them (linear_kernel.cpp, span_attention.cpp):
// 64-byte aligned arrays for what tiles load and store, eight tiles of 16 rows
// x 64 bytes, the process's permission asked of Linux once; and bf16_on_amx(),
// which each such kernel's library exports. Included once per kernel (each is
// one source file); build.py rebuilds a kernel when a header it includes changes.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>

namespace {

// Arrays that start on a 64-byte boundary, for what tiles load and store: a
// tile's 64-byte row that straddles two cache lines loads about half as fast,
// and new[] and std::vector align to 16 bytes only.
// Zeroed when asked (zeroing the span kernel's packed keys, megabytes, each
// call would cost more than it saves).
struct FreeAligned {
  void operator()(void* p) const { std::free(p); }
};
template <typename T>
using AlignedArray = std::unique_ptr<T[], FreeAligned>;
template <typename T>
AlignedArray<T> aligned_array(int64_t n, bool zeroed = false) {
  const size_t bytes = (static_cast<size_t>(n) * sizeof(T) + 63) / 64 * 64;
  T* p = static_cast<T*>(std::aligned_alloc(64, bytes ? bytes : 64));
  if (!p) throw std::bad_alloc();
  if (zeroed) std::memset(p, 0, bytes);
  return AlignedArray<T>(p);
}

// An aligned array kept from call to call: reallocated (contents not kept)
// only when a call asks for more than it holds.
template <typename T>
class KeptArray {
 public:
  T* at_least(int64_t n) {
    if (size_ < n) {
      array_ = aligned_array<T>(n);
      size_ = n;
    }
    return array_.get();
  }

 private:
  AlignedArray<T> array_;
  int64_t size_ = 0;
};

}  // namespace

#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define VLLM_ACCEL_AMX 1

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace {

// Linux hands AMX's tile state to a process that asks (once per process).
inline bool amx_permitted() {
  static const bool permitted =
      syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return permitted;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// Every tile 16 rows x 64 bytes: 16 x 16 float32 sums, or 16 x 32 bfloat16
// (a row tile: 16 rows x 32 along K; a VNNI tile: 16 pairs along K x 16
// columns). Once per thread, before its first tile instruction.
inline void configure_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = 16;
    config.bytes_per_row[t] = 64;
  }
  // GCC 12's _tile_loadconfig tells the compiler it reads 8 bytes of the
  // config: without this barrier the stores above may be dropped as dead
  // (a scratch program built so faulted in ldtilecfg).
  __asm__ __volatile__("" : : "r"(&config) : "memory");
  _tile_loadconfig(&config);
}

// The start of a pass that sums one row tile's products into tiles 0-1 (the
// kernels' loops: one group of 16 rows a pass): 0-1 zeroed, and 2-3 too,
// though unused: the linear kernel's passes ran faster so (zeroing tile 5 as
// well, slower); why is not known. Span attention runs level either way.
inline void zero_pass_sums() {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}

}  // namespace
#endif

// 1 where this build's bfloat16 runs on AMX tiles (the kernel's loader reads it).
extern "C" int bf16_on_amx() {
#if defined(VLLM_ACCEL_AMX)
  return 1;
#else
  return 0;
#endif
}
