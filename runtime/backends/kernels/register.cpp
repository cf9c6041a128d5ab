// RuvLLM's CPU kernels as onnxruntime custom operators in the domain `ruvllm`: one translation unit
// (built by runtime/backends/kernel_library.py) over the op families' headers. This file holds the
// registration: onnxruntime's OrtCustomOp layout, each operator's types and entry points, and the
// library's exported functions. tests/runtime/test_cpu_kernels.py checks every operator against what
// it replaces.

#include "gather_blocks.h"
#include "lora_delta.h"
#include "matmul_q4.h"
#include "matmul_q8.h"
#include "kv_write.h"
#include "paged_attention.h"
#include "sample_topk.h"
#include "skip_rms_norm.h"

namespace {

// onnxruntime's OrtCustomOp, version 18 layout
struct CustomOp {
  uint32_t version;
  void* (*CreateKernel)(const CustomOp*, const void*, const OrtKernelInfo*);
  const char* (*GetName)(const CustomOp*);
  const char* (*GetExecutionProviderType)(const CustomOp*);
  int (*GetInputType)(const CustomOp*, size_t);
  size_t (*GetInputTypeCount)(const CustomOp*);
  int (*GetOutputType)(const CustomOp*, size_t);
  size_t (*GetOutputTypeCount)(const CustomOp*);
  void (*KernelCompute)(void*, OrtKernelContext*);
  void (*KernelDestroy)(void*);
  int (*GetInputCharacteristic)(const CustomOp*, size_t);
  int (*GetOutputCharacteristic)(const CustomOp*, size_t);
  int (*GetInputMemoryType)(const CustomOp*, size_t);
  int (*GetVariadicInputMinArity)(const CustomOp*);
  int (*GetVariadicInputHomogeneity)(const CustomOp*);
  int (*GetVariadicOutputMinArity)(const CustomOp*);
  int (*GetVariadicOutputHomogeneity)(const CustomOp*);
  OrtStatus* (*CreateKernelV2)(const CustomOp*, const void*, const OrtKernelInfo*, void**);
  OrtStatus* (*KernelComputeV2)(void*, OrtKernelContext*);
  OrtStatus* (*InferOutputShapeFn)(const CustomOp*, void*);
  int (*GetStartVersion)(const CustomOp*);
  int (*GetEndVersion)(const CustomOp*);
  size_t (*GetMayInplace)(int**, int**);
  void (*ReleaseMayInplace)(int*, int*);
  size_t (*GetAliasMap)(int**, int**);
  void (*ReleaseAliasMap)(int*, int*);
};

// The version-1 entry points, which cannot report errors: onnxruntime calls the V2 ones (version >= 16)
using CreateFn = OrtStatus* (*)(const CustomOp*, const void*, const OrtKernelInfo*, void**);
using ComputeFn = OrtStatus* (*)(void*, OrtKernelContext*);
template <CreateFn create>
void* create_v1(const CustomOp* self, const void* a, const OrtKernelInfo* info) {
  void* k = nullptr;
  return create(self, a, info, &k) ? nullptr : k;
}
template <ComputeFn run>
void compute_v1(void* k, OrtKernelContext* ctx) {
  (void)run(k, ctx);
}

// the fields the operators share; each sets its name, types and entry points
CustomOp base_op() {
  CustomOp op{};
  op.version = kApiVersion;
  op.GetExecutionProviderType = [](const CustomOp*) { return "CPUExecutionProvider"; };
  op.GetOutputType = [](const CustomOp*, size_t) { return kFloat; };
  op.GetOutputTypeCount = [](const CustomOp*) -> size_t { return 1; };
  op.GetInputCharacteristic = [](const CustomOp*, size_t) { return 0; };   // required
  op.GetOutputCharacteristic = [](const CustomOp*, size_t) { return 0; };
  op.GetInputMemoryType = [](const CustomOp*, size_t) { return 0; };       // OrtMemTypeDefault
  op.GetVariadicInputMinArity = [](const CustomOp*) { return 1; };
  op.GetVariadicInputHomogeneity = [](const CustomOp*) { return 1; };
  op.GetVariadicOutputMinArity = [](const CustomOp*) { return 1; };
  op.GetVariadicOutputHomogeneity = [](const CustomOp*) { return 1; };
  op.InferOutputShapeFn = nullptr;
  op.GetStartVersion = [](const CustomOp*) { return 1; };
  op.GetEndVersion = [](const CustomOp*) { return INT_MAX; };
  op.GetMayInplace = [](int**, int**) -> size_t { return 0; };
  op.ReleaseMayInplace = [](int*, int*) {};
  op.GetAliasMap = [](int**, int**) -> size_t { return 0; };
  op.ReleaseAliasMap = [](int*, int*) {};
  return op;
}

// `run`, with nothing unwinding into onnxruntime: running out of memory is `what`'s error status
template <ComputeFn run, const char* what>
OrtStatus* guarded(void* kernel, OrtKernelContext* ctx) {
  try {
    return run(kernel, ctx);
  } catch (const std::bad_alloc&) {
    return fail(std::string(what) + ": out of memory");
  }
}

constexpr char kMatMulName[] = "ruvllm.MatMulQ4", kAttentionName[] = "ruvllm.PagedAttention",
               kNormName[] = "ruvllm.SkipRMSNorm", kLoraName[] = "ruvllm.LoraDelta",
               kMatMulQ8Name[] = "ruvllm.MatMulQ8", kLoraSwigluName[] = "ruvllm.LoraSwiGLU",
               kLoraSplitName[] = "ruvllm.LoraSplit", kGatherName[] = "ruvllm.GatherQ",
               kSampleName[] = "ruvllm.SampleTopK";

// the entry points of an operator whose kernel object (a K) `create` makes and `run` computes with
template <typename K, CreateFn create, ComputeFn run, const char* what>
CustomOp kernel_op() {
  CustomOp op = base_op();
  op.CreateKernel = create_v1<create>;
  op.KernelCompute = compute_v1<guarded<run, what>>;
  op.KernelDestroy = [](void* k) { delete static_cast<K*>(k); };
  op.CreateKernelV2 = create;
  op.KernelComputeV2 = guarded<run, what>;
  return op;
}

CustomOp matmul_op() {
  CustomOp op = kernel_op<Kernel, create_kernel, compute_rows, kMatMulName>();
  op.GetName = [](const CustomOp*) { return "MatMulQ4"; };
  op.GetInputType = [](const CustomOp*, size_t i) { return (i == 1 || i == 3) ? kUint8 : i == 4 ? kFloat16 : kFloat; };
  op.GetInputTypeCount = [](const CustomOp*) -> size_t { return 5; };
  // scales and zero points: absent in the k-quant layout (kquant=1: its one weights input holds them);
  // minimums: optional
  op.GetInputCharacteristic = [](const CustomOp*, size_t i) { return i >= 2 ? 1 : 0; };
  return op;
}

CustomOp attention_op() {
  CustomOp op = kernel_op<AttnKernel, create_attention, attend_step, kAttentionName>();
  op.GetName = [](const CustomOp*) { return "PagedAttention"; };
  // the pools (2, 3): float, or int8 with their rows' fp16 group scales (7, 8), fp16 or fp32 tails (9, 10)
  // and the rows' floors (11)
  op.GetInputType = [](const CustomOp*, size_t i) {
    return i == 2 || i == 3 || i == 9 || i == 10 ? kUndefined : i == 11 ? kInt64 : i > 6 ? kFloat16 : i < 4 ? kFloat : kInt64;
  };
  op.GetInputTypeCount = [](const CustomOp*) -> size_t { return 12; };
  op.GetInputCharacteristic = [](const CustomOp*, size_t i) { return i >= 7 ? 1 : 0; };  // scales, tails, floors: optional
  return op;
}

CustomOp norm_op() {
  CustomOp op = kernel_op<NormKernel, create_norm, skip_rms_norm, kNormName>();
  op.GetName = [](const CustomOp*) { return "SkipRMSNorm"; };
  op.GetInputType = [](const CustomOp*, size_t) { return kFloat; };
  op.GetInputTypeCount = [](const CustomOp*) -> size_t { return 3; };
  op.GetOutputTypeCount = [](const CustomOp*) -> size_t { return 2; };
  return op;
}

CustomOp lora_op() {
  CustomOp op = kernel_op<LoraKernel, create_lora, lora_delta, kLoraName>();
  op.GetName = [](const CustomOp*) { return "LoraDelta"; };
  op.GetInputType = [](const CustomOp*, size_t i) { return i == 2 || i == 3 ? kUndefined : kFloat; };  // A, B: fp32 or fp16
  op.GetInputTypeCount = [](const CustomOp*) -> size_t { return 6; };
  op.GetInputCharacteristic = [](const CustomOp*, size_t i) { return i == 5 ? 1 : 0; };  // the scale: optional
  return op;
}

CustomOp lora_swiglu_op() {
  CustomOp op = kernel_op<LoraKernel, create_lora, lora_swiglu, kLoraSwigluName>();
  op.GetName = [](const CustomOp*) { return "LoraSwiGLU"; };
  op.GetInputType = [](const CustomOp*, size_t i) { return i >= 2 && i <= 5 ? kUndefined : kFloat; };
  op.GetInputTypeCount = [](const CustomOp*) -> size_t { return 7; };
  return op;
}

CustomOp lora_split_op() {
  CustomOp op = kernel_op<LoraKernel, create_lora, lora_split, kLoraSplitName>();
  op.GetName = [](const CustomOp*) { return "LoraSplit"; };
  op.GetInputType = [](const CustomOp*, size_t i) { return i >= 2 && i <= 7 ? kUndefined : kFloat; };
  op.GetInputTypeCount = [](const CustomOp*) -> size_t { return 9; };
  op.GetOutputTypeCount = [](const CustomOp*) -> size_t { return 2; };
  return op;
}

CustomOp matmul_q8_op() {
  CustomOp op = kernel_op<Q8Kernel, create_q8, compute_q8, kMatMulQ8Name>();
  op.GetName = [](const CustomOp*) { return "MatMulQ8"; };
  op.GetInputType = [](const CustomOp*, size_t i) { return (i == 1 || i == 3) ? kUint8 : kFloat; };
  op.GetInputTypeCount = [](const CustomOp*) -> size_t { return 4; };
  op.GetInputCharacteristic = [](const CustomOp*, size_t i) { return i >= 2 ? 1 : 0; };  // absent in Q8_0's own layout
  return op;
}

CustomOp gather_op() {
  CustomOp op = kernel_op<GatherKernel, create_gather, gather_rows, kGatherName>();
  op.GetName = [](const CustomOp*) { return "GatherQ"; };
  op.GetInputType = [](const CustomOp*, size_t i) { return i == 0 ? kUint8 : kInt64; };
  op.GetInputTypeCount = [](const CustomOp*) -> size_t { return 2; };
  return op;
}

CustomOp sample_op() {
  CustomOp op = kernel_op<SampleKernel, create_sample, sample_topk, kSampleName>();
  op.GetName = [](const CustomOp*) { return "SampleTopK"; };
  op.GetInputType = [](const CustomOp*, size_t i) { return i == 1 || i == 4 ? kInt64 : kFloat; };
  op.GetInputTypeCount = [](const CustomOp*) -> size_t { return 6; };
  op.GetInputCharacteristic = [](const CustomOp*, size_t i) { return i == 5 ? 1 : 0; };  // the mask: optional
  op.GetOutputType = [](const CustomOp*, size_t i) { return i == 1 ? kInt64 : kFloat; };
  op.GetOutputTypeCount = [](const CustomOp*) -> size_t { return 2; };
  return op;
}

CustomOp matmul_split_op() {
  CustomOp op = matmul_op();
  op.GetName = [](const CustomOp*) { return "MatMulQ4Split"; };
  op.GetOutputTypeCount = [](const CustomOp*) -> size_t { return 2; };
  return op;
}

CustomOp matmul_swiglu_op() {
  CustomOp op = matmul_op();
  op.GetName = [](const CustomOp*) { return "MatMulQ4SwiGLU"; };
  return op;
}

const CustomOp g_matmul = matmul_op();
const CustomOp g_matmul_split = matmul_split_op();
const CustomOp g_matmul_swiglu = matmul_swiglu_op();
const CustomOp g_lora = lora_op();
const CustomOp g_lora_swiglu = lora_swiglu_op();
const CustomOp g_lora_split = lora_split_op();
const CustomOp g_matmul_q8 = matmul_q8_op();
const CustomOp g_gather = gather_op();
const CustomOp g_sample = sample_op();
const CustomOp g_attention = attention_op();
const CustomOp g_norm = norm_op();

}  // namespace

extern "C" {

__attribute__((visibility("default"))) OrtStatus* RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* base) {
  const void* table = base->GetApi(kApiVersion);
  if (!table) return nullptr;  // an onnxruntime older than 1.17 has no ParallelFor; nothing registered
  g_api = static_cast<const void* const*>(table);
  OrtCustomOpDomain* domain = nullptr;  // kept for the process's life, as sessions refer to it
  RETURN_IF(api<OrtStatus* (*)(const char*, OrtCustomOpDomain**)>(kCreateCustomOpDomain)("ruvllm", &domain));
  auto add = api<OrtStatus* (*)(OrtCustomOpDomain*, const CustomOp*)>(kCustomOpDomain_Add);
  for (const CustomOp* op : {&g_matmul, &g_matmul_split, &g_matmul_swiglu, &g_matmul_q8, &g_gather, &g_attention, &g_norm, &g_lora,
                            &g_lora_swiglu, &g_lora_split, &g_sample})
    RETURN_IF(add(domain, op));
  return api<OrtStatus* (*)(OrtSessionOptions*, OrtCustomOpDomain*)>(kAddCustomOpDomain)(options, domain);
}

// Which operators this build registers (both builds: all of them), and in which instruction set
__attribute__((visibility("default"))) const char* ruvllm_kernel_ops() {
  return "MatMulQ4,MatMulQ8,PagedAttention,SkipRMSNorm,LoraDelta,SampleTopK";
}
__attribute__((visibility("default"))) const char* ruvllm_kernel_isa() { return RUVLLM_AVX512 ? "AVX-512 VNNI" : "AVX2"; }

// The own-bit types this build was compiled with, one "name kind bits block zero superblock scales gather" a
// line, so that a test compares the compiled table with runtime/formats/block_types.py
__attribute__((visibility("default"))) const char* ruvllm_block_types() {
  static const std::string text = [] {
    std::string out;
    for (const OwnBits& t : kOwnBits)
      out += std::string(t.name) + " " + std::to_string(t.kind) + " " + std::to_string(t.bits) + " " + std::to_string(t.block) +
             " " + std::to_string(t.zero) + " " + std::to_string(t.superblock) + " " + std::to_string((int)t.scales) + " " +
             std::to_string((int)t.gather) + "\n";
    return out;
  }();
  return text.c_str();
}

// For the library's own test: the kernel on plain buffers, without onnxruntime.
__attribute__((visibility("default"))) int ruvllm_q4_matmul(const float* A, int64_t M, int K, int N, int block,
                                                          const uint8_t* B, const float* S, const uint8_t* Z, float* C) {
  try {
    PackedWeights w;
    pack(w, N, K, block, B, S, Z);
    QuantizedRows rows;
    quantize_rows(rows, A, M, K, block);
    gemm_tiles(w, rows, M, Output{C, nullptr, N, 0, w.ntiles}, 0, w.ntiles, false);
  } catch (...) {
    return 1;
  }
  return 0;
}

}  // extern "C"
