// q6 (GGUF Q6_K's own 6-bit super-blocks) matmul for AVX2 CPUs: the fallback of qgemm_q6_avx512.cpp
// with the same layout and arithmetic. A 16-row tile is two halves of 8 rows (ymm registers of int32
// lanes); each half's codes come from its 32 bytes of a 64-byte lane group, a pair of int16
// activations times a pair of codes is vpmaddwd, the sub-block's offset 32 * sum(xq) is taken off
// the exact int32 sum before it is scaled by d sc in float.
#pragma GCC target("avx2,fma,f16c")

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "job_runs.h"
#include "qgemm.h"

namespace llmserve {
namespace avx2 {

#include "act_quant.inc"

namespace {

constexpr int MAX_MT = 2;
constexpr int SUBS = Q6_SUPER / Q6_SUB;

thread_local std::vector<int32_t> offsets;  // [token][K / 16]: 32 * each sub-block's sum of xq

#include "avx2_tile.inc"

template <int MT>
void tile_q6(const uint8_t* w, const uint16_t* d, int64_t ns, const int16_t* xq, int64_t K, const int32_t* xs,
             const float* dx, const float* bias, int nvalid, float* out, int64_t ldo) {
  const __m256i low4 = _mm256_set1_epi16(0x0F), top2 = _mm256_set1_epi16(0x30);
  __m256 acc[MT][2];
  for (int t = 0; t < MT; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
  for (int64_t s = 0; s < ns; ++s) {
    const uint8_t* rec = w + s * Q6_RECORD;
    for (int i = 0; i < SUBS; ++i) {
      const uint8_t* p = rec + Q6_SUB * NT + i * 192;
      const int64_t k0 = s * Q6_SUPER + i * Q6_SUB;
      for (int h = 0; h < 2; ++h) {  // rows 0-7, rows 8-15
        const __m256i hi2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 128 + 32 * h));
        __m256i ia[MT];
        for (int t = 0; t < MT; ++t) ia[t] = _mm256_setzero_si256();
        for (int g = 0; g < 2; ++g) {
          const __m256i lo4 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * g + 32 * h));
          for (int sh = 0; sh < 4; ++sh) {
            const int pr = 4 * g + sh;  // the pair of columns 2 pr, 2 pr + 1
            const __m256i lo = _mm256_and_si256(_mm256_srli_epi16(lo4, 4 * sh), low4);
            const __m256i hi = 2 * pr <= 4 ? _mm256_slli_epi16(hi2, 4 - 2 * pr) : _mm256_srli_epi16(hi2, 2 * pr - 4);
            const __m256i q = _mm256_or_si256(lo, _mm256_and_si256(hi, top2));
            for (int t = 0; t < MT; ++t)
              ia[t] = _mm256_add_epi32(ia[t], _mm256_madd_epi16(q, pair_at(xq + t * K + k0 + 2 * pr)));
          }
        }
        const __m128i sc8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(rec + i * NT + 8 * h));
        const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc8));
        const __m256 scale = _mm256_mul_ps(sc, half8(d + s * NT + 8 * h));  // d sc: exact in float32
        for (int t = 0; t < MT; ++t) {
          const __m256i sum = _mm256_sub_epi32(ia[t], _mm256_set1_epi32(xs[t * (K / Q6_SUB) + s * SUBS + i]));
          acc[t][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), scale, acc[t][h]);
        }
      }
    }
  }
  store_tile<MT>(acc, dx, bias, nvalid, out, ldo);
}

}  // namespace

void gemm_q6(const GemmArgs& a) {
  const int64_t tiles = num_tiles(a.N), ns = a.K / Q6_SUPER, n16 = a.K / Q6_SUB;
  scratch.fit(a.M, a.K);
  int16_t* xq = scratch.xq.data();
  float* dx = scratch.dx.data();
  quantize_activations(a.x, a.ldx, a.M, a.K, xq, dx, nullptr);
  if ((int64_t)offsets.size() < a.M * n16) offsets.resize(a.M * n16);
  for (int64_t t = 0; t < a.M; ++t)
    for (int64_t i = 0; i < n16; ++i) {
      int32_t s = 0;
      for (int k = 0; k < Q6_SUB; ++k) s += xq[t * a.K + i * Q6_SUB + k];
      offsets[t * n16 + i] = 32 * s;
    }
  const int32_t* xs = offsets.data();
  const int64_t chunk = std::max<int64_t>(8, ((256 * 1024) / (a.K * 2)) / 8 * 8);
  const JobRuns runs(tiles, (a.M + chunk - 1) / chunk);
#pragma omp parallel
  for (int64_t t0 = 0; t0 < a.M; t0 += chunk) {
    const int64_t t1 = std::min(a.M, t0 + chunk);
    runs.each(t0 / chunk, [&](int64_t tile) {
      const int nvalid = static_cast<int>(std::min<int64_t>(NT, a.N - tile * NT));
      const uint8_t* w = static_cast<const uint8_t*>(a.w) + tile * ns * Q6_RECORD;
      const uint16_t* d = a.d + tile * ns * NT;
      const float* bias = a.bias ? a.bias + tile * NT : nullptr;
      for (int64_t t = t0; t < t1; t += MAX_MT) {
        float* out = a.out + t * a.ldo + tile * NT;
        if (t1 - t >= 2) tile_q6<2>(w, d, ns, xq + t * a.K, a.K, xs + t * n16, dx + t, bias, nvalid, out, a.ldo);
        else tile_q6<1>(w, d, ns, xq + t * a.K, a.K, xs + t * n16, dx + t, bias, nvalid, out, a.ldo);
      }
    });
  }
}

}  // namespace avx2
}  // namespace llmserve
