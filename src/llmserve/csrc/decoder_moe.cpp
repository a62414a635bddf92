// The mixture-of-experts MLP of one layer of the fused decoder (decoder_stack.cpp, step 6), with the
// math and order of llmserve/layers/moe.py:
//
//   logits = h @ router.T;  p = softmax(logits);  (w, ids) = top-k of p   (w / sum(w) if renormalize)
//   out[m] = 0 + w[m, j] * expert_e(h[m]) for each chosen e in ascending order of e
//            (+ sigmoid(h[m] . g) * shared(h[m]) when the block has a shared expert)
//
// Experts run grouped: each expert that any token chose multiplies the rows of those tokens at once
// (gathered into one contiguous block), so a batch-1 decode reads only its k experts' weights and a
// batch reads each chosen expert once. The router stays float32, as the model's does.
#pragma GCC target("avx2,fma,f16c")

#include <algorithm>
#include <cmath>
#include <cstring>

#include "decoder_stack.h"

namespace llmserve {
namespace {

constexpr int64_t kParallelRows = 4;  // as decoder_stack.cpp's kParallelTokens

float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// Token m's k experts (ids) and weights from its router logits, as torch.topk over the softmax.
void route(const Moe& moe, const float* x, int64_t H, float* probs, int64_t* ids, float* w) {
  float top = -3.0e38f;
  for (int64_t e = 0; e < moe.E; ++e) top = std::max(top, probs[e] = dot(x, moe.router + e * H, H));
  float total = 0.f;
  for (int64_t e = 0; e < moe.E; ++e) total += probs[e] = std::exp(probs[e] - top);
  for (int64_t e = 0; e < moe.E; ++e) probs[e] /= total;
  float chosen = 0.f;
  for (int64_t j = 0; j < moe.k; ++j) {  // k passes: the largest left, the lower id on a tie
    int64_t best = -1;
    for (int64_t e = 0; e < moe.E; ++e)
      if (probs[e] >= 0.f && (best < 0 || probs[e] > probs[best])) best = e;
    ids[j] = best;
    chosen += w[j] = probs[best];
    probs[best] = -1.f;  // taken
  }
  if (moe.renormalize)
    for (int64_t j = 0; j < moe.k; ++j) w[j] /= chosen;
}

}  // namespace

void Decoder::moe_mlp(const Moe& moe, int64_t M, float* h) {
  const int64_t k = moe.k;
  moe_ids.resize(M * k);
  moe_w.resize(M * k);
  moe_rows.resize(M);
  moe_x.resize(M * H);
  moe_y.resize(M * H);
  moe_out.assign(M * H, 0.f);
  float *gu = gate_up.data(), *act_ = act.data(), *xs = moe_x.data(), *ys = moe_y.data();
  float* out = moe_out.data();

  // 1. route every token
#pragma omp parallel if (M >= kParallelRows)
  {
    std::vector<float> probs(moe.E);
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; ++m)
      route(moe, h + m * H, H, probs.data(), moe_ids.data() + m * k, moe_w.data() + m * k);
  }
  // 2. each chosen expert once, over the rows of the tokens that chose it, in ascending order
  std::vector<float> row_w(M);
  for (int64_t e = 0; e < moe.E; ++e) {
    int64_t n = 0;
    for (int64_t m = 0; m < M; ++m)
      for (int64_t j = 0; j < k; ++j)
        if (moe_ids[m * k + j] == e) moe_rows[n] = m, row_w[n++] = moe_w[m * k + j];
    if (n == 0) continue;
    const float* x = h;
    if (n < M) {  // gather: rows of the tokens that chose e, contiguous
      for (int64_t i = 0; i < n; ++i) std::memcpy(xs + i * H, h + moe_rows[i] * H, H * sizeof(float));
      x = xs;
    }
    const int64_t I_e = moe.down[e].K;
    linear(moe.gate_up[e], x, n, gu);
#pragma omp parallel for schedule(static) if (n >= kParallelRows)
    for (int64_t i = 0; i < n; ++i) silu_mul(gu + i * 2 * I_e, gu + i * 2 * I_e + I_e, I_e, act_ + i * I_e);
    linear(moe.down[e], act_, n, ys);
#pragma omp parallel for schedule(static) if (n >= kParallelRows)
    for (int64_t i = 0; i < n; ++i) {
      float* o = out + moe_rows[i] * H;
      const float* y = ys + i * H;
      const float wi = row_w[i];
#pragma omp simd
      for (int64_t d = 0; d < H; ++d) o[d] += y[d] * wi;
    }
  }
  // 3. the shared expert, every token, scaled by its own sigmoid gate
  if (moe.shared_down.N) {
    const int64_t I_s = moe.shared_down.K;
    linear(moe.shared_gate_up, h, M, gu);
#pragma omp parallel for schedule(static) if (M >= kParallelRows)
    for (int64_t m = 0; m < M; ++m) silu_mul(gu + m * 2 * I_s, gu + m * 2 * I_s + I_s, I_s, act_ + m * I_s);
    linear(moe.shared_down, act_, M, ys);
#pragma omp parallel for schedule(static) if (M >= kParallelRows)
    for (int64_t m = 0; m < M; ++m) {
      const float g = 1.0f / (1.0f + std::exp(-dot(h + m * H, moe.shared_gate, H)));
      float* o = out + m * H;
      const float* y = ys + m * H;
#pragma omp simd
      for (int64_t d = 0; d < H; ++d) o[d] += g * y[d];
    }
  }
  std::memcpy(h, out, M * H * sizeof(float));
}

}  // namespace llmserve
