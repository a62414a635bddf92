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

constexpr int MAX_MT = 8;  // tokens per register tile: 8 int32 + 8 float accumulators

inline __m512 half16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Independent int32 accumulator chains per token: vpdpwssd has a latency of several cycles, so a
// single token needs several chains in flight; four tokens already give four.
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

// Per block: the int32 dot products (in chains) become float and are scaled by the rows' d (and
// the minimums' term m * xsum added, for weights that have minimums).
template <int MT, int A>
inline void finish_block(__m512i (&ia)[MT][A], const uint16_t* d, const uint16_t* m, const float* xs,
                         __m512 (&acc)[MT]) {
  const __m512 sc = half16(d);
  for (int t = 0; t < MT; ++t) {
    __m512i s = ia[t][0];
    for (int c = 1; c < A; ++c) s = _mm512_add_epi32(s, ia[t][c]);
    acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), sc, acc[t]);
  }
  if (m) {
    const __m512 mn = half16(m);
    for (int t = 0; t < MT; ++t) acc[t] = _mm512_fmadd_ps(mn, _mm512_set1_ps(xs[t]), acc[t]);
  }
}

// One tile (16 rows) for a group of MT tokens:
//   out[t, n] = dx[t] * sum_b (d[n, b] <q[n, b], xq[t, b]> (+ m[n, b] xsum[t, b])) + bias[n]
// xi, xs: the group's interleaved pairs and block sums (act_quant.inc).
template <int MT>
void tile_q8(const int8_t* w, const uint16_t* d, const uint16_t* m, int64_t nb, const int32_t* xi,
             const float* xs, const float* dx, const float* bias, int nvalid, float* out, int64_t ldo) {
  constexpr int A = chains<MT>();
  __m512 acc[MT];
  for (int t = 0; t < MT; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512i ia[MT][A];
    for (int t = 0; t < MT; ++t)
      for (int c = 0; c < A; ++c) ia[t][c] = _mm512_setzero_si512();
    const int8_t* wb = w + b * (KB * NT);
    const int32_t* xb = xi + b * (KB / 2) * MT;
#pragma GCC unroll 16
    for (int p = 0; p < KB / 2; ++p) {
      const __m512i wv = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + p * 32)));
      for (int t = 0; t < MT; ++t)
        ia[t][p % A] = _mm512_dpwssd_epi32(ia[t][p % A], _mm512_set1_epi32(xb[p * MT + t]), wv);
    }
    finish_block<MT, A>(ia, d + b * NT, m ? m + b * NT : nullptr, xs ? xs + b * MT : nullptr, acc);
  }
  store_tile<MT>(acc, dx, bias, nvalid, out, ldo);
}

// The same for 4-bit weights (m always present).
template <int MT>
void tile_q4(const uint8_t* w, const uint16_t* d, const uint16_t* m, int64_t nb, const int32_t* xi,
             const float* xs, const float* dx, const float* bias, int nvalid, float* out, int64_t ldo) {
  constexpr int A = chains<MT>();
  const __m512i low4 = _mm512_set1_epi16(0x000F);
  __m512 acc[MT];
  for (int t = 0; t < MT; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512i ia[MT][A];
    for (int t = 0; t < MT; ++t)
      for (int c = 0; c < A; ++c) ia[t][c] = _mm512_setzero_si512();
    const uint8_t* wb = w + b * (KB * NT / 2);
    const int32_t* xb = xi + b * (KB / 2) * MT;
#pragma GCC unroll 4
    for (int g = 0; g < KB / 8; ++g) {
      // 64 bytes = 16 rows x 2 lanes of four nibbles: nibble s of lane j holds column 8g + 2s + j.
      const __m512i v = _mm512_loadu_si512(wb + g * 64);
      const __m512i s4[4] = {_mm512_and_si512(v, low4), _mm512_and_si512(_mm512_srli_epi16(v, 4), low4),
                             _mm512_and_si512(_mm512_srli_epi16(v, 8), low4), _mm512_srli_epi16(v, 12)};
      for (int s = 0; s < 4; ++s) {
        const int p = 4 * g + s;  // the pair of columns 8g + 2s, 8g + 2s + 1
        for (int t = 0; t < MT; ++t)
          ia[t][p % A] = _mm512_dpwssd_epi32(ia[t][p % A], _mm512_set1_epi32(xb[p * MT + t]), s4[s]);
      }
    }
    finish_block<MT, A>(ia, d + b * NT, m + b * NT, xs + b * MT, acc);
  }
  store_tile<MT>(acc, dx, bias, nvalid, out, ldo);
}

// Tokens [t0, t1) of one tile (t0, t1 on group boundaries), a group of up to MAX_MT at a time.
template <bool Q4>
void tile_tokens(const GemmArgs& a, int64_t tile, int64_t t0, int64_t t1, const int32_t* xi, const float* xs,
                 const float* dx) {
  const int64_t nb = num_blocks(a.K), pairs = nb * KB / 2;
  const int nvalid = static_cast<int>(std::min<int64_t>(NT, a.N - tile * NT));
  const uint16_t* d = a.d + tile * nb * NT;
  const uint16_t* m = a.m ? a.m + tile * nb * NT : nullptr;
  const float* bias = a.bias ? a.bias + tile * NT : nullptr;
  for (int64_t t = t0; t < t1; t += MAX_MT) {
    const int mt = static_cast<int>(std::min<int64_t>(MAX_MT, t1 - t));
    const int32_t* x = xi + t * pairs;
    const float* s = xs ? xs + t * nb : nullptr;
    float* out = a.out + t * a.ldo + tile * NT;
    if constexpr (Q4) {
      const uint8_t* w = static_cast<const uint8_t*>(a.w) + tile * nb * (KB * NT / 2);
      switch (mt) {
#define LLMSERVE_Q4(MT) case MT: tile_q4<MT>(w, d, m, nb, x, s, dx + t, bias, nvalid, out, a.ldo); break;
        LLMSERVE_Q4(1) LLMSERVE_Q4(2) LLMSERVE_Q4(3) LLMSERVE_Q4(4)
        LLMSERVE_Q4(5) LLMSERVE_Q4(6) LLMSERVE_Q4(7) LLMSERVE_Q4(8)
#undef LLMSERVE_Q4
      }
    } else {
      const int8_t* w = static_cast<const int8_t*>(a.w) + tile * nb * (KB * NT);
      switch (mt) {
#define LLMSERVE_Q8(MT) case MT: tile_q8<MT>(w, d, m, nb, x, s, dx + t, bias, nvalid, out, a.ldo); break;
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
  float* xsum = a.m ? scratch.xsum.data() : nullptr;  // block sums carry the minimums' term
  quantize_activations(a.x, a.ldx, a.M, a.K, scratch.xq.data(), scratch.dx.data(), xsum);
  interleave_groups(scratch.xq.data(), xsum, a.M, a.K, MAX_MT, scratch.xi.data(), xsum ? scratch.xs.data() : nullptr);
  const int32_t* xi = scratch.xi.data();
  const float* xs = xsum ? scratch.xs.data() : nullptr;
  const float* dx = scratch.dx.data();
  const int64_t chunk = std::max<int64_t>(MAX_MT, ((256 * 1024) / (nb * KB * 2)) / MAX_MT * MAX_MT);
#pragma omp parallel
  for (int64_t t0 = 0; t0 < a.M; t0 += chunk) {
    const int64_t t1 = std::min(a.M, t0 + chunk);
#pragma omp for schedule(static)
    for (int64_t tile = 0; tile < tiles; ++tile) tile_tokens<Q4>(a, tile, t0, t1, xi, xs, dx);
  }
}

}  // namespace

void gemm_q8(const GemmArgs& a) { gemm<false>(a); }
void gemm_q4(const GemmArgs& a) { gemm<true>(a); }

}  // namespace avx512
}  // namespace llmserve
