// The fused forward of a Llama-family decoder stack (decoder_stack.cpp), as the Python module builds
// it: every pointer below is owned by a torch tensor that the Python side keeps alive for as long
// as the Decoder exists.
#pragma once

#include <cstdint>
#include <vector>

#include "qgemm.h"

namespace llmserve {

constexpr int kCacheF32 = 0, kCacheBF16 = 1, kCacheF16 = 2, kCacheI8 = 3;  // int8: see decoder_stack.cpp
constexpr int64_t kInt8Group = 32;                                         // values per int8-cache scale

struct QuantLinear {
  int bits = 8;  // 8 (q8) or 4 (q4)
  const void* w = nullptr;
  const uint16_t* d = nullptr;
  const uint16_t* m = nullptr;
  const float* bias = nullptr;
  int64_t N = 0, K = 0;
};

struct Layer {
  const float* input_norm = nullptr;
  QuantLinear qkv;
  const float* q_norm = nullptr;  // per-head norms (Qwen3), or nullptr
  const float* k_norm = nullptr;
  QuantLinear o;
  const float* post_norm = nullptr;
  QuantLinear gate_up;  // [gate | up] rows
  QuantLinear down;
  void* kv_cache = nullptr;  // [2, Hkv, num_blocks, block_size, row] of the cache type (int8 rows: D + 2 ceil(D/32) bytes)
  int64_t window = 0;        // sliding window, 0 = full attention
};

struct AttentionItem {
  int64_t m, kh, p0, p1;  // token, KV head, visible positions [p0, p1)
};

struct Decoder {
  int64_t H = 0, Hq = 0, Hkv = 0, D = 0, rot = 0, I = 0;
  int64_t num_blocks = 0, block_size = 0, max_position = 0;
  float eps = 1e-6f, scale = 1.0f;
  int cache_type = kCacheF32;
  const float* cos_sin = nullptr;  // [max_position, rot]: cos halves then sin halves
  const float* final_norm = nullptr;
  std::vector<Layer> layers;

  // x [T, H] embeddings of a flat batch of T new tokens -> out [T, H] final hidden states.
  // positions, slots [T]: each token's position in its sequence and its cache slot; token_seqs [T]:
  // its sequence, a row of block_tables [num_seqs, max_blocks]. A token attends causally to its
  // sequence's positions up to its own (the batch's K/V are written to the cache first).
  void forward(const float* x, int64_t T, const int64_t* positions, const int64_t* slots,
               const int64_t* token_seqs, const int64_t* block_tables, int64_t max_blocks, float* out);

 private:
  void fit(int64_t M);
  void plan_attention(int64_t T, const int64_t* positions, int64_t window);
  int64_t capacity = 0;
  std::vector<float> res, h, qkv, attn, gate_up, act;
  std::vector<AttentionItem> items;  // this layer's attention work
  std::vector<int64_t> item_groups;  // where each (token, KV head)'s chunks start in `items`, + end
  int64_t max_chunk = 0;             // longest chunk of `items`
  std::vector<float> part_o, part_mx, part_l;  // per item and query head: o [D], mx, l
};

// Dispatch to the kernel set in use (module.cpp).
void gemm(int bits, const GemmArgs& a);

}  // namespace llmserve
