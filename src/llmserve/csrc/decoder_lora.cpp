// LoRA adapters inside the fused decoder (decoder_stack.cpp): after each linear layer of a step with
// adapters in it, every token adds its own adapter's delta, in float32 whatever the adapter's type:
//
//   y[t] += (x[t] A_s) B_s        s = the token's adapter; A_s [K, R], B_s [R, N] (scale folded in)
//
// as lora/layers.py's masked matmul pair computes it for the layer path, but with each token
// reading only its own adapter's ranks. A work item is up to four tokens of one adapter, which it
// takes through both halves with no barrier between them:
//
//   shrink   h[i, c] = sum_k x[row_i, k] A_s[k, c]      16 ranks at a time; each row of A_s loaded
//                                                      serves the item's four tokens
//   expand   y[row_i, n] += sum_c h[i, c] B_s[c, n]     64 columns at a time; a rank whose non-zero
//                                                      columns miss them is skipped (a q rank of a
//                                                      stacked qkv B reaches no k or v column)
//
// One parallel loop per layer: the first version split the shrink by ranks and the expand by
// columns, two barriers apart, and on the loaded 2-core development machine its threads spent most
// of the step waiting for each other at those barriers. For qkv, o and gate_up that loop is an
// `omp for` inside the parallel region of the per-token loop that reads the layer's output
// (decoder_stack.cpp): a step with adapters opens one parallel region a layer more than the
// base's (down's deltas) instead of four.
//
// Measured (thread CPU time, one thread, a decode step of 16 tokens over 4 rank-16 adapters on
// every projection of SmolLM2-135M Q4_1): the base 9-10 ms, the deltas +5-6 ms, float32 and
// bfloat16 weights alike (bound by float32 fused multiply-adds and L2 reads, not by memory).
// The shrink keeps two vectors of ranks per token (8 independent chains of fused multiply-adds,
// where one vector left the four chains waiting on each other's latency). Rejected: each vector of
// B shared by two tokens in the expand (+6-8 ms, within this loaded machine's noise or worse).
//
// Each token's sums run in the same order whatever else is in the batch (k ascending in the shrink,
// c ascending in the expand, one delta added to y at the end), so, as with the rest of the fused
// decoder, a token's result is the same to the bit alone or batched. A bfloat16 or float16 adapter
// (`--lora-dtype`) is widened to float32 as it is loaded: half the bytes read for the rounding of
// the weights, nothing else.
#pragma GCC target("avx2,fma,f16c")

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "decoder_stack.h"

namespace llmserve {
namespace {

constexpr int64_t kExpandCols = 64;  // columns of y summed at once: 8 vectors of accumulators
constexpr int64_t kGroupRows = 4;    // tokens of one work item: each loaded row of A serves them all
constexpr int64_t kShrinkRanks = 16;  // ranks summed at once: 4 tokens x 2 vectors, 8 independent chains

// Value i of an adapter's matrix as float32.
template <int DT>
inline float load1(const void* base, int64_t i) {
  if constexpr (DT == kLoraF32) return static_cast<const float*>(base)[i];
  const uint16_t v = static_cast<const uint16_t*>(base)[i];
  if constexpr (DT == kLoraF16) return _cvtsh_ss(v);
  const uint32_t bits = uint32_t(v) << 16;  // bfloat16: the top half of a float32
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Values i .. i + 8 of an adapter's matrix as float32 (n < 8: the first n, the rest 0).
template <int DT>
inline __m256 load8(const void* base, int64_t i, int64_t n = 8) {
  if (n < 8) {
    alignas(32) float t[8] = {};
    for (int64_t j = 0; j < n; ++j) t[j] = load1<DT>(base, i + j);
    return _mm256_load_ps(t);
  }
  if constexpr (DT == kLoraF32) return _mm256_loadu_ps(static_cast<const float*>(base) + i);
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + i));
  if constexpr (DT == kLoraF16) return _mm256_cvtph_ps(v);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

// h[i, c0 .. c0 + nc) for the n tokens at xr (nc <= 8 NV; Full: nc == 8 NV): NV vectors of ranks
// per token, a compile-time count, so that the kGroupRows x NV accumulators stay in registers; each
// loaded vector of A serves every token, each broadcast x value every vector. Full is a template
// argument so that the loop over k has no part-vector branch (with it, gcc passed A through the
// stack).
template <int DT, int NV, bool Full>
inline void shrink_block(const LoraPair& p, const float* const* xr, int64_t K, int64_t c0, int64_t nc, int64_t n,
                         float* h, int64_t ldh) {
  __m256 acc[kGroupRows][NV];
  for (int64_t j = 0; j < kGroupRows; ++j)
    for (int v = 0; v < NV; ++v) acc[j][v] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m256 a[NV];
    for (int v = 0; v < NV; ++v) {
      if constexpr (Full) a[v] = load8<DT>(p.a, k * p.R + c0 + 8 * v);
      else a[v] = load8<DT>(p.a, k * p.R + c0 + 8 * v, nc - 8 * v);
    }
    for (int64_t j = 0; j < kGroupRows; ++j) {
      const __m256 xk = _mm256_set1_ps(xr[j][k]);
      for (int v = 0; v < NV; ++v) acc[j][v] = _mm256_fmadd_ps(xk, a[v], acc[j][v]);
    }
  }
  for (int64_t j = 0; j < n; ++j) {
    alignas(32) float out[8 * NV];
    for (int v = 0; v < NV; ++v) _mm256_store_ps(out + 8 * v, acc[j][v]);
    std::copy(out, out + nc, h + j * ldh + c0);
  }
}

// h[i, 0 .. R) for the tokens rows[0 .. n), n <= kGroupRows, of one adapter (h rows of ldh floats):
// kShrinkRanks ranks at a time (the last 1-8 ranks, 8 at a time).
template <int DT>
void shrink(const LoraPair& p, const float* x, int64_t K, const int64_t* rows, int64_t n, float* h, int64_t ldh) {
  const float* xr[kGroupRows];
  for (int64_t j = 0; j < kGroupRows; ++j) xr[j] = x + rows[std::min(j, n - 1)] * K;  // past n: a repeat, not stored
  constexpr int NV = kShrinkRanks / 8;
  int64_t c0 = 0;
  for (; c0 + 8 < p.R; c0 += kShrinkRanks) {
    const int64_t nc = std::min<int64_t>(kShrinkRanks, p.R - c0);
    if (nc == kShrinkRanks) shrink_block<DT, NV, true>(p, xr, K, c0, nc, n, h, ldh);
    else shrink_block<DT, NV, false>(p, xr, K, c0, nc, n, h, ldh);
  }
  if (c0 + 8 == p.R) shrink_block<DT, 1, true>(p, xr, K, c0, 8, n, h, ldh);
  else if (c0 < p.R) shrink_block<DT, 1, false>(p, xr, K, c0, p.R - c0, n, h, ldh);
}

// y[n0 .. n0 + 8 NV) += h B over those columns for one token (yr = its row at n0): NV vectors of
// accumulators, a compile-time count, so that they stay in registers.
template <int DT, int NV>
inline void expand_block(const LoraPair& p, const float* h, int64_t n0, int64_t N, float* yr) {
  __m256 acc[NV];
  for (int v = 0; v < NV; ++v) acc[v] = _mm256_setzero_ps();
  for (int64_t c = 0; c < p.R; ++c) {
    if (p.cols[2 * c + 1] <= n0 || p.cols[2 * c] >= n0 + 8 * NV) continue;  // nothing of rank c here
    const __m256 hc = _mm256_set1_ps(h[c]);
    const int64_t at = c * N + n0;
    for (int v = 0; v < NV; ++v) acc[v] = _mm256_fmadd_ps(hc, load8<DT>(p.b, at + 8 * v), acc[v]);
  }
  for (int v = 0; v < NV; ++v) _mm256_storeu_ps(yr + 8 * v, _mm256_add_ps(_mm256_loadu_ps(yr + 8 * v), acc[v]));
}

// y[row_i] += h[i] B for the tokens rows[0 .. n) of one adapter, kExpandCols columns at a time (the
// last columns, past a multiple of 8, one at a time in the same order of ranks).
template <int DT>
void expand(const LoraPair& p, const float* h, int64_t ldh, const int64_t* rows, int64_t n, float* y, int64_t N) {
  const int64_t full = N / kExpandCols * kExpandCols, vec = N / 8 * 8;
  for (int64_t i = 0; i < n; ++i) {
    float* yr = y + rows[i] * N;
    const float* hi = h + i * ldh;
    for (int64_t n0 = 0; n0 < full; n0 += kExpandCols) expand_block<DT, kExpandCols / 8>(p, hi, n0, N, yr + n0);
    for (int64_t n0 = full; n0 < vec; n0 += 8) expand_block<DT, 1>(p, hi, n0, N, yr + n0);
    for (int64_t col = vec; col < N; ++col) {
      float acc = 0.f;
      for (int64_t c = 0; c < p.R; ++c) acc += hi[c] * load1<DT>(p.b, c * N + col);
      yr[col] += acc;
    }
  }
}

}  // namespace

void Decoder::group_lora(const LoraAdapter* const* loras, int64_t num_loras, const int64_t* row_slots, int64_t M) {
  lora.assign(loras, loras + num_loras);
  if (lora.empty()) return;
  // a counting sort of the tokens by adapter; base-model tokens (-1) join no group
  lora_first.assign(num_loras + 1, 0);
  for (int64_t m = 0; m < M; ++m)
    if (row_slots[m] >= 0) ++lora_first[row_slots[m] + 1];
  for (int64_t s = 0; s < num_loras; ++s) lora_first[s + 1] += lora_first[s];
  lora_rows.resize(lora_first[num_loras]);
  std::vector<int64_t> next(lora_first.begin(), lora_first.end() - 1);
  for (int64_t m = 0; m < M; ++m)
    if (row_slots[m] >= 0) lora_rows[next[row_slots[m]]++] = m;
}

int64_t Decoder::plan_lora(size_t l, int module) {
  // work items: (adapter, its tokens [i0, i0 + kGroupRows)); h rows of the largest rank here
  lora_items.clear();
  lora_ldh = 0;
  for (int64_t s = 0; s < static_cast<int64_t>(lora.size()); ++s) {
    const LoraPair& p = lora[s]->layers[l][module];
    if (p.R == 0) continue;  // the adapter leaves this layer alone
    lora_ldh = std::max(lora_ldh, p.R);
    for (int64_t i0 = lora_first[s]; i0 < lora_first[s + 1]; i0 += kGroupRows)
      lora_items.insert(lora_items.end(), {s, i0});
  }
  if (lora_h.size() < lora_rows.size() * lora_ldh) lora_h.resize(lora_rows.size() * lora_ldh);
  return static_cast<int64_t>(lora_items.size()) / 2;
}

void Decoder::run_lora(size_t l, int module, const float* x, int64_t K, int64_t N, float* y) {
  const int64_t num_items = static_cast<int64_t>(lora_items.size()) / 2, ldh = lora_ldh;
  float* h = lora_h.data();
#pragma omp for schedule(dynamic, 1)
  for (int64_t it = 0; it < num_items; ++it) {
    const int64_t s = lora_items[2 * it], i0 = lora_items[2 * it + 1];
    const LoraPair& p = lora[s]->layers[l][module];
    const int64_t n = std::min(kGroupRows, lora_first[s + 1] - i0);
    const int64_t* rows = lora_rows.data() + i0;
    float* hi = h + i0 * ldh;
    switch (lora[s]->dtype) {
      case kLoraBF16: shrink<kLoraBF16>(p, x, K, rows, n, hi, ldh), expand<kLoraBF16>(p, hi, ldh, rows, n, y, N); break;
      case kLoraF16: shrink<kLoraF16>(p, x, K, rows, n, hi, ldh), expand<kLoraF16>(p, hi, ldh, rows, n, y, N); break;
      default: shrink<kLoraF32>(p, x, K, rows, n, hi, ldh), expand<kLoraF32>(p, hi, ldh, rows, n, y, N);
    }
  }
}

void Decoder::add_lora(size_t l, int module, const float* x, int64_t K, int64_t N, float* y) {
  const int64_t num_items = plan_lora(l, module);
  if (num_items == 0) return;
#pragma omp parallel if (num_items > 1)
  run_lora(l, module, x, K, N, y);
}

}  // namespace llmserve
