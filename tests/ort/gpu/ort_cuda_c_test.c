/* ORT's CUDA EP on epmem memory, from C through onnxruntime-gpu's
 * libonnxruntime (GPU machine only; scripts/ort-gpu-test.sh builds and runs it).
 *
 *   ort_cuda_c_test /abs/libepmem.so model.onnx D_MODEL
 *
 * One env-wide epmem allocator (CreateSharedAllocator with epmem's options)
 * serves a CUDA-EP session (session.use_env_allocators=1). It checks, from
 * AllocatorGetStats: the session's allocations went through epmem (NumAllocs
 * grows, the CUDA EP passed its stream: epmem.stream_allocs > 0), no driver
 * allocation after warm-up (NumArenaExtensions and epmem.committed_bytes
 * flat), InUse back to its start after the session ends, Shrink gives memory
 * back; and an epmem.arena_bytes limit below the model's size is ORT's error,
 * not a crash. Prints "ort-gpu-c: N passed, N failed".
 */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ort_gpu_min.h"

static const OrtApi* api;
static OrtEnv* env;
static int passed, failed;
static int D;

#define CHECK(cond, ...)                                      \
  do {                                                        \
    if (cond) {                                               \
      passed++;                                               \
    } else {                                                  \
      failed++;                                               \
      printf("FAIL %s:%d: %s: ", __func__, __LINE__, #cond);  \
      printf(__VA_ARGS__);                                    \
      printf("\n");                                           \
    }                                                         \
  } while (0)

static char last_msg[2048];
static int ok(OrtStatus* st) {
  if (!st) return 1;
  snprintf(last_msg, sizeof last_msg, "%s", ORT_FN(api, GetErrorMessage)(st));
  ORT_FN(api, ReleaseStatus)(st);
  return 0;
}

static long long stat(const OrtAllocator* a, const char* key) {
  OrtKeyValuePairs* kv = NULL;
  if (!ok(ORT_FN(api, AllocatorGetStats)(a, &kv))) return -1;
  const char* v = ORT_FN(api, GetKeyValue)(kv, key);
  long long r = v ? atoll(v) : -1;
  ORT_FN(api, ReleaseKeyValuePairs)(kv);
  return r;
}

static const OrtEpDevice* find_device(const char* name) {
  const OrtEpDevice* const* devs = NULL;
  size_t n = 0;
  if (!ok(ORT_FN(api, GetEpDevices)(env, &devs, &n))) return NULL;
  for (size_t i = 0; i < n; i++)
    if (strcmp(ORT_FN(api, EpDevice_EpName)(devs[i]), name) == 0) return devs[i];
  return NULL;
}

static OrtAllocator* shared_allocator(const OrtEpDevice* dev, const char* arena_bytes) {
  OrtKeyValuePairs* kv = NULL;
  ORT_FN(api, CreateKeyValuePairs)(&kv);
  ORT_FN(api, AddKeyValuePair)(kv, "epmem.arena_bytes", arena_bytes);
  OrtAllocator* a = NULL;
  int good = ok(ORT_FN(api, CreateSharedAllocator)(env, dev, OrtDeviceMemoryType_DEFAULT, OrtDeviceAllocator, kv, &a));
  ORT_FN(api, ReleaseKeyValuePairs)(kv);
  CHECK(good && a, "CreateSharedAllocator(epmem.arena_bytes=%s): %s", arena_bytes, last_msg);
  return good ? a : NULL;
}

/* A session on the CUDA EP using the env's allocators; NULL with last_msg on failure. */
static OrtSession* cuda_session(const char* model) {
  OrtSessionOptions* so = NULL;
  OrtCUDAProviderOptionsV2* cuda = NULL;
  OrtSession* s = NULL;
  if (ok(ORT_FN(api, CreateSessionOptions)(&so)) &&
      ok(ORT_FN(api, AddSessionConfigEntry)(so, "session.use_env_allocators", "1")) &&
      ok(ORT_FN(api, CreateCUDAProviderOptions)(&cuda)) &&
      ok(ORT_FN(api, SessionOptionsAppendExecutionProvider_CUDA_V2)(so, cuda)))
    ok(ORT_FN(api, CreateSession)(env, model, so, &s));
  if (cuda) ORT_FN(api, ReleaseCUDAProviderOptions)(cuda);
  if (so) ORT_FN(api, ReleaseSessionOptions)(so);
  return s;
}

/* Run one (batch, seq) shape; returns a checksum of Y (NAN on failure, message in last_msg). */
static double run(OrtSession* s, int b, int t) {
  size_t n = (size_t)b * t * D;
  float* x = malloc(n * sizeof(float));
  for (size_t i = 0; i < n; i++) x[i] = (float)((int)((i * 2654435761u) % 2001) - 1000) / 1000.0f;
  OrtMemoryInfo* mi = NULL;
  OrtValue *in = NULL, *out = NULL;
  double sum = NAN;
  int64_t shape[3] = {b, t, D};
  const char* in_names[1] = {"X"};
  const char* out_names[1] = {"Y"};
  if (ok(ORT_FN(api, CreateCpuMemoryInfo)(OrtDeviceAllocator, 0, &mi)) &&
      ok(ORT_FN(api, CreateTensorWithDataAsOrtValue)(mi, x, n * sizeof(float), shape, 3, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, &in)) &&
      ok(ORT_FN(api, Run)(s, NULL, in_names, (const OrtValue* const*)&in, 1, out_names, 1, &out))) {
    float* y = NULL;
    if (ok(ORT_FN(api, GetTensorMutableData)(out, (void**)&y))) {
      sum = 0;
      for (size_t i = 0; i < n; i++) sum += (double)y[i] * (double)((i % 7) + 1);
    }
  }
  if (out) ORT_FN(api, ReleaseValue)(out);
  if (in) ORT_FN(api, ReleaseValue)(in);
  if (mi) ORT_FN(api, ReleaseMemoryInfo)(mi);
  free(x);
  return sum;
}

static const int SHAPES[][2] = {{1, 1}, {2, 64}, {4, 128}, {8, 31}, {3, 200}, {16, 64}, {1, 512}};
#define NSHAPES (int)(sizeof SHAPES / sizeof SHAPES[0])

static void test_session_memory_goes_through_epmem(const OrtEpDevice* dev, const char* model) {
  OrtAllocator* a = shared_allocator(dev, "16GiB");
  if (!a) return;
  long long allocs0 = stat(a, "NumAllocs"), in_use0 = stat(a, "InUse");
  OrtSession* s = cuda_session(model);
  CHECK(s != NULL, "CUDA EP session: %s", last_msg);
  if (!s) return;
  double first[NSHAPES];
  for (int round = 0; round < 2; round++) /* warm-up: every shape twice */
    for (int i = 0; i < NSHAPES; i++) {
      double c = run(s, SHAPES[i][0], SHAPES[i][1]);
      CHECK(!isnan(c), "warm-up run %dx%d: %s", SHAPES[i][0], SHAPES[i][1], last_msg);
      if (round == 0) first[i] = c;
      else CHECK(c == first[i], "shape %d: run-to-run output differs", i);
    }
  long long committed_w = stat(a, "epmem.committed_bytes"), ext_w = stat(a, "NumArenaExtensions");
  long long allocs_w = stat(a, "NumAllocs");
  for (int round = 0; round < 5; round++)
    for (int i = 0; i < NSHAPES; i++) {
      double c = run(s, SHAPES[i][0], SHAPES[i][1]);
      CHECK(c == first[i], "shape %dx%d after warm-up: checksum %.9g, first %.9g (%s)", SHAPES[i][0], SHAPES[i][1], c, first[i],
            isnan(c) ? last_msg : "");
    }
  long long allocs1 = stat(a, "NumAllocs"), committed1 = stat(a, "epmem.committed_bytes");
  long long ext1 = stat(a, "NumArenaExtensions"), stream_allocs = stat(a, "epmem.stream_allocs");
  printf("  NumAllocs %lld -> %lld -> %lld, committed %lld -> %lld bytes, NumArenaExtensions %lld -> %lld, "
         "stream_allocs %lld, same_stream_reuses %lld, deferred_frees %lld, events recorded %lld created %lld, waits %lld\n",
         allocs0, allocs_w, allocs1, committed_w, committed1, ext_w, ext1, stream_allocs,
         stat(a, "epmem.same_stream_reuses"), stat(a, "epmem.deferred_frees"), stat(a, "epmem.stream_events_recorded"),
         stat(a, "epmem.stream_events_created"),
         stat(a, "epmem.stream_waits"));
  CHECK(allocs_w > allocs0 && allocs1 > allocs_w, "the session's allocations did not go through epmem");
  CHECK(stream_allocs > 0, "ORT never called AllocOnStream: frees are not stream-ordered");
  CHECK(committed1 == committed_w, "epmem.committed_bytes moved after warm-up");
  CHECK(ext1 == ext_w, "driver allocations after warm-up: %lld", ext1 - ext_w);
  ORT_FN(api, ReleaseSession)(s);
  long long in_use1 = stat(a, "InUse");
  CHECK(in_use1 == in_use0, "InUse %lld after the session, %lld before", in_use1, in_use0);

  /* Shrink gives the chunks the session left committed back to the driver. */
  long long before = stat(a, "epmem.committed_bytes"), shrinks = stat(a, "NumArenaShrinkages");
  CHECK(before > 0, "nothing committed to give back");
  CHECK(a->version >= 25 && a->Shrink, "no Shrink on the shared allocator (version %u)", a->version);
  if (a->version >= 25 && a->Shrink) {
    CHECK(ok(a->Shrink(a)), "Shrink: %s", last_msg);
    long long after = stat(a, "epmem.committed_bytes");
    printf("  Shrink: committed %lld -> %lld bytes\n", before, after);
    CHECK(after < before && stat(a, "NumArenaShrinkages") > shrinks, "Shrink gave nothing back");
  }
  CHECK(ok(ORT_FN(api, ReleaseSharedAllocator)(env, dev, OrtDeviceMemoryType_DEFAULT)), "%s", last_msg);
}

static void test_a_limit_below_the_model_is_an_error_not_a_crash(const OrtEpDevice* dev, const char* model) {
  OrtAllocator* a = shared_allocator(dev, "1MiB");
  if (!a) return;
  OrtSession* s = cuda_session(model);
  const char* where = "CreateSession";
  int failed_cleanly = (s == NULL);
  if (s) {
    where = "Run";
    failed_cleanly = isnan(run(s, 16, 256));
    ORT_FN(api, ReleaseSession)(s);
  }
  printf("  1 MiB limit: %s failed: %.300s\n", where, last_msg);
  CHECK(failed_cleanly, "a 1 MiB allocator ran the model");
  CHECK(stat(a, "epmem.failed_allocs") > 0, "epmem refused nothing");
  CHECK(ok(ORT_FN(api, ReleaseSharedAllocator)(env, dev, OrtDeviceMemoryType_DEFAULT)), "%s", last_msg);
}

int main(int argc, char** argv) {
  if (argc != 4) {
    fprintf(stderr, "usage: %s /abs/libepmem.so model.onnx d_model\n", argv[0]);
    return 2;
  }
  D = atoi(argv[3]);
  api = OrtGetApiBase()->GetApi(23);
  if (!api) {
    printf("ORT offers no API 23\nort-gpu-c: 0 passed, 1 failed\n");
    return 1;
  }
  if (!ok(ORT_FN(api, CreateEnv)(ORT_LOGGING_LEVEL_WARNING, "epmem-ort-gpu", &env))) {
    printf("CreateEnv: %s\nort-gpu-c: 0 passed, 1 failed\n", last_msg);
    return 1;
  }
  CHECK(ok(ORT_FN(api, RegisterExecutionProviderLibrary)(env, "epmem", argv[1])), "register: %s", last_msg);
  const OrtEpDevice* dev = find_device("epmem");
  CHECK(dev != NULL, "no epmem device");
  if (dev) {
    const char* kind = ORT_FN(api, GetKeyValue)(ORT_FN(api, EpDevice_EpMetadata)(dev), "epmem.device");
    CHECK(kind && strcmp(kind, "cuda") == 0, "epmem reports %s, not a CUDA device", kind ? kind : "(none)");
    test_session_memory_goes_through_epmem(dev, argv[2]);
    test_a_limit_below_the_model_is_an_error_not_a_crash(dev, argv[2]);
  }
  /* Teardown: sessions and shared allocators first (above), then the library, then the env. */
  CHECK(ok(ORT_FN(api, UnregisterExecutionProviderLibrary)(env, "epmem")), "unregister: %s", last_msg);
  ORT_FN(api, ReleaseEnv)(env);
  printf("ort-gpu-c: %d passed, %d failed\n", passed, failed);
  return failed ? 1 : 0;
}
