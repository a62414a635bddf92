// The fused forward of a Llama-family decoder stack (decoder_stack.cpp), as the Python module builds
// it: every pointer below is owned by a torch tensor that the Python side keeps alive for as long
// as the Decoder exists.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "qgemm.h"

namespace llmserve {

struct ShmComm;  // shm_comm.h

constexpr int kCacheF32 = 0, kCacheBF16 = 1, kCacheF16 = 2, kCacheI8 = 3;  // int8: see decoder_cache_rows.cpp
constexpr int64_t kInt8Group = 32;                                         // values per int8-cache scale

struct QuantLinear {
  int bits = 8;  // format code (qgemm.h): kQ8, kQ4, kQ6 or kQ4K
  const void* w = nullptr;
  const uint16_t* d = nullptr;
  const uint16_t* m = nullptr;  // GemmArgs::m: nullptr for q8 without minimums and symmetric q4
  const float* bias = nullptr;
  int64_t N = 0, K = 0;
  int act_bits = 16;  // GemmArgs::act_bits
  // Non-empty: a fused layer (qkv, gate_up) kept as several matrices whose rows follow one another
  // (shards in different formats, e.g. Q4_K q and k beside a Q6_K v); N is their sum, and the
  // fields above, but K, are unused. Rows are independent, so the output is the same bits as one
  // matrix in the widest format would give.
  std::vector<QuantLinear> parts;
};

// A sparse mixture-of-experts MLP (layers/moe.py): a float router picks k of E gated experts per token.
struct Moe {
  int64_t E = 0, k = 0;           // E == 0: the layer's MLP is dense (Layer::gate_up, down)
  bool renormalize = false;       // the top-k weights divided by their sum
  const float* router = nullptr;  // [E, H] float32
  std::vector<QuantLinear> gate_up, down;  // per expert: [gate | up] rows [2 I_e, H], down [H, I_e]
  QuantLinear shared_gate_up, shared_down;  // a shared expert (Qwen2-MoE), N == 0 where none
  const float* shared_gate = nullptr;       // [H]: sigmoid(h . shared_gate) scales the shared expert
};

// One adapter's LoRA pair for one linear layer (decoder_lora.cpp): y[t] += (x[t] A) B, the scale folded
// into B. a [K, R] and b [R, N] row-major in `dtype` (kLoraF32, kLoraBF16 or kLoraF16); R == 0: the
// adapter leaves the layer as it is. cols [R, 2]: the columns [cols[2r], cols[2r + 1]) where rank row
// r of b can be non-zero (a fused layer's stacked B is block-diagonal: q's ranks reach only q's columns).
constexpr int kLoraF32 = 0, kLoraBF16 = 1, kLoraF16 = 2;
struct LoraPair {
  const void* a = nullptr;
  const void* b = nullptr;
  const int64_t* cols = nullptr;
  int64_t R = 0;
};
constexpr int kLoraQKV = 0, kLoraO = 1, kLoraGateUp = 2, kLoraDown = 3, kLoraModules = 4;
struct LoraAdapter {
  int dtype = kLoraF32;
  std::vector<std::array<LoraPair, kLoraModules>> layers;  // per decoder layer: qkv, o, gate_up, down
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
  void* kv_cache = nullptr;  // [2, Hkv, num_blocks, block_size, row] of the cache type (int8 rows: D + 2 ceil(D/32) bytes);
                             // K and V of two types: [Hkv, num_blocks, block_size, row_k], V's half at v_offset
  int64_t window = 0;        // sliding window, 0 = full attention
  int64_t rope = 1;          // 0: q and k not rotated (a NoPE layer, SmolLM3's every fourth)
  Moe moe;
  // Gemma's sandwich norms: the attention's and the MLP's outputs normed before they join the
  // residual stream (nullptr: added as they are)
  const float* post_attn_norm = nullptr;
  const float* post_mlp_norm = nullptr;
  const float* cos_sin = nullptr;  // this layer's own RoPE table (Gemma 3's two bases), or nullptr: the stack's
  int64_t qk_norm_whole = 0;       // 1: q_norm over all Hq D of a token's q at once, k_norm over its Hkv D (OLMo 2)
  // LayerNorm stacks (StarCoder2, Decoder::norm_kind): the input and post-attention norms' biases
  const float* input_norm_bias = nullptr;
  const float* post_norm_bias = nullptr;
  int64_t gated = 1;  // 0: a plain MLP, down(act(up x)), `gate_up` holding the up rows alone (StarCoder2)
  // input_norm, post_norm nullptr: the layer's input is the stream itself (post-norm layers: OLMo 2)
};

constexpr int kActSilu = 0, kActGeluTanh = 1;  // Decoder::activation
constexpr int kNormRms = 0, kNormLayer = 1;     // Decoder::norm_kind: the input, post-attention and final norms

// Attention is computed on a fixed grid of positions, chunks [c * kChunk, (c + 1) * kChunk), the same
// whatever else is in the batch: a token's result is then the same to the bit whether it is decoded
// alone or with others (speculative verification, batches), as the matmuls' already is.
constexpr int64_t kChunk = 128;
// Up to kRun consecutive tokens of one sequence share a work item, reading each K and V row once.
constexpr int64_t kRun = 8;

struct AttentionItem {
  int64_t m0, m1, kh, p0, p1;  // tokens [m0, m1) of one sequence, KV head, grid chunk [p0, p1)
  int64_t slot;                // partial results of token m0 + u at slot + u
};

struct Decoder {
  int64_t H = 0, Hq = 0, Hkv = 0, D = 0, rot = 0, I = 0;
  int64_t num_blocks = 0, block_size = 0, max_position = 0;
  float eps = 1e-6f, scale = 1.0f;
  float residual_scale = 1.0f;   // r in residual += r * sublayer output (Granite; 1: r o == o exactly)
  int activation = kActSilu;     // the gated MLP's: silu or gelu_tanh (Gemma)
  float softcap = 0.f;           // c in c tanh(scale s / c) on the scores (Gemma 2), 0: none
  int norm_kind = kNormRms;      // LayerNorm with biases for StarCoder2 (q/k and Gemma's norms stay RMS)
  const float* final_norm_bias = nullptr;
  int cache_type = kCacheF32;    // K's type
  int v_cache_type = kCacheF32;  // V's: the same, unless K and V are kept apart (`--kv-cache-dtype int8,float16`)
  int64_t v_offset = 0;          // bytes from a layer's kv_cache to its V half (Hkv x K's head bytes when one type)
  const float* cos_sin = nullptr;  // [max_position, rot]: cos halves then sin halves
  const float* final_norm = nullptr;
  std::vector<Layer> layers;
  // A tensor-parallel rank's group: the o and down projections are row-parallel shards, their
  // partial outputs summed over the ranks right after each (nullptr: the whole model, no sums).
  ShmComm* comm = nullptr;

  // x [T, H] embeddings of a flat batch of T new tokens -> out [T, H] final hidden states.
  // positions, slots [T]: each token's position in its sequence and its cache slot; token_seqs [T]:
  // its sequence, a row of block_tables [num_seqs, max_blocks]. A token attends causally to its
  // sequence's positions up to its own (the batch's K/V are written to the cache first).
  // loras [num_loras], row_slots [T]: each token's adapter, an index in loras (-1: the base model);
  // num_loras == 0: every token runs the base model.
  void forward(const float* x, int64_t T, const int64_t* positions, const int64_t* slots,
               const int64_t* token_seqs, const int64_t* block_tables, int64_t max_blocks,
               const LoraAdapter* const* loras, int64_t num_loras, const int64_t* row_slots, float* out);

 private:
  void fit(int64_t M);
  int64_t mlp_width() const;  // the widest MLP (dense or expert) of any layer
  // h [M, H] (the post-attention norm's output) -> the MoE block's output, in place (decoder_moe.cpp)
  void moe_mlp(const Moe& moe, int64_t M, float* h);
  // The step's tokens grouped by adapter (decoder_lora.cpp): slot s's are lora_rows[lora_first[s] ..
  // lora_first[s + 1]); then y [M, N] += each token's adapter delta of layer l's `module`, x [M, K] its input:
  // plan_lora (one thread) lists the work items and returns their count, run_lora shares them out with
  // an `omp for` (every thread of the enclosing parallel region calls it, or one thread outside any),
  // so that the deltas join the parallel region of the per-token loop that reads y; add_lora: both.
  void group_lora(const LoraAdapter* const* loras, int64_t num_loras, const int64_t* row_slots, int64_t M);
  int64_t plan_lora(size_t l, int module);
  void run_lora(size_t l, int module, const float* x, int64_t K, int64_t N, float* y);
  void add_lora(size_t l, int module, const float* x, int64_t K, int64_t N, float* y);
  void plan_attention(int64_t T, const int64_t* positions, const int64_t* token_seqs, int64_t window);
  void norm(const float* x, const float* w, const float* b, float* out) const;  // the stream's [H] norm
  int64_t capacity = 0;
  std::vector<float> res, h, qkv, attn, gate_up, act;
  std::vector<AttentionItem> items;  // this layer's attention work
  std::vector<int64_t> lo, hi;       // each token's visible positions [lo, hi)
  std::vector<int64_t> group_items;  // per (token, KV head): its items are [first, last), 2 entries
  std::vector<float> part_o, part_mx, part_l;  // per slot and query head: o [D], mx, l
  std::vector<float> moe_x, moe_y, moe_out, moe_w;   // expert rows in and out, the block's sum, weights
  std::vector<int64_t> moe_ids, moe_rows;           // each token's chosen experts; one expert's pairs
  std::vector<const LoraAdapter*> lora;             // this forward's adapters (empty: none)
  std::vector<int64_t> lora_rows, lora_first;       // their tokens, grouped by adapter
  std::vector<int64_t> lora_items;                  // one layer's work: (adapter, first token) pairs
  std::vector<float> lora_h;                        // the shrink's output, [tokens of any adapter, R]
  int64_t lora_ldh = 0;                             // its row length: one layer's largest rank
};

// Shared with decoder_moe.cpp (defined in decoder_stack.cpp).
void linear(const QuantLinear& w, const float* x, int64_t M, float* out);  // out [M, N] = x [M, K] W.T (+ b)
// decoder_act.cpp
void silu_mul(const float* g, const float* u, int64_t n, float* a);        // a = silu(g) * u
void gelu_tanh_mul(const float* g, const float* u, int64_t n, float* a);   // a = gelu_tanh(g) * u
void gelu_tanh(const float* g, int64_t n, float* a);                        // a = gelu_tanh(g)

// KV cache rows of D values in `cache_type` (decoder_cache_rows.cpp): bytes per row; one float32
// row stored; `rows` rows read as float32 into dst (a float32 cache's own rows are returned as they are)
int64_t row_bytes(int cache_type, int64_t D);
void store_row(int cache_type, const float* src, int64_t n, void* dst);
const float* load_rows(int cache_type, const void* src, int64_t rows, int64_t D, float* dst);
// Asks for `bytes` of cache rows at `p` to be brought into the L1 (attention's next block).
void prefetch_rows(const void* p, int64_t bytes);

// Dispatch to the kernel set in use (module.cpp).
void gemm(int bits, const GemmArgs& a);

}  // namespace llmserve
