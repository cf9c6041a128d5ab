// Which instruction set a build of RuvLLM's CPU kernels uses, and the headers every part includes.
#pragma once

#include <immintrin.h>

// Every operator is built for AVX-512 (BW, VL, VNNI) or for a CPU with AVX2, FMA and F16C only. The AVX2
// build computes the block matmuls with vpmaddubsw + vpmaddwd where AVX-512 VNNI has vpdpbusd (the same
// integer sums), and PagedAttention and SkipRMSNorm on two 8-lane halves of each 16-lane vector
// (vec16.h: the same numbers bit for bit). `ruvllm_kernel_isa` says which build a library is.
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
