/*
 * Shared plumbing of the Q1–Q5 probes: one question per binary,
 * so a poisoned CUDA context cannot contaminate another answer. Each probe
 * uses the epmem C API for the arena and the CUDA runtime/driver directly
 * for kernels, graphs and access queries; epmem works in the device's
 * primary context, which the runtime shares.
 * Build: ffi-tests/gpu/build.sh OUTDIR (nvcc); each prints PASS/FAIL.
 */
#ifndef EPM_PROBE_H
#define EPM_PROBE_H

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <vector>

#include <cuda.h>
#include <cuda_runtime.h>

#include "epmem.h"
#include "epmem_testing.h" /* epm_checksum_host */

static const char *probe_name = "probe";

[[noreturn]] static void probe_fail(const char *file, int line, const char *what, const char *detail) {
  fprintf(stderr, "%s:%d: %s: %s\n", file, line, what, detail);
  printf("FAIL %s: %s (%s)\n", probe_name, what, detail);
  fflush(stdout);
  exit(1);
}

/* An epmem call that must succeed. */
#define EPM(call)                                                                         \
  do {                                                                                    \
    EpmStatus st_ = (call);                                                               \
    if (st_ != EPM_STATUS_OK) probe_fail(__FILE__, __LINE__, #call, epm_last_error_message()); \
  } while (0)

/* A CUDA runtime call that must succeed. */
#define RT(call)                                                                          \
  do {                                                                                    \
    cudaError_t e_ = (call);                                                              \
    if (e_ != cudaSuccess) probe_fail(__FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
  } while (0)

/* A CUDA driver call that must succeed. */
#define DRV(call)                                                                         \
  do {                                                                                    \
    CUresult r_ = (call);                                                                 \
    if (r_ != CUDA_SUCCESS) {                                                             \
      const char *s_ = "?";                                                               \
      cuGetErrorName(r_, &s_);                                                            \
      probe_fail(__FILE__, __LINE__, #call, s_);                                          \
    }                                                                                     \
  } while (0)

#define EXPECT(cond, ...)                                                                 \
  do {                                                                                    \
    if (!(cond)) {                                                                        \
      char m_[512];                                                                       \
      snprintf(m_, sizeof m_, __VA_ARGS__);                                               \
      probe_fail(__FILE__, __LINE__, #cond, m_);                                          \
    }                                                                                     \
  } while (0)

static inline double now_us(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

static inline double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

/* The device, a stream (and its native handle), an arena, the qwen14b layout. */
struct Probe {
  EpmDevice *dev = nullptr;
  EpmStream *stream = nullptr;
  cudaStream_t cs = nullptr;
  EpmKvPool *arena = nullptr;
  EpmKvLayout layout{};
  uint64_t granule = 0;
};

static Probe probe_open(const char *name, uint64_t budget) {
  Probe p;
  probe_name = name;
  EPM(epm_device_open_select("cuda", 0, &p.dev));
  EpmDeviceInfo di;
  memset(&di, 0, sizeof di);
  di.size = sizeof di;
  EPM(epm_device_get_info(p.dev, &di));
  p.granule = di.granularity;
  RT(cudaSetDevice(0));
  RT(cudaFree(0)); /* the runtime joins the primary context epmem uses */
  EPM(epm_stream_create(p.dev, &p.stream));
  void *native = nullptr;
  EPM(epm_stream_native(p.stream, &native));
  p.cs = (cudaStream_t)native;
  EPM(epm_kv_pool_create(p.dev, budget, &p.arena));
  p.layout.size = sizeof p.layout;
  EPM(epm_kv_layout_token_major(48, 8, 128, 2, &p.layout)); /* qwen14b: 196,608 B/token */
  printf("%s on %s, granule %llu KiB\n", name, di.name, (unsigned long long)(p.granule >> 10));
  return p;
}

static void probe_close(Probe &p) {
  epm_kv_pool_destroy(p.arena);
  epm_stream_destroy(p.stream);
  epm_device_destroy(p.dev);
}

static inline EpmKvSeqInfo seq_info(EpmKvSeq *q) {
  EpmKvSeqInfo i;
  memset(&i, 0, sizeof i);
  i.size = sizeof i;
  EPM(epm_kv_seq_get_info(q, &i));
  return i;
}

static inline EpmKvStats stats(EpmKvPool *a) {
  EpmKvStats s;
  memset(&s, 0, sizeof s);
  s.size = sizeof s;
  EPM(epm_kv_pool_get_stats(a, &s));
  return s;
}

/* An origin sequence with `n` tokens of a recognisable pattern, pinned. */
static EpmKvSeq *origin_with_prefix(Probe &p, uint64_t n, uint64_t max, std::vector<unsigned char> &bytes,
                                    EpmKvPrefix **prefix) {
  EpmKvSeq *o = nullptr;
  EPM(epm_kv_seq_create(p.arena, &p.layout, max, EPM_KV_ADMIT_ON_DEMAND, &o));
  EPM(epm_kv_seq_prepare_append(o, n, p.stream));
  bytes.resize(n * p.layout.token_stride);
  for (size_t i = 0; i < bytes.size(); i++) bytes[i] = (unsigned char)(i * 131 + (i >> 13) + 7);
  RT(cudaMemcpy((void *)seq_info(o).base, bytes.data(), bytes.size(), cudaMemcpyHostToDevice));
  EPM(epm_kv_prefix_pin(o, n, p.stream, prefix));
  return o;
}

/* Position-weighted checksum of u32 words (the same formula as epm_checksum_host). */
__global__ void checksum_kernel(const unsigned int *const *ptrs, size_t words, unsigned long long *out) {
  const unsigned int *p = ptrs[blockIdx.y];
  unsigned long long acc = 0;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < words; i += (size_t)gridDim.x * blockDim.x)
    acc += (unsigned long long)p[i] * (2 * i + 1);
  atomicAdd(&out[blockIdx.y], acc);
}

/* Busy-wait about `cycles` SM clocks (keeps a stream busy). */
__global__ void spin_kernel(long long cycles) {
  long long t0 = clock64();
  while (clock64() - t0 < cycles) {
  }
}

#endif
