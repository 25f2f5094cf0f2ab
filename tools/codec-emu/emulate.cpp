// Runs src/device/cuda/codec.cu's kernel on the CPU: every thread of a block
// is a std::thread, __syncthreads a barrier, __shfl_up_sync a per-warp
// exchange (any number of scans, each call its own two barrier phases). It
// checks the kernel's logic (indexing, escapes, the block scans, format v2's
// two-level escape codes, partial blocks) where there is no GPU; it says
// nothing about speed.
//
//   c++ -std=c++20 -O1 -pthread [-DEPM_SLICES=1] -o emulate tools/codec-emu/emulate.cpp
//   ./emulate COMPRESSED RAW_OUT     (a format v1 or v2 buffer; writes the decoded bytes)
//
// Driven by tools/tests/codec_kernel_emulated.rs.
#include <barrier>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

// Room for the largest block (256 threads); the kernel's EPM_THREADS picks how much is used.
#define EPM_WARPS 8

struct uint2 { unsigned int x, y; };
struct uint4 { unsigned int x, y, z, w; };
static inline uint2 make_uint2(unsigned a, unsigned b) { return {a, b}; }
static inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
// The integer intrinsics, as CUDA defines them (prmt's default mode; the
// kernel never sets a selector nibble's bit 3).
static unsigned int __byte_perm(unsigned int x, unsigned int y, unsigned int s) {
  const uint64_t in = (uint64_t)y << 32 | x;
  unsigned int r = 0;
  for (int n = 0; n < 4; n++) r |= (unsigned int)((in >> (8 * ((s >> (4 * n)) & 7))) & 0xFF) << (8 * n);
  return r;
}
static unsigned int __funnelshift_r(unsigned int lo, unsigned int hi, unsigned int sh) {
  return (unsigned int)((((uint64_t)hi << 32) | lo) >> (sh & 31));
}
static unsigned int __funnelshift_rc(unsigned int lo, unsigned int hi, unsigned int sh) {
  return (unsigned int)((((uint64_t)hi << 32) | lo) >> (sh < 32 ? sh : 32));
}
static int __popc(unsigned int x) { return __builtin_popcount(x); }
static int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
static int __ffsll(long long x) { return __builtin_ffsll(x); }
struct Dim { unsigned int x, y, z; };
static thread_local Dim threadIdx, blockIdx;
static std::barrier<> *block_barrier;
static std::barrier<> *warp_barrier[EPM_WARPS];
static unsigned int shfl_slot[EPM_WARPS * 32];
static void __syncthreads() { block_barrier->arrive_and_wait(); }
static unsigned int __shfl_up_sync(unsigned int, unsigned int v, unsigned int d) {
  unsigned int t = threadIdx.x, lane = t & 31, w = t >> 5;
  shfl_slot[t] = v;
  warp_barrier[w]->arrive_and_wait();
  unsigned int r = lane >= d ? shfl_slot[t - d] : v;
  warp_barrier[w]->arrive_and_wait();
  return r;
}
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(n)
// One block runs at a time, so function-static storage is the block's shared memory.
#define __shared__ static

#include "../../src/device/cuda/codec.cu"
static_assert(EPM_THREADS % 32 == 0 && EPM_THREADS <= EPM_WARPS * 32);

static uint64_t u64_at(const unsigned char *b, size_t at) { uint64_t v; memcpy(&v, b + at, 8); return v; }
static_assert(sizeof(EpmDecodeParams) == 136, "EpmDecodeParams is 136 bytes (src/device/cuda/codec.rs DecodeParams)");

int main(int argc, char **argv) {
  if (argc != 3) { fprintf(stderr, "usage: %s COMPRESSED RAW_OUT\n", argv[0]); return 2; }
  FILE *f = fopen(argv[1], "rb");
  if (!f) { perror(argv[1]); return 2; }
  std::vector<unsigned char> raw_buf;
  unsigned char chunk[1 << 16];
  size_t got;
  while ((got = fread(chunk, 1, sizeof chunk, f)) > 0) raw_buf.insert(raw_buf.end(), chunk, chunk + got);
  fclose(f);
  // 16-byte aligned copy, as in device memory.
  unsigned char *buf = (unsigned char *)aligned_alloc(256, (raw_buf.size() + 255) & ~size_t(255));
  memcpy(buf, raw_buf.data(), raw_buf.size());
  EpmDecodeParams p;
  memset(&p, 0, sizeof p);
  uint64_t n = u64_at(buf, 16);
  p.n_values = n;
  p.n_escapes = u64_at(buf, 24);
  uint64_t base = (uint64_t)(uintptr_t)buf;
  p.offsets = base + u64_at(buf, 32);
  p.codes = base + u64_at(buf, 40);
  p.lows = base + u64_at(buf, 48);
  p.escapes = base + u64_at(buf, 56);
  p.dtype = buf[8];
  p.k = buf[9];
  p.code_bits = buf[10];
  p.blocks = (unsigned int)((n + 4095) / 4096);
  memcpy(p.table, buf + 72, 16);
  // Format v2: the escape stream is k2-bit codes, plus a level-3 index and byte stream.
  const unsigned int version = (unsigned int)buf[4] | (unsigned int)buf[5] << 8;
  if (version == 2) {
    p.k2 = buf[11];
    memcpy(p.table2, buf + 88, 16);
    p.n_escapes3 = u64_at(buf, 104);
    p.escapes3 = base + u64_at(buf, 112);
    p.offsets3 = base + 128 + ((((uint64_t)p.blocks + 1) * 4 + 15) & ~(uint64_t)15);
  } else if (version != 1) {
    fprintf(stderr, "emulate: format version %u\n", version);
    return 2;
  }
  // 64 guard bytes past the output catch a store past the end.
  size_t out_len = n * 2;
  unsigned char *out = (unsigned char *)aligned_alloc(256, (out_len + 64 + 255) & ~size_t(255));
  memset(out, 0xC5, out_len + 64);
  p.dst = (uint64_t)(uintptr_t)out;
  std::barrier<> bb(EPM_THREADS);
  block_barrier = &bb;
  for (int w = 0; w < EPM_THREADS / 32; w++) warp_barrier[w] = new std::barrier<>(32);
  for (unsigned int b = 0; b < p.blocks; b++) {
    std::vector<std::thread> ts;
    for (unsigned int t = 0; t < EPM_THREADS; t++)
      ts.emplace_back([&, b, t] { blockIdx = {b, 0, 0}; threadIdx = {t, 0, 0}; epm_codec_decode(p); });
    for (auto &t : ts) t.join();
  }
  for (size_t i = out_len; i < out_len + 64; i++)
    if (out[i] != 0xC5) { fprintf(stderr, "emulate: the kernel wrote past its destination (byte %zu)\n", i); return 1; }
  FILE *o = fopen(argv[2], "wb");
  if (!o || fwrite(out, 1, out_len, o) != out_len) { perror(argv[2]); return 2; }
  fclose(o);
  return 0;
}
