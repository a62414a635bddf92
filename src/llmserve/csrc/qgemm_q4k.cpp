// q4k rows dequantized for embedding lookups (qgemm.h: Q4_K's super-block scales kept): each
// row's per-block half scale and minimum are made as the kernels make them, half(d sc) and
// half(-dmin mn) rounded to nearest even by F16C (which every kernel set has), then the row goes
// through q4's own dequantization, so a looked-up row is q4's bits.
#pragma GCC target("f16c")

#include <immintrin.h>

#include <vector>

#include "qgemm.h"

namespace llmserve {

void dequant_rows_q4k(const uint8_t* w, const uint16_t* d, const uint8_t* sub, int64_t K, const int64_t* ids,
                      int64_t n, float* out) {
  const int64_t nb = num_blocks(K), nsb = K / KSB;
#pragma omp parallel if (n * K >= (1 << 16))
  {
    // one tile's q4 scales [nb][16 rows], only the looked-up row's entries written
    std::vector<uint16_t> scale(nb * NT), minimum(nb * NT);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      const int64_t tile = ids[i] / NT, r = ids[i] % NT;
      const uint16_t* dt = d + tile * nsb * 2 * NT;
      const uint8_t* st = sub + tile * nsb * 16 * NT;
      for (int64_t b = 0; b < nb; ++b) {
        const uint16_t* dd = dt + (b / 8) * 2 * NT;
        const uint8_t* u = st + (b / 8) * 16 * NT + (b % 8) * NT;
        const float sc = _cvtsh_ss(dd[r]) * u[r], mn = -_cvtsh_ss(dd[NT + r]) * u[8 * NT + r];
        scale[b * NT + r] = _cvtss_sh(sc, _MM_FROUND_TO_NEAREST_INT);
        minimum[b * NT + r] = _cvtss_sh(mn, _MM_FROUND_TO_NEAREST_INT);
      }
      dequant_rows_q4(w + tile * nb * (KB * NT / 2), scale.data(), minimum.data(), K, &r, 1, out + i * K);
    }
  }
}

}  // namespace llmserve
