// llmserve._cpu_kernels: the Python face of the block-quantized CPU kernels (qgemm.h).
//
// Every function takes tensors as raw addresses (torch's `data_ptr()`) and sizes: the Python side
// (llmserve.layers.quantization.cpu_kernels) owns the tensors and checks their dtypes, shapes and
// contiguity once, where they are created; calls then cost a few hundred nanoseconds. The GIL is
// released while a kernel runs, so the server's event loop keeps going.
//
// The kernel set is chosen once from the CPU's features (AVX-512 VNNI, else AVX2+FMA+F16C) and can
// be lowered with set_isa() - the tests use that to run the AVX2 path on an AVX-512 machine.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <cstring>
#include <vector>

#include "decoder_stack.h"
#include "qgemm.h"
#include "py_util.h"
#include "shm_comm.h"

namespace llmserve {
namespace {

enum class Isa { none = 0, avx2 = 1, avx512_vnni = 2 };
const char* const kIsaNames[] = {"none", "avx2", "avx512_vnni"};

Isa detect_isa() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("f16c");
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                      __builtin_cpu_supports("avx512vnni");
  return avx512 ? Isa::avx512_vnni : (avx2 ? Isa::avx2 : Isa::none);
#else
  return Isa::none;
#endif
}

const Isa g_best = detect_isa();
Isa g_isa = g_best;

float half_to_float(uint16_t h) {  // IEEE binary16 -> binary32, subnormals included
  const uint32_t sign = uint32_t(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    int e = -1;
    do {
      ++e;
      man <<= 1;
    } while (!(man & 0x400));
    bits = sign | uint32_t(112 - e) << 23 | ((man & 0x3FF) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// -- the fused decoder stack (decoder_stack.cpp) ----------------------------------------------------------------

const char* const kDecoderCapsule = "llmserve.Decoder";

bool item_ll(PyObject* seq, Py_ssize_t i, int64_t* out) {
  PyObject* o = PyTuple_GetItem(seq, i);  // borrowed
  if (!o) return false;
  *out = PyLong_AsLongLong(o);
  return !PyErr_Occurred();
}

template <typename T>
bool item_ptr(PyObject* seq, Py_ssize_t i, T** out) {
  PyObject* o = PyTuple_GetItem(seq, i);
  if (!o) return false;
  *out = static_cast<T*>(PyLong_AsVoidPtr(o));
  return !PyErr_Occurred();
}

bool item_float(PyObject* seq, Py_ssize_t i, float* out) {
  PyObject* o = PyTuple_GetItem(seq, i);
  if (!o) return false;
  *out = static_cast<float>(PyFloat_AsDouble(o));
  return !PyErr_Occurred();
}

// (bits, w, d, m, bias, N, K, act_bits), or a list of them: one fused layer's matrices, rows one
// after another (QuantLinear::parts)
bool parse_linear(PyObject* t, QuantLinear* q) {
  if (PyList_Check(t)) {
    q->parts.resize(PyList_GET_SIZE(t));
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(t); ++i)
      if (!parse_linear(PyList_GET_ITEM(t, i), &q->parts[i])) return false;
    if (q->parts.empty()) {
      PyErr_SetString(PyExc_ValueError, "a linear layer's list of matrices is empty");
      return false;
    }
    q->K = q->parts[0].K, q->N = 0;
    for (const QuantLinear& p : q->parts) {
      if (p.K != q->K) {
        PyErr_SetString(PyExc_ValueError, "a linear layer's matrices differ in input width");
        return false;
      }
      q->N += p.N;
    }
    return true;
  }
  if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 8) {
    PyErr_SetString(PyExc_TypeError, "a linear layer is (bits, w, d, m, bias, N, K, act_bits)");
    return false;
  }
  int64_t bits, act_bits;
  if (!item_ll(t, 0, &bits) || !item_ptr(t, 1, const_cast<void**>(&q->w)) ||
      !item_ptr(t, 2, const_cast<uint16_t**>(&q->d)) || !item_ptr(t, 3, const_cast<uint16_t**>(&q->m)) ||
      !item_ptr(t, 4, const_cast<float**>(&q->bias)) || !item_ll(t, 5, &q->N) || !item_ll(t, 6, &q->K) ||
      !item_ll(t, 7, &act_bits))
    return false;
  if (bits != kQ8 && bits != kQ4 && bits != kQ6 && bits != kQ4K) {
    PyErr_Format(PyExc_ValueError, "bits must be 8, 4, 6 (q6) or 46 (q4k), got %lld", static_cast<long long>(bits));
    return false;
  }
  if (act_bits != 16 && act_bits != 8) {
    PyErr_Format(PyExc_ValueError, "act_bits must be 16 or 8, got %lld", static_cast<long long>(act_bits));
    return false;
  }
  if (bits == kQ6 && q->K % Q6_SUPER) {
    PyErr_Format(PyExc_ValueError, "q6 rows are whole super-blocks of %d columns; K is %lld", Q6_SUPER,
                 static_cast<long long>(q->K));
    return false;
  }
  q->bits = static_cast<int>(bits);
  q->act_bits = static_cast<int>(act_bits);
  return true;
}

bool parse_linears(PyObject* list, std::vector<QuantLinear>* out) {
  if (!PyList_Check(list)) {
    PyErr_SetString(PyExc_TypeError, "experts' layers are a list");
    return false;
  }
  out->resize(PyList_GET_SIZE(list));
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(list); ++i)
    if (!parse_linear(PyList_GET_ITEM(list, i), &(*out)[i])) return false;
  return true;
}

// None (a dense MLP), or (E, k, renormalize, router, [gate_up], [down], shared_gate_up | None,
// shared_down | None, shared_gate)
bool parse_moe(PyObject* t, Moe* moe) {
  if (t == Py_None) return true;
  if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 9) {
    PyErr_SetString(PyExc_TypeError, "a MoE block is a tuple of 9 entries");
    return false;
  }
  int64_t renormalize = 0;
  if (!item_ll(t, 0, &moe->E) || !item_ll(t, 1, &moe->k) || !item_ll(t, 2, &renormalize) ||
      !item_ptr(t, 3, const_cast<float**>(&moe->router)) || !parse_linears(PyTuple_GET_ITEM(t, 4), &moe->gate_up) ||
      !parse_linears(PyTuple_GET_ITEM(t, 5), &moe->down) || !item_ptr(t, 8, const_cast<float**>(&moe->shared_gate)))
    return false;
  moe->renormalize = renormalize != 0;
  PyObject *sgu = PyTuple_GET_ITEM(t, 6), *sd = PyTuple_GET_ITEM(t, 7);
  if (sgu != Py_None && (!parse_linear(sgu, &moe->shared_gate_up) || !parse_linear(sd, &moe->shared_down)))
    return false;
  const bool shared_ok = (sgu == Py_None) == (sd == Py_None) && (sgu == Py_None || moe->shared_gate != nullptr);
  if (moe->E <= 0 || moe->k <= 0 || moe->k > moe->E || static_cast<int64_t>(moe->gate_up.size()) != moe->E ||
      static_cast<int64_t>(moe->down.size()) != moe->E || !shared_ok) {
    PyErr_SetString(PyExc_ValueError, "decoder_new: inconsistent MoE block");
    return false;
  }
  return true;
}

// (input_norm, qkv, q_norm, k_norm, o, post_norm, gate_up, down, kv_cache, window, moe, rope,
// post_attn_norm, post_mlp_norm, cos_sin, qk_norm_whole, input_norm_bias, post_norm_bias, gated);
// a MoE layer's gate_up and down are None; rope 0: a layer without positions (NoPE); a norm, bias or
// table 0 where the layer has none of its own; gated 0: a plain MLP (gate_up holds the up rows)
bool parse_layer(PyObject* t, Layer* L) {
  if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 19) {
    PyErr_SetString(PyExc_TypeError, "a layer is a tuple of 19 entries");
    return false;
  }
  PyObject* moe = PyTuple_GET_ITEM(t, 10);
  const bool dense = moe == Py_None;
  return item_ptr(t, 0, const_cast<float**>(&L->input_norm)) && parse_linear(PyTuple_GET_ITEM(t, 1), &L->qkv) &&
         item_ptr(t, 2, const_cast<float**>(&L->q_norm)) && item_ptr(t, 3, const_cast<float**>(&L->k_norm)) &&
         parse_linear(PyTuple_GET_ITEM(t, 4), &L->o) && item_ptr(t, 5, const_cast<float**>(&L->post_norm)) &&
         (!dense || parse_linear(PyTuple_GET_ITEM(t, 6), &L->gate_up)) &&
         (!dense || parse_linear(PyTuple_GET_ITEM(t, 7), &L->down)) && item_ptr(t, 8, &L->kv_cache) &&
         item_ll(t, 9, &L->window) && parse_moe(moe, &L->moe) && item_ll(t, 11, &L->rope) &&
         item_ptr(t, 12, const_cast<float**>(&L->post_attn_norm)) &&
         item_ptr(t, 13, const_cast<float**>(&L->post_mlp_norm)) && item_ptr(t, 14, const_cast<float**>(&L->cos_sin)) &&
         item_ll(t, 15, &L->qk_norm_whole) && item_ptr(t, 16, const_cast<float**>(&L->input_norm_bias)) &&
         item_ptr(t, 17, const_cast<float**>(&L->post_norm_bias)) && item_ll(t, 18, &L->gated);
}

void free_decoder(PyObject* capsule) {
  delete static_cast<Decoder*>(PyCapsule_GetPointer(capsule, kDecoderCapsule));
}

// decoder_new(config, layers, cos_sin, final_norm[, comm]) -> capsule
// config = (H, Hq, Hkv, D, rot, I, num_blocks, block_size, max_position, eps, scale, cache_type,
//           v_cache_type, v_offset, residual_scale, activation, softcap, norm_kind, final_norm_bias): K's
//           cache type, V's, the bytes from a
//           layer's cache to its V half, what each sublayer's output is multiplied by as it joins the
//           residual stream (Granite's residual_multiplier; 1 for the others), the gated MLP's
//           activation (kActSilu, kActGeluTanh), the scores' soft cap (Gemma 2; 0: none), the stream
//           norms' kind (kNormRms, kNormLayer) and the final norm's bias (LayerNorm's; 0: none);
// comm: a tensor-parallel rank's group (its layers are shards), or None
PyObject* py_decoder_new(PyObject*, PyObject* args) {
  PyObject *config, *layers, *cos_sin, *final_norm, *comm = Py_None;
  if (!PyArg_ParseTuple(args, "O!O!OO|O", &PyTuple_Type, &config, &PyList_Type, &layers, &cos_sin, &final_norm,
                        &comm))
    return nullptr;
  ShmComm* group = nullptr;
  if (comm != Py_None && !(group = comm_of(comm))) return nullptr;
  if (PyTuple_GET_SIZE(config) != 19) {
    PyErr_SetString(PyExc_TypeError, "config is a tuple of 19 entries");
    return nullptr;
  }
  auto dec = new Decoder();
  int64_t cache_type = 0, v_cache_type = 0, activation = 0, norm_kind = 0;
  bool ok = item_ll(config, 0, &dec->H) && item_ll(config, 1, &dec->Hq) && item_ll(config, 2, &dec->Hkv) &&
            item_ll(config, 3, &dec->D) && item_ll(config, 4, &dec->rot) && item_ll(config, 5, &dec->I) &&
            item_ll(config, 6, &dec->num_blocks) && item_ll(config, 7, &dec->block_size) &&
            item_ll(config, 8, &dec->max_position) && item_float(config, 9, &dec->eps) &&
            item_float(config, 10, &dec->scale) && item_ll(config, 11, &cache_type) &&
            item_ll(config, 12, &v_cache_type) && item_ll(config, 13, &dec->v_offset) &&
            item_float(config, 14, &dec->residual_scale) && item_ll(config, 15, &activation) &&
            item_float(config, 16, &dec->softcap) && item_ll(config, 17, &norm_kind) &&
            item_ptr(config, 18, const_cast<float**>(&dec->final_norm_bias));
  dec->cos_sin = static_cast<const float*>(PyLong_AsVoidPtr(cos_sin));
  dec->final_norm = static_cast<const float*>(PyLong_AsVoidPtr(final_norm));
  ok = ok && !PyErr_Occurred();
  if (ok && (cache_type < kCacheF32 || cache_type > kCacheI8 || v_cache_type < kCacheF32 ||
             v_cache_type > kCacheI8 || dec->v_offset <= 0 || dec->Hkv <= 0 || dec->Hq % dec->Hkv ||
             dec->rot > dec->D || dec->rot % 2 || (activation != kActSilu && activation != kActGeluTanh) || dec->softcap < 0.f ||
             (norm_kind != kNormRms && norm_kind != kNormLayer))) {
    PyErr_SetString(PyExc_ValueError, "decoder_new: inconsistent config");
    ok = false;
  }
  dec->cache_type = static_cast<int>(cache_type);
  dec->v_cache_type = static_cast<int>(v_cache_type);
  dec->activation = static_cast<int>(activation);
  dec->norm_kind = static_cast<int>(norm_kind);
  for (Py_ssize_t i = 0; ok && i < PyList_GET_SIZE(layers); ++i) {
    dec->layers.emplace_back();
    ok = parse_layer(PyList_GET_ITEM(layers, i), &dec->layers.back());
  }
  dec->comm = group;
  if (!ok) {
    delete dec;
    return nullptr;
  }
  PyObject* capsule = PyCapsule_New(dec, kDecoderCapsule, free_decoder);
  if (!capsule) delete dec;
  return capsule;
}

// -- LoRA adapters of the fused decoder (decoder_lora.cpp) --------------------------------------------------------

const char* const kLoraCapsule = "llmserve.LoraAdapter";

void free_lora(PyObject* capsule) { delete static_cast<LoraAdapter*>(PyCapsule_GetPointer(capsule, kLoraCapsule)); }

// None (the adapter leaves this linear layer alone) or (a, b, cols, R)
bool parse_lora_pair(PyObject* t, LoraPair* p) {
  if (t == Py_None) return true;
  if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 4) {
    PyErr_SetString(PyExc_TypeError, "a LoRA pair is (a, b, cols, R) or None");
    return false;
  }
  if (!item_ptr(t, 0, const_cast<void**>(&p->a)) || !item_ptr(t, 1, const_cast<void**>(&p->b)) ||
      !item_ptr(t, 2, const_cast<int64_t**>(&p->cols)) || !item_ll(t, 3, &p->R))
    return false;
  if (p->R < 1 || !p->a || !p->b || !p->cols) {
    PyErr_SetString(PyExc_ValueError, "decoder_lora_new: a LoRA pair needs R >= 1 and its three tensors");
    return false;
  }
  return true;
}

// decoder_lora_new(decoder, dtype, layers) -> capsule; layers: per decoder layer, a tuple of 4 LoRA
// pairs (qkv, o, gate_up, down). The tensors are the caller's, kept alive as long as the capsule.
PyObject* py_decoder_lora_new(PyObject*, PyObject* args) {
  PyObject *decoder, *layers;
  int dtype;
  if (!PyArg_ParseTuple(args, "OiO!", &decoder, &dtype, &PyList_Type, &layers)) return nullptr;
  auto dec = static_cast<Decoder*>(PyCapsule_GetPointer(decoder, kDecoderCapsule));
  if (!dec) return nullptr;
  if (dtype < kLoraF32 || dtype > kLoraF16 || PyList_GET_SIZE(layers) != static_cast<Py_ssize_t>(dec->layers.size())) {
    PyErr_SetString(PyExc_ValueError, "decoder_lora_new: a dtype of 0, 1 or 2 and one entry per decoder layer");
    return nullptr;
  }
  auto lora = new LoraAdapter();
  lora->dtype = dtype;
  lora->layers.resize(dec->layers.size());
  bool ok = true;
  for (Py_ssize_t i = 0; ok && i < PyList_GET_SIZE(layers); ++i) {
    PyObject* t = PyList_GET_ITEM(layers, i);
    ok = PyTuple_Check(t) && PyTuple_GET_SIZE(t) == kLoraModules;
    if (!ok) PyErr_SetString(PyExc_TypeError, "a layer's LoRA pairs are a tuple of 4 (qkv, o, gate_up, down)");
    for (int j = 0; ok && j < kLoraModules; ++j) ok = parse_lora_pair(PyTuple_GET_ITEM(t, j), &lora->layers[i][j]);
    ok = ok && (!dec->layers[i].moe.E || (!lora->layers[i][kLoraGateUp].R && !lora->layers[i][kLoraDown].R));
    if (ok) continue;
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "decoder_lora_new: a MoE layer takes no MLP pairs");
  }
  if (!ok) {
    delete lora;
    return nullptr;
  }
  PyObject* capsule = PyCapsule_New(lora, kLoraCapsule, free_lora);
  if (!capsule) delete lora;
  return capsule;
}

// decoder_forward(decoder, x, T, positions, slots, token_seqs, block_tables, max_blocks, loras,
//                 row_slots, out) -> None; loras: a tuple of decoder_lora_new capsules (empty: none),
//                 row_slots [T] int64: each token's index in it, -1 for the base model
PyObject* py_decoder_forward(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!check_args(nargs, 11, "decoder_forward")) return nullptr;
  auto dec = static_cast<Decoder*>(PyCapsule_GetPointer(args[0], kDecoderCapsule));
  if (!dec) return nullptr;
  const float* x = ptr<const float>(args[1]);
  const int64_t M = PyLong_AsLongLong(args[2]);
  const int64_t* positions = ptr<const int64_t>(args[3]);
  const int64_t* slots = ptr<const int64_t>(args[4]);
  const int64_t* token_seqs = ptr<const int64_t>(args[5]);
  const int64_t* tables = ptr<const int64_t>(args[6]);
  const int64_t max_blocks = PyLong_AsLongLong(args[7]);
  const int64_t* row_slots = ptr<const int64_t>(args[9]);
  float* out = ptr<float>(args[10]);
  if (PyErr_Occurred()) return nullptr;
  if (!PyTuple_Check(args[8])) {
    PyErr_SetString(PyExc_TypeError, "decoder_forward: loras is a tuple");
    return nullptr;
  }
  const Py_ssize_t num_loras = PyTuple_GET_SIZE(args[8]);
  std::vector<const LoraAdapter*> loras(num_loras);
  for (Py_ssize_t i = 0; i < num_loras; ++i)
    if (!(loras[i] = static_cast<LoraAdapter*>(PyCapsule_GetPointer(PyTuple_GET_ITEM(args[8], i), kLoraCapsule))))
      return nullptr;
  if (num_loras && (!row_slots || loras[0]->layers.size() != dec->layers.size())) {
    PyErr_SetString(PyExc_ValueError, "decoder_forward: adapters need row_slots and one entry per layer");
    return nullptr;
  }
  if (g_isa == Isa::none) {
    PyErr_SetString(PyExc_RuntimeError, "decoder_forward: no quantized kernel set on this CPU");
    return nullptr;
  }
  if (!run_comm([&] {
        dec->forward(x, M, positions, slots, token_seqs, tables, max_blocks, loras.data(), num_loras, row_slots, out);
      }))
    return nullptr;
  Py_RETURN_NONE;
}

// gemm(bits, x, ldx, M, K, N, w, d, m, bias, out, ldo, act_bits) -> None
PyObject* py_gemm(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!check_args(nargs, 13, "gemm")) return nullptr;
  const long bits = PyLong_AsLong(args[0]);
  GemmArgs a;
  a.x = ptr<const float>(args[1]);
  a.ldx = PyLong_AsLongLong(args[2]);
  a.M = PyLong_AsLongLong(args[3]);
  a.K = PyLong_AsLongLong(args[4]);
  a.N = PyLong_AsLongLong(args[5]);
  a.w = ptr<const void>(args[6]);
  a.d = ptr<const uint16_t>(args[7]);
  a.m = ptr<const uint16_t>(args[8]);
  a.bias = ptr<const float>(args[9]);
  a.out = ptr<float>(args[10]);
  a.ldo = PyLong_AsLongLong(args[11]);
  a.act_bits = static_cast<int>(PyLong_AsLong(args[12]));
  if (PyErr_Occurred()) return nullptr;
  if (bits != kQ8 && bits != kQ4 && bits != kQ6 && bits != kQ4K) {
    PyErr_Format(PyExc_ValueError, "gemm: bits must be 8, 4, 6 (q6) or 46 (q4k), got %ld", bits);
    return nullptr;
  }
  if (a.act_bits != 16 && a.act_bits != 8) {
    PyErr_Format(PyExc_ValueError, "gemm: act_bits must be 16 or 8, got %d", a.act_bits);
    return nullptr;
  }
  if (bits == kQ6 && a.K % Q6_SUPER) {
    PyErr_Format(PyExc_ValueError, "gemm: q6 rows are whole super-blocks of %d columns; K is %lld", Q6_SUPER,
                 static_cast<long long>(a.K));
    return nullptr;
  }
  if (g_isa == Isa::none) {
    PyErr_SetString(PyExc_RuntimeError, "gemm: this CPU has neither AVX2+FMA+F16C nor AVX-512 VNNI");
    return nullptr;
  }
  if (a.M > 0 && a.N > 0) {
    Py_BEGIN_ALLOW_THREADS;
    gemm(static_cast<int>(bits), a);
    Py_END_ALLOW_THREADS;
  }
  Py_RETURN_NONE;
}

// dequant_rows(bits, w, d, m, K, ids, n, out) -> None: out[i, :K] = row ids[i] of the weight
PyObject* py_dequant_rows(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!check_args(nargs, 8, "dequant_rows")) return nullptr;
  const long bits = PyLong_AsLong(args[0]);
  const void* w = ptr<const void>(args[1]);
  const uint16_t* d = ptr<const uint16_t>(args[2]);
  const uint16_t* m = ptr<const uint16_t>(args[3]);
  const int64_t K = PyLong_AsLongLong(args[4]);
  const int64_t* ids = ptr<const int64_t>(args[5]);
  const int64_t n = PyLong_AsLongLong(args[6]);
  float* out = ptr<float>(args[7]);
  if (PyErr_Occurred()) return nullptr;
  if (bits == kQ4K && g_isa == Isa::none) {  // its rounding is F16C's
    PyErr_SetString(PyExc_RuntimeError, "dequant_rows: q4k needs a CPU with F16C");
    return nullptr;
  }
  Py_BEGIN_ALLOW_THREADS;
  if (bits == kQ8) dequant_rows_q8(static_cast<const int8_t*>(w), d, m, K, ids, n, out);
  else if (bits == kQ6) dequant_rows_q6(static_cast<const uint8_t*>(w), d, K, ids, n, out);
  else if (bits == kQ4K) dequant_rows_q4k(static_cast<const uint8_t*>(w), d, reinterpret_cast<const uint8_t*>(m), K, ids, n, out);
  else dequant_rows_q4(static_cast<const uint8_t*>(w), d, m, K, ids, n, out);
  Py_END_ALLOW_THREADS;
  Py_RETURN_NONE;
}

PyObject* py_isa(PyObject*, PyObject*) { return PyUnicode_FromString(kIsaNames[int(g_isa)]); }

PyObject* py_best_isa(PyObject*, PyObject*) { return PyUnicode_FromString(kIsaNames[int(g_best)]); }

// set_isa(name): use a kernel set no better than the CPU's best ("avx512_vnni", "avx2").
PyObject* py_set_isa(PyObject*, PyObject* arg) {
  const char* name = PyUnicode_AsUTF8(arg);
  if (!name) return nullptr;
  for (int i = 1; i <= int(Isa::avx512_vnni); ++i) {
    if (std::strcmp(name, kIsaNames[i]) != 0) continue;
    if (i > int(g_best)) {
      PyErr_Format(PyExc_ValueError, "kernel set %s needs CPU features this CPU lacks (best: %s)", name,
                   kIsaNames[int(g_best)]);
      return nullptr;
    }
    g_isa = Isa(i);
    Py_RETURN_NONE;
  }
  PyErr_Format(PyExc_ValueError, "unknown kernel set %R; known: avx512_vnni, avx2", arg);
  return nullptr;
}

PyMethodDef kMethods[] = {
    {"gemm", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_gemm)), METH_FASTCALL,
     "gemm(bits, x, ldx, M, K, N, w, d, m, bias, out, ldo, act_bits): out = x @ W.T (+ bias), W block-quantized"},
    {"dequant_rows", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_dequant_rows)), METH_FASTCALL,
     "dequant_rows(bits, w, d, m, K, ids, n, out): rows `ids` of a block-quantized weight as float32"},
    {"decoder_new", py_decoder_new, METH_VARARGS,
     "decoder_new(config, layers, cos_sin, final_norm): a fused Llama-family decoder stack (capsule)"},
    {"decoder_forward", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_decoder_forward)),
     METH_FASTCALL,
     "decoder_forward(decoder, x, T, positions, slots, token_seqs, block_tables, max_blocks, loras, row_slots, "
     "out)"},
    {"decoder_lora_new", py_decoder_lora_new, METH_VARARGS,
     "decoder_lora_new(decoder, dtype, layers): a LoRA adapter the fused decoder adds (capsule)"},
    {"comm_segment_bytes", py_comm_segment_bytes, METH_VARARGS,
     "comm_segment_bytes(world, slot_bytes, bcast_bytes): the shared segment's size"},
    {"comm_new", py_comm_new, METH_VARARGS,
     "comm_new(address, rank, world, slot_bytes, bcast_bytes, timeout_s): this rank's shared-memory group"},
    {"comm_all_reduce", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_comm_all_reduce)),
     METH_FASTCALL, "comm_all_reduce(comm, address, n): float32 [n] summed over the ranks in place"},
    {"comm_all_gather", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_comm_all_gather)),
     METH_FASTCALL, "comm_all_gather(comm, src, nbytes, dst): every rank's bytes, in rank order"},
    {"comm_broadcast", py_comm_broadcast, METH_VARARGS, "comm_broadcast(comm, data | None): rank 0's bytes"},
    {"comm_abort", py_comm_abort, METH_O, "comm_abort(comm): fail every rank's collectives"},
    {"job_runs_trial", py_job_runs_trial, METH_VARARGS,
     "job_runs_trial(n, parts, threads, slow_us[, team]): (runs of each job, jobs of each thread), a thread slowed"},
    {"isa", py_isa, METH_NOARGS, "the kernel set in use: 'avx512_vnni', 'avx2' or 'none'"},
    {"best_isa", py_best_isa, METH_NOARGS, "the best kernel set this CPU runs"},
    {"set_isa", py_set_isa, METH_O, "use the named kernel set (no better than best_isa())"},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_cpu_kernels", "Block-quantized CPU matmul kernels.", -1,
                       kMethods};

}  // namespace

void gemm(int bits, const GemmArgs& a) {
  if (bits == kQ6) {
    g_isa == Isa::avx512_vnni ? avx512::gemm_q6(a) : avx2::gemm_q6(a);
    return;
  }
  if (g_isa == Isa::avx512_vnni) {
    bits == kQ8 ? avx512::gemm_q8(a) : bits == kQ4K ? avx512::gemm_q4k(a) : avx512::gemm_q4(a);
  } else {
    bits == kQ8 ? avx2::gemm_q8(a) : bits == kQ4K ? avx2::gemm_q4k(a) : avx2::gemm_q4(a);
  }
}

// -- portable dequantization (embedding lookups of a tied, quantized table) ----------------------

void dequant_rows_q8(const int8_t* w, const uint16_t* d, const uint16_t* m, int64_t K, const int64_t* ids, int64_t n,
                     float* out) {
  const int64_t nb = num_blocks(K);
#pragma omp parallel for schedule(static) if (n * K >= (1 << 16))
  for (int64_t i = 0; i < n; ++i) {
    const int64_t tile = ids[i] / NT, r = ids[i] % NT;
    const int8_t* wt = w + tile * nb * (KB * NT);
    const uint16_t* dt = d + tile * nb * NT;
    float* o = out + i * K;
    for (int64_t b = 0; b < nb; ++b) {
      const float s = half_to_float(dt[b * NT + r]);
      const float mn = m ? half_to_float(m[tile * nb * NT + b * NT + r]) : 0.f;
      for (int p = 0; p < KB / 2; ++p)
        for (int j = 0; j < 2; ++j) {
          const int64_t k = b * KB + 2 * p + j;
          if (k < K) o[k] = s * wt[b * (KB * NT) + (p * NT + r) * 2 + j] + mn;
        }
    }
  }
}

void dequant_rows_q4(const uint8_t* w, const uint16_t* d, const uint16_t* m, int64_t K, const int64_t* ids,
                     int64_t n, float* out) {
  const int64_t nb = num_blocks(K);
#pragma omp parallel for schedule(static) if (n * K >= (1 << 16))
  for (int64_t i = 0; i < n; ++i) {
    const int64_t tile = ids[i] / NT, r = ids[i] % NT;
    const uint8_t* wt = w + tile * nb * (KB * NT / 2);
    const uint16_t* dt = d + tile * nb * NT;
    const uint16_t* mt = m ? m + tile * nb * NT : nullptr;  // nullptr: symmetric, m = -8 d
    float* o = out + i * K;
    for (int64_t b = 0; b < nb; ++b) {
      const float s_ = half_to_float(dt[b * NT + r]), mn = mt ? half_to_float(mt[b * NT + r]) : -8.f * s_;
      for (int g = 0; g < KB / 8; ++g)
        for (int j = 0; j < 2; ++j) {
          const uint8_t* v = wt + b * (KB * NT / 2) + (g * NT + r) * 4 + j * 2;
          const unsigned u = v[0] | (unsigned(v[1]) << 8);  // four nibbles: columns 8g + 2s + j
          for (int s = 0; s < 4; ++s) {
            const int64_t k = b * KB + 8 * g + 2 * s + j;
            if (k < K) o[k] = s_ * ((u >> (4 * s)) & 0x0F) + mn;
          }
        }
    }
  }
}

// q6 (qgemm.h): w = d sc (q - 32), computed as (d sc) (q - 32) in float32 as gguf does (exact).
void dequant_rows_q6(const uint8_t* w, const uint16_t* d, int64_t K, const int64_t* ids, int64_t n, float* out) {
  const int64_t ns = K / Q6_SUPER;
#pragma omp parallel for schedule(static) if (n * K >= (1 << 16))
  for (int64_t i = 0; i < n; ++i) {
    const int64_t tile = ids[i] / NT, r = ids[i] % NT;
    float* o = out + i * K;
    for (int64_t s = 0; s < ns; ++s) {
      const uint8_t* rec = w + (tile * ns + s) * Q6_RECORD;
      const float dv = half_to_float(d[(tile * ns + s) * NT + r]);
      for (int j = 0; j < Q6_SUPER / Q6_SUB; ++j) {
        const float scale = dv * static_cast<float>(static_cast<int8_t>(rec[j * NT + r]));
        const uint8_t* sub = rec + Q6_SUB * NT + j * 192;
        for (int c = 0; c < Q6_SUB; ++c) {  // column 2p + i: nibble p % 4 of lane (p / 4, r, i), bits 2p of (r, i)
          const int p = c / 2, lane = c % 2;
          const uint8_t* lo = sub + ((p / 4) * NT + r) * 4 + lane * 2;
          const uint8_t* hi = sub + 128 + (r * 2 + lane) * 2;
          const unsigned lo16 = lo[0] | (unsigned(lo[1]) << 8), hi16 = hi[0] | (unsigned(hi[1]) << 8);
          const int q = int(((lo16 >> (4 * (p % 4))) & 0x0F) | (((hi16 >> (2 * p)) & 3) << 4));
          o[s * Q6_SUPER + j * Q6_SUB + c] = scale * static_cast<float>(q - 32);
        }
      }
    }
  }
}

}  // namespace llmserve

PyMODINIT_FUNC PyInit__cpu_kernels() { return PyModule_Create(&llmserve::kModule); }
