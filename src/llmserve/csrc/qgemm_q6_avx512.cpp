// q6 (GGUF Q6_K's own 6-bit super-blocks) matmul for CPUs with AVX-512 VNNI, int16 activations.
//
//   out[t, n] = dx[t] * sum_s sum_j (d[n, s] sc[n, j]) * sum_{k in j} (q[n, k] - 32) xq[t, k]  (+ bias)
//
// Per sub-block j of 16 columns (8 pairs), each 16-bit lane pair of the tile is made from the low
// nibble (q4's shifts and masks) and the top two bits (one shift, merged by one vpternlogd), then
// multiplied by the broadcast activation pair (vpdpwssd). The int32 sum of a sub-block is at most
// 16 * 63 * 32767 < 2^25, and the unsigned codes' offset is taken off it once, exactly, as
// 32 * sum_{k in j} xq[t, k]; it then becomes float and is scaled by d sc (exact in float32: 11 + 8
// significant bits). Two sub-blocks' products would not fit int32 once scaled by sc, so the float
// step is per sub-block: 8 vpdpwssd per conversion and FMA, where q4 has 16.
// The layout (formats_q6.py, qgemm.h): a record of 3328 bytes per tile of 16 rows and super-block
// of 256 columns, its 256 int8 scales first, then 16 sub-blocks of 192 bytes (128 of nibbles, 64 of
// bit pairs); the half d of each row and super-block apart.
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c,avx2")

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "job_runs.h"
#include "qgemm.h"

namespace llmserve {
namespace avx512 {

#include "act_quant.inc"

namespace {

// Tokens a register tile: 8 tokens x 2 tiles = 16 int32 chains and 16 float accumulators (which the
// compiler partly keeps in L1). Each pair's codes (shifts, masks, a ternary merge) then feed 16
// vpdpwssd instead of 8: at 16 tokens, 0.91x the time of 4-token tiles (bench_q6.py --batch 16,
// q6 / q8 time 1.26 -> 1.15). A token's bits do not depend on its tile (int32 sums are exact).
constexpr int MAX_MT = 8;
constexpr int TILES = 2;   // tiles sharing each broadcast activation pair (and two weight streams in flight)
constexpr int SUBS = Q6_SUPER / Q6_SUB;

// Per token and sub-block of 16 columns, 32 * the sum of its int16 activations (the codes' offset),
// interleaved by groups of G tokens as the pairs are (act_quant.inc): xs + t0 * n16 + i * g + t.
thread_local std::vector<int32_t> offsets;

void sub_block_offsets(const int16_t* xq, int64_t M, int64_t K, int64_t G, int32_t* xs) {
  const int64_t n16 = K / Q6_SUB;
  for (int64_t t0 = 0; t0 < M; t0 += G) {
    const int64_t g = std::min(G, M - t0);
    for (int64_t t = 0; t < g; ++t) {
      const int16_t* x = xq + (t0 + t) * K;
      for (int64_t i = 0; i < n16; ++i) {
        int32_t s = 0;
        for (int k = 0; k < Q6_SUB; ++k) s += x[i * Q6_SUB + k];
        xs[t0 * n16 + i * g + t] = 32 * s;
      }
    }
  }
}

template <int MT, int NTL>
constexpr int chains() {
  return MT * NTL >= 4 ? 1 : (MT * NTL >= 2 ? 2 : 4);
}

// Pair p (columns 2p, 2p + 1) of a sub-block for 16 rows: the nibbles of lane group p / 4 (lo4)
// and the bit pairs (hi2) merged into int16 codes 0..63.
template <int P>
inline __m512i codes(__m512i lo4, __m512i hi2, __m512i low4, __m512i top2) {
  constexpr int s = P % 4;
  __m512i lo = s == 0 ? lo4 : _mm512_srli_epi16(lo4, 4 * s);
  if constexpr (s != 3) lo = _mm512_and_si512(lo, low4);
  __m512i hi = hi2;  // bits 2P, 2P + 1 moved to bits 4, 5
  if constexpr (2 * P < 4) hi = _mm512_slli_epi16(hi2, 4 - 2 * P);
  if constexpr (2 * P > 4) hi = _mm512_srli_epi16(hi2, 2 * P - 4);
  return _mm512_ternarylogic_epi32(lo, hi, top2, 0xF8);  // lo | (hi & top2)
}

template <int P, int MT, int NTL, int A>
inline void pair_step(__m512i (&ia)[NTL][MT][A], const __m512i (&lo4)[NTL][2], const __m512i (&hi2)[NTL],
                      const int32_t* xb, __m512i low4, __m512i top2) {
  __m512i q[NTL];
  for (int j = 0; j < NTL; ++j) q[j] = codes<P>(lo4[j][P / 4], hi2[j], low4, top2);
  for (int t = 0; t < MT; ++t) {
    const __m512i x = _mm512_set1_epi32(xb[P * MT + t]);
    for (int j = 0; j < NTL; ++j) ia[j][t][P % A] = _mm512_dpwssd_epi32(ia[j][t][P % A], x, q[j]);
  }
}

// NTL consecutive tiles (tile j's records `ns * Q6_RECORD` bytes after tile 0's) for MT tokens.
template <int MT, int NTL>
void tile_q6(const uint8_t* w, const uint16_t* d, int64_t ns, const int32_t* xi, const int32_t* xs,
             const float* dx, const float* bias, int nvalid, float* out, int64_t ldo) {
  constexpr int A = chains<MT, NTL>();
  const __m512i low4 = _mm512_set1_epi16(0x0F), top2 = _mm512_set1_epi16(0x30);
  __m512 acc[NTL][MT];
  for (int j = 0; j < NTL; ++j)
    for (int t = 0; t < MT; ++t) acc[j][t] = _mm512_setzero_ps();
  for (int64_t s = 0; s < ns; ++s) {
    const uint8_t* rec[NTL];
    __m512 dv[NTL];
    for (int j = 0; j < NTL; ++j) {
      rec[j] = w + (j * ns + s) * Q6_RECORD;
      dv[j] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d + (j * ns + s) * NT)));
    }
    for (int i = 0; i < SUBS; ++i) {
      __m512i ia[NTL][MT][A];
      __m512i lo4[NTL][2], hi2[NTL];
      for (int j = 0; j < NTL; ++j) {
        for (int t = 0; t < MT; ++t)
          for (int c = 0; c < A; ++c) ia[j][t][c] = _mm512_setzero_si512();
        // the next record's bytes, one record ahead (the weights stream from memory once a step)
        const char* ahead = reinterpret_cast<const char*>(rec[j]) + Q6_RECORD + i * (Q6_RECORD / SUBS);
        for (int l = 0; l < 4; ++l) _mm_prefetch(ahead + 64 * l, _MM_HINT_T0);
        const uint8_t* p = rec[j] + Q6_SUB * NT + i * 192;
        lo4[j][0] = _mm512_loadu_si512(p);
        lo4[j][1] = _mm512_loadu_si512(p + 64);
        hi2[j] = _mm512_loadu_si512(p + 128);
      }
      const int32_t* xb = xi + (s * Q6_SUPER + i * Q6_SUB) / 2 * MT;
      pair_step<0>(ia, lo4, hi2, xb, low4, top2);
      pair_step<1>(ia, lo4, hi2, xb, low4, top2);
      pair_step<2>(ia, lo4, hi2, xb, low4, top2);
      pair_step<3>(ia, lo4, hi2, xb, low4, top2);
      pair_step<4>(ia, lo4, hi2, xb, low4, top2);
      pair_step<5>(ia, lo4, hi2, xb, low4, top2);
      pair_step<6>(ia, lo4, hi2, xb, low4, top2);
      pair_step<7>(ia, lo4, hi2, xb, low4, top2);
      const int32_t* off = xs + (s * SUBS + i) * MT;
      for (int j = 0; j < NTL; ++j) {
        const __m128i sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rec[j] + i * NT));
        const __m512 scale = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc8)), dv[j]);  // exact
        for (int t = 0; t < MT; ++t) {
          __m512i sum = ia[j][t][0];
          for (int c = 1; c < A; ++c) sum = _mm512_add_epi32(sum, ia[j][t][c]);
          sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(off[t]));
          acc[j][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), scale, acc[j][t]);
        }
      }
    }
  }
  for (int j = 0; j < NTL; ++j) {
    const int nv = j == NTL - 1 ? nvalid : NT;
    const __mmask16 mask = nv >= NT ? __mmask16(0xFFFF) : __mmask16((1u << nv) - 1);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + j * NT) : _mm512_setzero_ps();
    for (int t = 0; t < MT; ++t)
      _mm512_mask_storeu_ps(out + t * ldo + j * NT, mask, _mm512_fmadd_ps(acc[j][t], _mm512_set1_ps(dx[t]), bv));
  }
}

// One group of MT tokens (at t) on the NTL tiles from `tile` on.
template <int MT, int NTL>
void run_group(const GemmArgs& a, int64_t tile, int64_t t, const int32_t* xi, const int32_t* xs, const float* dx) {
  const int64_t ns = a.K / Q6_SUPER;
  const int nvalid = static_cast<int>(std::min<int64_t>(NT, a.N - (tile + NTL - 1) * NT));
  const uint8_t* w = static_cast<const uint8_t*>(a.w) + tile * ns * Q6_RECORD;
  tile_q6<MT, NTL>(w, a.d + tile * ns * NT, ns, xi + t * a.K / 2, xs + t * (a.K / Q6_SUB), dx + t,
                   a.bias ? a.bias + tile * NT : nullptr, nvalid, a.out + t * a.ldo + tile * NT, a.ldo);
}

template <int NTL>
void run_group(int mt, const GemmArgs& a, int64_t tile, int64_t t, const int32_t* xi, const int32_t* xs,
               const float* dx) {
  switch (mt) {
    case 1: run_group<1, NTL>(a, tile, t, xi, xs, dx); break;
    case 2: run_group<2, NTL>(a, tile, t, xi, xs, dx); break;
    case 3: run_group<3, NTL>(a, tile, t, xi, xs, dx); break;
    case 4: run_group<4, NTL>(a, tile, t, xi, xs, dx); break;
    case 5: run_group<5, NTL>(a, tile, t, xi, xs, dx); break;
    case 6: run_group<6, NTL>(a, tile, t, xi, xs, dx); break;
    case 7: run_group<7, NTL>(a, tile, t, xi, xs, dx); break;
    default: run_group<8, NTL>(a, tile, t, xi, xs, dx); break;
  }
}

}  // namespace

// Tokens in chunks whose activations stay in L2 while every tile streams past; each thread owns a
// contiguous run of tile pairs (its weights) and helps the others when done, as `gemm` in
// qgemm_avx512.cpp.
void gemm_q6(const GemmArgs& a) {
  const int64_t tiles = num_tiles(a.N), jobs = (tiles + TILES - 1) / TILES;
  scratch.fit(a.M, a.K);
  quantize_activations(a.x, a.ldx, a.M, a.K, scratch.xq.data(), scratch.dx.data(), nullptr);
  interleave_groups(scratch.xq.data(), nullptr, a.M, a.K, MAX_MT, scratch.xi.data(), nullptr);
  if ((int64_t)offsets.size() < a.M * (a.K / Q6_SUB)) offsets.resize(a.M * (a.K / Q6_SUB));
  sub_block_offsets(scratch.xq.data(), a.M, a.K, MAX_MT, offsets.data());
  const int32_t* xi = scratch.xi.data();
  const int32_t* xs = offsets.data();
  const float* dx = scratch.dx.data();
  const int64_t chunk = std::max<int64_t>(MAX_MT, ((256 * 1024) / (a.K * 2)) / MAX_MT * MAX_MT);
  const JobRuns runs(jobs, (a.M + chunk - 1) / chunk);
#pragma omp parallel
  for (int64_t t0 = 0; t0 < a.M; t0 += chunk) {
    const int64_t t1 = std::min(a.M, t0 + chunk);
    runs.each(t0 / chunk, [&](int64_t job) {
      const int64_t tile = job * TILES, ntl = std::min<int64_t>(TILES, tiles - tile);
      for (int64_t t = t0; t < t1; t += MAX_MT) {
        const int mt = static_cast<int>(std::min<int64_t>(MAX_MT, t1 - t));
        if (ntl == TILES) run_group<TILES>(mt, a, tile, t, xi, xs, dx);
        else run_group<1>(mt, a, tile, t, xi, xs, dx);
      }
    });
  }
}

}  // namespace avx512
}  // namespace llmserve
