/*
 * The misuse suite, part 6: the namespaced KV lookups (`*_ns`). Same rules as
 * test_misuse.c: exact status, non-empty message, out-params untouched. A
 * namespace longer than EPM_KV_NAMESPACE_MAX_BYTES or containing NUL is
 * refused with a message naming the problem, before anything is created.
 */
#include "misuse.h"

static EpmKvLayout mu_layout(void) {
  EpmKvLayout l;
  memset(&l, 0, sizeof l);
  l.size = sizeof l;
  if (epm_kv_layout_token_major(2, 2, 64, 2, &l) != EPM_STATUS_OK) l.size = 0;
  return l;
}

static void test_namespaces(MuFx *f) {
  EpmKvLayout l = mu_layout();
  EpmKvPool *kv = NULL, *dead_kv = NULL;
  EpmKvBatch *b = NULL, *dead_b = NULL;
  EpmKvSeq *uq = NULL;
  uint32_t toks[16];
  uint64_t shared = 77, found = 77;
  char longest[EPM_KV_NAMESPACE_MAX_BYTES + 1];
  const char nul[] = "ten\0ant";
  EpmKvStats st;

  for (int i = 0; i < 16; i++) toks[i] = (uint32_t)i;
  memset(longest, 'x', sizeof longest);
  REQUIRE(l.size == sizeof l);
  REQUIRE_OK(epm_kv_pool_create(f->dev, 64ull << 20, &kv));
  REQUIRE_OK(epm_kv_pool_create(f->dev, 64ull << 20, &dead_kv));
  REQUIRE_OK(epm_kv_batch_create(kv, &l, 16, 2, &b));
  REQUIRE_OK(epm_kv_batch_create(kv, &l, 16, 2, &dead_b));
  REQUIRE_OK(epm_kv_batch_destroy(dead_b));
  REQUIRE_OK(epm_kv_pool_destroy(dead_kv));

  /* epm_kv_seq_create_for_tokens_ns */
  BAD_HANDLES(EpmKvPool, h, f->dev, dead_kv,
              epm_kv_seq_create_for_tokens_ns(h, &l, 16, "a", 1, toks, 16, 0, &uq, &shared));
  MU_EXPECT(epm_kv_seq_create_for_tokens_ns(kv, &l, 16, NULL, 1, toks, 16, 0, &uq, &shared),
            EPM_STATUS_NULL_POINTER, "NULL ns with ns_len 1");
  CHECK_MESSAGE_HAS("`ns`");
  MU_EXPECT(epm_kv_seq_create_for_tokens_ns(kv, &l, 16, longest, sizeof longest, toks, 16, 0, &uq, &shared),
            EPM_STATUS_INVALID_ARGUMENT, "a namespace one byte too long");
  CHECK_MESSAGE_HAS("EPM_KV_NAMESPACE_MAX_BYTES (128)");
  MU_EXPECT(epm_kv_seq_create_for_tokens_ns(kv, &l, 16, longest, SIZE_MAX, toks, 16, 0, &uq, &shared),
            EPM_STATUS_INVALID_ARGUMENT, "ns_len SIZE_MAX");
  MU_EXPECT(epm_kv_seq_create_for_tokens_ns(kv, &l, 16, nul, sizeof nul - 1, toks, 16, 0, &uq, &shared),
            EPM_STATUS_INVALID_ARGUMENT, "a namespace containing NUL");
  CHECK_MESSAGE_HAS("NUL byte at offset 3");
  MU_EXPECT(epm_kv_seq_create_for_tokens_ns(kv, &l, 16, "a", 1, NULL, 16, 0, &uq, &shared),
            EPM_STATUS_NULL_POINTER, "NULL tokens");
  MU_EXPECT(epm_kv_seq_create_for_tokens_ns(kv, NULL, 16, "a", 1, toks, 16, 0, &uq, &shared),
            EPM_STATUS_NULL_POINTER, "NULL layout");
  MU_EXPECT(epm_kv_seq_create_for_tokens_ns(kv, &l, 16, "a", 1, toks, 16, 0, NULL, &shared),
            EPM_STATUS_NULL_POINTER, "NULL out");
  MU_EXPECT(epm_kv_seq_create_for_tokens_ns(kv, &l, 8, "a", 1, toks, 16, 0, &uq, &shared),
            EPM_STATUS_INVALID_ARGUMENT, "more tokens than max_tokens");
  MU_EXPECT(epm_kv_seq_create_for_tokens_ns(kv, &l, 16, "a", 1, toks, 16, 7, &uq, &shared),
            EPM_STATUS_INVALID_ARGUMENT, "admit mode 7");
  CHECK(uq == NULL && shared == 77);

  /* epm_kv_find_prefix_ns */
  BAD_HANDLES(EpmKvPool, h, f->dev, dead_kv, epm_kv_find_prefix_ns(h, &l, "a", 1, toks, 16, &found));
  MU_EXPECT(epm_kv_find_prefix_ns(kv, &l, NULL, 3, toks, 16, &found), EPM_STATUS_NULL_POINTER, "NULL ns");
  MU_EXPECT(epm_kv_find_prefix_ns(kv, &l, longest, sizeof longest, toks, 16, &found), EPM_STATUS_INVALID_ARGUMENT,
            "a namespace one byte too long");
  MU_EXPECT(epm_kv_find_prefix_ns(kv, &l, nul, sizeof nul - 1, toks, 16, &found), EPM_STATUS_INVALID_ARGUMENT,
            "a namespace containing NUL");
  MU_EXPECT(epm_kv_find_prefix_ns(kv, &l, "a", 1, toks, 16, NULL), EPM_STATUS_NULL_POINTER, "NULL out");
  MU_EXPECT(epm_kv_find_prefix_ns(kv, &l, "a", 1, NULL, 2, &found), EPM_STATUS_NULL_POINTER, "NULL tokens");
  CHECK(found == 77);

  /* epm_kv_batch_take_slot_for_tokens_ns */
  BAD_HANDLES(EpmKvBatch, h, kv, dead_b,
              epm_kv_batch_take_slot_for_tokens_ns(h, 0, "a", 1, toks, 16, 0, f->s, &uq, &shared));
  BAD_HANDLES(EpmStream, h, b, f->dead_s,
              epm_kv_batch_take_slot_for_tokens_ns(b, 0, "a", 1, toks, 16, 0, h, &uq, &shared));
  MU_EXPECT(epm_kv_batch_take_slot_for_tokens_ns(b, 0, NULL, 1, toks, 16, 0, f->s, &uq, &shared),
            EPM_STATUS_NULL_POINTER, "NULL ns");
  MU_EXPECT(epm_kv_batch_take_slot_for_tokens_ns(b, 0, longest, sizeof longest, toks, 16, 0, f->s, &uq, &shared),
            EPM_STATUS_INVALID_ARGUMENT, "a namespace one byte too long");
  MU_EXPECT(epm_kv_batch_take_slot_for_tokens_ns(b, 0, nul, sizeof nul - 1, toks, 16, 0, f->s, &uq, &shared),
            EPM_STATUS_INVALID_ARGUMENT, "a namespace containing NUL");
  MU_EXPECT(epm_kv_batch_take_slot_for_tokens_ns(b, 0, "a", 1, toks, 16, 0, f->s2, &uq, &shared),
            EPM_STATUS_INVALID_ARGUMENT, "a stream of another device");
  MU_EXPECT(epm_kv_batch_take_slot_for_tokens_ns(b, 2, "a", 1, toks, 16, 0, f->s, &uq, &shared),
            EPM_STATUS_INVALID_ARGUMENT, "slot == max_slots");
  MU_EXPECT(epm_kv_batch_take_slot_for_tokens_ns(b, 0, "a", 1, toks, 16, 0, f->s, NULL, &shared),
            EPM_STATUS_NULL_POINTER, "NULL out");
  CHECK(uq == NULL && shared == 77);

  /* Nothing was created by any refused call. */
  memset(&st, 0, sizeof st);
  st.size = sizeof st;
  REQUIRE_OK(epm_kv_pool_get_stats(kv, &st));
  CHECK(st.sequences == 0 && st.prefixes == 0);
  /* The longest namespace accepted works. */
  CHECK_OK(epm_kv_find_prefix_ns(kv, &l, longest, EPM_KV_NAMESPACE_MAX_BYTES, toks, 16, &found));
  CHECK(found == 0);

cleanup:
  epm_kv_seq_destroy(uq);
  CHECK_OK(epm_kv_batch_destroy(b));
  epm_kv_pool_destroy(kv);
}

int main(void) {
  MuFx f;
  if (mu_open(&f)) RUN_FX(test_namespaces, &f);
  mu_close(&f);
  TEST_SUMMARY();
}
