// The fused decoder's KV cache rows (decoder_stack.h's declarations): converting between float32
// rows and the cache's types, as layers/attention stores and reads them in torch.
#pragma GCC target("avx2,fma,f16c")

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "decoder_stack.h"

namespace llmserve {

// -- cache rows: float32, bfloat16 (uint16 bits), float16 (uint16 bits), or int8 values followed by
//    a float16 scale per group of 32 (row = D + 2 ceil(D / 32) bytes; value = scale * q,
//    scale = max|group| / 127 rounded to float16; GGUF Q8_0's blocks) -----------------------------

namespace {

inline uint16_t to_bf16(float f) {  // round to nearest even, as torch's .to(bfloat16)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN stays NaN
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

}  // namespace

int64_t row_bytes(int cache_type, int64_t D) {
  switch (cache_type) {
    case kCacheF32: return D * 4;
    case kCacheI8: return D + 2 * ((D + kInt8Group - 1) / kInt8Group);
    default: return D * 2;
  }
}

// One row of D floats into the cache (the same rounding as layers/attention: torch's .to(), and
// for int8 `quantize_rows`).
void store_row(int cache_type, const float* src, int64_t n, void* dst) {
  if (cache_type == kCacheF32) {
    std::memcpy(dst, src, n * 4);
  } else if (cache_type == kCacheBF16) {
    uint16_t* d = static_cast<uint16_t*>(dst);
    for (int64_t i = 0; i < n; ++i) d[i] = to_bf16(src[i]);
  } else if (cache_type == kCacheF16) {
    uint16_t* d = static_cast<uint16_t*>(dst);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)  // round to nearest even
      _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), 0));
    for (; i < n; ++i) d[i] = _cvtss_sh(src[i], 0);
  } else {
    int8_t* q = static_cast<int8_t*>(dst);
    uint16_t* scales = reinterpret_cast<uint16_t*>(q + n);  // 2-byte aligned: n is even or so is D + 2G
    for (int64_t g0 = 0; g0 < n; g0 += kInt8Group) {
      const int64_t g1 = std::min<int64_t>(n, g0 + kInt8Group);
      float amax = 0.f;
      for (int64_t i = g0; i < g1; ++i) amax = std::max(amax, std::fabs(src[i]));
      const uint16_t h = _cvtss_sh(amax / 127.f, 0);
      const float scale = _cvtsh_ss(h);
      const float div = scale > 0.f ? scale : 1.f;
      for (int64_t i = g0; i < g1; ++i)
        q[i] = static_cast<int8_t>(std::max(-127.f, std::min(127.f, std::nearbyint(src[i] / div))));
      std::memcpy(scales + g0 / kInt8Group, &h, 2);
    }
  }
}

// `rows` cache rows of D values as float32 rows [rows, D] in `dst` (returns `src` itself for a
// float32 cache, whose rows are already that).
const float* load_rows(int cache_type, const void* src, int64_t rows, int64_t D, float* dst) {
  const int64_t n = rows * D;
  if (cache_type == kCacheF32) return static_cast<const float*>(src);
  if (cache_type == kCacheI8) {
    const int64_t rb = row_bytes(kCacheI8, D);
    const int8_t* q = static_cast<const int8_t*>(src);
    for (int64_t r = 0; r < rows; ++r, q += rb) {
      float* o = dst + r * D;
      for (int64_t g0 = 0; g0 < D; g0 += kInt8Group) {
        uint16_t h;
        std::memcpy(&h, q + D + 2 * (g0 / kInt8Group), 2);
        const float scale = _cvtsh_ss(h);
        const int64_t g1 = std::min<int64_t>(D, g0 + kInt8Group);
#pragma omp simd
        for (int64_t d = g0; d < g1; ++d) o[d] = scale * static_cast<float>(q[d]);
      }
    }
    return dst;
  }
  const uint16_t* s = static_cast<const uint16_t*>(src);
  if (cache_type == kCacheBF16) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t u = static_cast<uint32_t>(s[i]) << 16;
      float f;
      std::memcpy(&f, &u, 4);
      dst[i] = f;
    }
  } else {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i))));
    for (; i < n; ++i) dst[i] = _cvtsh_ss(s[i]);
  }
  return dst;
}

void prefetch_rows(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(c + i, _MM_HINT_T0);
}

}  // namespace llmserve
