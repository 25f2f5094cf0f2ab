/*
 * KV sharing namespaces (per-tenant cache salts) through the C API: two
 * namespaces with identical prompts share nothing (the ledger's owned bytes
 * and the driver's physical handles both grow by a full private copy), one
 * namespace shares as the unsalted calls do, batch slots likewise, and
 * explicit sharing by prefix handle is unchanged.
 * Runs on the device EPM_DEVICE names (host in CI, cuda on a GPU machine).
 *   make test-c      (or: cc -std=c11 -Iinclude ffi-tests/test_kv_namespace.c -Ltarget/release -lepmem)
 */
#include <stdint.h>
#include <stdlib.h>

#include "testhelper.h"

#define GIB (1ull << 30)
#define T 40 /* two whole 16-token hash blocks and 8 more */

static EpmKvLayout qwen14b(void) {
  EpmKvLayout l;
  memset(&l, 0, sizeof l);
  l.size = sizeof l;
  if (epm_kv_layout_token_major(48, 8, 128, 2, &l) != EPM_STATUS_OK) l.size = 0;
  return l;
}

static EpmKvStats stats(EpmKvPool *a) {
  EpmKvStats s;
  memset(&s, 0, sizeof s);
  s.size = sizeof s;
  if (epm_kv_pool_get_stats(a, &s) != EPM_STATUS_OK) s.owned_bytes = UINT64_MAX;
  return s;
}

static EpmKvSeqInfo info(EpmKvSeq *q) {
  EpmKvSeqInfo i;
  memset(&i, 0, sizeof i);
  i.size = sizeof i;
  if (epm_kv_seq_get_info(q, &i) != EPM_STATUS_OK) i.len_tokens = UINT64_MAX;
  return i;
}

static const char TENANT_A[] = "tenant-a";
static const char TENANT_B[] = "tenant-b";
#define NS(s) (s), (sizeof(s) - 1)

static void test_two_namespaces_share_nothing(void) {
  EpmDevice *dev = NULL;
  EpmStream *s = NULL;
  EpmKvPool *a = NULL;
  EpmKvSeq *oa = NULL, *qb = NULL, *qa = NULL;
  EpmKvPrefix *pa = NULL;
  EpmKvLayout l = qwen14b();
  EpmKvStats before, after;
  uint32_t prompt[T];
  uint64_t shared = 99, found = 99, granules;
  unsigned char *got = NULL, *want = NULL;
  size_t n = (size_t)T * l.token_stride;

  for (int i = 0; i < T; i++) prompt[i] = 500 + (uint32_t)i;
  REQUIRE_OK(epm_device_open(0, &dev));
  REQUIRE_OK(epm_stream_create(dev, &s));
  REQUIRE_OK(epm_kv_pool_create(dev, GIB, &a));
  REQUIRE_OK(epm_kv_seq_create_for_tokens_ns(a, &l, 64, NS(TENANT_A), prompt, T, EPM_KV_ADMIT_ON_DEMAND, &oa, &shared));
  CHECK(shared == 0);
  REQUIRE_OK(epm_kv_seq_prepare_append(oa, T, s));
  want = malloc(n);
  got = malloc(n);
  REQUIRE(want && got);
  th_fill_random(want, n, 3);
  REQUIRE_OK(epm_memcpy_htod_async(dev, info(oa).base, want, n, s));
  REQUIRE_OK(epm_stream_synchronize(s));
  REQUIRE_OK(epm_kv_prefix_pin(oa, T, s, &pa));

  /* Tenant B, same prompt: not found, nothing shared, its slots read zeros. */
  REQUIRE_OK(epm_kv_find_prefix_ns(a, &l, NS(TENANT_B), prompt, T, &found));
  CHECK(found == 0);
  REQUIRE_OK(epm_kv_find_prefix(a, &l, prompt, T, &found));
  CHECK(found == 0); /* the default namespace is a namespace too */
  before = stats(a);
  shared = 99;
  REQUIRE_OK(epm_kv_seq_create_for_tokens_ns(a, &l, 64, NS(TENANT_B), prompt, T, EPM_KV_ADMIT_ON_DEMAND, &qb, &shared));
  CHECK(shared == 0);
  CHECK(info(qb).len_tokens == 0 && info(qb).shared_granules == 0);
  REQUIRE_OK(epm_memcpy_dtoh_async(dev, got, info(qb).base, n, s));
  REQUIRE_OK(epm_stream_synchronize(s));
  CHECK(got[0] == 0 && memcmp(got, got + 1, n - 1) == 0); /* the zeroed dummy */
  REQUIRE_OK(epm_kv_seq_prepare_append(qb, T, s));
  after = stats(a);
  granules = ((uint64_t)T * l.token_stride + after.granule_bytes - 1) / after.granule_bytes;
  CHECK(after.hash_hits == before.hash_hits);
  CHECK(after.owned_bytes - before.owned_bytes == granules * after.granule_bytes);
  CHECK(after.pool_created - before.pool_created == granules); /* the driver agrees */
  CHECK(info(qb).shared_granules == 0);

  /* Tenant A again: its own prefix is found and shared at no cost. */
  before = after;
  prompt[T - 1] = 1;
  REQUIRE_OK(epm_kv_seq_create_for_tokens_ns(a, &l, 64, NS(TENANT_A), prompt, T, EPM_KV_ADMIT_ON_DEMAND, &qa, &shared));
  CHECK(shared == 32);
  after = stats(a);
  CHECK(after.hash_hits == before.hash_hits + 1);
  CHECK(after.owned_bytes == before.owned_bytes && after.pool_created == before.pool_created);
  REQUIRE_OK(epm_memcpy_dtoh_async(dev, got, info(qa).base, 32 * l.token_stride, s));
  REQUIRE_OK(epm_stream_synchronize(s));
  CHECK(memcmp(got, want, 32 * l.token_stride) == 0);

cleanup:
  free(got);
  free(want);
  CHECK_OK(epm_kv_seq_destroy(qa));
  CHECK_OK(epm_kv_seq_destroy(qb));
  CHECK_OK(epm_kv_prefix_unpin(pa));
  CHECK_OK(epm_kv_seq_destroy(oa));
  epm_kv_pool_destroy(a);
  epm_stream_destroy(s);
  epm_device_destroy(dev);
}

static void test_batch_slots_and_explicit_sharing(void) {
  EpmDevice *dev = NULL;
  EpmStream *s = NULL;
  EpmKvPool *a = NULL;
  EpmKvBatch *b = NULL;
  EpmKvSeq *o = NULL, *qb = NULL, *qa = NULL, *c = NULL;
  EpmKvPrefix *p = NULL;
  EpmKvLayout l = qwen14b();
  uint32_t prompt[T];
  uint64_t shared = 99, found = 99;

  for (int i = 0; i < T; i++) prompt[i] = 9000 + (uint32_t)i;
  REQUIRE_OK(epm_device_open(0, &dev));
  REQUIRE_OK(epm_stream_create(dev, &s));
  REQUIRE_OK(epm_kv_pool_create(dev, GIB, &a));
  REQUIRE_OK(epm_kv_batch_create(a, &l, 64, 4, &b));
  REQUIRE_OK(epm_kv_batch_take_slot_for_tokens_ns(b, EPM_KV_BATCH_ANY_SLOT, NS(TENANT_A), prompt, T,
                                                  EPM_KV_ADMIT_ON_DEMAND, s, &o, &shared));
  CHECK(shared == 0);
  REQUIRE_OK(epm_kv_seq_prepare_append(o, T, s));
  REQUIRE_OK(epm_kv_prefix_pin(o, T, s, &p));
  REQUIRE_OK(epm_kv_batch_take_slot_for_tokens_ns(b, EPM_KV_BATCH_ANY_SLOT, NS(TENANT_B), prompt, T,
                                                  EPM_KV_ADMIT_ON_DEMAND, s, &qb, &shared));
  CHECK(shared == 0);
  REQUIRE_OK(epm_kv_batch_take_slot_for_tokens_ns(b, EPM_KV_BATCH_ANY_SLOT, NS(TENANT_A), prompt, T,
                                                  EPM_KV_ADMIT_ON_DEMAND, s, &qa, &shared));
  CHECK(shared == 32);
  /* The prefix handle still shares explicitly, whatever the namespace; the
   * new sequence belongs to tenant A's namespace. */
  REQUIRE_OK(epm_kv_commit_shared_prefix(p, T, 64, EPM_KV_ADMIT_ON_DEMAND, &c));
  CHECK(info(c).len_tokens == T);
  /* A NULL namespace of length 0 is the default one. */
  REQUIRE_OK(epm_kv_find_prefix_ns(a, &l, NULL, 0, prompt, T, &found));
  CHECK(found == 0);
  REQUIRE_OK(epm_kv_find_prefix_ns(a, &l, NS(TENANT_A), prompt, T, &found));
  CHECK(found == 32);

cleanup:
  CHECK_OK(epm_kv_seq_destroy(c));
  CHECK_OK(epm_kv_batch_release_slot(qa, s));
  CHECK_OK(epm_kv_batch_release_slot(qb, s));
  CHECK_OK(epm_kv_prefix_unpin(p));
  CHECK_OK(epm_kv_batch_release_slot(o, s));
  CHECK_OK(epm_kv_batch_destroy(b));
  epm_kv_pool_destroy(a);
  epm_stream_destroy(s);
  epm_device_destroy(dev);
}

int main(void) {
  RUN(test_two_namespaces_share_nothing);
  RUN(test_batch_slots_and_explicit_sharing);
  TEST_SUMMARY();
}
