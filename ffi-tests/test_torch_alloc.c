/*
 * PyTorch's pluggable-allocator functions (epm_torch_alloc / epm_torch_free)
 * from C: the contract PyTorch relies on, and bad input, which cannot return
 * a status: NULL (alloc) or nothing freed (free), a message in
 * epm_last_error_message(), never a crash. The stream-order case runs where
 * the device has native streams (CUDA, the fake driver in CI included); on
 * the host device it says SKIPPED with the reason.
 *
 * Runs on the device EPM_DEVICE names (host in CI, cuda on a GPU machine).
 */
#define _POSIX_C_SOURCE 200809L /* setenv, alarm */
#include <stdint.h>
#include <stdlib.h>
#include <unistd.h>

#include "testhelper.h"

#define MIB (1u << 20)
#define CAPACITY (256ull * MIB)

static EpmDevice *g_dev;
/* Device pointers are host pointers: the host device, and CI's fake libcuda
 * (whose cuMemGetAddressRange knows no memory, so epmem's copies refuse
 * another device object's arena there). Elsewhere data goes through copies. */
static int g_host, g_direct;

/* The last error is non-empty and mentions `needle`. */
#define CHECK_LAST_HAS(needle) CHECK_MESSAGE_HAS(needle)

/* The PyTorch arena maps its memory one granule at a time, and the driver
 * sees each mapping as its own allocation: copies into it from the test's own
 * device object go granule by granule. */
static uint64_t g_gran;

static size_t piece(const void *p, size_t off, size_t n) {
  size_t room = (size_t)(g_gran - ((uintptr_t)p + off) % g_gran);
  return n - off < room ? n - off : room;
}

static void fill(void *p, unsigned char v, size_t n) {
  if (g_direct) {
    memset(p, v, n);
    return;
  }
  unsigned char *h = malloc(n);
  memset(h, v, n);
  for (size_t off = 0, k; off < n; off += k) {
    k = piece(p, off, n);
    CHECK_OK(epm_memcpy_htod(g_dev, (EpmDevicePtr)(uintptr_t)p + off, h + off, k));
  }
  free(h);
}

static int holds(const void *p, unsigned char v, size_t n) {
  unsigned char *h = malloc(n);
  int ok = h != NULL;
  if (ok && g_direct) memcpy(h, p, n);
  for (size_t off = 0, k; ok && !g_direct && off < n; off += k) {
    k = piece(p, off, n);
    ok = epm_memcpy_dtoh(g_dev, h + off, (EpmDevicePtr)(uintptr_t)p + off, k) == EPM_STATUS_OK;
  }
  for (size_t i = 0; ok && i < n; i++) ok = h[i] == v;
  free(h);
  return ok;
}

/* A fill queued on `s`, granule by granule (see g_gran). */
static EpmStatus fill_async(void *p, unsigned char v, size_t n, EpmStream *s) {
  EpmStatus st = EPM_STATUS_OK;
  for (size_t off = 0, k; st == EPM_STATUS_OK && off < n; off += k) {
    k = piece(p, off, n);
    st = epm_memset_d8_async(g_dev, (EpmDevicePtr)(uintptr_t)p + off, v, k, s);
  }
  return st;
}

static int stats(EpmOrderedArenaStats *st) {
  st->size = sizeof *st;
  return epm_torch_get_stats(0, st) == EPM_STATUS_OK;
}

static void test_before_first_use(void) {
  EpmOrderedArenaStats st;
  st.size = sizeof st;
  CHECK_STATUS(epm_torch_get_stats(0, &st), EPM_STATUS_INVALID_STATE);
  CHECK_STATUS(epm_torch_get_stats(-1, &st), EPM_STATUS_INVALID_ARGUMENT);
  CHECK_STATUS(epm_torch_get_stats(64, &st), EPM_STATUS_INVALID_ARGUMENT);
  CHECK_STATUS(epm_torch_get_stats(0, NULL), EPM_STATUS_NULL_POINTER);
  uint64_t given = 99;
  CHECK_OK(epm_torch_trim(0, &given)); /* no arena yet: nothing to give back */
  CHECK(given == 0);
  CHECK_STATUS(epm_torch_trim(-2, &given), EPM_STATUS_INVALID_ARGUMENT);
  CHECK_OK(epm_torch_set_capacity(CAPACITY));
}

static void test_alloc_free_contract(void) {
  static const ptrdiff_t SIZES[] = {0, 1, 4097, 3 * MIB, 64 * 1024};
  enum { N = sizeof SIZES / sizeof SIZES[0] };
  void *p[N] = {0};
  EpmOrderedArenaStats st;

  for (int i = 0; i < N; i++) {
    p[i] = epm_torch_alloc(SIZES[i], 0, NULL);
    REQUIRE(p[i] != NULL);
    CHECK(epm_last_error_message()[0] == '\0');
    CHECK(((uintptr_t)p[i] & 255) == 0); /* cudaMalloc's alignment, at least */
    for (int j = 0; j < i; j++) CHECK(p[i] != p[j]);
    if (SIZES[i] > 0) fill(p[i], (unsigned char)(0x10 + i), (size_t)SIZES[i]);
  }
  for (int i = 0; i < N; i++)
    if (SIZES[i] > 0) CHECK(holds(p[i], (unsigned char)(0x10 + i), (size_t)SIZES[i]));
  REQUIRE(stats(&st));
  CHECK(st.live_allocations == N);
  CHECK(st.live_bytes == 1 + 1 + 4097 + 3 * MIB + 64 * 1024); /* size 0 holds one byte */
  CHECK(st.reserved_bytes >= CAPACITY && st.reserved_bytes < CAPACITY + 64ull * MIB);
  CHECK(st.committed_bytes >= 3 * MIB && st.driver_alloc_calls >= 1);
  /* The capacity is fixed once the arena exists. */
  CHECK_STATUS(epm_torch_set_capacity(1ull << 30), EPM_STATUS_INVALID_STATE);
  CHECK_LAST_HAS("device 0");
  for (int i = 0; i < N; i++) {
    epm_torch_free(p[i], SIZES[i], 0, NULL);
    CHECK(epm_last_error_message()[0] == '\0');
    p[i] = NULL;
  }
  REQUIRE(stats(&st));
  CHECK(st.live_allocations == 0 && st.live_bytes == 0);
  CHECK(st.peak_live_bytes >= 3 * MIB && st.alloc_calls >= N && st.free_calls >= N);
  /* One stream (the legacy default) made every allocation: its frees were
   * immediate, with no event (the host device adopts no stream at all). */
  if (!g_host) CHECK(st.single_stream_frees == N && st.events_recorded == 0);
  epm_torch_free(NULL, 10, 0, NULL); /* NULL is a no-op */
  CHECK(epm_last_error_message()[0] == '\0');

cleanup:
  for (int i = 0; i < N; i++)
    if (p[i]) epm_torch_free(p[i], SIZES[i], 0, NULL);
}

static void test_bad_alloc_input_is_null_with_a_message(void) {
  EpmOrderedArenaStats before, after;
  REQUIRE(stats(&before));
  CHECK(epm_torch_alloc(-1, 0, NULL) == NULL);
  CHECK_LAST_HAS("negative");
  CHECK(epm_torch_alloc(PTRDIFF_MIN, 0, NULL) == NULL);
  CHECK_LAST_HAS("negative");
  CHECK(epm_torch_alloc(256, -1, NULL) == NULL);
  CHECK_LAST_HAS("device -1");
  CHECK(epm_torch_alloc(256, 64, NULL) == NULL);
  CHECK_LAST_HAS("device 64");
  CHECK(epm_torch_alloc(256, 1 << 30, NULL) == NULL);
  CHECK(epm_last_error_message()[0] != '\0');
  /* Beyond the capacity: refused, counted, nothing committed for it. */
  CHECK(epm_torch_alloc((ptrdiff_t)CAPACITY + 1, 0, NULL) == NULL);
  CHECK_LAST_HAS("PyTorch allocation");
  REQUIRE(stats(&after));
  CHECK(after.failed_allocs == before.failed_allocs + 1);
  CHECK(after.live_allocations == before.live_allocations);
  CHECK(after.committed_bytes == before.committed_bytes);
cleanup:;
}

static void test_bad_free_input_frees_nothing_and_says_why(void) {
  EpmOrderedArenaStats st;
  int local = 0;
  void *p = epm_torch_alloc(8192, 0, NULL);
  REQUIRE(p != NULL);
  fill(p, 0x5A, 8192);

  epm_torch_free(p, -8192, 0, NULL);
  CHECK_LAST_HAS("negative");
  epm_torch_free(p, 4096, 0, NULL); /* a size it was not allocated with */
  CHECK_LAST_HAS("8192");
  epm_torch_free(p, 8192, 7, NULL); /* a device with no arena */
  CHECK_LAST_HAS("device 7");
  epm_torch_free(p, 8192, 99, NULL); /* not an ordinal */
  CHECK_LAST_HAS("device 99");
  epm_torch_free(&local, 8192, 0, NULL); /* a foreign pointer */
  CHECK_LAST_HAS("not a live allocation");
  epm_torch_free((char *)p + 256, 8192, 0, NULL); /* inside a block */
  CHECK_LAST_HAS("not a live allocation");
  REQUIRE(stats(&st));
  CHECK(st.live_allocations == 1 && st.live_bytes == 8192); /* still live */
  CHECK(holds(p, 0x5A, 8192));

  epm_torch_free(p, 8192, 0, NULL);
  CHECK(epm_last_error_message()[0] == '\0');
  epm_torch_free(p, 8192, 0, NULL); /* a double free */
  CHECK_LAST_HAS("not a live allocation");
  REQUIRE(stats(&st));
  CHECK(st.live_allocations == 0 && st.live_bytes == 0);
cleanup:;
}

/* A block freed on stream a (PyTorch passes the allocation's stream) while a
 * is held: stream b gets other memory, a reuses it at once. */
static void test_frees_are_ordered_after_their_stream(void) {
  EpmStream *a = NULL, *b = NULL;
  EpmGate *gate = NULL;
  EpmEvent *done = NULL;
  void *na = NULL, *nb = NULL, *p = NULL, *q = NULL, *s = NULL, *t = NULL;
  int p_freed = 0;
  EpmOrderedArenaStats st;

  REQUIRE_OK(epm_stream_create(g_dev, &a));
  REQUIRE_OK(epm_stream_create(g_dev, &b));
  REQUIRE_OK(epm_event_create(g_dev, 0, &done));
  REQUIRE_OK(epm_stream_native(a, &na));
  REQUIRE_OK(epm_stream_native(b, &nb));
  if (na == NULL || nb == NULL) {
    printf("SKIPPED %s: the host device has no native streams to hand to epm_torch_alloc\n", __func__);
    goto cleanup;
  }
  p = epm_torch_alloc(MIB, 0, na);
  REQUIRE(p != NULL);
  {
    EpmStatus hs = epm_device_hold_async(g_dev, a, &gate);
    if (hs == EPM_STATUS_UNSUPPORTED) {
      printf("SKIPPED %s: %s\n", __func__, epm_last_error_message());
      goto cleanup;
    }
    REQUIRE_OK(hs);
  }
  /* a's last use of p, queued behind the gate (the fake driver runs fills
   * at enqueue, so there the data check is done by the real GPU run only). */
  if (!g_direct) REQUIRE_OK(fill_async(p, 0xA7, MIB, a));
  REQUIRE_OK(epm_event_record(done, a));
  epm_torch_free(p, MIB, 0, na);
  p_freed = 1;
  CHECK(epm_last_error_message()[0] == '\0');
  q = epm_torch_alloc(MIB, 0, nb);
  REQUIRE(q != NULL);
  CHECK((char *)q + MIB <= (char *)p || (char *)q >= (char *)p + MIB);
  if (!g_direct) REQUIRE_OK(fill_async(q, 0xB8, MIB, b));
  s = epm_torch_alloc(MIB, 0, na);
  CHECK(s == p);
  CHECK_STATUS(epm_event_query(done), EPM_STATUS_NOT_READY);
  REQUIRE(stats(&st));
  CHECK(st.same_stream_reuses >= 1 && st.pending_ranges == 0 && st.live_allocations == 2);
  CHECK_OK(epm_gate_open(gate));
  CHECK_OK(epm_stream_synchronize(a));
  CHECK_OK(epm_stream_synchronize(b));
  if (!g_direct) {
    CHECK(holds(p, 0xA7, MIB)); /* a's fill landed in a block b never got */
    CHECK(holds(q, 0xB8, MIB));
  }
  epm_torch_free(s, MIB, 0, na);
  s = NULL;
  CHECK_OK(epm_stream_synchronize(a));
  t = epm_torch_alloc(MIB, 0, nb);
  CHECK(t != NULL);

cleanup:
  if (t) epm_torch_free(t, MIB, 0, nb);
  if (s) epm_torch_free(s, MIB, 0, na);
  if (q) epm_torch_free(q, MIB, 0, nb);
  if (p && !p_freed) epm_torch_free(p, MIB, 0, na);
  epm_gate_destroy(gate);
  if (a) epm_stream_synchronize(a);
  if (b) epm_stream_synchronize(b);
  epm_event_destroy(done);
  epm_stream_destroy(a);
  epm_stream_destroy(b);
}

static void test_trim_gives_free_memory_back(void) {
  EpmOrderedArenaStats st;
  uint64_t given = 0, all = 99;
  void *p = epm_torch_alloc(5 * MIB, 0, NULL);
  REQUIRE(p != NULL);
  epm_torch_free(p, 5 * MIB, 0, NULL);
  CHECK_OK(epm_torch_trim(0, &given));
  REQUIRE(stats(&st));
  CHECK(given > 0 && st.committed_bytes == 0 && st.driver_free_calls >= 1);
  CHECK(st.peak_committed_bytes >= 5 * MIB);
  CHECK_OK(epm_torch_trim(-1, &all));
  CHECK(all == 0);
  CHECK_OK(epm_torch_trim(0, NULL));
  /* And the arena grows again afterwards. */
  p = epm_torch_alloc(MIB, 0, NULL);
  CHECK(p != NULL);
  if (p) epm_torch_free(p, MIB, 0, NULL);
  /* The allocator lives as long as the process (as PyTorch's does); a trim
   * leaves it holding nothing, so a leak check at exit finds no memory. */
  CHECK_OK(epm_torch_trim(0, NULL));
  REQUIRE(stats(&st));
  CHECK(st.committed_bytes == 0);
cleanup:;
}

int main(void) {
  EpmDeviceInfo info;
  alarm(300); /* a hang fails the run instead of stalling it */
  REQUIRE_OK(epm_device_open(0, &g_dev));
  info.size = sizeof info;
  REQUIRE_OK(epm_device_get_info(g_dev, &info));
  g_host = info.kind == EPM_DEVICE_KIND_HOST;
  g_direct = g_host || strcmp(info.name, "Fake H200") == 0;
  g_gran = info.granularity ? info.granularity : 2 * MIB;
  /* The PyTorch allocator never falls back to the host device by itself
   * (PyTorch's pointers are CUDA pointers): name it where the other tests
   * run on it. */
  if (g_host) setenv("EPM_DEVICE", "host", 1);
  RUN(test_before_first_use);
  RUN(test_alloc_free_contract);
  RUN(test_bad_alloc_input_is_null_with_a_message);
  RUN(test_bad_free_input_frees_nothing_and_says_why);
  RUN(test_frees_are_ordered_after_their_stream);
  RUN(test_trim_gives_free_memory_back);
cleanup:
  epm_device_destroy(g_dev);
  TEST_SUMMARY();
}
