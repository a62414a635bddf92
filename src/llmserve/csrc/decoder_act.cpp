// The fused decoder's gated activations (decoder_stack.cpp, decoder_moe.cpp): a = act(g) * u over
// one token's [gate | up] halves. Both are x * sigmoid(t x'), so both run on exp8's lanes.
#pragma GCC target("avx2,fma,f16c")

#include "decoder_stack.h"
#include "vec_exp.h"

namespace llmserve {
namespace {

// x / (1 + e^{-z}) * u on eight lanes: the reciprocal to ~12 bits, then one Newton step (~23 bits).
inline __m256 over_one_plus_exp(__m256 x, __m256 z, __m256 u) {
  const __m256 den = _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), z)));
  __m256 inv = _mm256_rcp_ps(den);
  inv = _mm256_mul_ps(inv, _mm256_fnmadd_ps(den, inv, _mm256_set1_ps(2.0f)));
  return _mm256_mul_ps(_mm256_mul_ps(x, inv), u);
}

constexpr float kGeluC = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluA = 0.044715f;

}  // namespace

// a[i] = silu(g[i]) * u[i] = g[i] / (1 + e^{-g[i]}) * u[i]
void silu_mul(const float* g, const float* u, int64_t n, float* a) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(g + i);
    _mm256_storeu_ps(a + i, over_one_plus_exp(x, x, _mm256_loadu_ps(u + i)));
  }
  for (; i < n; ++i) a[i] = g[i] / (1.0f + fast_exp(-g[i])) * u[i];
}

// a[i] = gelu_tanh(g[i]) * u[i]: 0.5 x (1 + tanh(y)) = x / (1 + e^{-2y}), y = sqrt(2/pi) (x + 0.044715 x^3)
// (torch's gelu(approximate="tanh"), transformers' gelu_pytorch_tanh)
void gelu_tanh_mul(const float* g, const float* u, int64_t n, float* a) {
  int64_t i = 0;
  const __m256 c2 = _mm256_set1_ps(2.0f * kGeluC), ca = _mm256_set1_ps(kGeluA);
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(g + i);
    const __m256 x3 = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
    const __m256 z = _mm256_mul_ps(c2, _mm256_fmadd_ps(ca, x3, x));
    _mm256_storeu_ps(a + i, over_one_plus_exp(x, z, _mm256_loadu_ps(u + i)));
  }
  for (; i < n; ++i) {
    const float x = g[i], z = 2.0f * kGeluC * (x + kGeluA * x * x * x);
    a[i] = x / (1.0f + fast_exp(-z)) * u[i];
  }
}

// a[i] = gelu_tanh(g[i]): a plain MLP's (StarCoder2)
void gelu_tanh(const float* g, int64_t n, float* a) {
  int64_t i = 0;
  const __m256 c2 = _mm256_set1_ps(2.0f * kGeluC), ca = _mm256_set1_ps(kGeluA), one = _mm256_set1_ps(1.0f);
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(g + i);
    const __m256 x3 = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
    _mm256_storeu_ps(a + i, over_one_plus_exp(x, _mm256_mul_ps(c2, _mm256_fmadd_ps(ca, x3, x)), one));
  }
  for (; i < n; ++i) {
    const float x = g[i], z = 2.0f * kGeluC * (x + kGeluA * x * x * x);
    a[i] = x / (1.0f + fast_exp(-z));
  }
}

}  // namespace llmserve
