/*
 * Q6: while a stream waits on the device (cuStreamWaitValue64) for a value
 * nothing has written yet, which driver calls made by another thread return,
 * and which block until the wait passes? Asked once with nothing else going
 * on, and once while a third thread copies from the device to pageable host
 * memory on the waiting stream (what `tensor.item()` / `.cpu()` does).
 *
 * Why it matters: a background filler that lets the consumer's stream wait
 * on the device for a copy it has not issued yet (epmem's
 * `fill_waits_on_host` 0) must issue that copy with calls that never block
 * here, or it deadlocks. On the H200 (CUDA 13 driver) it did, so epmem
 * refuses `fill_waits_on_host` 0; this probe FAILs the day the reason goes
 * away (then the refusal can be revisited; docs/RESIDENCY.md, "Why the host
 * waits").
 *   ffi-tests/gpu/build.sh OUT && OUT/q6_value_wait_blocks
 */
#include <atomic>
#include <pthread.h>
#include <unistd.h>

#include "probe.h"

/* A call counts as blocking if it has not returned this long after the
 * waiting stream's value was due (the wait is released right after). */
static const double BLOCK_US = 500e3;

static CUcontext g_ctx;
static CUstream g_wait, g_other;
static CUdeviceptr g_dev_src, g_dev_dst;

/* State the calls share (each call's setup is the previous call's result). */
struct Objects {
  CUevent ev = nullptr;
  void *pinned = nullptr;
  void *host = nullptr;
  CUdeviceptr dptr = 0;
  CUstream stream = nullptr;
};

struct Call {
  const char *name;
  void (*fn)(Objects &);
};

static const Call CALLS[] = {
    {"cuEventCreate", [](Objects &o) { DRV(cuEventCreate(&o.ev, CU_EVENT_DISABLE_TIMING)); }},
    {"cuEventRecord", [](Objects &o) { DRV(cuEventRecord(o.ev, g_other)); }},
    {"cuEventDestroy", [](Objects &o) { DRV(cuEventDestroy(o.ev)); }},
    {"cuMemHostAlloc", [](Objects &o) { DRV(cuMemHostAlloc(&o.pinned, 1 << 20, 0)); }},
    {"cuMemcpyHtoDAsync", [](Objects &o) { DRV(cuMemcpyHtoDAsync(g_dev_dst, o.pinned, 1 << 20, g_other)); }},
    {"cuStreamWriteValue64", [](Objects &o) { DRV(cuStreamWriteValue64(g_other, (CUdeviceptr)o.pinned, 1, 0)); }},
    {"cuMemFreeHost", [](Objects &o) { DRV(cuMemFreeHost(o.pinned)); }},
    {"cuMemHostRegister", [](Objects &o) {
       o.host = aligned_alloc(4096, 4 << 20);
       DRV(cuMemHostRegister(o.host, 4 << 20, 0));
     }},
    {"cuMemHostUnregister", [](Objects &o) { DRV(cuMemHostUnregister(o.host)); }},
    {"cuMemAlloc", [](Objects &o) { DRV(cuMemAlloc(&o.dptr, 2 << 20)); }},
    {"cuMemFree", [](Objects &o) { DRV(cuMemFree(o.dptr)); }},
    {"cuStreamCreate", [](Objects &o) { DRV(cuStreamCreate(&o.stream, CU_STREAM_NON_BLOCKING)); }},
    {"cuStreamDestroy", [](Objects &o) { DRV(cuStreamDestroy(o.stream)); }},
};
static const int NCALLS = sizeof CALLS / sizeof *CALLS;

struct Run {
  volatile uint64_t *word;
  uint64_t value;
  std::atomic<int> go{-1}, done{-1};
  Objects o;
  static char pageable[1 << 20];
};
char Run::pageable[1 << 20];

static void *caller(void *arg) {
  Run &r = *static_cast<Run *>(arg);
  DRV(cuCtxSetCurrent(g_ctx));
  for (int k = 0; k < NCALLS; k++) {
    while (r.go.load() < k) usleep(100);
    usleep(50000); /* the copying thread is inside its call by now */
    CALLS[k].fn(r.o);
    r.done.store(k);
  }
  return nullptr;
}

static void *pageable_copier(void *arg) {
  DRV(cuCtxSetCurrent(g_ctx));
  /* Returns once the waiting stream has passed its wait and this copy. */
  DRV(cuMemcpyDtoHAsync(Run::pageable, g_dev_src, sizeof Run::pageable, g_wait));
  (void)arg;
  return nullptr;
}

/* One pass over CALLS; blocked[k] says whether call k blocked. */
static void run_pass(bool pageable_copy, bool *blocked) {
  Run r;
  void *w = nullptr;
  DRV(cuMemHostAlloc(&w, 8, 0));
  r.word = static_cast<volatile uint64_t *>(w);
  *r.word = 0;
  pthread_t t;
  EXPECT(pthread_create(&t, nullptr, caller, &r) == 0, "pthread_create");
  for (int k = 0; k < NCALLS; k++) {
    DRV(cuStreamWaitValue64(g_wait, (CUdeviceptr)r.word, k + 1, 0));
    DRV(cuMemcpyDtoDAsync(g_dev_dst, g_dev_src, 1 << 20, g_wait));
    pthread_t c{};
    if (pageable_copy) EXPECT(pthread_create(&c, nullptr, pageable_copier, nullptr) == 0, "pthread_create");
    const double t0 = now_us();
    r.go.store(k);
    while (r.done.load() < k && now_us() - t0 < BLOCK_US) usleep(200);
    blocked[k] = r.done.load() < k;
    *r.word = k + 1; /* the host writes the value: the wait passes */
    while (r.done.load() < k) usleep(200);
    if (pageable_copy) pthread_join(c, nullptr);
    DRV(cuStreamSynchronize(g_wait));
  }
  pthread_join(t, nullptr);
  DRV(cuStreamSynchronize(g_other));
  free(r.o.host);
  DRV(cuMemFreeHost(w));
}

int main() {
  probe_name = "q6_value_wait_blocks";
  DRV(cuInit(0));
  CUdevice dev;
  DRV(cuDeviceGet(&dev, 0));
  int ops = 0;
  DRV(cuDeviceGetAttribute(&ops, CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS, dev));
  if (!ops) {
    printf("PASS q6_value_wait_blocks: this device has no 64-bit stream memory operations (nothing to ask)\n");
    return 0;
  }
  DRV(cuDevicePrimaryCtxRetain(&g_ctx, dev));
  DRV(cuCtxSetCurrent(g_ctx));
  DRV(cuStreamCreate(&g_wait, CU_STREAM_NON_BLOCKING));
  DRV(cuStreamCreate(&g_other, CU_STREAM_NON_BLOCKING));
  DRV(cuMemAlloc(&g_dev_src, 1 << 20));
  DRV(cuMemAlloc(&g_dev_dst, 1 << 20));
  bool idle[NCALLS], copying[NCALLS];
  run_pass(false, idle);
  run_pass(true, copying);
  printf("%-22s | nothing else | a pageable D2H on the waiting stream\n", "call (another thread)");
  for (int k = 0; k < NCALLS; k++)
    printf("%-22s | %-12s | %s\n", CALLS[k].name, idle[k] ? "BLOCKS" : "returns", copying[k] ? "BLOCKS" : "returns");
  DRV(cuMemFree(g_dev_src));
  DRV(cuMemFree(g_dev_dst));
  DRV(cuStreamDestroy(g_wait));
  DRV(cuStreamDestroy(g_other));
  DRV(cuDevicePrimaryCtxRelease(dev));
  /* The calls a filler cannot do without: an event per copy, pinned staging. */
  const bool reason = idle[6] || copying[0] || copying[3];
  if (!reason) {
    printf("FAIL q6_value_wait_blocks: no call a filler needs blocked behind a pending value wait on this driver: "
           "the reason epmem refuses fill_waits_on_host 0 is gone (revisit docs/RESIDENCY.md)\n");
    return 1;
  }
  printf("PASS q6_value_wait_blocks: behind a pending value wait, cuMemFreeHost %s; with a pageable D2H on the "
         "waiting stream, cuEventCreate %s, cuMemHostAlloc %s (why epmem refuses fill_waits_on_host 0)\n",
         idle[6] ? "blocks" : "returns", copying[0] ? "blocks" : "returns", copying[3] ? "blocks" : "returns");
  return 0;
}
