// q8 / q4 matmul for CPUs with AVX-512 VNNI (Zen 4, Ice Lake and later): 16 output rows live in one
// zmm register of int32 lanes; each step multiplies a pair of int16 activations (broadcast to all
// lanes) by the 16 rows' matching pair of weights and adds both products (vpdpwssd).
// See qgemm.h for the layout and the math.
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c,avx2")

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "qgemm.h"

namespace llmserve {
namespace avx512 {

#include "act_quant.inc"

namespace {

inline __m512i pair_at(const int16_t* p) {  // two int16 activations, broadcast to all 16 lanes
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

inline __m512 half16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Independent int32 accumulator chains per token: vpdpwssd has a latency of several cycles, so a
// single token needs several chains in flight; eight tokens already give eight.
template <int MT>
constexpr int chains() {
  return MT >= 4 ? 1 : (MT >= 2 ? 2 : 4);
}

template <int MT>
inline void store_tile(const __m512 (&acc)[MT], const float* dx, const float* bias, int nvalid, float* out,
                       int64_t ldo) {
  const __mmask16 mask = nvalid >= NT ? __mmask16(0xFFFF) : __mmask16((1u << nvalid) - 1);
  const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias) : _mm512_setzero_ps();
  for (int t = 0; t < MT; ++t)
    _mm512_mask_storeu_ps(out + t * ldo, mask, _mm512_fmadd_ps(acc[t], _mm512_set1_ps(dx[t]), bv));
}

// One tile (16 rows) for MT tokens: out[t, n] = dx[t] * sum_b d[n, b] * <q[n, b], xq[t, b]> + bias[n]
// (+ m[n, b] * xsum[t, b] inside the sum when the weight has minimums: int8 copies of 4-bit data).
template <int MT>
void tile_q8(const int8_t* w, const uint16_t* d, const uint16_t* m, int64_t nb, const int16_t* xq, int64_t Kp,
             const float* dx, const float* xsum, const float* bias, int nvalid, float* out, int64_t ldo) {
  constexpr int A = chains<MT>();
  __m512 acc[MT];
  for (int t = 0; t < MT; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512i ia[MT][A];
    for (int t = 0; t < MT; ++t)
      for (int c = 0; c < A; ++c) ia[t][c] = _mm512_setzero_si512();
    const int8_t* wb = w + b * (KB * NT);
    const int16_t* xb = xq + b * KB;
#pragma GCC unroll 16
    for (int p = 0; p < KB / 2; ++p) {
      const __m512i wv = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + p * 32)));
      for (int t = 0; t < MT; ++t) ia[t][p % A] = _mm512_dpwssd_epi32(ia[t][p % A], pair_at(xb + t * Kp + 2 * p), wv);
    }
    const __m512 sc = half16(d + b * NT);
    for (int t = 0; t < MT; ++t) {
      __m512i s = ia[t][0];
      for (int c = 1; c < A; ++c) s = _mm512_add_epi32(s, ia[t][c]);
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), sc, acc[t]);
    }
    if (m) {
      const __m512 mn = half16(m + b * NT);
      for (int t = 0; t < MT; ++t) acc[t] = _mm512_fmadd_ps(mn, _mm512_set1_ps(xsum[t * nb + b]), acc[t]);
    }
  }
  store_tile<MT>(acc, dx, bias, nvalid, out, ldo);
}

// The same for 4-bit weights: out[t, n] = dx[t] * sum_b (d[n,b] <q[n,b], xq[t,b]> + m[n,b] xsum[t,b]) + bias[n].
template <int MT>
void tile_q4(const uint8_t* w, const uint16_t* d, const uint16_t* m, int64_t nb, const int16_t* xq, int64_t Kp,
             const float* dx, const float* xsum, const float* bias, int nvalid, float* out, int64_t ldo) {
  constexpr int A = chains<MT>();
  const __m512i low4 = _mm512_set1_epi16(0x000F);
  __m512 acc[MT];
  for (int t = 0; t < MT; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512i ia[MT][A];
    for (int t = 0; t < MT; ++t)
      for (int c = 0; c < A; ++c) ia[t][c] = _mm512_setzero_si512();
    const uint8_t* wb = w + b * (KB * NT / 2);
    const int16_t* xb = xq + b * KB;
#pragma GCC unroll 4
    for (int g = 0; g < KB / 8; ++g) {
      // 64 bytes = 16 rows x 2 lanes of four nibbles: nibble s of lane j holds column 8g + 2s + j.
      const __m512i v = _mm512_loadu_si512(wb + g * 64);
      const __m512i s0 = _mm512_and_si512(v, low4);
      const __m512i s1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      const __m512i s2 = _mm512_and_si512(_mm512_srli_epi16(v, 8), low4);
      const __m512i s3 = _mm512_srli_epi16(v, 12);
      for (int t = 0; t < MT; ++t) {
        const int16_t* x = xb + t * Kp + 8 * g;
        ia[t][(4 * g) % A] = _mm512_dpwssd_epi32(ia[t][(4 * g) % A], pair_at(x), s0);
        ia[t][(4 * g + 1) % A] = _mm512_dpwssd_epi32(ia[t][(4 * g + 1) % A], pair_at(x + 2), s1);
        ia[t][(4 * g + 2) % A] = _mm512_dpwssd_epi32(ia[t][(4 * g + 2) % A], pair_at(x + 4), s2);
        ia[t][(4 * g + 3) % A] = _mm512_dpwssd_epi32(ia[t][(4 * g + 3) % A], pair_at(x + 6), s3);
      }
    }
    const __m512 sc = half16(d + b * NT), mn = half16(m + b * NT);
    for (int t = 0; t < MT; ++t) {
      __m512i s = ia[t][0];
      for (int c = 1; c < A; ++c) s = _mm512_add_epi32(s, ia[t][c]);
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), sc, acc[t]);
      acc[t] = _mm512_fmadd_ps(mn, _mm512_set1_ps(xsum[t * nb + b]), acc[t]);
    }
  }
  store_tile<MT>(acc, dx, bias, nvalid, out, ldo);
}

constexpr int MAX_MT = 8;

// Tokens [t0, t1) of one tile, MAX_MT at a time.
template <bool Q4>
void tile_tokens(const GemmArgs& a, int64_t tile, int64_t t0, int64_t t1, const int16_t* xq, const float* dx,
                 const float* xsum) {
  const int64_t nb = num_blocks(a.K), Kp = nb * KB;
  const int nvalid = static_cast<int>(std::min<int64_t>(NT, a.N - tile * NT));
  const uint16_t* d = a.d + tile * nb * NT;
  const uint16_t* m = a.m ? a.m + tile * nb * NT : nullptr;
  const float* bias = a.bias ? a.bias + tile * NT : nullptr;
  for (int64_t t = t0; t < t1; t += MAX_MT) {
    const int mt = static_cast<int>(std::min<int64_t>(MAX_MT, t1 - t));
    const int16_t* x = xq + t * Kp;
    float* out = a.out + t * a.ldo + tile * NT;
    const float* xs = xsum ? xsum + t * nb : nullptr;
    if constexpr (Q4) {
      const uint8_t* w = static_cast<const uint8_t*>(a.w) + tile * nb * (KB * NT / 2);
      switch (mt) {
#define LLMSERVE_Q4(MT) case MT: tile_q4<MT>(w, d, m, nb, x, Kp, dx + t, xs, bias, nvalid, out, a.ldo); break;
        LLMSERVE_Q4(1) LLMSERVE_Q4(2) LLMSERVE_Q4(3) LLMSERVE_Q4(4)
        LLMSERVE_Q4(5) LLMSERVE_Q4(6) LLMSERVE_Q4(7) LLMSERVE_Q4(8)
#undef LLMSERVE_Q4
      }
    } else {
      const int8_t* w = static_cast<const int8_t*>(a.w) + tile * nb * (KB * NT);
      switch (mt) {
#define LLMSERVE_Q8(MT) case MT: tile_q8<MT>(w, d, m, nb, x, Kp, dx + t, xs, bias, nvalid, out, a.ldo); break;
        LLMSERVE_Q8(1) LLMSERVE_Q8(2) LLMSERVE_Q8(3) LLMSERVE_Q8(4)
        LLMSERVE_Q8(5) LLMSERVE_Q8(6) LLMSERVE_Q8(7) LLMSERVE_Q8(8)
#undef LLMSERVE_Q8
      }
    }
  }
}

// Tokens are taken in chunks so that one chunk's quantized activations stay in the core's L2
// while every tile streams past them; each thread owns a contiguous run of tiles (its weights).
template <bool Q4>
void gemm(const GemmArgs& a) {
  const int64_t nb = num_blocks(a.K), tiles = num_tiles(a.N);
  scratch.fit(a.M, a.K);
  int16_t* xq = scratch.xq.data();
  float* dx = scratch.dx.data();
  float* xsum = a.m ? scratch.xsum.data() : nullptr;  // block sums carry the minimums' term
  quantize_activations(a.x, a.ldx, a.M, a.K, xq, dx, xsum);
  const int64_t chunk = std::max<int64_t>(MAX_MT, ((256 * 1024) / (nb * KB * 2)) / MAX_MT * MAX_MT);
#pragma omp parallel
  for (int64_t t0 = 0; t0 < a.M; t0 += chunk) {
    const int64_t t1 = std::min(a.M, t0 + chunk);
#pragma omp for schedule(static)
    for (int64_t tile = 0; tile < tiles; ++tile) tile_tokens<Q4>(a, tile, t0, t1, xq, dx, xsum);
  }
}

}  // namespace

void gemm_q8(const GemmArgs& a) { gemm<false>(a); }
void gemm_q4(const GemmArgs& a) { gemm<true>(a); }

}  // namespace avx512
}  // namespace llmserve
