/*
 * The misuse suite, KV batches: every bad handle, NULL out-param and
 * out-of-range argument of the epm_kv_batch_* functions, and use of a slot
 * or batch after it is gone. Same rules as test_misuse.c: exact status,
 * non-empty message, out-params untouched.
 *   make test-c
 */
#include "misuse.h"

static EpmKvLayout mu_layout(void) {
  EpmKvLayout l;
  memset(&l, 0, sizeof l);
  l.size = sizeof l;
  if (epm_kv_layout_token_major(2, 2, 64, 2, &l) != EPM_STATUS_OK) l.size = 0;
  return l;
}

static uint32_t desc_of_live(EpmKvBatch *b) {
  EpmKvBatchDesc d;
  memset(&d, 0, sizeof d);
  d.size = sizeof d;
  return epm_kv_batch_get_desc(b, &d) == EPM_STATUS_OK ? d.live_slots : UINT32_MAX;
}

static void test_batches(MuFx *f) {
  EpmKvLayout l = mu_layout();
  EpmKvPool *kv = NULL, *dead_kv = NULL;
  EpmKvBatch *b = NULL, *dead_b = NULL, *ub = NULL;
  EpmKvSeq *q = NULL, *dead_q = NULL, *plain = NULL, *uq = NULL;
  EpmKvPrefix *p = NULL, *dead_p = NULL;
  EpmKvBatchDesc d;
  EpmKvBatchSlotInfo si;
  uint32_t toks[4] = {1, 2, 3, 4};
  uint64_t shared = 77;

  REQUIRE(l.size == sizeof l);
  REQUIRE_OK(epm_kv_pool_create(f->dev, 64ull << 20, &kv));
  REQUIRE_OK(epm_kv_pool_create(f->dev, 64ull << 20, &dead_kv));
  REQUIRE_OK(epm_kv_pool_destroy(dead_kv));
  REQUIRE_OK(epm_kv_batch_create(kv, &l, 4096, 4, &b));
  REQUIRE_OK(epm_kv_batch_create(kv, &l, 4096, 4, &dead_b));
  REQUIRE_OK(epm_kv_batch_destroy(dead_b));
  REQUIRE_OK(epm_kv_batch_take_slot(b, 0, 0, &q));
  REQUIRE_OK(epm_kv_batch_take_slot(b, 1, 0, &dead_q));
  REQUIRE_OK(epm_kv_batch_release_slot(dead_q, f->s));
  REQUIRE_OK(epm_kv_seq_create(kv, &l, 4096, 0, &plain));
  REQUIRE_OK(epm_kv_seq_prepare_append(plain, 4, f->s));
  REQUIRE_OK(epm_kv_prefix_pin(plain, 4, f->s, &p));
  REQUIRE_OK(epm_kv_prefix_pin(plain, 2, f->s, &dead_p));
  REQUIRE_OK(epm_kv_prefix_unpin(dead_p));

  BAD_HANDLES(EpmKvPool, h, b, dead_kv, epm_kv_batch_create(h, &l, 16, 2, &ub));
  MU_EXPECT(epm_kv_batch_create(kv, NULL, 16, 2, &ub), EPM_STATUS_NULL_POINTER, "NULL layout");
  MU_EXPECT(epm_kv_batch_create(kv, &l, 16, 2, NULL), EPM_STATUS_NULL_POINTER, "NULL out");
  MU_EXPECT(epm_kv_batch_create(kv, &l, 0, 2, &ub), EPM_STATUS_INVALID_ARGUMENT, "max_tokens 0");
  MU_EXPECT(epm_kv_batch_create(kv, &l, 16, 0, &ub), EPM_STATUS_INVALID_ARGUMENT, "max_slots 0");
  MU_EXPECT(epm_kv_batch_create(kv, &l, UINT64_MAX, 2, &ub), EPM_STATUS_INVALID_ARGUMENT, "overflowing tokens");
  MU_EXPECT(epm_kv_batch_create(kv, &l, 1ull << 40, 1u << 30, &ub), EPM_STATUS_INVALID_ARGUMENT, "overflowing slots");
  CHECK(ub == NULL);

  BAD_DESTROY(EpmKvBatch, h, kv, dead_b, epm_kv_batch_destroy(h));
  MU_EXPECT(epm_kv_batch_destroy(b), EPM_STATUS_INVALID_STATE, "a batch with a taken slot");

  memset(&d, 0, sizeof d);
  d.size = sizeof d;
  BAD_HANDLES(EpmKvBatch, h, kv, dead_b, epm_kv_batch_get_desc(h, &d));
  MU_EXPECT(epm_kv_batch_get_desc(b, NULL), EPM_STATUS_NULL_POINTER, "NULL out");
  d.size = 0;
  MU_EXPECT(epm_kv_batch_get_desc(b, &d), EPM_STATUS_INVALID_ARGUMENT, "size 0");

  BAD_HANDLES(EpmKvBatch, h, q, dead_b, epm_kv_batch_take_slot(h, 2, 0, &uq));
  MU_EXPECT(epm_kv_batch_take_slot(b, 2, 0, NULL), EPM_STATUS_NULL_POINTER, "NULL out");
  MU_EXPECT(epm_kv_batch_take_slot(b, 4, 0, &uq), EPM_STATUS_INVALID_ARGUMENT, "slot == max_slots");
  MU_EXPECT(epm_kv_batch_take_slot(b, 0, 0, &uq), EPM_STATUS_INVALID_STATE, "a taken slot");
  MU_EXPECT(epm_kv_batch_take_slot(b, 2, 2, &uq), EPM_STATUS_INVALID_ARGUMENT, "admit mode 2");

  BAD_HANDLES(EpmKvBatch, h, p, dead_b, epm_kv_batch_take_shared_slot(h, 2, p, 4, 0, f->s, &uq));
  BAD_HANDLES(EpmKvPrefix, h, b, dead_p, epm_kv_batch_take_shared_slot(b, 2, h, 4, 0, f->s, &uq));
  BAD_HANDLES(EpmStream, h, b, f->dead_s, epm_kv_batch_take_shared_slot(b, 2, p, 4, 0, h, &uq));
  MU_EXPECT(epm_kv_batch_take_shared_slot(b, 2, p, 4, 0, f->s, NULL), EPM_STATUS_NULL_POINTER, "NULL out");
  MU_EXPECT(epm_kv_batch_take_shared_slot(b, 2, p, 4, 0, f->s2, &uq), EPM_STATUS_INVALID_ARGUMENT,
            "a stream of another device");
  MU_EXPECT(epm_kv_batch_take_shared_slot(b, 2, p, 5, 0, f->s, &uq), EPM_STATUS_INVALID_ARGUMENT,
            "more tokens than the prefix");
  MU_EXPECT(epm_kv_batch_take_shared_slot(b, 2, p, 0, 0, f->s, &uq), EPM_STATUS_INVALID_ARGUMENT, "0 tokens");

  BAD_HANDLES(EpmKvBatch, h, kv, dead_b, epm_kv_batch_take_slot_for_tokens(h, 2, toks, 4, 0, f->s, &uq, &shared));
  BAD_HANDLES(EpmStream, h, b, f->dead_s, epm_kv_batch_take_slot_for_tokens(b, 2, toks, 4, 0, h, &uq, &shared));
  MU_EXPECT(epm_kv_batch_take_slot_for_tokens(b, 2, NULL, 4, 0, f->s, &uq, &shared), EPM_STATUS_NULL_POINTER,
            "NULL tokens");
  MU_EXPECT(epm_kv_batch_take_slot_for_tokens(b, 2, toks, 4, 0, f->s, NULL, &shared), EPM_STATUS_NULL_POINTER,
            "NULL out");
  CHECK(uq == NULL && shared == 77);

  BAD_HANDLES(EpmKvSeq, h, b, dead_q, epm_kv_batch_release_slot(h, f->s));
  BAD_HANDLES(EpmStream, h, b, f->dead_s, epm_kv_batch_release_slot(q, h));
  MU_EXPECT(epm_kv_batch_release_slot(plain, f->s), EPM_STATUS_INVALID_ARGUMENT, "a plain sequence");
  MU_EXPECT(epm_kv_batch_release_slot(q, f->s2), EPM_STATUS_INVALID_ARGUMENT, "a stream of another device");

  memset(&si, 0, sizeof si);
  si.size = sizeof si;
  BAD_HANDLES(EpmKvSeq, h, b, dead_q, epm_kv_batch_slot_get_info(h, &si));
  MU_EXPECT(epm_kv_batch_slot_get_info(q, NULL), EPM_STATUS_NULL_POINTER, "NULL out");
  MU_EXPECT(epm_kv_batch_slot_get_info(plain, &si), EPM_STATUS_INVALID_ARGUMENT, "a plain sequence");
  si.size = EPM_KV_BATCH_SLOT_INFO_SIZE_V1 - 1;
  MU_EXPECT(epm_kv_batch_slot_get_info(q, &si), EPM_STATUS_INVALID_ARGUMENT, "a size below the first version's");
  CHECK(desc_of_live(b) == 1);

cleanup:
  epm_kv_seq_destroy(q);
  epm_kv_prefix_unpin(p);
  epm_kv_seq_destroy(plain);
  CHECK_OK(epm_kv_batch_destroy(b));
  epm_kv_pool_destroy(kv);
}

int main(void) {
  MuFx f;
  if (mu_open(&f)) RUN_FX(test_batches, &f);
  mu_close(&f);
  TEST_SUMMARY();
}
