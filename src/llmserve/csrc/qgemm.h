// Block-quantized matrix multiplication on the CPU: declarations shared by the ISA-specific
// translation units (qgemm_avx512.cpp, qgemm_avx2.cpp) and the Python module (module.cpp).
//
// Weights are stored in tiles of 16 output rows ("NT") and blocks of 32 input columns ("KB"):
//
//   q8:  int8 values,   w[n, k] = d[n, b] * q[n, k] (+ m[n, b])          (GGUF Q8_0's math; the
//                                   optional minimum holds 4-bit data exactly at 8 bits)
//   q4:  4-bit values,  w[n, k] = d[n, b] * q[n, k] + m[n, b],  q in 0..15 (GGUF Q4_0/Q4_1/Q4_K)
//        with b = k / 32 and d, m stored as IEEE half floats. Symmetric blocks (GGUF Q4_0) store
//        no m (m == nullptr): the kernels take m = -8 d, computed in float32 from the half d,
//        which is exactly the value a stored half -8 d converts to, so the results are the same
//        bits, from 18 bytes a block instead of 20. The choice is made per call (a template
//        parameter of the tile), never inside a block's loop.
//
// Memory layout of one tile (16 rows) and one block (32 columns), tiles outermost, then blocks:
//
//   q8 data  [16 pairs p][16 rows r][2]   512 bytes: byte (p, r, j) = q[r, 2p + j]
//   q4 data  [4 groups g][16 rows r][2]   256 bytes of 16-bit lanes: lane (g, r, j) holds
//                                         q[r, 8g + 2s + j] in bits 4s..4s+3, s = 0..3
//   d, m     [16 rows] half floats per block
//
// so that one load gives, for all 16 rows, the pairs of columns that VNNI multiply-adds (int16
// pairs -> int32) consume: q8 one pair per 32 bytes (sign-extended to int16), q4 four pairs per 64
// bytes (each nibble masked or shifted into an int16 lane; AVX-512's q4 tiles read the same 64 bytes
// as two vectors of unsigned bytes, low and high nibbles, for vpdpbusd against the int16
// activations' two bytes: the same int32 sums). The tile advances through K in lock step.
//
// Activations are quantized per token (row of x) to int16 with one scale, dx = max|x| / 32767:
// 16 bits keep the activations' outlier channels and small channels alike, so the result differs
// from a float matmul on the dequantized weights by little more than float rounding. For q4 the
// per-block sums of the int16 activations carry the `m` term:
//
//   y[t, n] = dx[t] * sum_b ( d[n,b] * sum_{k in b} q[n,k] xq[t,k]  +  m[n,b] * sum_{k in b} xq[t,k] )
//
// On AVX-512 VNNI, q4 can instead take int8 activations with a scale per block of 32 (act_bits = 8;
// ModelConfig.cpu_activations "int8", opt-in; "auto", the default, keeps int16): GGUF's Q8_1
// arithmetic, as llama.cpp computes 4-bit weights. vpdpbusd then does 64 products an instruction,
// twice vpdpwssd's, so several tokens at once (prefill, batches, speculative verification) run
// ~1.5x faster; the next-token distributions stay as close to the float model's as llama.cpp's.
#pragma once

#include <cstdint>

namespace llmserve {

constexpr int NT = 16;  // output rows per tile
constexpr int KB = 32;  // input columns per block

// q4k: q4's values and nibble tiles, with GGUF Q4_K's own scales instead of q4's half d, m per block:
// per tile and super-block of 256 columns (s = k / 256), in GemmArgs::d the rows' half d then half
// dmin ([2][16 rows]), and in GemmArgs::m (bytes) each block's 6-bit multipliers sc then mn
// ([2][8 blocks][16 rows]); 18.5 bytes a block instead of 20. The kernels take
//   d[n, b] = half(d[n, s] * sc[n, b]),  m[n, b] = half(-dmin[n, s] * mn[n, b])
// (the float32 product of a half and a 6-bit integer is exact; one rounding to nearest even), the
// values the loader gives q4 (formats.k_scales), so q4k's results are q4's bits. K % 256 == 0.
constexpr int KSB = 256;  // input columns per q4k super-block
constexpr int kQ8 = 8, kQ4 = 4, kQ6 = 6, kQ4K = 46;  // format codes ("bits" in module.cpp's API)

struct GemmArgs {
  const float* x;      // [M, ldx] activations, float32
  int64_t ldx;
  int64_t M, K, N;     // x is [M, K]; the weight is logically [N, K]
  const void* w;       // packed data (int8 for q8, nibbles for q4)
  const uint16_t* d;   // [tiles, blocks, 16] half scales
  const uint16_t* m;   // [tiles, blocks, 16] half minimums, or nullptr: q8 without, q4 symmetric (-8 d)
  const float* bias;   // [N] or nullptr
  float* out;          // [M, ldo] float32
  int64_t ldo;
  int act_bits = 16;   // 8: q4 takes int8 activations per block of 32 (AVX-512 VNNI only, else 16)
};

inline int64_t num_blocks(int64_t K) { return (K + KB - 1) / KB; }
inline int64_t num_tiles(int64_t N) { return (N + NT - 1) / NT; }

// q6: GGUF Q6_K's super-blocks as they are (qgemm_q6_avx512.cpp, formats_q6.py): w = d sc (q - 32),
// q 6-bit, sc int8 per 16 columns, d half per 256. GemmArgs::w holds a record of Q6_RECORD bytes per
// tile and super-block (the 256 scales, then 16 sub-blocks of nibbles and bit pairs), d the halves
// [tiles, super-blocks, 16], m is unused; K is a multiple of 256, and activations are int16 always.
constexpr int Q6_SUPER = 256, Q6_SUB = 16, Q6_RECORD = 3328;

namespace avx512 {
void gemm_q8(const GemmArgs& a);
void gemm_q4(const GemmArgs& a);
void gemm_q6(const GemmArgs& a);
void gemm_q4k(const GemmArgs& a);
}  // namespace avx512

namespace avx2 {
void gemm_q8(const GemmArgs& a);
void gemm_q4(const GemmArgs& a);
void gemm_q6(const GemmArgs& a);
void gemm_q4k(const GemmArgs& a);  // act_bits ignored: int16
}  // namespace avx2

// Portable code: embedding rows dequantized from the packed layout (any CPU); m as in GemmArgs.
void dequant_rows_q8(const int8_t* w, const uint16_t* d, const uint16_t* m, int64_t K, const int64_t* ids, int64_t n,
                     float* out);
void dequant_rows_q4(const uint8_t* w, const uint16_t* d, const uint16_t* m, int64_t K, const int64_t* ids,
                     int64_t n, float* out);
void dequant_rows_q6(const uint8_t* w, const uint16_t* d, int64_t K, const int64_t* ids, int64_t n, float* out);
void dequant_rows_q4k(const uint8_t* w, const uint16_t* d, const uint8_t* sub, int64_t K, const int64_t* ids,
                      int64_t n, float* out);  // qgemm_q4k.cpp

}  // namespace llmserve
