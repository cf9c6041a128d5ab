// Which instruction set a build of RuvLLM's CPU kernels uses, and the headers every part includes.
#pragma once

#include <immintrin.h>

// The full set (MatMulQ4 and its variants, PagedAttention, SkipRMSNorm) is AVX-512 (BW, VL, VNNI). On a
// CPU with AVX2, FMA and F16C only, the library holds MatMulQ4 and its variants alone, computed with
// AVX2 (vpmaddubsw + vpmaddwd where AVX-512 VNNI has vpdpbusd): the same arithmetic, rows for rows.
// `ruvllm_kernel_ops` says which operators a build has.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define RUVLLM_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define RUVLLM_AVX512 0
#else
#error "RuvLLM's CPU kernels need AVX-512 (F, BW, VL, VNNI) or AVX2 with FMA and F16C"
#endif

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdlib>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>
