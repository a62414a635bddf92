// The forward pass of a Llama-family decoder stack in one call: every layer, for a flat batch of
// tokens from many sequences (one new token each when decoding, a chunk when prefilling), with
// block-quantized weights and the paged KV cache read in place.
//
// At batch 1 a decode step of a small model is a few milliseconds of matmuls; run as a chain of
// torch and Python calls, the glue between them (dispatch, views, allocation, ~10 calls a layer)
// costs as much again. Here a layer is:
//
//   res += mlp_out  (layer > 0);  h = rms_norm(res) * w_in               residual stream in place
//   qkv = h @ Wqkv.T (+ b);  per head: [rms_norm(q), rms_norm(k)];  rope(q), rope(k) (a NoPE layer: none)
//   cache[slot] = k, v                                                  paged [2, Hkv, blocks, bs, D]
//   attn[t, hq] = softmax(scale * q . K[visible]) V[visible]            GQA: hq reads KV head hq / G;
//                                                                       visible: causal, windowed
//   res += attn @ Wo.T;  h = rms_norm(res) * w_post
//   mlp_out = (silu(h @ Wgate.T) * (h @ Wup.T)) @ Wdown.T               gelu_tanh for Gemma
//
// Gemma's sandwich norms (Layer::post_attn_norm, post_mlp_norm) norm attn @ Wo.T and mlp_out before
// each joins the residual stream; its sliding and global layers rotate with their own tables; Gemma 2
// soft-caps the scaled scores. OLMo 2 and EXAONE 4.0 have those two norms and not w_in, w_post.
// StarCoder2's stream norms are LayerNorms with biases (Decoder::norm_kind) and its MLP is plain,
// down(gelu_tanh(h @ Wup.T)) (Layer::gated 0); its linear layers' biases are the kernels' (+ b).
//
// and after the last layer the final norm: out = rms_norm(res + mlp_out) * w_final. The math and
// its order are those of llmserve/models/llama.py; matmuls are the q8/q4/q6/q4k kernels of qgemm.h.
// With LoRA adapters, each token's adapter adds its delta to the output of qkv, o, gate_up and
// down (decoder_lora.cpp), as the model's LoRALinear wrappers do. Compiled for AVX2 + FMA + F16C
// (every CPU that runs the quantized kernels); the element-wise loops are left to the vectorizer.
#pragma GCC target("avx2,fma,f16c")

#include "decoder_stack.h"
#include "shm_comm.h"
#include "vec_exp.h"

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace llmserve {
namespace {

// out[i] = exp(scale * (x[i] - m)) for i < n; returns their sum.
float exp_shifted(float* x, int64_t n, float scale, float m) {
  const __m256 vs = _mm256_set1_ps(scale), vm = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 p = exp8(_mm256_mul_ps(vs, _mm256_sub_ps(_mm256_loadu_ps(x + i), vm)));
    _mm256_storeu_ps(x + i, p);
    acc = _mm256_add_ps(acc, p);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  float total = lanes[0] + lanes[1] + lanes[2] + lanes[3] + lanes[4] + lanes[5] + lanes[6] + lanes[7];
  for (; i < n; ++i) total += (x[i] = fast_exp(scale * (x[i] - m)));
  return total;
}

// Gemma 2's soft cap on the scaled scores, kept in the unscaled units the softmax then scales:
// x[i] = (c / scale) tanh(scale x[i] / c), tanh(y) = 1 - 2 / (1 + e^{2y}) (plain arithmetic: vectorizes)
void cap_scores(float* x, int64_t n, float scale, float cap) {
  const float in = 2.0f * scale / cap, out = cap / scale;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) x[i] = out * (1.0f - 2.0f / (1.0f + fast_exp(in * x[i])));
}

float max_of(const float* x, int64_t n) {
  __m256 acc = _mm256_set1_ps(-3.0e38f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_max_ps(acc, _mm256_loadu_ps(x + i));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  float m = lanes[0];
  for (int j = 1; j < 8; ++j) m = std::max(m, lanes[j]);
  for (; i < n; ++i) m = std::max(m, x[i]);
  return m;
}


void rms_norm(const float* x, const float* w, float eps, int64_t n, float* out) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * inv * w[i];
}

// (x - mean) / sqrt(var + eps) * w + b (StarCoder2's LayerNorm; b nullptr: none); out may be x
void layer_norm(const float* x, const float* w, const float* b, float eps, int64_t n, float* out) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += x[i];
  const float mean = sum / static_cast<float>(n);
  float var = 0.f;
#pragma omp simd reduction(+ : var)
  for (int64_t i = 0; i < n; ++i) var += (x[i] - mean) * (x[i] - mean);
  const float inv = 1.0f / std::sqrt(var / static_cast<float>(n) + eps);
  if (b) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) out[i] = (x[i] - mean) * inv * w[i] + b[i];
  } else {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) out[i] = (x[i] - mean) * inv * w[i];
  }
}

// x [rot]: first half pairs with second half (GPT-NeoX / HF layout); cs = [cos | sin] halves.
void rope(float* x, const float* cs, int64_t rot) {
  const int64_t half = rot / 2;
  const float* c = cs;
  const float* s = cs + half;
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = x[i], x2 = x[i + half];
    x[i] = x1 * c[i] - x2 * s[i];
    x[i + half] = x2 * c[i] + x1 * s[i];
  }
}

// Cache rows (row_bytes, store_row, load_rows, prefetch_rows): decoder_cache_rows.cpp.

// Dot products of up to 4 vectors at once: lane j of the result is the sum of the 8 lanes of a[j],
// always by the same tree ((0+1)+(2+3))+((4+5)+(6+7)), whatever is reduced beside it.
inline __m128 hsum4x8(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

// The query rows of one work item that see positions in the current chunk: row r is (token u,
// query head g) = (r / G, r % G). Rows are taken NR at a time, so that each K and V row loaded
// serves all of them.
constexpr int kRowTile = 3;

// Eight cache values as floats: float32 rows as they are, float16 rows converted on the way.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline float load1(float v) { return v; }
inline float load1(uint16_t v) { return _cvtsh_ss(v); }

// s[r][t0 + j] = q[r] . K[t0 + j] for the NR rows and NP <= 4 positions j, D a multiple of 8.
// Per dot product: 8 lanes of fused multiply-adds along d in order, then hsum4x8: the same
// operations whatever the other rows and positions are, so a row's scores do not depend on them.
template <int NR, int NP, typename T>
inline void score_tile(const float* const* q, const T* K, int64_t D, int64_t t0, float* const* s) {
  __m256 acc[NR][4];
  for (int r = 0; r < NR; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm256_setzero_ps();
  const T* k = K + t0 * D;
  for (int64_t d = 0; d < D; d += 8) {
    __m256 qv[NR];
    for (int r = 0; r < NR; ++r) qv[r] = _mm256_loadu_ps(q[r] + d);
    for (int j = 0; j < NP; ++j) {
      const __m256 kv = load8(k + j * D + d);
      for (int r = 0; r < NR; ++r) acc[r][j] = _mm256_fmadd_ps(qv[r], kv, acc[r][j]);
    }
  }
  for (int r = 0; r < NR; ++r) {
    const __m128 v = hsum4x8(acc[r][0], acc[r][1], acc[r][2], acc[r][3]);
    if (NP == 4) {
      _mm_storeu_ps(s[r] + t0, v);
    } else {
      alignas(16) float out[4];
      _mm_store_ps(out, v);
      for (int j = 0; j < NP; ++j) s[r][t0 + j] = out[j];
    }
  }
}

template <int NR, typename T>
inline void score_rows(const float* const* q, const T* K, int64_t D, int64_t t0, int64_t t1, float* const* s) {
  int64_t t = t0;
  for (; t + 4 <= t1; t += 4) score_tile<NR, 4>(q, K, D, t, s);
  switch (t1 - t) {
    case 3: return score_tile<NR, 3>(q, K, D, t, s);
    case 2: return score_tile<NR, 2>(q, K, D, t, s);
    case 1: return score_tile<NR, 1>(q, K, D, t, s);
    default: return;
  }
}

// o[r][d] += sum_t p[r][t] V[t][d] over t in [t0, t1) for the NR rows, one fused multiply-add per
// (t, d) in order of t. A row's p is 0 at the positions of the span it does not see, which leaves
// its o exactly as it is: those V rows are its own sequence's, written and finite.
template <int NR, typename T>
inline void value_rows(const float* const* p, const T* V, int64_t D, int64_t t0, int64_t t1, float* const* o) {
  int64_t d = 0;
  for (; d + 32 <= D; d += 32) {
    __m256 acc[NR][4];
    for (int r = 0; r < NR; ++r)
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm256_loadu_ps(o[r] + d + 8 * c);
    for (int64_t t = t0; t < t1; ++t) {
      const T* v = V + t * D + d;
      const __m256 v0 = load8(v), v1 = load8(v + 8), v2 = load8(v + 16), v3 = load8(v + 24);
      for (int r = 0; r < NR; ++r) {
        const __m256 pr = _mm256_broadcast_ss(p[r] + t);
        acc[r][0] = _mm256_fmadd_ps(pr, v0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(pr, v1, acc[r][1]);
        acc[r][2] = _mm256_fmadd_ps(pr, v2, acc[r][2]);
        acc[r][3] = _mm256_fmadd_ps(pr, v3, acc[r][3]);
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int c = 0; c < 4; ++c) _mm256_storeu_ps(o[r] + d + 8 * c, acc[r][c]);
  }
  for (; d < D; ++d)
    for (int r = 0; r < NR; ++r)
      for (int64_t t = t0; t < t1; ++t) o[r][d] += p[r][t] * load1(V[t * D + d]);
}

// f(std::integral_constant<int, NR>{}) for a group of nr rows, 1 <= nr <= kRowTile: the tiles'
// row count is a compile-time constant.
template <typename F>
inline void with_rows(int64_t nr, F&& f) {
  switch (nr) {
    case 3: return f(std::integral_constant<int, 3>{});
    case 2: return f(std::integral_constant<int, 2>{});
    default: return f(std::integral_constant<int, 1>{});
  }
}

// Attention of one work item: for each of its R tokens u (query q + u * q_stride) and the G query
// heads that share KV head `kh`, over the token's visible positions within the grid chunk,
// [lo[u], hi[u]) (empty: the token has nothing there):
//
//   s[g, t] = q_g . K[t];  mx_g = max_t s[g, t];  l_g = sum_t e^{scale (s[g, t] - mx_g)}
//   o_g = sum_t e^{scale (s[g, t] - mx_g)} V[t]                       (not yet divided by l_g)
//
// Each block of K and V rows is read (and converted) once for all R tokens and G heads, and each
// row of it loaded once for up to kRowTile query rows. Every (u, g) runs the same operations in the
// same order as it would alone: its result does not depend on the other tokens. k_head, v_head:
// this KV head's [num_blocks, bs, D] in the cache's type; `table` maps block i of the sequence to a
// cache block. `s` holds R * G * kChunk floats, `buf` one block of floats; o [R, G, D], mx and l [R, G].
void attend_chunk(const Decoder& dec, const float* q, int64_t q_stride, int64_t R, const int64_t* lo,
                  const int64_t* hi, int64_t G, const char* k_head, const char* v_head, const int64_t* table,
                  int64_t p0, float* o, float* mx, float* l, float* s, float* buf) {
  const int64_t D = dec.D, bs = dec.block_size;
  const int64_t rk = row_bytes(dec.cache_type, D), rv = row_bytes(dec.v_cache_type, D);  // K's and V's rows
  const bool simd = D % 8 == 0;
  // the tokens with positions here (their rows j: row (us[j / G], j % G) = us[j / G] * G + j % G),
  // and the span [first, last) any of them sees
  int64_t us[kRun], nu = 0, first = INT64_MAX, last = 0;
  for (int64_t u = 0; u < R; ++u) {
    if (hi[u] <= lo[u]) continue;
    first = std::min(first, lo[u]), last = std::max(last, hi[u]);
    us[nu++] = u;
  }
  const int64_t n = nu * G;
  auto row = [&](int64_t j) { return us[j / G] * G + j % G; };
  // float16 rows that only one group of rows reads are converted in registers as they are loaded;
  // otherwise each block is converted once into `buf` for all the groups
  const bool direct_k = dec.cache_type == kCacheF16 && simd && n <= kRowTile;
  const bool direct_v = dec.v_cache_type == kCacheF16 && simd && n <= kRowTile;
  auto row_lo = [&](int64_t r) { return lo[r / G]; };
  auto row_hi = [&](int64_t r) { return hi[r / G]; };
  // 1. scores, s[r kChunk + p - p0] for row r and position p
  for (int64_t i = first / bs; i * bs < last; ++i) {
    const char* k_block = k_head + table[i] * bs * rk;
    // the next block's rows (anywhere in the cache: no hardware prefetcher guesses it); then V's first
    if ((i + 1) * bs < last) prefetch_rows(k_head + table[i + 1] * bs * rk, bs * rk);
    else prefetch_rows(v_head + table[first / bs] * bs * rv, bs * rv);
    const float* K = direct_k ? nullptr : load_rows(dec.cache_type, k_block, bs, D, buf);
    for (int64_t r0 = 0; r0 < n; r0 += kRowTile) {
      const int64_t nr = std::min<int64_t>(kRowTile, n - r0);
      int64_t t0 = INT64_MAX, t1 = 0;  // the positions of this block that any of the rows sees
      const float* qr[kRowTile];
      float* sr[kRowTile];
      for (int64_t j = 0; j < nr; ++j) {
        const int64_t r = row(r0 + j);
        t0 = std::min(t0, std::max<int64_t>(row_lo(r) - i * bs, 0));  // within the block
        t1 = std::max(t1, std::min<int64_t>(row_hi(r) - i * bs, bs));
        qr[j] = q + (r / G) * q_stride + (r % G) * D;
        sr[j] = s + r * kChunk + i * bs - p0;
      }
      if (t1 <= t0) continue;
      if (direct_k) {
        const uint16_t* Kh = reinterpret_cast<const uint16_t*>(k_block);
        with_rows(nr, [&](auto NR) { score_rows<NR>(qr, Kh, D, t0, t1, sr); });
      } else if (simd) {
        with_rows(nr, [&](auto NR) { score_rows<NR>(qr, K, D, t0, t1, sr); });
      } else {
        for (int64_t j = 0; j < nr; ++j)
          for (int64_t t = t0; t < t1; ++t) {
            float a = 0.f;
            for (int64_t d = 0; d < D; ++d) a += qr[j][d] * K[t * D + d];
            sr[j][t] = a;
          }
      }
    }
  }
  // 2. unnormalized probabilities; 0 at the positions of [first, last) a row does not see
  for (int64_t j = 0; j < n; ++j) {
    const int64_t r = row(j), a = row_lo(r), b = row_hi(r);
    float* sg = s + r * kChunk - p0;  // by position
    if (dec.softcap > 0.f) cap_scores(sg + a, b - a, dec.scale, dec.softcap);
    const float m = max_of(sg + a, b - a);
    mx[r] = m;
    l[r] = exp_shifted(sg + a, b - a, dec.scale, m);
    std::fill(sg + first, sg + a, 0.f);
    std::fill(sg + b, sg + last, 0.f);
  }
  // 3. weighted sums of V rows
  for (int64_t j = 0; j < n; ++j) std::fill(o + row(j) * D, o + (row(j) + 1) * D, 0.f);
  for (int64_t i = first / bs; i * bs < last; ++i) {
    const char* v_block = v_head + table[i] * bs * rv;
    if ((i + 1) * bs < last) prefetch_rows(v_head + table[i + 1] * bs * rv, bs * rv);
    const float* V = direct_v ? nullptr : load_rows(dec.v_cache_type, v_block, bs, D, buf);
    for (int64_t r0 = 0; r0 < n; r0 += kRowTile) {
      const int64_t nr = std::min<int64_t>(kRowTile, n - r0);
      int64_t t0 = INT64_MAX, t1 = 0;
      const float* pr[kRowTile];
      float* orow[kRowTile];
      for (int64_t j = 0; j < nr; ++j) {
        const int64_t r = row(r0 + j);
        t0 = std::min(t0, std::max<int64_t>(row_lo(r) - i * bs, 0));
        t1 = std::max(t1, std::min<int64_t>(row_hi(r) - i * bs, bs));
        pr[j] = s + r * kChunk + i * bs - p0;
        orow[j] = o + r * D;
      }
      if (t1 <= t0) continue;
      const uint16_t* Vh = reinterpret_cast<const uint16_t*>(v_block);
      with_rows(nr, [&](auto NR) {
        if (direct_v)
          value_rows<NR>(pr, Vh, D, t0, t1, orow);
        else
          value_rows<NR>(pr, V, D, t0, t1, orow);
      });
    }
  }
}

// Per-token element-wise work (norms, rotary, cache writes, the MLP's gate) is split over the
// threads from this many tokens up; below it, one thread does it faster than two can start.
constexpr int64_t kParallelTokens = 4;

}  // namespace

void linear(const QuantLinear& w, const float* x, int64_t M, float* out) {
  if (!w.parts.empty()) {  // each matrix writes its columns of out's rows
    int64_t col = 0;
    for (const QuantLinear& p : w.parts) {
      GemmArgs a;
      a.x = x, a.ldx = w.K, a.M = M, a.K = w.K, a.N = p.N, a.w = p.w, a.d = p.d, a.m = p.m;
      a.bias = p.bias, a.out = out + col, a.ldo = w.N, a.act_bits = p.act_bits;
      gemm(p.bits, a);
      col += p.N;
    }
    return;
  }
  GemmArgs a;
  a.x = x, a.ldx = w.K, a.M = M, a.K = w.K, a.N = w.N, a.w = w.w, a.d = w.d, a.m = w.m;
  a.bias = w.bias, a.out = out, a.ldo = w.N, a.act_bits = w.act_bits;
  gemm(w.bits, a);
}

// Work items for this layer's attention: runs of up to kRun consecutive tokens of one sequence,
// for each KV head, over each grid chunk that any of them sees (causal: up to its own position;
// within the sliding window). One token decoding alone has a chunk per 128 positions per KV head,
// which spreads a long context over every core.
// The stream's norms (input, post-attention, final): RMSNorm, or StarCoder2's LayerNorm with its bias.
void Decoder::norm(const float* x, const float* w, const float* b, float* out) const {
  if (norm_kind == kNormLayer) layer_norm(x, w, b, eps, H, out);
  else rms_norm(x, w, eps, H, out);
}

void Decoder::plan_attention(int64_t T, const int64_t* positions, const int64_t* token_seqs, int64_t window) {
  items.clear();
  lo.resize(T);
  hi.resize(T);
  group_items.resize(2 * T * Hkv);
  for (int64_t m = 0; m < T; ++m) {
    hi[m] = positions[m] + 1;
    lo[m] = window > 0 ? std::max<int64_t>(0, hi[m] - window) : 0;
  }
  int64_t slots = 0;
  for (int64_t m0 = 0; m0 < T;) {
    int64_t m1 = m0 + 1;
    while (m1 < T && m1 - m0 < kRun && token_seqs[m1] == token_seqs[m0]) ++m1;
    int64_t first = lo[m0], last = hi[m0];
    for (int64_t m = m0; m < m1; ++m) first = std::min(first, lo[m]), last = std::max(last, hi[m]);
    for (int64_t kh = 0; kh < Hkv; ++kh) {
      const int64_t begin = static_cast<int64_t>(items.size());
      for (int64_t p0 = first / kChunk * kChunk; p0 < last; p0 += kChunk, slots += m1 - m0)
        items.push_back({m0, m1, kh, p0, p0 + kChunk, slots});
      for (int64_t m = m0; m < m1; ++m) {
        group_items[2 * (m * Hkv + kh)] = begin;
        group_items[2 * (m * Hkv + kh) + 1] = static_cast<int64_t>(items.size());
      }
    }
    m0 = m1;
  }
  const size_t G = static_cast<size_t>(Hq / Hkv), n = static_cast<size_t>(slots);
  if (part_o.size() < n * G * D) part_o.resize(n * G * D);
  if (part_mx.size() < n * G) part_mx.resize(n * G), part_l.resize(n * G);
}

int64_t Decoder::mlp_width() const {
  int64_t width = I;
  for (const Layer& L : layers) {
    for (const QuantLinear& w : L.moe.down) width = std::max(width, w.K);
    width = std::max(width, L.moe.shared_down.K);
  }
  return width;
}

void Decoder::fit(int64_t M) {
  const int64_t qkv_n = (Hq + 2 * Hkv) * D;
  if (M <= capacity) return;
  const int64_t width = mlp_width();
  res.resize(M * H);
  h.resize(M * H);
  qkv.resize(M * qkv_n);
  attn.resize(M * Hq * D);
  gate_up.resize(M * 2 * width);
  act.resize(M * width);
  capacity = M;
}

void Decoder::forward(const float* x, int64_t M, const int64_t* positions, const int64_t* slots,
                      const int64_t* token_seqs, const int64_t* block_tables, int64_t max_blocks,
                      const LoraAdapter* const* loras, int64_t num_loras, const int64_t* row_slots, float* out) {
  fit(M);
  group_lora(loras, num_loras, row_slots, M);  // LoRA deltas join each linear layer's output (add_lora)
  const int64_t qkv_n = (Hq + 2 * Hkv) * D, G = Hq / Hkv;
  float *res_ = res.data(), *h_ = h.data(), *qkv_ = qkv.data(), *attn_ = attn.data();
  float *gu_ = gate_up.data(), *act_ = act.data();
  const float rs = residual_scale;  // 1 but for Granite: rs * o is then o, bit for bit
  std::memcpy(res_, x, M * H * 4);

  for (size_t l = 0; l < layers.size(); ++l) {
    const Layer& L = layers[l];
    // 1. input norm; the previous layer's MLP output (in h) joins the residual stream first
#pragma omp parallel for schedule(static) if (M >= kParallelTokens)
    for (int64_t m = 0; m < M; ++m) {
      float* r = res_ + m * H;
      if (l > 0) {
        float* mo = h_ + m * H;
        if (const float* w = layers[l - 1].post_mlp_norm) rms_norm(mo, w, eps, H, mo);
#pragma omp simd
        for (int64_t i = 0; i < H; ++i) r[i] += rs * mo[i];
      }
      if (L.input_norm) norm(r, L.input_norm, L.input_norm_bias, h_ + m * H);
      else std::memcpy(h_ + m * H, r, H * 4);  // post-norm layers (OLMo 2) attend to the stream itself
    }
    // 2. q, k, v; per-head norms (Qwen3); rotary embedding of q and k
    linear(L.qkv, h_, M, qkv_);
    char* kv = static_cast<char*>(L.kv_cache);  // K's half; V's at v_offset
    char* kv_v = kv + v_offset;
    const int64_t rk = row_bytes(cache_type, D), rv = row_bytes(v_cache_type, D);
    const int64_t k_head_bytes = num_blocks * block_size * rk, v_head_bytes = num_blocks * block_size * rv;  // one head's blocks
    // the LoRA deltas in the same parallel region as the loop after them (one fork and join a
    // linear layer instead of two; so for o and gate_up)
    const int64_t qkv_items = plan_lora(l, kLoraQKV);
#pragma omp parallel if (M >= kParallelTokens || qkv_items > 1)
    {
      if (qkv_items) run_lora(l, kLoraQKV, h_, L.qkv.K, L.qkv.N, qkv_);
#pragma omp for schedule(static)
      for (int64_t m = 0; m < M; ++m) {
        const float* cs = (L.cos_sin ? L.cos_sin : cos_sin) + positions[m] * rot;
        float* qm = qkv_ + m * qkv_n;
        if (L.qk_norm_whole) {  // OLMo 2: q over all its heads at once, k over all of its
          rms_norm(qm, L.q_norm, eps, Hq * D, qm);
          rms_norm(qm + Hq * D, L.k_norm, eps, Hkv * D, qm + Hq * D);
        }
        for (int64_t hd = 0; hd < Hq + Hkv; ++hd) {
          float* v = qm + hd * D;
          const float* nw = hd < Hq ? L.q_norm : L.k_norm;
          if (nw && !L.qk_norm_whole) rms_norm(v, nw, eps, D, v);
          if (L.rope) rope(v, cs, rot);
        }
        // 3. this token's K and V into their cache slot (all of the batch's before any token
        //    attends: the tokens of a prompt chunk see each other there)
        const int64_t row = slots[m];  // slot = block * block_size + offset: the row within one head
        for (int64_t kh = 0; kh < Hkv; ++kh) {
          const float* k = qkv_ + m * qkv_n + (Hq + kh) * D;
          const float* v = qkv_ + m * qkv_n + (Hq + Hkv + kh) * D;
          store_row(cache_type, k, D, kv + kh * k_head_bytes + row * rk);
          store_row(v_cache_type, v, D, kv_v + kh * v_head_bytes + row * rv);
        }
      }
    }
    // 4. attention, split into work items of (run of a sequence's tokens, KV head, grid chunk),
    //    then each query head's chunks merged: out = sum_c e^{mx_c - M} o_c / sum_c e^{mx_c - M} l_c
    if (l == 0 || L.window != layers[l - 1].window)  // the plan depends on nothing else
      plan_attention(M, positions, token_seqs, L.window);
    const int64_t num_items = static_cast<int64_t>(items.size());
    float *po = part_o.data(), *pm = part_mx.data(), *pl = part_l.data();
#pragma omp parallel
    {
      std::vector<float> s(kRun * G * kChunk), buf(block_size * D);
      int64_t clo[kRun], chi[kRun];
#pragma omp for schedule(dynamic, 1)
      for (int64_t it = 0; it < num_items; ++it) {
        const AttentionItem& w = items[it];
        const int64_t R = w.m1 - w.m0;
        for (int64_t u = 0; u < R; ++u)
          clo[u] = std::max(lo[w.m0 + u], w.p0), chi[u] = std::min(hi[w.m0 + u], w.p1);
        attend_chunk(*this, qkv_ + w.m0 * qkv_n + w.kh * G * D, qkv_n, R, clo, chi, G, kv + w.kh * k_head_bytes,
                     kv_v + w.kh * v_head_bytes, block_tables + token_seqs[w.m0] * max_blocks, w.p0,
                     po + w.slot * G * D, pm + w.slot * G, pl + w.slot * G, s.data(), buf.data());
      }
    }
    const int64_t num_groups = M * Hkv;
#pragma omp parallel for schedule(static) if (num_groups >= kParallelTokens)
    for (int64_t k = 0; k < num_groups; ++k) {  // (token m, KV head kh); its chunks in order
      const int64_t m = k / Hkv, kh = k % Hkv;
      auto seen = [&](const AttentionItem& w) { return std::min(hi[m], w.p1) > std::max(lo[m], w.p0); };
      for (int64_t g = 0; g < G; ++g) {
        float top = -3.0e38f;
        for (int64_t c = group_items[2 * k]; c < group_items[2 * k + 1]; ++c)
          if (seen(items[c])) top = std::max(top, pm[(items[c].slot + m - items[c].m0) * G + g]);
        float* out = attn_ + m * Hq * D + (kh * G + g) * D;
        std::fill(out, out + D, 0.f);
        float total = 0.f;
        for (int64_t c = group_items[2 * k]; c < group_items[2 * k + 1]; ++c) {
          if (!seen(items[c])) continue;
          const int64_t slot = items[c].slot + m - items[c].m0;
          const float f = fast_exp(scale * (pm[slot * G + g] - top));
          total += f * pl[slot * G + g];
          const float* oc = po + (slot * G + g) * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) out[d] += f * oc[d];
        }
        const float inv = 1.0f / total;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) out[d] *= inv;
      }
    }
    // 5. output projection into the residual stream, post-attention norm
    linear(L.o, attn_, M, h_);
    if (comm) {  // a tensor-parallel rank: the heads' shares summed, deltas included
      add_lora(l, kLoraO, attn_, L.o.K, L.o.N, h_);
      comm->all_reduce(h_, M * H);
    }
    const int64_t o_items = comm ? 0 : plan_lora(l, kLoraO);
#pragma omp parallel if (M >= kParallelTokens || o_items > 1)
    {
      if (o_items) run_lora(l, kLoraO, attn_, L.o.K, L.o.N, h_);
#pragma omp for schedule(static)
      for (int64_t m = 0; m < M; ++m) {
        float* r = res_ + m * H;
        float* o = h_ + m * H;
        if (L.post_attn_norm) rms_norm(o, L.post_attn_norm, eps, H, o);
#pragma omp simd
        for (int64_t i = 0; i < H; ++i) r[i] += rs * o[i];
        if (L.post_norm) norm(r, L.post_norm, L.post_norm_bias, h_ + m * H);
        else std::memcpy(h_ + m * H, r, H * 4);
      }
    }
    // 6. gated MLP: silu(gate) * up, then down (its output stays in h for the next layer); or
    //    the mixture of experts the router picks per token
    if (L.moe.E) {
      moe_mlp(L.moe, M, h_);
      // a rank's experts are slices of their intermediate dimension: their shares summed
      if (comm) comm->all_reduce(h_, M * H);
      continue;
    }
    linear(L.gate_up, h_, M, gu_);
    const int64_t gu_items = plan_lora(l, kLoraGateUp);
#pragma omp parallel if (M >= kParallelTokens || gu_items > 1)
    {
      if (gu_items) run_lora(l, kLoraGateUp, h_, L.gate_up.K, L.gate_up.N, gu_);
#pragma omp for schedule(static)
      for (int64_t m = 0; m < M; ++m) {
        if (!L.gated) {  // a plain MLP (StarCoder2): act(up x), its up rows alone in gate_up
          gelu_tanh(gu_ + m * I, I, act_ + m * I);
          continue;
        }
        const float* g = gu_ + m * 2 * I;
        (activation == kActGeluTanh ? gelu_tanh_mul : silu_mul)(g, g + I, I, act_ + m * I);
      }
    }
    linear(L.down, act_, M, h_);
    add_lora(l, kLoraDown, act_, L.down.K, L.down.N, h_);
    if (comm) comm->all_reduce(h_, M * H);  // the intermediate slices' shares summed
  }
  // 7. final norm
  const float* last_norm = layers.empty() ? nullptr : layers.back().post_mlp_norm;
  for (int64_t m = 0; m < M; ++m) {
    float* r = res_ + m * H;
    float* mo = h_ + m * H;
    if (last_norm) rms_norm(mo, last_norm, eps, H, mo);
#pragma omp simd
    for (int64_t i = 0; i < H; ++i) r[i] += rs * mo[i];
    norm(r, final_norm, final_norm_bias, out + m * H);
  }
}

}  // namespace llmserve
