// q8 / q4 matmul for CPUs with AVX-512 VNNI (Zen 4, Ice Lake and later): 16 output rows live in one
// zmm register of int32 lanes.
//   int16 activations (q8, and q4 by default): q8 multiplies a pair of int16 activations
//       (broadcast to all lanes) by the 16 rows' matching pair of weights and adds both products
//       (vpdpwssd). A register tile is up to 8 tokens x 2 tiles (32 rows): each broadcast feeds
//       two instructions, each unpacked weight vector eight. q4 takes each int16 activation as
//       its two bytes and multiplies four of them by four nibbles (vpdpbusd) per half, exactly
//       the same sums with less unpacking (tile_q4).
//   int8 activations (q4, opt-in): one scale per block of 32 (GGUF's Q8_1 arithmetic, as llama.cpp
//       computes Q4 weights); each step multiplies four unsigned 4-bit weights of each row by four
//       int8 activations and adds the four products (vpdpbusd): 64 products an instruction,
//       twice vpdpwssd's, which is what several tokens at once (verification, prefill) are bound by.
// What bounds the int16 path from batch 8 up (Zen 5, measured with a hand-written loop):
// vpdpwssd issues 2 a cycle with a latency of 4 (16 independent chains reach the peak), and the
// per-block float steps' FMAs (d * sum, + m * xsum) take the same two pipes; conversions, shifts
// and masks do not. So q4 tops out near 16 / (16 + 2) of the instruction's peak.
// See qgemm.h for the layout and the math.
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c,avx2")

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "job_runs.h"
#include "qgemm.h"

namespace llmserve {
namespace avx512 {

#include "act_quant.inc"

namespace {

// Register tiles. int16 activations: up to 8 tokens x TILES tiles of 16 rows, 16 int32 chains (the
// tiles share each broadcast activation pair); 12 or 16 tokens spilled and ran no faster. q4 from
// the activations' bytes (tile_q4) has two chains a token and tile: 8 tokens x 1 tile, or 4 x TILES.
// int8 activations: up to 8 tokens x 1 tile, 8 int32 + 8 float accumulators.
constexpr int MAX_MT = 8, MAX_MT_Q4_SHARED = 4;
constexpr int MAX_MT8 = 8;
constexpr int TILES = 2;

// Per-block int8 quantization of float activations for the q4 kernel (GGUF's Q8_1):
//   xq[t, k] = round(x[t, k] / dx[t, b]),  dx[t, b] = max over block b of |x[t, k]| / 127
//   xsum[t, b] = dx[t, b] * sum over block b of xq[t, k]                         (k >= K: 0)
// The minimums' term takes the rounded activations' sum, not the exact one, so that the result is
// exactly the dequantized weights (d q + m) times the rounded activations: the rounding errors then
// meet the weights themselves, not d q, which is up to twice as large where m offsets it.
//
// Written straight in the kernel's order: per block, per group g of 8 columns, the quads
// (8g, 8g+4, 8g+1, 8g+5) and (8g+2, 8g+6, 8g+3, 8g+7), matching the bytes its masks make of the
// weights' 16-bit lanes (qgemm.h). Within a group of G tokens the quads of all tokens sit side by
// side, quad-major (as interleave_groups does for pairs), and the block scales dx and sums xsum too:
//   xi: [quad j][token] at xi + t0 * quads + j * g + t;  xd, xs: [block b][token] at t0 * nb + b * g + t
// Called inside the matmul's parallel region: its threads share the blocks (an orphaned `omp for`,
// whose barrier ends it).
void quantize_quads_i8(const float* x, int64_t ldx, int64_t M, int64_t K, int64_t G, int32_t* xi, float* xd,
                       float* xs) {
  const int64_t nb = num_blocks(K), quads = nb * KB / 4;
  const __m256i order = _mm256_setr_epi8(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15,  //
                                         0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15);
#pragma omp for schedule(static)
  for (int64_t i = 0; i < nb * M; ++i) {  // block-major: a thread's blocks are its own stretch of xi
    const int64_t b = i / M, t = i % M;
    const int64_t t0 = t / G * G, g = std::min(G, M - t0), u = t - t0;
    const float* xt = x + t * ldx;
    int32_t* dst = xi + t0 * quads + u;
    const int64_t n = std::min<int64_t>(KB, K - b * KB);  // columns past K count as 0
    const __mmask16 m0 = n >= 16 ? 0xFFFF : (1u << n) - 1, m1 = n >= 32 ? 0xFFFF : n > 16 ? (1u << (n - 16)) - 1 : 0;
    const __m512 v0 = _mm512_maskz_loadu_ps(m0, xt + b * KB), v1 = _mm512_maskz_loadu_ps(m1, xt + b * KB + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const float inv = amax > 0.f ? 127.f / amax : 0.f, scale = amax / 127.f;
    // round to nearest even (the default rounding mode), as std::nearbyint
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(inv)));
    const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(inv)));
    const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    const __m256i bytes = _mm256_set_m128i(_mm512_cvtepi32_epi8(q1), _mm512_cvtepi32_epi8(q0));
    alignas(32) int32_t quad[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(quad), _mm256_shuffle_epi8(bytes, order));
    for (int j = 0; j < 8; ++j) dst[(b * 8 + j) * g] = quad[j];
    xd[t0 * nb + b * g + u] = scale;
    xs[t0 * nb + b * g + u] = scale * static_cast<float>(sum);
  }
}

struct ActScratch8 {
  std::vector<int32_t> xi;
  std::vector<float> xd, xs;
  void fit(int64_t M, int64_t K) {
    const int64_t nb = num_blocks(K);
    if ((int64_t)xi.size() < M * nb * KB / 4) xi.resize(M * nb * KB / 4);
    if ((int64_t)xd.size() < M * nb) xd.resize(M * nb), xs.resize(M * nb);
  }
};
thread_local ActScratch8 scratch8;

// tile_q4's activations: each int16 xq's low byte (unsigned) and high byte (signed), in the
// quads the nibble masks make of the weights (columns 8g + {0, 4, 1, 5} and 8g + {2, 6, 3, 7},
// as quantize_quads_i8 orders them), a group of up to G tokens side by side (interleave_groups'
// grouping): xb for tokens t0 .. t0 + g - 1, block b, half h (0: low bytes), quad j, token t at
//   xb + t0 * nb * 16 + ((b * 2 + h) * 8 + j) * g + t
void split_bytes(const int16_t* xq, int64_t M, int64_t K, int64_t G, int32_t* xb) {
  const int64_t nb = num_blocks(K), Kp = nb * KB;
  const __m256i order = _mm256_setr_epi8(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15,  //
                                         0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15);
  for (int64_t t0 = 0; t0 < M; t0 += G) {
    const int64_t g = std::min(G, M - t0);
    for (int64_t u = 0; u < g; ++u) {
      const int16_t* src = xq + (t0 + u) * Kp;
      int32_t* dst = xb + t0 * nb * 16 + u;
      for (int64_t b = 0; b < nb; ++b) {
        const __m512i v = _mm512_loadu_si512(src + b * KB);
        const __m256i lo = _mm256_shuffle_epi8(_mm512_cvtepi16_epi8(v), order);  // vpmovwb keeps the low byte
        const __m256i hi = _mm256_shuffle_epi8(_mm512_cvtepi16_epi8(_mm512_srai_epi16(v, 8)), order);
        if (g == 1) {
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + b * 16), lo);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + b * 16 + 8), hi);
        } else {
          alignas(32) int32_t q[16];
          _mm256_store_si256(reinterpret_cast<__m256i*>(q), lo);
          _mm256_store_si256(reinterpret_cast<__m256i*>(q + 8), hi);
          for (int j = 0; j < 16; ++j) dst[(b * 16 + j) * g] = q[j];
        }
      }
    }
  }
}

inline __m512 half16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Independent int32 accumulator chains per token and tile: vpdpwssd has a latency of several
// cycles, so a register tile needs several chains in flight; four tokens already give four. (One
// token on one tile, the one-stream matvec: 8 chains, 4 for two; against 4 and 2, alternating
// builds in one process, q4 at batch 1 and 2 took 0.95-0.98x the time, q8 and q4k the same. The
// int32 sums are exact: the same bits.)
template <int MT, int NTL = 1>
constexpr int chains() {
  return MT * NTL >= 4 ? 1 : (MT * NTL >= 2 ? 4 : 8);
}

// The float accumulators of a register tile (MT tokens x NTL tiles of 16 rows): zmm registers up
// to 8; beyond, the int32 chains take half the register file, so they live in an L1 array, read
// and written once a block. The float operations and their order are the same either way, and so
// are the bits: a token's row never depends on the register tile it was computed in.
template <int NA>
struct FloatAcc {
  static constexpr bool kInRegs = NA <= 8;
  __m512 reg[kInRegs ? NA : 1];
  alignas(64) float mem[kInRegs ? 1 : NA * NT];
  FloatAcc() {
    for (int i = 0; i < NA; ++i) set(i, _mm512_setzero_ps());
  }
  __m512 get(int i) const {
    if constexpr (kInRegs) return reg[i];
    else return _mm512_load_ps(mem + i * NT);
  }
  void set(int i, __m512 v) {
    if constexpr (kInRegs) reg[i] = v;
    else _mm512_store_ps(mem + i * NT, v);
  }
};

// Tile j's part of a register tile (accumulators j * MT ..): the last tile may have fewer than
// 16 valid rows (nvalid), the others are whole.
template <int MT, int NTL>
inline void store_tiles(const FloatAcc<MT * NTL>& acc, const float* dx, const float* bias, int nvalid, float* out,
                        int64_t ldo) {
  for (int j = 0; j < NTL; ++j) {
    const int nv = j == NTL - 1 ? nvalid : NT;
    const __mmask16 mask = nv >= NT ? __mmask16(0xFFFF) : __mmask16((1u << nv) - 1);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + j * NT) : _mm512_setzero_ps();
    for (int t = 0; t < MT; ++t)
      _mm512_mask_storeu_ps(out + t * ldo + j * NT, mask,
                            _mm512_fmadd_ps(acc.get(j * MT + t), _mm512_set1_ps(dx[t]), bv));
  }
}

// Where a tile's per-block scales d and minimums m come from (`load(b, j, sc, mn)`: block b of
// tile j of a register tile):
//   BlockScales: half d and m per block (q8, q4), tile j's `stride` halves after tile 0's; m ==
//       nullptr: none (q8), or for symmetric 4-bit blocks (SYM) -8 d from the scales already
//       converted: exact in float32, the value the half -8 d converts to.
//   KScales: q4k's d, dmin per super-block and 6-bit sc, mn per block (qgemm.h): half(d sc) and
//       -half(dmin mn), rounded to nearest even as the loader rounds q4's (and negated: exact).
template <bool SYM>
struct BlockScales {
  const uint16_t* d;
  const uint16_t* m;
  int64_t stride;
  bool with_m() const { return SYM || m; }
  [[gnu::always_inline]] void load(int64_t b, int j, __m512& sc, __m512& mn) const {
    sc = half16(d + b * NT + j * stride);
    if constexpr (SYM) mn = _mm512_mul_ps(sc, _mm512_set1_ps(-8.f));
    else mn = m ? half16(m + b * NT + j * stride) : _mm512_setzero_ps();
  }
};

inline __m512 round_to_half(__m512 v) {
  return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

inline __m512 bytes16(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

struct KScales {
  const uint16_t* d;  // tile 0's [super-blocks][d, dmin][16 rows]; tile j's d_stride halves further
  const uint8_t* sub;  // tile 0's [super-blocks][sc, mn][8 blocks][16 rows]; tile j's sub_stride further
  int64_t d_stride, sub_stride;
  bool with_m() const { return true; }
  [[gnu::always_inline]] void load(int64_t b, int j, __m512& sc, __m512& mn) const {
    const uint16_t* dd = d + j * d_stride + (b / 8) * 2 * NT;
    const uint8_t* u = sub + j * sub_stride + (b / 8) * 16 * NT + (b % 8) * NT;
    sc = round_to_half(_mm512_mul_ps(half16(dd), bytes16(u)));
    mn = _mm512_xor_ps(round_to_half(_mm512_mul_ps(half16(dd + NT), bytes16(u + 8 * NT))), _mm512_set1_ps(-0.f));
  }
};

// q4k's scales as KScales makes them, made once per tile pair into `s` ([tile j][block b][sc, mn]
// [16 rows] floats, tile j's `stride` floats after tile 0's) and read by every group of tokens:
// each group would otherwise redo that float arithmetic per block (expand_scales).
struct FloatScales {
  const float* s;
  int64_t stride;
  bool with_m() const { return true; }
  [[gnu::always_inline]] void load(int64_t b, int j, __m512& sc, __m512& mn) const {
    const float* p = s + j * stride + b * 2 * NT;
    sc = _mm512_loadu_ps(p);
    mn = _mm512_loadu_ps(p + NT);
  }
};

// Per block and tile j: the int32 dot products (in chains) become float and are scaled by the
// rows' d (and the minimums' term m * xsum added, for weights that have minimums), d and m of
// block b from `scales`.
template <int MT, int NTL, int A, class S>
inline void finish_block(__m512i (&ia)[NTL][MT][A], const S& scales, int64_t b, const float* xs,
                         FloatAcc<MT * NTL>& acc) {
  for (int j = 0; j < NTL; ++j) {
    __m512 sc, mn;
    scales.load(b, j, sc, mn);
    const bool with_m = scales.with_m();
    for (int t = 0; t < MT; ++t) {
      __m512i s = ia[j][t][0];
      for (int c = 1; c < A; ++c) s = _mm512_add_epi32(s, ia[j][t][c]);
      __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), sc, acc.get(j * MT + t));
      if (with_m) v = _mm512_fmadd_ps(mn, _mm512_set1_ps(xs[t]), v);
      acc.set(j * MT + t, v);
    }
  }
}

// Asks for a tile's weights `BLOCKS` blocks ahead of the one being read (BYTES a block): a
// model's weights stream from memory once a step, and the hardware prefetcher alone left part of
// that wait exposed (a 1B step on one thread: batch 1 0.83x, batch 16 0.92x the time with it;
// docs/benchmarks.md). Past a tile's end it reads the next tile's first blocks: with one weight
// stream (ONE_STREAM_TOKENS) the tile read next, with two tiles sharing the pair's second tile
// (already streaming) or the next pair's first. The distances, judged with alternating builds
// on one thread, batch 1, after one stream came in (8 layers of a 1B's matrices, medians of 9-11
// passes): q4 8 blocks (2 KB) 7.86 ms, 16 7.05, 32 6.72, 64 6.69; q8 8 blocks (4 KB) 6.04 ms,
// 16 6.22, 32 6.37. (Before one stream, two tiles' streams: q4 0 blocks 13.65 ms, 4 10.9, 8 10.3,
// 16 10.4.)
constexpr int Q8_PREFETCH_BLOCKS = 8, Q4_PREFETCH_BLOCKS = 32;
template <int BYTES, int BLOCKS>
inline void prefetch_ahead(const void* block) {
  const char* p = static_cast<const char*>(block) + BLOCKS * BYTES;
  for (int i = 0; i < BYTES; i += 64) _mm_prefetch(p + i, _MM_HINT_T0);
}

// NTL consecutive tiles (16 rows each) for a group of MT tokens:
//   out[t, n] = dx[t] * sum_b (d[n, b] <q[n, b], xq[t, b]> (+ m[n, b] xsum[t, b])) + bias[n]
// xi, xs: the group's interleaved pairs and block sums (act_quant.inc); w, d, m, bias, out: tile
// 0's, the next tiles' follow at their strides. Several tiles share each broadcast activation
// pair: a broadcast is a load, and one a vpdpwssd would cap the multiply-adds at the load ports'
// rate (about half of what Zen 5's multipliers do).
template <int MT, int NTL = 1>
void tile_q8(const int8_t* w, const uint16_t* d, const uint16_t* m, int64_t nb, const int32_t* xi,
             const float* xs, const float* dx, const float* bias, int nvalid, float* out, int64_t ldo) {
  constexpr int A = chains<MT, NTL>();
  FloatAcc<MT * NTL> acc;
  for (int64_t b = 0; b < nb; ++b) {
    __m512i ia[NTL][MT][A];
    for (int j = 0; j < NTL; ++j)
      for (int t = 0; t < MT; ++t)
        for (int c = 0; c < A; ++c) ia[j][t][c] = _mm512_setzero_si512();
    const int8_t* wb = w + b * (KB * NT);
    for (int j = 0; j < NTL; ++j) prefetch_ahead<KB * NT, Q8_PREFETCH_BLOCKS>(wb + j * nb * (KB * NT));
    const int32_t* xb = xi + b * (KB / 2) * MT;
#pragma GCC unroll 16
    for (int p = 0; p < KB / 2; ++p) {
      __m512i wv[NTL];
      for (int j = 0; j < NTL; ++j)
        wv[j] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + j * nb * (KB * NT) + p * 32)));
      for (int t = 0; t < MT; ++t) {
        const __m512i x = _mm512_set1_epi32(xb[p * MT + t]);
        for (int j = 0; j < NTL; ++j) ia[j][t][p % A] = _mm512_dpwssd_epi32(ia[j][t][p % A], x, wv[j]);
      }
    }
    finish_block<MT, NTL, A>(ia, BlockScales<false>{d, m, nb * NT}, b, xs ? xs + b * MT : nullptr, acc);
  }
  store_tiles<MT, NTL>(acc, dx, bias, nvalid, out, ldo);
}

// The same for 4-bit weights, whose minimums' term is always there (scales S: BlockScales, q4;
// BlockScales<true>, symmetric q4; KScales or FloatScales, q4k), from the bytes of the int16
// activations: xq = 256 hi + lo (lo unsigned, hi signed), and per block
//   sum_k q xq = sum_k q lo + 256 sum_k q hi,
// each half by vpdpbusd (lo unsigned against the nibbles as signed bytes; the nibbles unsigned
// against hi signed): exact int32 sums, vpdpwssd's on the int16 values, so the same bits. A
// 64-byte load of nibbles becomes two vectors of bytes in three instructions (mask; shift, mask)
// where int16 lanes took six for their four vectors, and the multiply-adds stay 16 a block and
// token. Against the int16 lanes (the same bits; bench_kernel_ab.py, two threads, a 1B layer's
// q4 and q4k matrices from the L3, Zen 5): time 0.87-0.97x from 1 to 128 tokens (q4k at 64: 1.00x);
// at batch 1 from memory, 1.01x (the bytes bound it, not the instructions).
// xb: the group's bytes as split_bytes lays them out, per block [half h][quad j][token].
template <int MT, class S, int NTL = 1>
void tile_q4(const uint8_t* w, const S& scales, int64_t nb, const int32_t* xb, const float* xs, const float* dx,
             const float* bias, int nvalid, float* out, int64_t ldo) {
  constexpr int A = MT * NTL >= 4 ? 1 : (MT * NTL >= 2 ? 2 : 4);  // chains per half
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  FloatAcc<MT * NTL> acc;
  for (int64_t b = 0; b < nb; ++b) {
    __m512i il[NTL][MT][A], ih[NTL][MT][A];
    for (int j = 0; j < NTL; ++j)
      for (int t = 0; t < MT; ++t)
        for (int c = 0; c < A; ++c) il[j][t][c] = ih[j][t][c] = _mm512_setzero_si512();
    const uint8_t* wb = w + b * (KB * NT / 2);
    for (int j = 0; j < NTL; ++j) prefetch_ahead<KB * NT / 2, Q4_PREFETCH_BLOCKS>(wb + j * nb * (KB * NT / 2));
    const int32_t* xl = xb + b * 16 * MT;
    const int32_t* xh = xl + 8 * MT;
#pragma GCC unroll 4
    for (int g = 0; g < KB / 8; ++g) {
      // 64 bytes = 16 rows x 4 bytes; the low nibbles of a row's 4 bytes are columns 8g + {0, 4,
      // 1, 5}, the high ones 8g + {2, 6, 3, 7} (qgemm.h's lanes read as bytes): quads 2g, 2g + 1
      __m512i nib[NTL][2];
      for (int j = 0; j < NTL; ++j) {
        const __m512i v = _mm512_loadu_si512(wb + j * nb * (KB * NT / 2) + g * 64);
        nib[j][0] = _mm512_and_si512(v, low4);
        nib[j][1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      }
      for (int h = 0; h < 2; ++h) {
        const int q = 2 * g + h, c = q % A;
        for (int t = 0; t < MT; ++t) {
          const __m512i lo = _mm512_set1_epi32(xl[q * MT + t]), hi = _mm512_set1_epi32(xh[q * MT + t]);
          for (int j = 0; j < NTL; ++j) {
            il[j][t][c] = _mm512_dpbusd_epi32(il[j][t][c], lo, nib[j][h]);
            ih[j][t][c] = _mm512_dpbusd_epi32(ih[j][t][c], nib[j][h], hi);
          }
        }
      }
    }
    __m512i ia[NTL][MT][1];
    for (int j = 0; j < NTL; ++j)
      for (int t = 0; t < MT; ++t) {
        __m512i lo = il[j][t][0], hi = ih[j][t][0];
        for (int c = 1; c < A; ++c) lo = _mm512_add_epi32(lo, il[j][t][c]), hi = _mm512_add_epi32(hi, ih[j][t][c]);
        ia[j][t][0] = _mm512_add_epi32(lo, _mm512_slli_epi32(hi, 8));
      }
    finish_block<MT, NTL, 1>(ia, scales, b, xs + b * MT, acc);
  }
  store_tiles<MT, NTL>(acc, dx, bias, nvalid, out, ldo);
}

// The same for 4-bit weights against int8 activations with a scale per block (quantize_quads_i8
// above): per block, two masks give each 32-bit lane's four low and four high
// nibbles as unsigned bytes, the columns 8g + {0, 4, 1, 5} and 8g + {2, 6, 3, 7}, which the
// activations' quads are interleaved to match.
//   out[t, n] = sum_b (d[n, b] dx[t, b] <q[n, b], xq[t, b]> + m[n, b] xsum[t, b]) + bias[n]
// (d, m of block b from the scales S, as tile_q4's.)
template <int MT, class S>
void tile_q4_i8(const uint8_t* w, const S& scales, int64_t nb, const int32_t* xi, const float* xd,
                const float* xs, const float* bias, int nvalid, float* out, int64_t ldo) {
  constexpr int A = chains<MT>();
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512 acc[MT];
  for (int t = 0; t < MT; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512i ia[MT][A];
    for (int t = 0; t < MT; ++t)
      for (int c = 0; c < A; ++c) ia[t][c] = _mm512_setzero_si512();
    const uint8_t* wb = w + b * (KB * NT / 2);
    const int32_t* xb = xi + b * (KB / 4) * MT;
#pragma GCC unroll 4
    for (int g = 0; g < KB / 8; ++g) {
      const __m512i v = _mm512_loadu_si512(wb + g * 64);
      const __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      for (int t = 0; t < MT; ++t)
        ia[t][(2 * g) % A] = _mm512_dpbusd_epi32(ia[t][(2 * g) % A], lo, _mm512_set1_epi32(xb[2 * g * MT + t]));
      for (int t = 0; t < MT; ++t)
        ia[t][(2 * g + 1) % A] =
            _mm512_dpbusd_epi32(ia[t][(2 * g + 1) % A], hi, _mm512_set1_epi32(xb[(2 * g + 1) * MT + t]));
    }
    __m512 sc, mn;
    scales.load(b, 0, sc, mn);
    for (int t = 0; t < MT; ++t) {
      __m512i s = ia[t][0];
      for (int c = 1; c < A; ++c) s = _mm512_add_epi32(s, ia[t][c]);
      const __m512 scale = _mm512_mul_ps(sc, _mm512_set1_ps(xd[b * MT + t]));
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), scale, acc[t]);
      acc[t] = _mm512_fmadd_ps(mn, _mm512_set1_ps(xs[b * MT + t]), acc[t]);
    }
  }
  const __mmask16 mask = nvalid >= NT ? __mmask16(0xFFFF) : __mmask16((1u << nvalid) - 1);
  const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias) : _mm512_setzero_ps();
  for (int t = 0; t < MT; ++t) _mm512_mask_storeu_ps(out + t * ldo, mask, _mm512_add_ps(acc[t], bv));
}

// A 4-bit matrix's scales from `tile` on (tile j's at their stride): F is kQ4 or kQ4K; `fn` is
// called with the scales' object (BlockScales<SYM> or KScales).
template <int F, class Fn>
inline void with_scales(const GemmArgs& a, int64_t tile, Fn&& fn) {
  const int64_t nb = num_blocks(a.K);
  if constexpr (F == kQ4K) {
    const int64_t nsb = a.K / KSB;
    fn(KScales{a.d + tile * nsb * 2 * NT, static_cast<const uint8_t*>(static_cast<const void*>(a.m)) + tile * nsb * 16 * NT,
               nsb * 2 * NT, nsb * 16 * NT});
  } else if (a.m) {
    fn(BlockScales<false>{a.d + tile * nb * NT, a.m + tile * nb * NT, nb * NT});
  } else {  // symmetric blocks
    fn(BlockScales<true>{a.d + tile * nb * NT, nullptr, nb * NT});
  }
}

// q4 / q4k against int8 activations: tokens [t0, t1) of one tile, a group of up to MAX_MT8 at a time.
template <int F>
void tile_tokens_q4_i8(const GemmArgs& a, int64_t tile, int64_t t0, int64_t t1, const int32_t* xi,
                       const float* xd, const float* xs) {
  const int64_t nb = num_blocks(a.K), quads = nb * KB / 4;
  const int nvalid = static_cast<int>(std::min<int64_t>(NT, a.N - tile * NT));
  const uint8_t* w = static_cast<const uint8_t*>(a.w) + tile * nb * (KB * NT / 2);
  const float* bias = a.bias ? a.bias + tile * NT : nullptr;
  for (int64_t t = t0; t < t1; t += MAX_MT8) {
    const int mt = static_cast<int>(std::min<int64_t>(MAX_MT8, t1 - t));
    const int32_t* x = xi + t * quads;
    float* out = a.out + t * a.ldo + tile * NT;
    with_scales<F>(a, tile, [&](const auto& sc) {
      switch (mt) {
#define LLMSERVE_Q4(MT) \
  case MT: tile_q4_i8<MT>(w, sc, nb, x, xd + t * nb, xs + t * nb, bias, nvalid, out, a.ldo); break;
        LLMSERVE_Q4(1) LLMSERVE_Q4(2) LLMSERVE_Q4(3) LLMSERVE_Q4(4)
        LLMSERVE_Q4(5) LLMSERVE_Q4(6) LLMSERVE_Q4(7) LLMSERVE_Q4(8)
#undef LLMSERVE_Q4
      }
    });
  }
}

// One group of MT tokens (at t) on the NTL tiles from `tile` on; F: kQ8, kQ4 or kQ4K. `expanded`:
// q4k's scales as floats (FloatScales, from expand_scales), or nullptr (made per block).
template <int F, int MT, int NTL>
void run_group(const GemmArgs& a, int64_t tile, int64_t t, const int32_t* xi, const float* xs, const float* dx,
               const float* expanded) {
  const int64_t nb = num_blocks(a.K);
  const int nvalid = static_cast<int>(std::min<int64_t>(NT, a.N - (tile + NTL - 1) * NT));  // the last tile's
  const uint16_t* d = a.d + tile * nb * NT;
  const uint16_t* m = a.m ? a.m + tile * nb * NT : nullptr;
  const float* bias = a.bias ? a.bias + tile * NT : nullptr;
  const int32_t* x = xi + t * nb * KB / 2;
  const float* s = xs ? xs + t * nb : nullptr;
  float* out = a.out + t * a.ldo + tile * NT;
  if constexpr (F != kQ8) {
    const uint8_t* w = static_cast<const uint8_t*>(a.w) + tile * nb * (KB * NT / 2);
    const auto run = [&](const auto& sc) {
      tile_q4<MT, std::decay_t<decltype(sc)>, NTL>(w, sc, nb, x, s, dx + t, bias, nvalid, out, a.ldo);
    };
    if constexpr (F == kQ4K) {
      if (expanded) return run(FloatScales{expanded, nb * 2 * NT});
    }
    with_scales<F>(a, tile, run);
  } else {
    const int8_t* w = static_cast<const int8_t*>(a.w) + tile * nb * (KB * NT);
    tile_q8<MT, NTL>(w, d, m, nb, x, s, dx + t, bias, nvalid, out, a.ldo);
  }
}

template <int F, int NTL>
void run_group(int mt, const GemmArgs& a, int64_t tile, int64_t t, const int32_t* xi, const float* xs,
               const float* dx, const float* expanded) {
  constexpr int top = F != kQ8 && NTL > 1 ? MAX_MT_Q4_SHARED : MAX_MT;  // 4-bit shared groups: gemm's G
  switch (mt) {
#define LLMSERVE_GROUP(MT) case MT: if constexpr (MT <= top) run_group<F, MT, NTL>(a, tile, t, xi, xs, dx, expanded); break;
    LLMSERVE_GROUP(1) LLMSERVE_GROUP(2) LLMSERVE_GROUP(3) LLMSERVE_GROUP(4)
    LLMSERVE_GROUP(5) LLMSERVE_GROUP(6) LLMSERVE_GROUP(7) LLMSERVE_GROUP(8)
#undef LLMSERVE_GROUP
  }
}

// Tokens [t0, t1) (on group boundaries) of the TILES tiles from `tile` on (fewer at N's end), a
// group of up to MAX_MT tokens at a time.
// q4k's per-block scales of the ntl tiles from `tile` on, made by KScales (the same float
// operations, so the same values) into this thread's `expanded_scales` (FloatScales' layout).
thread_local std::vector<float> expanded_scales;

const float* expand_scales(const GemmArgs& a, int64_t tile, int64_t ntl) {
  const int64_t nb = num_blocks(a.K), stride = nb * 2 * NT;
  if ((int64_t)expanded_scales.size() < ntl * stride) expanded_scales.resize(ntl * stride);
  float* dst = expanded_scales.data();
  with_scales<kQ4K>(a, tile, [&](const auto& scales) {
    for (int j = 0; j < ntl; ++j)
      for (int64_t b = 0; b < nb; ++b) {
        __m512 sc, mn;
        scales.load(b, j, sc, mn);
        _mm512_storeu_ps(dst + j * stride + b * 2 * NT, sc);
        _mm512_storeu_ps(dst + j * stride + b * 2 * NT + NT, mn);
      }
  });
  return dst;
}

// Up to this many tokens in the matmul (q8: ONE_STREAM_TOKENS_Q8), each tile of a job runs alone
// (one weight stream), else the job's TILES tiles share each broadcast. One stream is what the
// memory system streams best: with two tiles' streams (each a tile's 16 KB at K = 2048, then a
// jump) one thread read q4 weights at 28 GB/s where torch.sum reads 39 (two threads: 37 against
// 48). Alternating builds in one process, 8 layers of a 1B's matrices, two threads, medians of
// 7-11 passes, time of one stream / two tiles: q4 at 1, 2, 4, 8, 16, 24, 32, 64, 128 tokens 0.80,
// 0.83, 0.87, 0.93, 0.98, 0.99, 0.99, 1.03, 1.03 (compute-bound from 64: the shared broadcasts
// win), q4k at 1 and 16 0.83 and 0.97; q8 (twice the bytes a multiply-add, less work a byte) at
// 4, 8, 16 0.86, 0.95, 1.01.
constexpr int64_t ONE_STREAM_TOKENS = 32, ONE_STREAM_TOKENS_Q8 = 8;

template <int F>
void tile_tokens(const GemmArgs& a, int64_t tile, int64_t t0, int64_t t1, const int32_t* xi, const float* xs,
                 const float* dx, int64_t G) {
  const int64_t ntl = std::min<int64_t>(TILES, num_tiles(a.N) - tile);
  const bool shared = ntl == TILES && a.M > (F == kQ8 ? ONE_STREAM_TOKENS_Q8 : ONE_STREAM_TOKENS);
  // q4k with three groups of tokens or more: its scales made once for all of them (bench_q4k.py,
  // alternating builds: q4k / q4 time at 128 tokens 1.065 -> 1.001, medians of 4; at 16 tokens, two
  // groups, the extra pass cost what it saved: 1.074 -> 1.080), else per block in the loop
  const float* expanded = F == kQ4K && t1 - t0 > 2 * MAX_MT ? expand_scales(a, tile, ntl) : nullptr;
  const int64_t stride = num_blocks(a.K) * 2 * NT;
  for (int64_t t = t0; t < t1; t += G) {
    const int mt = static_cast<int>(std::min<int64_t>(G, t1 - t));
    if (shared) run_group<F, TILES>(mt, a, tile, t, xi, xs, dx, expanded);
    else
      for (int64_t j = 0; j < ntl; ++j)
        run_group<F, 1>(mt, a, tile + j, t, xi, xs, dx, expanded ? expanded + j * stride : nullptr);
  }
}

// Tokens are taken in chunks so that one chunk's quantized activations stay in the core's L2
// while every tile streams past them; each thread owns a contiguous run of tiles (its weights), and
// helps the others with theirs when done (JobRuns).
template <int F>
void gemm(const GemmArgs& a) {
  const int64_t nb = num_blocks(a.K), jobs = (num_tiles(a.N) + TILES - 1) / TILES;
  scratch.fit(a.M, a.K);
  float* xsum = (F != kQ8 || a.m) ? scratch.xsum.data() : nullptr;  // block sums carry the minimums' term
  quantize_activations(a.x, a.ldx, a.M, a.K, scratch.xq.data(), scratch.dx.data(), xsum);
  // 4-bit tiles take the activations' bytes (tile_q4), two tiles' worth of them (shared) in
  // groups of MAX_MT_Q4_SHARED tokens
  const bool bytes = F != kQ8;
  const int64_t G = bytes && a.M > ONE_STREAM_TOKENS ? MAX_MT_Q4_SHARED : MAX_MT;
  interleave_groups(scratch.xq.data(), xsum, a.M, a.K, G, bytes ? nullptr : scratch.xi.data(),
                    xsum ? scratch.xs.data() : nullptr);
  if (bytes) split_bytes(scratch.xq.data(), a.M, a.K, G, scratch.xi.data());
  const int32_t* xi = scratch.xi.data();
  const float* xs = xsum ? scratch.xs.data() : nullptr;
  const float* dx = scratch.dx.data();
  const int64_t chunk = std::max<int64_t>(MAX_MT, ((256 * 1024) / (nb * KB * 2)) / MAX_MT * MAX_MT);
  const JobRuns runs(jobs, (a.M + chunk - 1) / chunk);  // no barrier between chunks: their outputs are apart
#pragma omp parallel
  for (int64_t t0 = 0; t0 < a.M; t0 += chunk) {
    const int64_t t1 = std::min(a.M, t0 + chunk);
    runs.each(t0 / chunk, [&](int64_t job) { tile_tokens<F>(a, job * TILES, t0, t1, xi, xs, dx, G); });
  }
}

// q4 / q4k against int8 activations, chunked over tokens and split over tiles as `gemm` is.
template <int F>
void gemm_q4_i8(const GemmArgs& a) {
  const int64_t nb = num_blocks(a.K), tiles = num_tiles(a.N);
  scratch8.fit(a.M, a.K);
  int32_t* xi = scratch8.xi.data();
  float *xd = scratch8.xd.data(), *xs = scratch8.xs.data();
  const int64_t chunk = std::max<int64_t>(MAX_MT8, ((256 * 1024) / (nb * KB)) / MAX_MT8 * MAX_MT8);
  const JobRuns runs(tiles, (a.M + chunk - 1) / chunk);
#pragma omp parallel
  {
    quantize_quads_i8(a.x, a.ldx, a.M, a.K, MAX_MT8, xi, xd, xs);
    for (int64_t t0 = 0; t0 < a.M; t0 += chunk) {
      const int64_t t1 = std::min(a.M, t0 + chunk);
      runs.each(t0 / chunk, [&](int64_t tile) { tile_tokens_q4_i8<F>(a, tile, t0, t1, xi, xd, xs); });
    }
  }
}

}  // namespace

void gemm_q8(const GemmArgs& a) { gemm<kQ8>(a); }
void gemm_q4(const GemmArgs& a) { a.act_bits == 8 ? gemm_q4_i8<kQ4>(a) : gemm<kQ4>(a); }
void gemm_q4k(const GemmArgs& a) { a.act_bits == 8 ? gemm_q4_i8<kQ4K>(a) : gemm<kQ4K>(a); }

}  // namespace avx512
}  // namespace llmserve
