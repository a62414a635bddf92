// q8 / q4 matmul for AVX2 CPUs (Zen 3, Haswell and later): the fallback of qgemm_avx512.cpp with the
// same layout. A 16-row tile is two ymm registers of int32 lanes (rows 0-7, rows 8-15); a pair of
// int16 activations times a pair of weights is vpmaddwd, added into the lanes with vpaddd.
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

#include "avx2_tile.inc"

template <int MT>
constexpr int chains() {
  return MT >= 2 ? 1 : 2;
}

template <int MT>
void tile_q8(const int8_t* w, const uint16_t* d, const uint16_t* m, int64_t nb, const int16_t* xq, int64_t Kp,
             const float* dx, const float* xsum, const float* bias, int nvalid, float* out, int64_t ldo) {
  constexpr int A = chains<MT>();
  __m256 acc[MT][2];
  for (int t = 0; t < MT; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m256i ia[MT][A][2];
    for (int t = 0; t < MT; ++t)
      for (int c = 0; c < A; ++c) ia[t][c][0] = ia[t][c][1] = _mm256_setzero_si256();
    const int8_t* wb = w + b * (KB * NT);
    const int16_t* xb = xq + b * KB;
#pragma GCC unroll 16
    for (int p = 0; p < KB / 2; ++p) {
      const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + p * 32)));
      const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + p * 32 + 16)));
      for (int t = 0; t < MT; ++t) {
        const __m256i x = pair_at(xb + t * Kp + 2 * p);
        ia[t][p % A][0] = _mm256_add_epi32(ia[t][p % A][0], _mm256_madd_epi16(w0, x));
        ia[t][p % A][1] = _mm256_add_epi32(ia[t][p % A][1], _mm256_madd_epi16(w1, x));
      }
    }
    const __m256 s0 = half8(d + b * NT), s1 = half8(d + b * NT + 8);
    for (int t = 0; t < MT; ++t) {
      __m256i i0 = ia[t][0][0], i1 = ia[t][0][1];
      for (int c = 1; c < A; ++c) i0 = _mm256_add_epi32(i0, ia[t][c][0]), i1 = _mm256_add_epi32(i1, ia[t][c][1]);
      acc[t][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0), s0, acc[t][0]);
      acc[t][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i1), s1, acc[t][1]);
    }
    if (m) {
      const __m256 m0 = half8(m + b * NT), m1 = half8(m + b * NT + 8);
      for (int t = 0; t < MT; ++t) {
        const __m256 xs = _mm256_set1_ps(xsum[t * nb + b]);
        acc[t][0] = _mm256_fmadd_ps(m0, xs, acc[t][0]);
        acc[t][1] = _mm256_fmadd_ps(m1, xs, acc[t][1]);
      }
    }
  }
  store_tile<MT>(acc, dx, bias, nvalid, out, ldo);
}

// A 4-bit tile's scales and minimums of block b, rows 0-7 and 8-15 (`load`), as qgemm_avx512.cpp's:
//   BlockScales: q4's half d, m per block; SYM: symmetric blocks (m == nullptr), m = -8 d (qgemm.h)
//   KScales: q4k's half(d sc) and -half(dmin mn), rounded to nearest even as the loader rounds q4's
template <bool SYM>
struct BlockScales {
  const uint16_t* d;
  const uint16_t* m;
  [[gnu::always_inline]] void load(int64_t b, __m256 (&sc)[2], __m256 (&mn)[2]) const {
    for (int h = 0; h < 2; ++h) {
      sc[h] = half8(d + b * NT + 8 * h);
      mn[h] = SYM ? _mm256_mul_ps(sc[h], _mm256_set1_ps(-8.f)) : half8(m + b * NT + 8 * h);
    }
  }
};

inline __m256 round_to_half(__m256 v) {
  return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

inline __m256 bytes8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

struct KScales {
  const uint16_t* d;   // this tile's [super-blocks][d, dmin][16 rows]
  const uint8_t* sub;  // this tile's [super-blocks][sc, mn][8 blocks][16 rows]
  [[gnu::always_inline]] void load(int64_t b, __m256 (&sc)[2], __m256 (&mn)[2]) const {
    const uint16_t* dd = d + (b / 8) * 2 * NT;
    const uint8_t* u = sub + (b / 8) * 16 * NT + (b % 8) * NT;
    for (int h = 0; h < 2; ++h) {
      sc[h] = round_to_half(_mm256_mul_ps(half8(dd + 8 * h), bytes8(u + 8 * h)));
      const __m256 m = round_to_half(_mm256_mul_ps(half8(dd + NT + 8 * h), bytes8(u + 8 * NT + 8 * h)));
      mn[h] = _mm256_xor_ps(m, _mm256_set1_ps(-0.f));
    }
  }
};

template <int MT, class S>
void tile_q4(const uint8_t* w, const S& scales, int64_t nb, const int16_t* xq, int64_t Kp, const float* dx,
             const float* xsum, const float* bias, int nvalid, float* out, int64_t ldo) {
  const __m256i low4 = _mm256_set1_epi16(0x000F);
  __m256 acc[MT][2];
  for (int t = 0; t < MT; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m256i ia[MT][2];
    for (int t = 0; t < MT; ++t) ia[t][0] = ia[t][1] = _mm256_setzero_si256();
    const uint8_t* wb = w + b * (KB * NT / 2);
    const int16_t* xb = xq + b * KB;
#pragma GCC unroll 4
    for (int g = 0; g < KB / 8; ++g) {
      for (int h = 0; h < 2; ++h) {  // rows 0-7, rows 8-15
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + g * 64 + 32 * h));
        const int16_t* x = xb + 8 * g;
        for (int t = 0; t < MT; ++t) {
          const int16_t* xt = x + t * Kp;
          const __m256i p0 = _mm256_madd_epi16(_mm256_and_si256(v, low4), pair_at(xt));
          const __m256i p1 = _mm256_madd_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 4), low4), pair_at(xt + 2));
          const __m256i p2 = _mm256_madd_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 8), low4), pair_at(xt + 4));
          const __m256i p3 = _mm256_madd_epi16(_mm256_srli_epi16(v, 12), pair_at(xt + 6));
          ia[t][h] = _mm256_add_epi32(ia[t][h], _mm256_add_epi32(_mm256_add_epi32(p0, p1), _mm256_add_epi32(p2, p3)));
        }
      }
    }
    __m256 sc[2], mn[2];
    scales.load(b, sc, mn);
    for (int t = 0; t < MT; ++t) {
      const __m256 xs = _mm256_set1_ps(xsum[t * nb + b]);
      acc[t][0] = _mm256_fmadd_ps(mn[0], xs, _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia[t][0]), sc[0], acc[t][0]));
      acc[t][1] = _mm256_fmadd_ps(mn[1], xs, _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia[t][1]), sc[1], acc[t][1]));
    }
  }
  store_tile<MT>(acc, dx, bias, nvalid, out, ldo);
}

constexpr int MAX_MT = 2;

// The 4-bit tile for MT tokens with this tile's scales (F: kQ4 or kQ4K).
template <int F, int MT>
void run_q4(const GemmArgs& a, int64_t tile, const uint8_t* w, const int16_t* x, const float* dx, const float* xs,
            const float* bias, int nvalid, float* out) {
  const int64_t nb = num_blocks(a.K), Kp = nb * KB;
  if constexpr (F == kQ4K) {
    const int64_t nsb = a.K / KSB;
    const KScales sc{a.d + tile * nsb * 2 * NT, reinterpret_cast<const uint8_t*>(a.m) + tile * nsb * 16 * NT};
    tile_q4<MT>(w, sc, nb, x, Kp, dx, xs, bias, nvalid, out, a.ldo);
  } else if (a.m) {
    tile_q4<MT>(w, BlockScales<false>{a.d + tile * nb * NT, a.m + tile * nb * NT}, nb, x, Kp, dx, xs, bias, nvalid,
                out, a.ldo);
  } else {
    tile_q4<MT>(w, BlockScales<true>{a.d + tile * nb * NT, nullptr}, nb, x, Kp, dx, xs, bias, nvalid, out, a.ldo);
  }
}

template <int F>
void tile_tokens(const GemmArgs& a, int64_t tile, int64_t t0, int64_t t1, const int16_t* xq, const float* dx,
                 const float* xsum) {
  const int64_t nb = num_blocks(a.K), Kp = nb * KB;
  const int nvalid = static_cast<int>(std::min<int64_t>(NT, a.N - tile * NT));
  const uint16_t* d = a.d + tile * nb * NT;
  const float* bias = a.bias ? a.bias + tile * NT : nullptr;
  for (int64_t t = t0; t < t1; t += MAX_MT) {
    const int mt = static_cast<int>(std::min<int64_t>(MAX_MT, t1 - t));
    const int16_t* x = xq + t * Kp;
    float* out = a.out + t * a.ldo + tile * NT;
    const uint16_t* m = a.m ? a.m + tile * nb * NT : nullptr;
    const float* xs = xsum ? xsum + t * nb : nullptr;
    if constexpr (F != kQ8) {
      const uint8_t* w = static_cast<const uint8_t*>(a.w) + tile * nb * (KB * NT / 2);
      if (mt == 2) run_q4<F, 2>(a, tile, w, x, dx + t, xs, bias, nvalid, out);
      else run_q4<F, 1>(a, tile, w, x, dx + t, xs, bias, nvalid, out);
    } else {
      const int8_t* w = static_cast<const int8_t*>(a.w) + tile * nb * (KB * NT);
      if (mt == 2) tile_q8<2>(w, d, m, nb, x, Kp, dx + t, xs, bias, nvalid, out, a.ldo);
      else tile_q8<1>(w, d, m, nb, x, Kp, dx + t, xs, bias, nvalid, out, a.ldo);
    }
  }
}

template <int F>
void gemm(const GemmArgs& a) {
  const int64_t nb = num_blocks(a.K), tiles = num_tiles(a.N);
  scratch.fit(a.M, a.K);
  int16_t* xq = scratch.xq.data();
  float* dx = scratch.dx.data();
  float* xsum = (F != kQ8 || a.m) ? scratch.xsum.data() : nullptr;  // block sums carry the minimums' term
  quantize_activations(a.x, a.ldx, a.M, a.K, xq, dx, xsum);
  const int64_t chunk = std::max<int64_t>(8, ((256 * 1024) / (nb * KB * 2)) / 8 * 8);
  const JobRuns runs(tiles, (a.M + chunk - 1) / chunk);  // as qgemm_avx512.cpp's gemm
#pragma omp parallel
  for (int64_t t0 = 0; t0 < a.M; t0 += chunk) {
    const int64_t t1 = std::min(a.M, t0 + chunk);
    runs.each(t0 / chunk, [&](int64_t tile) { tile_tokens<F>(a, tile, t0, t1, xq, dx, xsum); });
  }
}

}  // namespace

void gemm_q8(const GemmArgs& a) { gemm<kQ8>(a); }
void gemm_q4(const GemmArgs& a) { gemm<kQ4>(a); }
void gemm_q4k(const GemmArgs& a) { gemm<kQ4K>(a); }

}  // namespace avx2
}  // namespace llmserve
