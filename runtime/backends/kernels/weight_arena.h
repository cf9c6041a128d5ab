// Where the packed weights live: 2 MB-aligned chunks advised for transparent huge pages.
//
// Why: a decode step streams every weight once (~100 MB for SmolLM2), and with 4 KB pages that is a TLB
// miss every 4 KB. Linux hands out huge pages only on request here (THP "madvise"), and only for whole
// aligned 2 MB ranges, which a projection of a few hundred KB never spans on its own. So the weights of
// all kernels are packed side by side into shared 32 MB chunks (larger tensors get a chunk of their own),
// each advised MADV_HUGEPAGE before it is touched. A one-row decode step on SmolLM2 took ~10% less time
// (docs/PERFORMANCE.md). Pages are committed as they are written, so at most the 2 MB page being filled
// is resident beyond the weights. A chunk is returned to the system when its last tensor is freed and
// it is no longer the one being filled.
#pragma once

#include <sys/mman.h>

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <new>
#include <vector>

namespace {

class WeightArena {
 public:
  static constexpr size_t kHuge = size_t(2) << 20, kChunk = size_t(32) << 20, kAlign = 64;

  static WeightArena& instance() {
    static WeightArena arena;
    return arena;
  }

  void* allocate(size_t bytes) {
    bytes = (bytes + kAlign - 1) / kAlign * kAlign;
    std::lock_guard<std::mutex> lock(mutex_);
    if (bytes > kChunk / 2) {  // a tensor of its own chunk: the current one keeps filling
      Chunk* c = map((bytes + kHuge - 1) / kHuge * kHuge);
      c->used = bytes;
      c->live = 1;
      return c->base;
    }
    if (current_ < 0 || chunks_[current_].used + bytes > chunks_[current_].size) {
      const int old = current_;
      map(kChunk);
      current_ = (int)chunks_.size() - 1;
      if (old >= 0 && chunks_[old].live == 0) unmap(old);
    }
    Chunk& c = chunks_[current_];
    void* p = c.base + c.used;
    c.used += bytes;
    c.live++;
    return p;
  }

  void release(void* p) {
    if (!p) return;
    std::lock_guard<std::mutex> lock(mutex_);
    for (int i = 0; i < (int)chunks_.size(); i++) {
      Chunk& c = chunks_[i];
      if (static_cast<uint8_t*>(p) < c.base || static_cast<uint8_t*>(p) >= c.base + c.size) continue;
      if (--c.live == 0) {
        if (i == current_) c.used = 0;  // empty again: refilled from its start
        else unmap(i);
      }
      return;
    }
  }

  static void free(void* p) { instance().release(p); }

 private:
  struct Chunk {
    uint8_t* base;
    size_t size, used, live;
  };

  // An anonymous mapping of `size` bytes starting on a 2 MB boundary (the slack around it unmapped).
  Chunk* map(size_t size) {
    const size_t span = size + kHuge;
    void* raw = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) throw std::bad_alloc();
    const uintptr_t start = reinterpret_cast<uintptr_t>(raw), aligned = (start + kHuge - 1) / kHuge * kHuge;
    if (aligned > start) munmap(raw, aligned - start);
    if (const size_t tail = start + span - (aligned + size)) munmap(reinterpret_cast<void*>(aligned + size), tail);
#ifdef MADV_HUGEPAGE
    madvise(reinterpret_cast<void*>(aligned), size, MADV_HUGEPAGE);  // advice: without THP, plain pages
#endif
    chunks_.push_back(Chunk{reinterpret_cast<uint8_t*>(aligned), size, 0, 0});
    return &chunks_.back();
  }

  void unmap(int i) {
    munmap(chunks_[i].base, chunks_[i].size);
    chunks_.erase(chunks_.begin() + i);
    if (current_ > i) current_--;
  }

  std::mutex mutex_;
  std::vector<Chunk> chunks_;
  int current_ = -1;
};

// Weights a kernel reads where onnxruntime maps them: their page tables filled in one call (Linux 5.14's
// MADV_POPULATE_READ; else a read-ahead hint), as llama.cpp maps its file with MAP_POPULATE. Left to page
// faults, the first step took ~0.8 s of a 1B model's load (a fault each 4 KB).
inline void populate(const void* p, size_t bytes) {
  const size_t page = 4096;
  const uintptr_t start = reinterpret_cast<uintptr_t>(p) & ~(uintptr_t)(page - 1);
  const size_t len = reinterpret_cast<uintptr_t>(p) + bytes - start;
  constexpr int kPopulateRead = 22;  // MADV_POPULATE_READ, absent from older headers
  if (madvise(reinterpret_cast<void*>(start), len, kPopulateRead) != 0)
    madvise(reinterpret_cast<void*>(start), len, MADV_WILLNEED);
}

}  // namespace
