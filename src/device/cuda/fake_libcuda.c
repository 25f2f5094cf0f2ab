// A fake libcuda.so: runs epmem's CUDA device code on a machine with no GPU.
//
// It checks what a real driver would reject (flags, struct fields, which
// context is current) and reports a violation as an error, so the CUDA
// tests fail. Device memory is host memory (so device pointers are host
// pointers), VMM is memfd + mmap + mprotect, copies and the checksum kernel
// run synchronously (the codec decode with a plain C decoder of formats v1 and v2),
// and the spin kernel advances a per-stream "busy until"
// clock that events, queries and synchronizes honour. A stream memory wait
// (cuStreamWaitValue32_v2, the gate of Device::hold_async) holds its stream:
// events recorded behind it stay NOT_READY, and waits on them block, until
// the word it watches reaches the value; freeing that word while a wait on
// it is unsatisfied is reported as a violation. (Copies still run at
// enqueue: the fake orders completion, not data.)
//
// Built and used by the test `fake_driver_runs_the_gpu_tests` (tests.rs).
// It proves the plumbing (symbols, argument order, layouts, kernel
// parameters), not the real driver's behaviour: the GPU run does that.
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>
#include <time.h>

typedef int CUresult;
typedef int CUdevice;
typedef void* CUcontext;
// A wait queued on a stream: on `addr` reaching `value`, or (addr NULL) a
// join, for cuStreamWaitEvent. It passes only after the waits queued before
// it (`prev`), as a GPU's stream order has it.
typedef struct Hold { const uint32_t *addr; uint32_t value; int done; struct Hold *prev[2], *next; } Hold;
typedef struct { uint64_t busy_until; Hold *hold; } Stream;
typedef struct { uint64_t at; int flags; int recorded; Hold *hold; } Event;
typedef void* CUmodule;
typedef void* CUfunction;
typedef unsigned long long CUdeviceptr;

static int CTX_OBJ;
static __thread CUcontext current;
static int retains;
static int failures; // argument validation failures seen
#define BAD(...) do { fprintf(stderr, "FAKE-CUDA BAD: " __VA_ARGS__); fprintf(stderr, "\n"); failures++; return 1; } while (0)
#define NEED_CTX() do { if (current != &CTX_OBJ) BAD("%s without our context current", __func__); } while (0)
static uint64_t now_ns(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return (uint64_t)t.tv_sec * 1000000000ull + t.tv_nsec; }

int fake_failures(void) { return failures; }
int fake_retains(void) { return retains; }

CUresult cuInit(unsigned f) { return f ? 1 : 0; }
CUresult cuGetErrorName(CUresult r, const char **p) {
  switch (r) { case 1: *p = "CUDA_ERROR_INVALID_VALUE"; return 0; case 600: *p = "CUDA_ERROR_NOT_READY"; return 0;
  case 2: *p = "CUDA_ERROR_OUT_OF_MEMORY"; return 0; default: return 1; }
}
CUresult cuDriverGetVersion(int *v) { *v = 12080; return 0; }
CUresult cuDeviceGetCount(int *c) { *c = 1; return 0; }
CUresult cuDeviceGet(CUdevice *d, int o) { if (o != 0) return 101; *d = 0; return 0; }
CUresult cuDeviceGetName(char *n, int len, CUdevice d) { if (d) return 101; snprintf(n, len, "Fake H200"); return 0; }
CUresult cuDeviceTotalMem_v2(size_t *b, CUdevice d) { *b = 80ull << 30; return d ? 101 : 0; }
CUresult cuDeviceGetAttribute(int *v, int a, CUdevice d) {
  if (d) return 101;
  switch (a) { case 102: *v = 1; break; case 75: *v = 9; break; case 76: *v = 0; break; case 113: *v = 1; break; case 16: *v = 132; break; default: BAD("attribute %d", a); }
  return 0;
}
CUresult cuDeviceGetPCIBusId(char *b, int len, CUdevice d) { snprintf(b, len, "00000000:9A:00.0"); return d ? 101 : 0; }
CUresult cuDevicePrimaryCtxRetain(CUcontext *c, CUdevice d) { if (d) return 101; *c = &CTX_OBJ; retains++; return 0; }
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d) { if (d) return 101; retains--; return 0; }
CUresult cuCtxGetCurrent(CUcontext *c) { *c = current; return 0; }
CUresult cuCtxSetCurrent(CUcontext c) { if (c && c != &CTX_OBJ) BAD("set foreign ctx"); current = c; return 0; }
CUresult cuCtxSynchronize(void) { NEED_CTX(); return 0; }
CUresult cuMemGetInfo_v2(size_t *f, size_t *t) { NEED_CTX(); *f = 70ull << 30; *t = 80ull << 30; return 0; }
static Hold *holds; // every wait ever queued (never freed: a test process makes a handful)
static pthread_mutex_t holds_mu = PTHREAD_MUTEX_INITIALIZER;
static int satisfied(const Hold *h) { return (int32_t)(__atomic_load_n(h->addr, __ATOMIC_ACQUIRE) - h->value) >= 0; } // GEQ is cyclic
// 2 = CU_MEMHOSTALLOC_DEVICEMAP, the gate's flag; 0 for the staging pool.
CUresult cuMemHostAlloc(void **p, size_t n, unsigned flags) { NEED_CTX(); if (flags & ~2u) BAD("host alloc flags %u", flags); *p = aligned_alloc(4096, (n + 4095) & ~4095ul); return *p ? 0 : 2; }
CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr *d, void *p, unsigned flags) { NEED_CTX(); if (flags || !p) BAD("host device pointer"); *d = (CUdeviceptr)p; return 0; }
static Hold *pending(Hold *h);
CUresult cuMemFreeHost(void *p) {
  NEED_CTX();
  for (Hold *h = holds; h; h = h->next) // only prepended to: safe to walk unlocked
    if ((const void *)h->addr == p && pending(h)) BAD("cuMemFreeHost of a word a stream still waits on (the wait has not passed)");
  free(p); return 0;
}
CUresult cuMemHostRegister_v2(void *p, size_t n, unsigned flags) { NEED_CTX(); if (!p || !n || (flags & ~9u)) BAD("register"); return 0; } /* PORTABLE | READ_ONLY */
CUresult cuMemHostUnregister(void *p) { NEED_CTX(); return p ? 0 : 1; }
CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n) { NEED_CTX(); void *m = aligned_alloc(256, (n + 255) & ~255ul); *p = (CUdeviceptr)m; return m ? 0 : 2; }
CUresult cuMemFree_v2(CUdeviceptr p) { NEED_CTX(); free((void*)p); return 0; }
CUresult cuMemGetAddressRange_v2(CUdeviceptr *b, size_t *s, CUdeviceptr p) { NEED_CTX(); (void)b; (void)s; (void)p; return 1; }
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr d, const void *s, size_t n, Stream *st) { NEED_CTX(); (void)st; memcpy((void*)d, s, n); return 0; }
CUresult cuMemcpyDtoHAsync_v2(void *d, CUdeviceptr s, size_t n, Stream *st) { NEED_CTX(); (void)st; memcpy(d, (void*)s, n); return 0; }
CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr d, CUdeviceptr s, size_t n, Stream *st) { NEED_CTX(); (void)st; memmove((void*)d, (void*)s, n); return 0; }
CUresult cuMemsetD8Async(CUdeviceptr d, unsigned char v, size_t n, Stream *st) { NEED_CTX(); (void)st; memset((void*)d, v, n); return 0; }
CUresult cuStreamCreate(Stream **s, unsigned f) { NEED_CTX(); if (f != 1) BAD("stream flags %u", f); *s = calloc(1, sizeof(Stream)); return 0; }
CUresult cuStreamDestroy_v2(Stream *s) { NEED_CTX(); free(s); return 0; }
static void wait_until(uint64_t t) { while (now_ns() < t) usleep(100); }
// A wait that has not passed yet (NULL if none or passed); once passed it
// stays passed, as on a GPU (the word may change later).
static Hold *pending(Hold *h) {
  if (!h) return NULL;
  if (__atomic_load_n(&h->done, __ATOMIC_ACQUIRE)) return NULL;
  if (pending(h->prev[0]) || pending(h->prev[1])) return h;
  if (h->addr && !satisfied(h)) return h;
  __atomic_store_n(&h->done, 1, __ATOMIC_RELEASE);
  return NULL;
}
static void wait_hold(Hold *h) { while (pending(h)) usleep(100); }
static Hold *new_hold(const uint32_t *addr, uint32_t value, Hold *a, Hold *b) {
  Hold *h = calloc(1, sizeof(Hold));
  if (!h) return NULL;
  h->addr = addr; h->value = value; h->prev[0] = a; h->prev[1] = b;
  pthread_mutex_lock(&holds_mu); h->next = holds; __atomic_store_n(&holds, h, __ATOMIC_RELEASE); pthread_mutex_unlock(&holds_mu);
  return h;
}
// flags 0 = CU_STREAM_WAIT_VALUE_GEQ, the only one epmem uses.
CUresult cuStreamWaitValue32_v2(Stream *s, CUdeviceptr addr, uint32_t value, unsigned flags) {
  NEED_CTX();
  if ((uintptr_t)s <= 2 || !addr || (addr & 3) || flags) BAD("stream wait value: stream %p addr %llx flags %u", (void *)s, addr, flags);
  Hold *h = new_hold((const uint32_t *)addr, value, pending(s->hold), NULL);
  if (!h) return 2;
  s->hold = h; return 0;
}
CUresult cuStreamSynchronize(Stream *s) { NEED_CTX(); if ((uintptr_t)s > 2) { wait_hold(s->hold); wait_until(s->busy_until); } return 0; }
CUresult cuStreamWaitEvent(Stream *s, Event *e, unsigned f) {
  NEED_CTX(); if (f) BAD("wait flags");
  if ((uintptr_t)s > 2) {
    if (e->at > s->busy_until) s->busy_until = e->at;
    if (pending(e->hold)) { Hold *j = new_hold(NULL, 0, pending(s->hold), e->hold); if (!j) return 2; s->hold = j; }
  }
  return 0;
}
CUresult cuStreamGetCtx(Stream *s, CUcontext *c) { (void)s; *c = current; return 0; }
CUresult cuEventCreate(Event **e, unsigned f) { NEED_CTX(); if (f != 0 && f != 2) BAD("event flags %u", f); *e = calloc(1, sizeof(Event)); (*e)->flags = f; return 0; }
CUresult cuEventDestroy_v2(Event *e) { NEED_CTX(); free(e); return 0; }
CUresult cuEventRecord(Event *e, Stream *s) {
  NEED_CTX(); uint64_t t = now_ns();
  if ((uintptr_t)s > 2 && s->busy_until > t) t = s->busy_until;
  e->at = t; e->recorded = 1; e->hold = (uintptr_t)s > 2 ? pending(s->hold) : NULL; return 0;
}
CUresult cuEventQuery(Event *e) { NEED_CTX(); return !pending(e->hold) && now_ns() >= e->at ? 0 : 600; }
CUresult cuEventSynchronize(Event *e) { NEED_CTX(); wait_hold(e->hold); wait_until(e->at); return 0; }
static CUresult elapsed(float *ms, Event *a, Event *b) { NEED_CTX(); if ((a->flags | b->flags) & 2) return 400; if (pending(a->hold) || pending(b->hold)) return 600; if (now_ns() < a->at || now_ns() < b->at) BAD("elapsed on a pending event"); *ms = (float)((double)((int64_t)(b->at - a->at)) / 1e6); return 0; }
CUresult cuEventElapsedTime(float *ms, Event *a, Event *b) { return elapsed(ms, a, b); }
CUresult cuEventElapsedTime_v2(float *ms, Event *a, Event *b) { return elapsed(ms, a, b); }
static int MOD, CODEC_MOD, F_SUM, F_SPIN, F_DECODE;
// The two modules: the built-in kernels and the codec (codec.ptx).
CUresult cuModuleLoadDataEx(CUmodule *m, const void *img, unsigned n, int *opts, void **vals) {
  NEED_CTX();
  if (n != 2 || opts[0] != 5 || opts[1] != 6 || (size_t)vals[1] != 8192) BAD("jit options");
  if (strstr((const char*)img, ".entry epm_codec_decode(")) { *m = &CODEC_MOD; return 0; }
  if (!strstr((const char*)img, ".entry epm_checksum(") || !strstr((const char*)img, ".entry epm_spin(")) BAD("ptx");
  *m = &MOD; return 0;
}
CUresult cuModuleGetFunction(CUfunction *f, CUmodule m, const char *name) {
  if (m == &CODEC_MOD) { if (strcmp(name, "epm_codec_decode")) return 500; *f = &F_DECODE; return 0; }
  if (m != &MOD) BAD("module");
  if (!strcmp(name, "epm_checksum")) *f = &F_SUM;
  else if (!strcmp(name, "epm_spin")) *f = &F_SPIN;
  else return 500;
  return 0;
}
CUresult cuModuleUnload(CUmodule m) { NEED_CTX(); return m == &MOD || m == &CODEC_MOD ? 0 : 400; }
// codec.cu's parameter block, and a plain C decoder of formats v1 and v2: a
// second, independent reading of the format that the CUDA path's tests decode with.
typedef struct {
  uint64_t dst, offsets, codes, lows, escapes, n_values, n_escapes;
  uint32_t dtype, k, code_bits, blocks;
  uint8_t table[16];
  uint64_t offsets3, escapes3, n_escapes3;
  uint32_t k2, reserved;
  uint8_t table2[16];
} DecodeParams;
static CUresult fake_decode(unsigned grid, unsigned block, const DecodeParams *p) {
  if (block != 128 || p->blocks != grid || (uint64_t)grid * 4096 < p->n_values || (uint64_t)(grid - 1) * 4096 >= p->n_values) BAD("decode launch: grid %u block %u for %llu values", grid, block, (unsigned long long)p->n_values);
  if (p->k < 1 || p->k > 4 || p->code_bits != p->k + (p->dtype == 2 ? 3 : 0) || (p->dtype != 1 && p->dtype != 2)) BAD("decode params: dtype %u k %u W %u", p->dtype, p->k, p->code_bits);
  if ((p->dst | p->codes | p->lows) & 15) BAD("decode: unaligned stream or destination");
  if (p->k2 > 4 || p->reserved) BAD("decode params: k2 %u", p->k2);
  const uint8_t *codes = (const uint8_t *)p->codes, *lows = (const uint8_t *)p->lows, *escs = (const uint8_t *)p->escapes;
  const uint32_t *offs = (const uint32_t *)p->offsets;
  uint16_t *dst = (uint16_t *)p->dst;
  const uint32_t w = p->code_bits, esc = (1u << p->k) - 1;
  for (uint64_t b = 0; b < grid; b++) {
    uint64_t e = offs[b], s3 = p->k2 ? ((const uint32_t *)p->offsets3)[b] : 0;
    for (uint64_t i = b * 4096; i < p->n_values && i < (b + 1) * 4096; i++) {
      uint64_t bit = i * w, c = 0;
      for (uint32_t j = 0; j < w; j++, bit++) c |= (uint64_t)((codes[bit / 8] >> (bit % 8)) & 1) << j;
      uint32_t code = c & esc, extra = (uint32_t)(c >> p->k), exp, low = lows[i];
      if (code == esc && p->k2) {
        /* v2: escape e's k2-bit code; the escape code's exponent is the next level-3 byte. */
        uint32_t c2 = 0, esc2 = (1u << p->k2) - 1;
        for (uint32_t j = 0; e < p->n_escapes && j < p->k2; j++) {
          uint64_t at = e * p->k2 + j;
          c2 |= (uint32_t)((escs[at / 8] >> (at % 8)) & 1) << j;
        }
        if (c2 == esc2) { exp = s3 < p->n_escapes3 ? ((const uint8_t *)p->escapes3)[s3] : 0; s3++; }
        else exp = p->table2[c2];
        e++;
      } else if (code == esc) { exp = e < p->n_escapes ? escs[e] : 0; e++; } else exp = p->table[code];
      dst[i] = p->dtype == 2 ? (uint16_t)(((extra & 4) << 13) | ((exp & 0x1F) << 10) | ((extra & 3) << 8) | low)
                             : (uint16_t)(((low & 0x80) << 8) | ((exp & 0xFF) << 7) | (low & 0x7F));
    }
  }
  return 0;
}
CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, unsigned sh, Stream *s, void **params, void **extra) {
  NEED_CTX();
  if (gy != 1 || gz != 1 || by != 1 || bz != 1 || sh || extra || !gx || !bx) BAD("launch dims");
  if (f == &F_SUM) {
    if (bx % 32) BAD("block");
    const uint32_t *p = (const uint32_t*)*(uint64_t*)params[0]; uint64_t words = *(uint64_t*)params[1]; uint64_t *out = (uint64_t*)*(uint64_t*)params[2];
    uint64_t sum = 0; for (uint64_t i = 0; i < words; i++) sum += (uint64_t)p[i] * (2 * i + 1);
    *out += sum; return 0;
  }
  if (f == &F_DECODE) return fake_decode(gx, bx, (const DecodeParams *)params[0]);
  if (f == &F_SPIN) { uint64_t ns = *(uint64_t*)params[0]; uint64_t t = now_ns(); if (s->busy_until > t) t = s->busy_until; s->busy_until = t + ns; return 0; }
  BAD("function");
}
// ---- VMM
#define GRAN (2u << 20)
typedef struct { int type, handleTypes; int locType, locId; void *win32; unsigned char flags[8]; } Prop;
typedef struct { int locType, locId; int flags; } AccessDesc;
static int check_prop(const Prop *p) { return p->type == 1 && p->handleTypes == 0 && p->locType == 1 && p->locId == 0 && !p->win32; }
CUresult cuMemGetAllocationGranularity(size_t *g, const Prop *p, int opt) { if (!check_prop(p) || opt != 1) BAD("granularity prop"); *g = GRAN; return 0; }
CUresult cuMemCreate(unsigned long long *h, size_t n, const Prop *p, unsigned long long f) {
  NEED_CTX(); if (!check_prop(p) || f || n % GRAN) BAD("create");
  int fd = memfd_create("fakevmm", 0); if (fd < 0 || ftruncate(fd, n)) return 2; *h = (unsigned long long)fd + 1000; return 0;
}
CUresult cuMemRelease(unsigned long long h) { NEED_CTX(); close((int)(h - 1000)); return 0; }
CUresult cuMemAddressReserve(CUdeviceptr *p, size_t n, size_t align, CUdeviceptr addr, unsigned long long f) {
  NEED_CTX(); if (addr || f || n % GRAN || align % GRAN) BAD("reserve");
  size_t over = n + align; char *m = mmap(0, over, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (m == MAP_FAILED) return 2;
  uintptr_t a = ((uintptr_t)m + align - 1) & ~(uintptr_t)(align - 1);
  if (a > (uintptr_t)m) munmap(m, a - (uintptr_t)m);
  if ((char*)a + n < m + over) munmap((char*)a + n, m + over - ((char*)a + n));
  *p = a; return 0;
}
CUresult cuMemAddressFree(CUdeviceptr p, size_t n) { NEED_CTX(); munmap((void*)p, n); return 0; }
CUresult cuMemMap(CUdeviceptr p, size_t n, size_t off, unsigned long long h, unsigned long long f) {
  NEED_CTX(); if (f || p % GRAN || n % GRAN || off % GRAN) BAD("map");
  return mmap((void*)p, n, PROT_NONE, MAP_SHARED | MAP_FIXED, (int)(h - 1000), off) == MAP_FAILED ? 1 : 0;
}
CUresult cuMemUnmap(CUdeviceptr p, size_t n) { NEED_CTX(); return mmap((void*)p, n, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0) == MAP_FAILED ? 1 : 0; }
CUresult cuMemSetAccess(CUdeviceptr p, size_t n, const AccessDesc *d, size_t count) {
  NEED_CTX(); if (count != 1 || d->locType != 1 || d->locId != 0 || (d->flags != 1 && d->flags != 3)) BAD("access desc %d %d %d", d->locType, d->locId, d->flags);
  return mprotect((void*)p, n, d->flags == 3 ? PROT_READ | PROT_WRITE : PROT_READ) ? 1 : 0;
}
