// onnxruntime's C API is reached through the function table it hands to RegisterCustomOps. Its
// header is not shipped with the Python wheel, so the few entries used are declared here by their
// fixed position in that table (the table is append-only: an entry never moves between releases).
#pragma once

#include "isa.h"

extern "C" {
struct OrtStatus;
struct OrtKernelInfo;
struct OrtKernelContext;
struct OrtValue;
struct OrtTensorTypeAndShapeInfo;
struct OrtSessionOptions;
struct OrtCustomOpDomain;
struct OrtApiBase {
  const void* (*GetApi)(uint32_t version);
  const char* (*GetVersionString)();
};
}

namespace {

// Positions in onnxruntime's OrtApi function table.
enum ApiEntry : size_t {
  kCreateStatus = 0,
  kCreateCustomOpDomain = 26,
  kCustomOpDomain_Add = 27,
  kAddCustomOpDomain = 28,
  kGetTensorMutableData = 51,
  kGetTensorElementType = 60,
  kGetDimensionsCount = 61,
  kGetDimensions = 62,
  kGetTensorTypeAndShape = 65,
  kKernelInfoGetAttribute_float = 85,
  kKernelInfoGetAttribute_int64 = 86,
  kKernelContext_GetInput = 90,
  kKernelContext_GetOutput = 91,
  kReleaseStatus = 93,
  kReleaseTensorTypeAndShapeInfo = 99,
  kKernelInfoGetConstantInput_tensor = 249,
  kKernelContext_ParallelFor = 274,
};
constexpr uint32_t kApiVersion = 18;  // KernelContext_ParallelFor (the last entry used) exists from 17 on
constexpr int kOrtFail = 1;           // OrtErrorCode ORT_FAIL
constexpr int kUndefined = 0, kFloat = 1, kUint8 = 2, kInt8 = 3, kInt64 = 7, kFloat16 = 10;  // ONNXTensorElementDataType
// (kUndefined as an input's type: any type, the kernel reads which with tensor_type)

const void* const* g_api = nullptr;

struct CustomOp;  // onnxruntime's OrtCustomOp, laid out in register.cpp

template <typename F>
F api(ApiEntry e) { return reinterpret_cast<F>(const_cast<void*>(g_api[e])); }

OrtStatus* fail(const std::string& msg) {
  return api<OrtStatus* (*)(int, const char*)>(kCreateStatus)(kOrtFail, msg.c_str());
}

#define RETURN_IF(call) \
  do {                  \
    OrtStatus* st_ = (call); \
    if (st_) return st_;     \
  } while (0)

OrtStatus* tensor_shape(const OrtValue* v, std::vector<int64_t>& dims) {
  OrtTensorTypeAndShapeInfo* info = nullptr;
  RETURN_IF(api<OrtStatus* (*)(const OrtValue*, OrtTensorTypeAndShapeInfo**)>(kGetTensorTypeAndShape)(v, &info));
  size_t n = 0;
  OrtStatus* st = api<OrtStatus* (*)(const OrtTensorTypeAndShapeInfo*, size_t*)>(kGetDimensionsCount)(info, &n);
  if (!st) {
    dims.resize(n);
    st = api<OrtStatus* (*)(const OrtTensorTypeAndShapeInfo*, int64_t*, size_t)>(kGetDimensions)(info, dims.data(), n);
  }
  api<void (*)(OrtTensorTypeAndShapeInfo*)>(kReleaseTensorTypeAndShapeInfo)(info);
  return st;
}

OrtStatus* tensor_type(const OrtValue* v, int* type) {
  OrtTensorTypeAndShapeInfo* info = nullptr;
  RETURN_IF(api<OrtStatus* (*)(const OrtValue*, OrtTensorTypeAndShapeInfo**)>(kGetTensorTypeAndShape)(v, &info));
  OrtStatus* st = api<OrtStatus* (*)(const OrtTensorTypeAndShapeInfo*, int*)>(kGetTensorElementType)(info, type);
  api<void (*)(OrtTensorTypeAndShapeInfo*)>(kReleaseTensorTypeAndShapeInfo)(info);
  return st;
}

template <typename T>
OrtStatus* tensor_data(const OrtValue* v, T** out) {
  void* p = nullptr;
  RETURN_IF(api<OrtStatus* (*)(OrtValue*, void**)>(kGetTensorMutableData)(const_cast<OrtValue*>(v), &p));
  *out = static_cast<T*>(p);
  return nullptr;
}

// constant input i (an initializer), whose element count must be `want`, as bytes; `what` names it in errors
OrtStatus* constant_bytes(const OrtKernelInfo* info, size_t i, size_t want, const std::string& what,
                          const uint8_t** data) {
  int is_const = 0;
  const OrtValue* v = nullptr;
  RETURN_IF(api<OrtStatus* (*)(const OrtKernelInfo*, size_t, int*, const OrtValue**)>(kKernelInfoGetConstantInput_tensor)(
      info, i, &is_const, &v));
  if (!is_const) return fail(what + " must be an initializer");
  std::vector<int64_t> dims;
  RETURN_IF(tensor_shape(v, dims));
  int64_t count = 1;
  for (int64_t d : dims) count *= d;
  if ((size_t)count != want)
    return fail(what + " must be the layout's size for N and K (" + std::to_string(want) + " bytes, not " +
                std::to_string(count) + ")");
  return tensor_data(v, data);
}

// output i of the given shape, allocated by onnxruntime, as floats (or int64s)
template <typename T>
OrtStatus* output_data(OrtKernelContext* ctx, size_t i, const int64_t* dims, size_t rank, T** data) {
  OrtValue* v = nullptr;
  RETURN_IF(api<OrtStatus* (*)(OrtKernelContext*, size_t, const int64_t*, size_t, OrtValue**)>(kKernelContext_GetOutput)(
      ctx, i, dims, rank, &v));
  return tensor_data(v, data);
}
// inputs 0..n-1 of the kernel's context, with their shapes. From `required` on they are optional: an absent one
// is null (its dims empty); one absent before it is `op`'s error.
OrtStatus* read_inputs(OrtKernelContext* ctx, size_t n, const OrtValue** in, std::vector<int64_t>* dims,
                       size_t required = SIZE_MAX, const char* op = "ruvllm") {
  auto input = api<OrtStatus* (*)(const OrtKernelContext*, size_t, const OrtValue**)>(kKernelContext_GetInput);
  for (size_t i = 0; i < n; i++) {
    RETURN_IF(input(ctx, i, &in[i]));
    if (!in[i]) {
      if (i < required) return fail(std::string(op) + ": a required input is missing");
      continue;
    }
    RETURN_IF(tensor_shape(in[i], dims[i]));
  }
  return nullptr;
}

// fn(job, item) for items 0..items-1 on onnxruntime's intra-op thread pool
OrtStatus* parallel_for(OrtKernelContext* ctx, void (*fn)(void*, size_t), size_t items, void* job) {
  return api<OrtStatus* (*)(const OrtKernelContext*, void (*)(void*, size_t), size_t, size_t, void*)>(
      kKernelContext_ParallelFor)(ctx, fn, items, 0, job);
}

}  // namespace
