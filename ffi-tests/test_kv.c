/*
 * The KV pool through the C API: a pinned prefix shared by N sequences is
 * charged once, reads identically everywhere and refuses host writes; COW on
 * append; admission; content-hash detection; clean errors for destroyed
 * handles, NULLs and out-of-range lengths.
 * Runs on the device EPM_DEVICE names (host in CI, cuda on a GPU machine).
 *   make test-c      (or: cc -std=c11 -Iinclude ffi-tests/test_kv.c -Ltarget/release -lepmem)
 */
#include <stdint.h>
#include <stdlib.h>

#include "testhelper.h"

#define GIB (1ull << 30)

static EpmKvLayout qwen14b(void) {
  EpmKvLayout l;
  memset(&l, 0, sizeof l);
  l.size = sizeof l;
  if (epm_kv_layout_token_major(48, 8, 128, 2, &l) != EPM_STATUS_OK) l.size = 0;
  return l;
}

static uint64_t owned(EpmKvPool *a) {
  EpmKvStats s;
  memset(&s, 0, sizeof s);
  s.size = sizeof s;
  if (epm_kv_pool_get_stats(a, &s) != EPM_STATUS_OK) return UINT64_MAX;
  return s.owned_bytes;
}

static uint64_t base_of(EpmKvSeq *q) {
  EpmKvSeqInfo i;
  memset(&i, 0, sizeof i);
  i.size = sizeof i;
  if (epm_kv_seq_get_info(q, &i) != EPM_STATUS_OK) return 0;
  return i.base;
}

static void test_layout_descriptor(void) {
  EpmKvLayout l = qwen14b();
  CHECK(l.size == sizeof l);
  CHECK(l.token_stride == 196608u); /* 48 x 2 x 8 x 128 x 2 */
  CHECK(l.layer_stride == 2u * 8 * 128 * 2);
  CHECK(l.kv_stride == 8u * 128 * 2);
  CHECK(l.head_stride == 128u * 2);
  CHECK_STATUS(epm_kv_layout_token_major(0, 8, 128, 2, &l), EPM_STATUS_INVALID_ARGUMENT);
  CHECK_STATUS(epm_kv_layout_token_major(1, 1, 1, 1, NULL), EPM_STATUS_NULL_POINTER);
}

static void test_shared_prefix_is_charged_once_and_read_only(void) {
  enum { N = 4, TOKENS = 10 };
  EpmDevice *dev = NULL;
  EpmStream *s = NULL;
  EpmKvPool *a = NULL;
  EpmKvSeq *origin = NULL, *sharers[N] = {0};
  EpmKvPrefix *p = NULL;
  EpmKvLayout l = qwen14b();
  size_t n = TOKENS * 196608u;
  unsigned char *buf = malloc(n), *back = malloc(n);
  EpmDeviceInfo di;
  uint64_t g = 0, before = 0;

  REQUIRE(buf && back);
  th_fill_random(buf, n, 5);
  REQUIRE_OK(epm_device_open(0, &dev));
  memset(&di, 0, sizeof di);
  di.size = sizeof di;
  REQUIRE_OK(epm_device_get_info(dev, &di));
  g = di.granularity;
  REQUIRE_OK(epm_stream_create(dev, &s));
  REQUIRE_OK(epm_kv_pool_create(dev, GIB, &a));
  CHECK(owned(a) == g); /* the dummy granule */
  REQUIRE_OK(epm_kv_seq_create(a, &l, 64, EPM_KV_ADMIT_ON_DEMAND, &origin));
  REQUIRE_OK(epm_kv_seq_prepare_append(origin, TOKENS, s));
  REQUIRE_OK(epm_memcpy_htod(dev, base_of(origin), buf, n));
  REQUIRE_OK(epm_kv_prefix_pin(origin, TOKENS, s, &p));
  before = owned(a);
  CHECK(before == 2 * g);
  for (int i = 0; i < N; i++) {
    REQUIRE_OK(epm_kv_commit_shared_prefix(p, TOKENS, 64, EPM_KV_ADMIT_ON_DEMAND, &sharers[i]));
    CHECK(owned(a) == before); /* the Nth sharer costs 0 owned bytes */
    memset(back, 0, n);
    REQUIRE_OK(epm_memcpy_dtoh(dev, back, base_of(sharers[i]), n));
    CHECK(memcmp(buf, back, n) == 0);
  }
  /* Host writes into the shared prefix are refused, and nothing changed. */
  CHECK(epm_memcpy_htod(dev, base_of(sharers[0]), buf + 1, 4096) != EPM_STATUS_OK);
  CHECK(epm_last_error_message()[0] != '\0');
  REQUIRE_OK(epm_memcpy_dtoh(dev, back, base_of(origin), n));
  CHECK(memcmp(buf, back, n) == 0);
  {
    EpmKvPrefixInfo pi;
    memset(&pi, 0, sizeof pi);
    pi.size = sizeof pi;
    REQUIRE_OK(epm_kv_prefix_get_info(p, &pi));
    CHECK(pi.n_tokens == TOKENS && pi.granules == 1 && pi.pinned && pi.sharers == N + 1);
  }
  /* Copy-on-write: the sharer gets a private boundary granule, others keep theirs. */
  REQUIRE_OK(epm_kv_seq_prepare_append(sharers[0], 1, s));
  REQUIRE_OK(epm_stream_synchronize(s));
  /* Token 10 straddles granules 0 and 1: one copy-on-write plus one fresh granule. */
  CHECK(owned(a) == before + 2 * g);
  REQUIRE_OK(epm_memcpy_htod(dev, base_of(sharers[0]) + n, buf, 4096));
  REQUIRE_OK(epm_memcpy_dtoh(dev, back, base_of(sharers[0]), n));
  CHECK(memcmp(buf, back, n) == 0);
  REQUIRE_OK(epm_memcpy_dtoh(dev, back, base_of(sharers[1]), n));
  CHECK(memcmp(buf, back, n) == 0);

cleanup:
  for (int i = 0; i < N; i++) CHECK_OK(epm_kv_seq_destroy(sharers[i]));
  CHECK_OK(epm_kv_seq_destroy(origin));
  if (a && p) CHECK(owned(a) == 2 * g); /* the pin keeps the prefix */
  CHECK_OK(epm_kv_prefix_unpin(p));
  if (a) CHECK(owned(a) == g);
  epm_kv_pool_destroy(a);
  epm_stream_destroy(s);
  epm_device_destroy(dev);
  free(buf);
  free(back);
}

static void test_errors_are_clean(void) {
  EpmDevice *dev = NULL, *other = NULL;
  EpmStream *s = NULL, *foreign = NULL;
  EpmKvPool *a = NULL;
  EpmKvSeq *q = NULL, *q2 = NULL;
  EpmKvPrefix *p = NULL;
  EpmKvLayout l = qwen14b(), bad;
  EpmKvStats st;

  REQUIRE_OK(epm_device_open(0, &dev));
  REQUIRE_OK(epm_stream_create(dev, &s));
  REQUIRE_OK(epm_kv_pool_create(dev, GIB, &a));
  CHECK_STATUS(epm_kv_seq_create(a, NULL, 8, 0, &q), EPM_STATUS_NULL_POINTER);
  CHECK_STATUS(epm_kv_seq_create(a, &l, 8, 0, NULL), EPM_STATUS_NULL_POINTER);
  CHECK_STATUS(epm_kv_seq_create(a, &l, 0, 0, &q), EPM_STATUS_INVALID_ARGUMENT);
  CHECK_STATUS(epm_kv_seq_create(a, &l, 8, 7, &q), EPM_STATUS_INVALID_ARGUMENT);
  CHECK_MESSAGE_HAS("admit mode");
  bad = l;
  bad.size = 4;
  CHECK_STATUS(epm_kv_seq_create(a, &bad, 8, 0, &q), EPM_STATUS_INVALID_ARGUMENT);
  bad = l;
  bad.token_stride = 100; /* not token-major */
  CHECK_STATUS(epm_kv_seq_create(a, &bad, 8, 0, &q), EPM_STATUS_INVALID_ARGUMENT);
  CHECK(q == NULL); /* out-params untouched on failure */
  REQUIRE_OK(epm_kv_seq_create(a, &l, 8, EPM_KV_ADMIT_PROMISE, &q));
  CHECK_STATUS(epm_kv_seq_prepare_append(q, 9, s), EPM_STATUS_INVALID_ARGUMENT);
  CHECK_STATUS(epm_kv_prefix_pin(q, 1, s, &p), EPM_STATUS_INVALID_ARGUMENT); /* nothing written */
  REQUIRE_OK(epm_kv_seq_prepare_append(q, 8, s));
  CHECK_STATUS(epm_kv_seq_prepare_append(q, 1, s), EPM_STATUS_INVALID_ARGUMENT);
  CHECK_STATUS(epm_kv_prefix_pin(q, 9, s, &p), EPM_STATUS_INVALID_ARGUMENT);
  /* A stream of another device. */
  REQUIRE_OK(epm_device_open(0, &other));
  REQUIRE_OK(epm_stream_create(other, &foreign));
  CHECK_STATUS(epm_kv_seq_prepare_append(q, 0, foreign), EPM_STATUS_INVALID_ARGUMENT);
  REQUIRE_OK(epm_kv_prefix_pin(q, 8, s, &p));
  CHECK_STATUS(epm_kv_commit_shared_prefix(p, 9, 16, 0, &q2), EPM_STATUS_INVALID_ARGUMENT);
  CHECK_STATUS(epm_kv_commit_shared_prefix(p, 8, 7, 0, &q2), EPM_STATUS_INVALID_ARGUMENT);
  CHECK_STATUS(epm_kv_commit_shared_prefix(p, 0, 7, 0, &q2), EPM_STATUS_INVALID_ARGUMENT);
  /* Destroyed handles: clean INVALID_HANDLE, never a crash. */
  CHECK_OK(epm_kv_seq_destroy(q));
  CHECK_STATUS(epm_kv_seq_destroy(q), EPM_STATUS_INVALID_HANDLE);
  CHECK_STATUS(epm_kv_seq_prepare_append(q, 1, s), EPM_STATUS_INVALID_HANDLE);
  CHECK_STATUS(epm_kv_prefix_pin(q, 1, s, &p), EPM_STATUS_INVALID_HANDLE);
  q = NULL;
  CHECK_OK(epm_kv_prefix_unpin(p));
  CHECK_STATUS(epm_kv_prefix_unpin(p), EPM_STATUS_INVALID_HANDLE);
  CHECK_STATUS(epm_kv_commit_shared_prefix(p, 1, 8, 0, &q2), EPM_STATUS_INVALID_HANDLE);
  p = NULL;
  CHECK_STATUS(epm_kv_seq_prepare_append((EpmKvSeq *)a, 1, s), EPM_STATUS_INVALID_HANDLE);
  CHECK_MESSAGE_HAS("EpmKvSeq");
  CHECK_OK(epm_kv_seq_destroy(NULL));
  CHECK_OK(epm_kv_prefix_unpin(NULL));
  memset(&st, 0, sizeof st);
  st.size = 8;
  CHECK_STATUS(epm_kv_pool_get_stats(a, &st), EPM_STATUS_INVALID_ARGUMENT);

cleanup:
  epm_kv_seq_destroy(q);
  epm_kv_prefix_unpin(p);
  epm_kv_pool_destroy(a);
  epm_stream_destroy(foreign);
  epm_stream_destroy(s);
  epm_device_destroy(other);
  epm_device_destroy(dev);
}

static void test_admission(void) {
  EpmDevice *dev = NULL;
  EpmKvPool *a = NULL;
  EpmKvSeq *q1 = NULL, *q2 = NULL;
  EpmKvLayout l = qwen14b();
  EpmKvAdmission ad;
  EpmKvRequestCost c;
  EpmDeviceInfo di;
  uint64_t q = 3 * GIB / 8;

  memset(&ad, 0, sizeof ad);
  ad.size = sizeof ad;
  REQUIRE_OK(epm_kv_admissible(3 * GIB, q, q, &ad));
  CHECK(ad.without_sharing == 4 && ad.with_sharing == 7 && ad.seed_formula == 8);
  REQUIRE_OK(epm_device_open(0, &dev));
  memset(&di, 0, sizeof di);
  di.size = sizeof di;
  REQUIRE_OK(epm_device_get_info(dev, &di));
  /* Dummy + 6 granules: one 64-token qwen14b sequence (6 granules) fits, two do not. */
  REQUIRE_OK(epm_kv_pool_create(dev, 7 * di.granularity, &a));
  memset(&c, 0, sizeof c);
  c.size = sizeof c;
  REQUIRE_OK(epm_kv_request_cost(a, &l, 0, 64, &c));
  CHECK(c.unshared_bytes == 6 * di.granularity);
  REQUIRE_OK(epm_kv_seq_create(a, &l, 64, EPM_KV_ADMIT_PROMISE, &q1));
  CHECK_STATUS(epm_kv_seq_create(a, &l, 64, EPM_KV_ADMIT_PROMISE, &q2), EPM_STATUS_OUT_OF_BUDGET);
  CHECK_MESSAGE_HAS("budget");
  CHECK_OK(epm_kv_seq_destroy(q1));
  q1 = NULL;
  CHECK_OK(epm_kv_seq_create(a, &l, 64, EPM_KV_ADMIT_PROMISE, &q2));

cleanup:
  epm_kv_seq_destroy(q1);
  epm_kv_seq_destroy(q2);
  epm_kv_pool_destroy(a);
  epm_device_destroy(dev);
}

static void test_content_hash_and_lifetimes(void) {
  enum { T = 40 };
  EpmDevice *dev = NULL;
  EpmStream *s = NULL;
  EpmKvPool *a = NULL;
  EpmKvSeq *o = NULL, *q = NULL;
  EpmKvPrefix *p = NULL;
  EpmKvLayout l = qwen14b();
  uint32_t prompt[T];
  uint64_t shared = 99, found = 99;

  for (int i = 0; i < T; i++) prompt[i] = 500 + (uint32_t)i;
  REQUIRE_OK(epm_device_open(0, &dev));
  REQUIRE_OK(epm_stream_create(dev, &s));
  REQUIRE_OK(epm_kv_pool_create(dev, GIB, &a));
  REQUIRE_OK(epm_kv_seq_create_for_tokens(a, &l, 64, prompt, T, 0, &o, &shared));
  CHECK(shared == 0);
  REQUIRE_OK(epm_kv_seq_prepare_append(o, T, s));
  REQUIRE_OK(epm_kv_prefix_pin(o, T, s, &p));
  CHECK_STATUS(epm_kv_seq_create_for_tokens(a, &l, 8, prompt, T, 0, &q, &shared), EPM_STATUS_INVALID_ARGUMENT);
  CHECK_STATUS(epm_kv_find_prefix(a, &l, NULL, 3, &found), EPM_STATUS_NULL_POINTER);
  REQUIRE_OK(epm_kv_find_prefix(a, &l, prompt, T, &found));
  CHECK(found == 32); /* two whole 16-token blocks */
  prompt[T - 1] = 1;   /* a different question after the same system prompt */
  REQUIRE_OK(epm_kv_seq_create_for_tokens(a, &l, 64, prompt, T, 0, &q, &shared));
  CHECK(shared == 32);
  /* The pool handle goes first: sequences and prefixes keep the pool alive. */
  CHECK_OK(epm_kv_pool_destroy(a));
  a = NULL;
  CHECK_OK(epm_kv_seq_prepare_append(q, 8, s));
  CHECK_OK(epm_stream_synchronize(s));

cleanup:
  CHECK_OK(epm_kv_seq_destroy(q));
  CHECK_OK(epm_kv_prefix_unpin(p));
  CHECK_OK(epm_kv_seq_destroy(o));
  epm_kv_pool_destroy(a);
  epm_stream_destroy(s);
  epm_device_destroy(dev);
}

int main(void) {
  RUN(test_layout_descriptor);
  RUN(test_shared_prefix_is_charged_once_and_read_only);
  RUN(test_errors_are_clean);
  RUN(test_admission);
  RUN(test_content_hash_and_lifetimes);
  TEST_SUMMARY();
}
