/* epmem as an ONNX Runtime plugin EP, driven from C through the wheel's
 * libonnxruntime (no ORT headers: see ort_min.h).
 *
 * Build and run (scripts/ort-test.sh does this):
 *   gcc -std=c11 -pthread -Wall -Wextra -Werror tests/ort/ort_c_test.c -o ort_c_test \
 *       $ORT_CAPI/libonnxruntime.so.1.x.y -Wl,-rpath,$ORT_CAPI
 *   ./ort_c_test /abs/path/libepmem.so
 * Prints "ort-c: N passed, N failed"; the exit code is the failure count.
 */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ort_min.h"

static const OrtApi* api;
static OrtEnv* env;
static const char* lib;
static int passed, failed;

#define CHECK(cond, ...)                                   \
  do {                                                     \
    if (cond) {                                            \
      passed++;                                            \
    } else {                                               \
      failed++;                                            \
      printf("FAIL %s:%d: %s: ", __func__, __LINE__, #cond); \
      printf(__VA_ARGS__);                                 \
      printf("\n");                                        \
    }                                                      \
  } while (0)

/* Consume a status: returns 1 on success; on failure keeps the message. */
static char last_msg[1024];
static int ok(OrtStatus* st) {
  if (!st) return 1;
  snprintf(last_msg, sizeof last_msg, "%s", ORT_FN(api, GetErrorMessage)(st));
  ORT_FN(api, ReleaseStatus)(st);
  return 0;
}

static const OrtEpDevice* find_device(const char* name) {
  const OrtEpDevice* const* devs = NULL;
  size_t n = 0;
  if (!ok(ORT_FN(api, GetEpDevices)(env, &devs, &n))) return NULL;
  for (size_t i = 0; i < n; i++)
    if (strcmp(ORT_FN(api, EpDevice_EpName)(devs[i]), name) == 0) return devs[i];
  return NULL;
}

static OrtKeyValuePairs* kv1(const char* k, const char* v) {
  OrtKeyValuePairs* kv = NULL;
  ORT_FN(api, CreateKeyValuePairs)(&kv);
  ORT_FN(api, AddKeyValuePair)(kv, k, v);
  return kv;
}

/* A statistic as a number (-1 when missing). */
static long long stat(const OrtAllocator* a, const char* key) {
  OrtKeyValuePairs* kv = NULL;
  if (!ok(ORT_FN(api, AllocatorGetStats)(a, &kv))) return -1;
  const char* v = ORT_FN(api, GetKeyValue)(kv, key);
  long long r = v ? atoll(v) : -1;
  ORT_FN(api, ReleaseKeyValuePairs)(kv);
  return r;
}

static void test_device_is_reported(void) {
  CHECK(ok(ORT_FN(api, RegisterExecutionProviderLibrary)(env, "epmem_c", lib)), "register: %s", last_msg);
  const OrtEpDevice* d = find_device("epmem_c");
  CHECK(d != NULL, "no epmem_c device");
  if (!d) return;
  const char* kind = ORT_FN(api, GetKeyValue)(ORT_FN(api, EpDevice_EpMetadata)(d), "epmem.device");
  CHECK(kind && (strcmp(kind, "cuda") == 0 || strcmp(kind, "host") == 0), "epmem.device=%s", kind ? kind : "(none)");
  const char* want = getenv("EPM_DEVICE");
  if (kind && want && (strcmp(want, "cuda") == 0 || strcmp(want, "host") == 0))
    CHECK(strcmp(kind, want) == 0, "EPM_DEVICE=%s but the device is %s", want, kind);
  CHECK(ORT_FN(api, EpDevice_MemoryInfo)(d, OrtDeviceMemoryType_DEFAULT) != NULL, "no DEFAULT memory info");
  CHECK(ORT_FN(api, EpDevice_MemoryInfo)(d, OrtDeviceMemoryType_HOST_ACCESSIBLE) != NULL, "no pinned memory info");
}

static void test_shared_allocator_options_and_stats(void) {
  const OrtEpDevice* d = find_device("epmem_c");
  if (!d) return;
  OrtKeyValuePairs* opts = kv1("epmem.arena_bytes", "1MiB");
  OrtAllocator* a = NULL;
  CHECK(ok(ORT_FN(api, CreateSharedAllocator)(env, d, OrtDeviceMemoryType_DEFAULT, OrtDeviceAllocator, opts, &a)),
        "CreateSharedAllocator: %s", last_msg);
  ORT_FN(api, ReleaseKeyValuePairs)(opts);
  if (!a) return;
  OrtAllocator* again = NULL;
  CHECK(ok(ORT_FN(api, GetSharedAllocator)(env, ORT_FN(api, EpDevice_MemoryInfo)(d, OrtDeviceMemoryType_DEFAULT), &again)) &&
            again == a,
        "GetSharedAllocator returned %p, not the allocator just made (%p)", (void*)again, (void*)a);
  const char* keys[] = {"Limit", "InUse", "TotalAllocated", "MaxInUse", "NumAllocs", "NumReserves",
                        "NumArenaExtensions", "NumArenaShrinkages", "MaxAllocSize", "epmem.reserved_bytes"};
  for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++) CHECK(stat(a, keys[i]) >= 0, "stat %s missing", keys[i]);
  CHECK(stat(a, "Limit") == 1 << 20, "Limit=%lld, options asked for 1MiB", stat(a, "Limit"));

  void* p = a->Alloc(a, 4096);
  CHECK(p != NULL, "Alloc(4096) failed");
  CHECK(stat(a, "InUse") == 4096 && stat(a, "NumAllocs") == 1, "InUse=%lld NumAllocs=%lld", stat(a, "InUse"),
        stat(a, "NumAllocs"));
  CHECK(stat(a, "epmem.committed_bytes") > 0, "nothing committed after an Alloc");
  /* The arena commits a chunk once; later allocations make no driver call. */
  CHECK(stat(a, "NumArenaExtensions") == 1, "extensions after the first Alloc: %lld", stat(a, "NumArenaExtensions"));
  void* many[64];
  for (int i = 0; i < 64; i++) many[i] = a->Alloc(a, 1024);
  for (int i = 0; i < 64; i++) {
    CHECK(many[i] != NULL, "small Alloc %d failed", i);
    if (many[i]) a->Free(a, many[i]);
  }
  CHECK(stat(a, "NumArenaExtensions") == 1, "64 small allocations went to the driver: extensions=%lld",
        stat(a, "NumArenaExtensions"));
  /* AllocOnStream with no stream is a plain allocation (nothing to order after). */
  CHECK(a->AllocOnStream != NULL, "no AllocOnStream");
  if (a->AllocOnStream) {
    void* q = a->AllocOnStream(a, 2048, NULL);
    CHECK(q != NULL && stat(a, "InUse") == 4096 + 2048, "AllocOnStream(NULL stream): %p, InUse=%lld", q, stat(a, "InUse"));
    if (q) a->Free(a, q);
    CHECK(stat(a, "epmem.stream_allocs") == 0 && stat(a, "epmem.deferred_frees") == 0 &&
              stat(a, "epmem.pending_blocks") == 0,
          "a stream-less allocation was stream-ordered: stream_allocs=%lld deferred_frees=%lld",
          stat(a, "epmem.stream_allocs"), stat(a, "epmem.deferred_frees"));
  }
  void* big = a->Alloc(a, 2 << 20);
  CHECK(big == NULL, "Alloc past the 1 MiB limit succeeded");
  CHECK(stat(a, "epmem.failed_allocs") == 1, "failed_allocs=%lld", stat(a, "epmem.failed_allocs"));
  a->Free(a, p);
  CHECK(stat(a, "InUse") == 0 && stat(a, "MaxInUse") == 4096 + 64 * 1024, "after Free: InUse=%lld MaxInUse=%lld",
        stat(a, "InUse"), stat(a, "MaxInUse"));
  /* A second Free of the same pointer, or a pointer it never made, is ignored. */
  long long frees = stat(a, "epmem.frees");
  a->Free(a, p);
  a->Free(a, (void*)&frees);
  CHECK(stat(a, "epmem.frees") == frees && stat(a, "InUse") == 0, "bad Free changed the books: frees %lld -> %lld",
        frees, stat(a, "epmem.frees"));
  /* Shrink (ORT 1.25+ reads it when version >= 25) gives unused memory back. */
  if (a->version >= 25) {
    CHECK(a->Shrink && ok(a->Shrink(a)), "Shrink: %s", last_msg);
    CHECK(stat(a, "epmem.committed_bytes") == 0, "committed after Shrink with nothing live: %lld",
          stat(a, "epmem.committed_bytes"));
    CHECK(stat(a, "NumArenaShrinkages") == 1, "shrinkages=%lld", stat(a, "NumArenaShrinkages"));
  }
  CHECK(ok(ORT_FN(api, ReleaseSharedAllocator)(env, d, OrtDeviceMemoryType_DEFAULT)), "ReleaseSharedAllocator: %s",
        last_msg);
}

static void test_bad_options_are_rejected(void) {
  const OrtEpDevice* d = find_device("epmem_c");
  if (!d) return;
  struct { const char *k, *v, *expect; } bad[] = {
      {"epmem.arena_bytes", "lots", "epmem.arena_bytes"},
      {"epmem.arena_bytes", "0", "greater than zero"},
      {"epmem.arena_byte", "1", "unknown allocator option"},
      {"arena.max_mem", "1024", "brings its own arena"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    OrtKeyValuePairs* opts = kv1(bad[i].k, bad[i].v);
    OrtAllocator* a = NULL;
    int good = ok(ORT_FN(api, CreateSharedAllocator)(env, d, OrtDeviceMemoryType_DEFAULT, OrtDeviceAllocator, opts, &a));
    ORT_FN(api, ReleaseKeyValuePairs)(opts);
    CHECK(!good, "%s=%s was accepted", bad[i].k, bad[i].v);
    CHECK(!good && strstr(last_msg, bad[i].expect), "%s=%s: message %s", bad[i].k, bad[i].v, last_msg);
  }
  /* ORT's own arena on top of ours is refused, by ORT or by us. */
  OrtAllocator* a = NULL;
  CHECK(!ok(ORT_FN(api, CreateSharedAllocator)(env, d, OrtDeviceMemoryType_DEFAULT, OrtArenaAllocator, NULL, &a)),
        "OrtArenaAllocator was accepted");
  /* A good allocator can still be made afterwards. */
  CHECK(ok(ORT_FN(api, CreateSharedAllocator)(env, d, OrtDeviceMemoryType_DEFAULT, OrtDeviceAllocator, NULL, &a)) && a,
        "allocator after bad options: %s", last_msg);
}

static OrtValue* tensor(OrtAllocator* a, int64_t n) {
  OrtValue* v = NULL;
  int64_t shape[1] = {n};
  if (!ok(ORT_FN(api, CreateTensorAsOrtValue)(a, shape, 1, ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8, &v))) return NULL;
  return v;
}

static unsigned char* data(OrtValue* v) {
  void* p = NULL;
  return ok(ORT_FN(api, GetTensorMutableData)(v, &p)) ? p : NULL;
}

static void test_copy_tensors(void) {
  const OrtEpDevice* d = find_device("epmem_c");
  if (!d) return;
  OrtAllocator *cpu = NULL, *dev = NULL, *pin = NULL;
  CHECK(ok(ORT_FN(api, GetAllocatorWithDefaultOptions)(&cpu)), "CPU allocator: %s", last_msg);
  CHECK(ok(ORT_FN(api, CreateSharedAllocator)(env, d, OrtDeviceMemoryType_DEFAULT, OrtDeviceAllocator, NULL, &dev)),
        "device allocator: %s", last_msg);
  CHECK(ok(ORT_FN(api, CreateSharedAllocator)(env, d, OrtDeviceMemoryType_HOST_ACCESSIBLE, OrtDeviceAllocator, NULL, &pin)),
        "pinned allocator: %s", last_msg);
  if (!cpu || !dev || !pin) return;
  enum { N = 3 << 20 }; /* 3 MiB: more than one 2 MiB granule */
  OrtValue *src = tensor(cpu, N), *on_dev = tensor(dev, N), *pinned = tensor(pin, N), *back = tensor(cpu, N);
  OrtValue* on_dev_b = tensor(dev, N);
  OrtValue *src2 = tensor(cpu, 1000), *on_dev2 = tensor(dev, 1000), *back2 = tensor(cpu, 1000), *wrong = tensor(dev, 999);
  int made = src && on_dev && on_dev_b && pinned && back && src2 && on_dev2 && back2 && wrong;
  CHECK(made, "tensor creation: %s", last_msg);
  if (!made) goto cleanup;
  unsigned char *s = data(src), *b = data(back), *s2 = data(src2), *b2 = data(back2);
  srand(42);
  for (size_t i = 0; i < N; i++) s[i] = (unsigned char)rand();
  for (size_t i = 0; i < 1000; i++) s2[i] = (unsigned char)rand();
  memset(b, 0, N);
  memset(b2, 0, 1000);

  /* CPU -> device and a second pair in one batch, then device -> CPU. */
  const OrtValue* up_src[2] = {src, src2};
  OrtValue* up_dst[2] = {on_dev, on_dev2};
  CHECK(ok(ORT_FN(api, CopyTensors)(env, up_src, up_dst, NULL, 2)), "H2D: %s", last_msg);
  const OrtValue* down_src[2] = {on_dev, on_dev2};
  OrtValue* down_dst[2] = {back, back2};
  CHECK(ok(ORT_FN(api, CopyTensors)(env, down_src, down_dst, NULL, 2)), "D2H: %s", last_msg);
  CHECK(memcmp(s, b, N) == 0 && memcmp(s2, b2, 1000) == 0, "device round trip is not bit-exact");
  /* ORT chose epmem's data transfer for both directions; host -> device went
   * through the staging engine (pageable source: staged). */
  CHECK(stat(dev, "epmem.htod_staged") >= 2, "htod_staged=%lld", stat(dev, "epmem.htod_staged"));
  CHECK(stat(dev, "epmem.copies_htod") >= 2 && stat(dev, "epmem.copies_dtoh") >= 2, "htod=%lld dtoh=%lld",
        stat(dev, "epmem.copies_htod"), stat(dev, "epmem.copies_dtoh"));

  /* device -> device -> CPU. */
  memset(b, 0, N);
  const OrtValue* dd_src[1] = {on_dev};
  OrtValue* dd_dst[1] = {on_dev_b};
  CHECK(ok(ORT_FN(api, CopyTensors)(env, dd_src, dd_dst, NULL, 1)), "D2D: %s", last_msg);
  const OrtValue* db_src[1] = {on_dev_b};
  OrtValue* db_dst[1] = {back};
  CHECK(ok(ORT_FN(api, CopyTensors)(env, db_src, db_dst, NULL, 1)), "D2H after D2D: %s", last_msg);
  CHECK(memcmp(s, b, N) == 0, "device-to-device copy is not bit-exact");
  CHECK(stat(dev, "epmem.copies_dtod") >= 1, "D2D was not copied by epmem");

  /* device -> pinned -> CPU. */
  memset(b, 0, N);
  const OrtValue* p_src[1] = {on_dev};
  OrtValue* p_dst[1] = {pinned};
  CHECK(ok(ORT_FN(api, CopyTensors)(env, p_src, p_dst, NULL, 1)), "D2pinned: %s", last_msg);
  const OrtValue* c_src[1] = {pinned};
  OrtValue* c_dst[1] = {back};
  CHECK(ok(ORT_FN(api, CopyTensors)(env, c_src, c_dst, NULL, 1)), "pinned2CPU: %s", last_msg);
  CHECK(memcmp(s, b, N) == 0, "pinned round trip is not bit-exact");
  /* pinned -> device: a page-locked source is copied directly, not staged. */
  const OrtValue* pd_src[1] = {pinned};
  OrtValue* pd_dst[1] = {on_dev_b};
  long long direct = stat(dev, "epmem.htod_direct");
  CHECK(ok(ORT_FN(api, CopyTensors)(env, pd_src, pd_dst, NULL, 1)), "pinned2D: %s", last_msg);
  CHECK(stat(dev, "epmem.htod_direct") == direct + 1, "pinned source was staged (direct %lld -> %lld)", direct,
        stat(dev, "epmem.htod_direct"));
  CHECK(stat(dev, "epmem.copies_host") >= 1, "pinned -> CPU was not copied by epmem");

  /* Mismatched sizes are an error, not a partial copy. */
  const OrtValue* w_src[1] = {src2};
  OrtValue* w_dst[1] = {wrong};
  CHECK(!ok(ORT_FN(api, CopyTensors)(env, w_src, w_dst, NULL, 1)), "1000 -> 999 bytes was accepted");

cleanup:
  ORT_FN(api, ReleaseValue)(src);
  ORT_FN(api, ReleaseValue)(on_dev);
  ORT_FN(api, ReleaseValue)(on_dev_b);
  ORT_FN(api, ReleaseValue)(pinned);
  ORT_FN(api, ReleaseValue)(back);
  ORT_FN(api, ReleaseValue)(src2);
  ORT_FN(api, ReleaseValue)(on_dev2);
  ORT_FN(api, ReleaseValue)(back2);
  ORT_FN(api, ReleaseValue)(wrong);
  CHECK(stat(dev, "InUse") == 0, "device InUse=%lld after releasing every tensor", stat(dev, "InUse"));
}

/* Several threads allocating and freeing on one allocator at once. */
enum { THREADS = 4, ROUNDS = 500 };
static void* churn(void* arg) {
  OrtAllocator* a = arg;
  void* held[8] = {0};
  unsigned seed = (unsigned)(size_t)&held;
  for (int i = 0; i < ROUNDS; i++) {
    int k = i % 8;
    if (held[k]) a->Free(a, held[k]);
    held[k] = a->Alloc(a, 64 + (size_t)(rand_r(&seed) % 65536));
    if (!held[k]) return (void*)1;
    memset(held[k], i & 0xff, 64); /* pinned memory: the host may touch it */
  }
  for (int k = 0; k < 8; k++) a->Free(a, held[k]);
  return NULL;
}

static void test_concurrent_allocations(void) {
  const OrtEpDevice* d = find_device("epmem_c");
  OrtAllocator* a = NULL;
  CHECK(d && ok(ORT_FN(api, CreateSharedAllocator)(env, d, OrtDeviceMemoryType_HOST_ACCESSIBLE, OrtDeviceAllocator, NULL, &a)) && a,
        "pinned allocator: %s", last_msg);
  if (!a) return;
  long long before = stat(a, "NumAllocs");
  pthread_t t[THREADS];
  for (int i = 0; i < THREADS; i++) pthread_create(&t[i], NULL, churn, a);
  int failures = 0;
  for (int i = 0; i < THREADS; i++) {
    void* r = NULL;
    pthread_join(t[i], &r);
    failures += r != NULL;
  }
  CHECK(failures == 0, "%d threads saw an Alloc fail", failures);
  CHECK(stat(a, "InUse") == 0, "InUse=%lld after every thread freed everything", stat(a, "InUse"));
  CHECK(stat(a, "NumAllocs") - before == THREADS * ROUNDS, "NumAllocs grew by %lld, not %d", stat(a, "NumAllocs") - before,
        THREADS * ROUNDS);
  CHECK(stat(a, "epmem.live_allocations") == 0, "live=%lld", stat(a, "epmem.live_allocations"));
}

static void test_double_registration(void) {
  /* Same name twice: refused, and the first registration is unharmed. */
  CHECK(!ok(ORT_FN(api, RegisterExecutionProviderLibrary)(env, "epmem_c", lib)), "second epmem_c was accepted");
  CHECK(find_device("epmem_c") != NULL, "epmem_c lost its device");
  /* Same file under a second name: an independent factory. */
  CHECK(ok(ORT_FN(api, RegisterExecutionProviderLibrary)(env, "epmem_c2", lib)), "epmem_c2: %s", last_msg);
  const OrtEpDevice* d2 = find_device("epmem_c2");
  CHECK(d2 != NULL, "no epmem_c2 device");
  OrtAllocator* a2 = NULL;
  if (d2)
    CHECK(ok(ORT_FN(api, CreateSharedAllocator)(env, d2, OrtDeviceMemoryType_DEFAULT, OrtDeviceAllocator, NULL, &a2)),
          "epmem_c2 allocator: %s", last_msg);
  void* p = a2 ? a2->Alloc(a2, 256) : NULL;
  CHECK(p != NULL, "epmem_c2 Alloc failed");
  if (p) a2->Free(a2, p);
  CHECK(ok(ORT_FN(api, UnregisterExecutionProviderLibrary)(env, "epmem_c2")), "unregister epmem_c2: %s", last_msg);
  CHECK(find_device("epmem_c2") == NULL, "epmem_c2 still listed");
  /* The first name still allocates. ORT keys env-level shared allocators by
   * memory device, which both names share, so make ours again. */
  const OrtEpDevice* d = find_device("epmem_c");
  OrtAllocator* a = NULL;
  CHECK(d && ok(ORT_FN(api, CreateSharedAllocator)(env, d, OrtDeviceMemoryType_DEFAULT, OrtDeviceAllocator, NULL, &a)) && a,
        "epmem_c allocator after epmem_c2 went: %s", last_msg);
  p = a ? a->Alloc(a, 256) : NULL;
  CHECK(p != NULL, "epmem_c Alloc after epmem_c2 went");
  if (p) a->Free(a, p);
}

static void test_teardown_order(void) {
  /* Unregister while a shared allocator made with options is still live
   * (never released by the user): ORT releases it, we must not crash. */
  const OrtEpDevice* d = find_device("epmem_c");
  OrtKeyValuePairs* opts = kv1("epmem.arena_bytes", "64MiB");
  OrtAllocator* a = NULL;
  CHECK(d && ok(ORT_FN(api, CreateSharedAllocator)(env, d, OrtDeviceMemoryType_HOST_ACCESSIBLE, OrtDeviceAllocator, opts, &a)),
        "pinned allocator: %s", last_msg);
  ORT_FN(api, ReleaseKeyValuePairs)(opts);
  void* p = a ? a->Alloc(a, 1 << 20) : NULL;
  CHECK(p != NULL, "pinned Alloc");
  if (p) a->Free(a, p);
  CHECK(ok(ORT_FN(api, UnregisterExecutionProviderLibrary)(env, "epmem_c")), "unregister epmem_c: %s", last_msg);
  CHECK(find_device("epmem_c") == NULL, "epmem_c still listed");
  /* Unregistering again is a clean error. */
  CHECK(!ok(ORT_FN(api, UnregisterExecutionProviderLibrary)(env, "epmem_c")), "second unregister was accepted");
  /* Re-register under the same name: a fresh factory that works. */
  CHECK(ok(ORT_FN(api, RegisterExecutionProviderLibrary)(env, "epmem_c", lib)), "re-register: %s", last_msg);
  d = find_device("epmem_c");
  a = NULL;
  CHECK(d && ok(ORT_FN(api, CreateSharedAllocator)(env, d, OrtDeviceMemoryType_DEFAULT, OrtDeviceAllocator, NULL, &a)) && a,
        "allocator after re-register: %s", last_msg);
  p = a ? a->Alloc(a, 4096) : NULL;
  CHECK(p != NULL, "Alloc after re-register");
  if (p) a->Free(a, p);
  /* Left registered on purpose: ReleaseEnv must tear it down. */
}

int main(int argc, char** argv) {
  if (argc != 2 || argv[1][0] != '/') {
    fprintf(stderr, "usage: %s /absolute/path/libepmem.so\n", argv[0]);
    return 2;
  }
  lib = argv[1];
  const OrtApiBase* base = OrtGetApiBase();
  api = base->GetApi(23);
  if (!api) {
    fprintf(stderr, "onnxruntime %s has no API 23\n", base->GetVersionString());
    return 2;
  }
  printf("onnxruntime %s, EPM_DEVICE=%s\n", base->GetVersionString(), getenv("EPM_DEVICE") ? getenv("EPM_DEVICE") : "auto");
  if (!ok(ORT_FN(api, CreateEnv)(ORT_LOGGING_LEVEL_WARNING, "epmem-ort-test", &env))) {
    fprintf(stderr, "CreateEnv: %s\n", last_msg);
    return 2;
  }
  test_device_is_reported();
  test_shared_allocator_options_and_stats();
  test_bad_options_are_rejected();
  test_copy_tensors();
  test_concurrent_allocations();
  test_double_registration();
  test_teardown_order();
  ORT_FN(api, ReleaseEnv)(env);
  printf("ort-c: %d passed, %d failed\n", passed, failed);
  return failed;
}
