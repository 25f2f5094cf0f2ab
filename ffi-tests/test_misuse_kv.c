/*
 * The misuse suite, part 3: the KV pool, sequences and prefixes, including
 * use after a sequence's reservation or a prefix's pin is gone. Same rules
 * as test_misuse.c: exact status, non-empty message, out-params untouched.
 */
#include "misuse.h"

/* A small layout: 2 layers x 2 heads x 64 x 2 bytes = 1 KiB per token, so a
 * 2 MiB granule holds 2048 tokens. */
static EpmKvLayout mu_layout(void) {
  EpmKvLayout l;
  memset(&l, 0, sizeof l);
  l.size = sizeof l;
  if (epm_kv_layout_token_major(2, 2, 64, 2, &l) != EPM_STATUS_OK) l.size = 0;
  return l;
}

static void test_layout_and_pool(MuFx *f) {
  EpmKvLayout l, u;
  EpmKvPool *kv = NULL, *dead = NULL, *ukv = NULL;
  EpmKvStats st;
  EpmKvAdmission adm;
  EpmKvRequestCost cost;

  memset(&u, 0xab, sizeof u);
  MU_EXPECT(epm_kv_layout_token_major(2, 2, 64, 2, NULL), EPM_STATUS_NULL_POINTER, "NULL out");
  MU_EXPECT(epm_kv_layout_token_major(0, 2, 64, 2, &u), EPM_STATUS_INVALID_ARGUMENT, "0 layers");
  MU_EXPECT(epm_kv_layout_token_major(2, 0, 64, 2, &u), EPM_STATUS_INVALID_ARGUMENT, "0 heads");
  MU_EXPECT(epm_kv_layout_token_major(2, 2, 0, 2, &u), EPM_STATUS_INVALID_ARGUMENT, "head_dim 0");
  MU_EXPECT(epm_kv_layout_token_major(2, 2, 64, 0, &u), EPM_STATUS_INVALID_ARGUMENT, "0 elem bytes");
  MU_EXPECT(epm_kv_layout_token_major(UINT32_MAX, UINT32_MAX, UINT32_MAX, UINT32_MAX, &u), EPM_STATUS_INVALID_ARGUMENT,
            "an overflowing token");
  CHECK(u.layers == 0xabababab);
  l = mu_layout();
  REQUIRE(l.size == sizeof l);

  BAD_HANDLES(EpmDevice, h, f->s, f->dead_dev, epm_kv_pool_create(h, 64ull << 20, &ukv));
  MU_EXPECT(epm_kv_pool_create(f->dev, 64ull << 20, NULL), EPM_STATUS_NULL_POINTER, "NULL out");
  MU_EXPECT(epm_kv_pool_create(f->dev, 0, &ukv), EPM_STATUS_OUT_OF_BUDGET, "budget 0");
  MU_EXPECT(epm_kv_pool_create(f->dev, f->info.granularity - 1, &ukv), EPM_STATUS_OUT_OF_BUDGET,
            "a budget below one granule");
  CHECK(ukv == NULL);
  REQUIRE_OK(epm_kv_pool_create(f->dev, 64ull << 20, &kv));
  REQUIRE_OK(epm_kv_pool_create(f->dev, 64ull << 20, &dead));
  REQUIRE_OK(epm_kv_pool_destroy(dead));

  st.size = sizeof st;
  BAD_HANDLES(EpmKvPool, h, f->dev, dead, epm_kv_pool_get_stats(h, &st));
  MU_EXPECT(epm_kv_pool_get_stats(kv, NULL), EPM_STATUS_NULL_POINTER, "NULL out");
  st.size = 8;
  MU_EXPECT(epm_kv_pool_get_stats(kv, &st), EPM_STATUS_INVALID_ARGUMENT, "size 8");

  adm.size = sizeof adm;
  MU_EXPECT(epm_kv_admissible(1 << 30, 1 << 20, 1 << 20, NULL), EPM_STATUS_NULL_POINTER, "NULL out");
  adm.size = 0;
  MU_EXPECT(epm_kv_admissible(1 << 30, 1 << 20, 1 << 20, &adm), EPM_STATUS_INVALID_ARGUMENT, "size 0");
  adm.size = sizeof adm;
  CHECK_OK(epm_kv_admissible(UINT64_MAX, UINT64_MAX, 0, &adm)); /* saturates, never divides by 0 */

  cost.size = sizeof cost;
  BAD_HANDLES(EpmKvPool, h, f->s, dead, epm_kv_request_cost(h, &l, 16, 64, &cost));
  MU_EXPECT(epm_kv_request_cost(kv, NULL, 16, 64, &cost), EPM_STATUS_NULL_POINTER, "NULL layout");
  MU_EXPECT(epm_kv_request_cost(kv, &l, 16, 64, NULL), EPM_STATUS_NULL_POINTER, "NULL out");
  MU_EXPECT(epm_kv_request_cost(kv, &l, 65, 64, &cost), EPM_STATUS_INVALID_ARGUMENT, "prefix beyond max_tokens");
  MU_EXPECT(epm_kv_request_cost(kv, &l, 0, UINT64_MAX, &cost), EPM_STATUS_INVALID_ARGUMENT, "max_tokens UINT64_MAX");
  cost.size = 0;
  MU_EXPECT(epm_kv_request_cost(kv, &l, 16, 64, &cost), EPM_STATUS_INVALID_ARGUMENT, "size 0");
  BAD_DESTROY(EpmKvPool, h, f->dev, dead, epm_kv_pool_destroy(h));

cleanup:
  epm_kv_pool_destroy(kv);
}

static void test_sequences(MuFx *f) {
  EpmKvLayout l = mu_layout(), bad;
  EpmKvPool *kv = NULL, *dead_kv = NULL;
  EpmKvSeq *seq = NULL, *dead = NULL, *useq = NULL;
  EpmKvSeqInfo info;
  uint64_t shared = 31, found = 32;
  uint32_t tokens[64];
  uint64_t g = f->info.granularity;
  uint64_t per_granule = g / l.token_stride;

  for (int i = 0; i < 64; i++) tokens[i] = (uint32_t)(1000 + i);
  REQUIRE_OK(epm_kv_pool_create(f->dev, 4 * g, &kv)); /* the dummy + 3 granules */
  REQUIRE_OK(epm_kv_pool_create(f->dev, 4 * g, &dead_kv));
  REQUIRE_OK(epm_kv_pool_destroy(dead_kv));

  BAD_HANDLES(EpmKvPool, h, f->dev, dead_kv, epm_kv_seq_create(h, &l, 64, EPM_KV_ADMIT_PROMISE, &useq));
  MU_EXPECT(epm_kv_seq_create(kv, NULL, 64, EPM_KV_ADMIT_PROMISE, &useq), EPM_STATUS_NULL_POINTER, "NULL layout");
  MU_EXPECT(epm_kv_seq_create(kv, &l, 64, EPM_KV_ADMIT_PROMISE, NULL), EPM_STATUS_NULL_POINTER, "NULL out");
  MU_EXPECT(epm_kv_seq_create(kv, &l, 0, EPM_KV_ADMIT_PROMISE, &useq), EPM_STATUS_INVALID_ARGUMENT, "max_tokens 0");
  MU_EXPECT(epm_kv_seq_create(kv, &l, UINT64_MAX, EPM_KV_ADMIT_ON_DEMAND, &useq), EPM_STATUS_INVALID_ARGUMENT,
            "max_tokens UINT64_MAX");
  MU_EXPECT(epm_kv_seq_create(kv, &l, 64, 2, &useq), EPM_STATUS_INVALID_ARGUMENT, "admit mode 2");
  MU_EXPECT(epm_kv_seq_create(kv, &l, 4 * per_granule, EPM_KV_ADMIT_PROMISE, &useq), EPM_STATUS_OUT_OF_BUDGET,
            "a reservation beyond the budget");
  bad = l;
  bad.token_stride = 1;
  MU_EXPECT(epm_kv_seq_create(kv, &bad, 64, EPM_KV_ADMIT_PROMISE, &useq), EPM_STATUS_INVALID_ARGUMENT,
            "a layout that is not token-major");
  bad = l;
  bad.size = 4;
  MU_EXPECT(epm_kv_seq_create(kv, &bad, 64, EPM_KV_ADMIT_PROMISE, &useq), EPM_STATUS_INVALID_ARGUMENT, "layout size 4");
  BAD_HANDLES(EpmKvPool, h, f->dev, dead_kv,
              epm_kv_seq_create_for_tokens(h, &l, 64, tokens, 16, EPM_KV_ADMIT_PROMISE, &useq, &shared));
  MU_EXPECT(epm_kv_seq_create_for_tokens(kv, &l, 64, NULL, 16, EPM_KV_ADMIT_PROMISE, &useq, &shared),
            EPM_STATUS_NULL_POINTER, "NULL tokens, n 16");
  MU_EXPECT(epm_kv_seq_create_for_tokens(kv, &l, 8, tokens, 16, EPM_KV_ADMIT_PROMISE, &useq, &shared),
            EPM_STATUS_INVALID_ARGUMENT, "more tokens than max_tokens");
  MU_EXPECT(epm_kv_seq_create_for_tokens(kv, &l, 64, tokens, SIZE_MAX, EPM_KV_ADMIT_PROMISE, &useq, &shared),
            EPM_STATUS_INVALID_ARGUMENT, "n_tokens SIZE_MAX");
  MU_EXPECT(epm_kv_seq_create_for_tokens(kv, NULL, 64, tokens, 16, EPM_KV_ADMIT_PROMISE, &useq, &shared),
            EPM_STATUS_NULL_POINTER, "NULL layout");
  MU_EXPECT(epm_kv_seq_create_for_tokens(kv, &l, 64, tokens, 16, EPM_KV_ADMIT_PROMISE, NULL, &shared),
            EPM_STATUS_NULL_POINTER, "NULL out");
  CHECK(useq == NULL && shared == 31);

  REQUIRE_OK(epm_kv_seq_create(kv, &l, 64, EPM_KV_ADMIT_PROMISE, &dead));
  REQUIRE_OK(epm_kv_seq_destroy(dead));
  REQUIRE_OK(epm_kv_seq_create_for_tokens(kv, &l, 2 * per_granule, tokens, 64, EPM_KV_ADMIT_ON_DEMAND, &seq, NULL));

  info.size = sizeof info;
  BAD_HANDLES(EpmKvSeq, h, kv, dead, epm_kv_seq_get_info(h, &info));
  MU_EXPECT(epm_kv_seq_get_info(seq, NULL), EPM_STATUS_NULL_POINTER, "NULL out");
  info.size = 2;
  MU_EXPECT(epm_kv_seq_get_info(seq, &info), EPM_STATUS_INVALID_ARGUMENT, "size 2");

  BAD_HANDLES(EpmKvSeq, h, kv, dead, epm_kv_seq_prepare_append(h, 16, f->s));
  BAD_HANDLES(EpmStream, h, seq, f->dead_s, epm_kv_seq_prepare_append(seq, 16, h));
  MU_EXPECT(epm_kv_seq_prepare_append(seq, 16, f->s2), EPM_STATUS_INVALID_ARGUMENT, "another device's stream");
  MU_EXPECT(epm_kv_seq_prepare_append(seq, 2 * per_granule + 1, f->s), EPM_STATUS_INVALID_ARGUMENT,
            "beyond max_tokens");
  MU_EXPECT(epm_kv_seq_prepare_append(seq, UINT64_MAX, f->s), EPM_STATUS_INVALID_ARGUMENT, "n_tokens UINT64_MAX");
  CHECK_OK(epm_kv_seq_prepare_append(seq, 0, f->s));

  BAD_HANDLES(EpmKvSeq, h, kv, dead, epm_kv_seq_declare_tokens(h, tokens, 4));
  MU_EXPECT(epm_kv_seq_declare_tokens(seq, NULL, 4), EPM_STATUS_NULL_POINTER, "NULL tokens, n 4");
  MU_EXPECT(epm_kv_seq_declare_tokens(seq, tokens, SIZE_MAX), EPM_STATUS_INVALID_ARGUMENT, "n_tokens SIZE_MAX");
  CHECK_OK(epm_kv_seq_declare_tokens(seq, NULL, 0));

  BAD_HANDLES(EpmKvPool, h, seq, dead_kv, epm_kv_find_prefix(h, &l, tokens, 16, &found));
  MU_EXPECT(epm_kv_find_prefix(kv, NULL, tokens, 16, &found), EPM_STATUS_NULL_POINTER, "NULL layout");
  MU_EXPECT(epm_kv_find_prefix(kv, &l, NULL, 16, &found), EPM_STATUS_NULL_POINTER, "NULL tokens, n 16");
  MU_EXPECT(epm_kv_find_prefix(kv, &l, tokens, 16, NULL), EPM_STATUS_NULL_POINTER, "NULL out");
  MU_EXPECT(epm_kv_find_prefix(kv, &l, tokens, SIZE_MAX, &found), EPM_STATUS_INVALID_ARGUMENT, "n_tokens SIZE_MAX");
  CHECK(found == 32);

  /* On demand, the budget runs out: refused before any mapping changes. */
  REQUIRE_OK(epm_kv_seq_prepare_append(seq, 2 * per_granule, f->s));
  {
    EpmKvSeq *more = NULL;
    REQUIRE_OK(epm_kv_seq_create(kv, &l, 2 * per_granule, EPM_KV_ADMIT_ON_DEMAND, &more));
    MU_EXPECT(epm_kv_seq_prepare_append(more, 2 * per_granule, f->s), EPM_STATUS_OUT_OF_BUDGET, "a full ledger");
    info.size = sizeof info;
    CHECK_OK(epm_kv_seq_get_info(more, &info));
    CHECK(info.len_tokens == 0 && info.private_granules == 0);
    CHECK_OK(epm_kv_seq_destroy(more));
  }
  BAD_DESTROY(EpmKvSeq, h, kv, dead, epm_kv_seq_destroy(h));

cleanup:
  epm_kv_seq_destroy(seq);
  epm_kv_pool_destroy(kv);
}

static void test_prefixes_and_lifetimes(MuFx *f) {
  EpmKvLayout l = mu_layout();
  EpmKvPool *kv = NULL;
  EpmKvSeq *origin = NULL, *sharer = NULL, *useq = NULL;
  EpmKvPrefix *pfx = NULL, *dead = NULL, *upfx = NULL;
  EpmKvPrefixInfo pi;
  EpmKvSeqInfo si;
  EpmKvStats st;
  uint64_t g = f->info.granularity;

  REQUIRE_OK(epm_kv_pool_create(f->dev, 16 * g, &kv));
  REQUIRE_OK(epm_kv_seq_create(kv, &l, 4096, EPM_KV_ADMIT_PROMISE, &origin));
  REQUIRE_OK(epm_kv_seq_prepare_append(origin, 100, f->s));

  BAD_HANDLES(EpmKvSeq, h, kv, NULL, epm_kv_prefix_pin(h, 10, f->s, &upfx));
  BAD_HANDLES(EpmStream, h, origin, f->dead_s, epm_kv_prefix_pin(origin, 10, h, &upfx));
  MU_EXPECT(epm_kv_prefix_pin(origin, 10, f->s, NULL), EPM_STATUS_NULL_POINTER, "NULL out");
  MU_EXPECT(epm_kv_prefix_pin(origin, 0, f->s, &upfx), EPM_STATUS_INVALID_ARGUMENT, "0 tokens");
  MU_EXPECT(epm_kv_prefix_pin(origin, 101, f->s, &upfx), EPM_STATUS_INVALID_ARGUMENT, "beyond the prepared tokens");
  MU_EXPECT(epm_kv_prefix_pin(origin, UINT64_MAX, f->s, &upfx), EPM_STATUS_INVALID_ARGUMENT, "UINT64_MAX tokens");
  MU_EXPECT(epm_kv_prefix_pin(origin, 10, f->s2, &upfx), EPM_STATUS_INVALID_ARGUMENT, "another device's stream");
  CHECK(upfx == NULL);

  REQUIRE_OK(epm_kv_prefix_pin(origin, 50, f->s, &dead));
  REQUIRE_OK(epm_kv_prefix_unpin(dead));
  REQUIRE_OK(epm_kv_prefix_pin(origin, 100, f->s, &pfx));

  pi.size = sizeof pi;
  BAD_HANDLES(EpmKvPrefix, h, origin, dead, epm_kv_prefix_get_info(h, &pi));
  MU_EXPECT(epm_kv_prefix_get_info(pfx, NULL), EPM_STATUS_NULL_POINTER, "NULL out");
  pi.size = 1;
  MU_EXPECT(epm_kv_prefix_get_info(pfx, &pi), EPM_STATUS_INVALID_ARGUMENT, "size 1");

  BAD_HANDLES(EpmKvPrefix, h, kv, dead, epm_kv_commit_shared_prefix(h, 10, 200, EPM_KV_ADMIT_PROMISE, &useq));
  MU_EXPECT(epm_kv_commit_shared_prefix(pfx, 10, 200, EPM_KV_ADMIT_PROMISE, NULL), EPM_STATUS_NULL_POINTER, "NULL out");
  MU_EXPECT(epm_kv_commit_shared_prefix(pfx, 0, 200, EPM_KV_ADMIT_PROMISE, &useq), EPM_STATUS_INVALID_ARGUMENT,
            "0 tokens");
  MU_EXPECT(epm_kv_commit_shared_prefix(pfx, 101, 200, EPM_KV_ADMIT_PROMISE, &useq), EPM_STATUS_INVALID_ARGUMENT,
            "beyond the prefix");
  MU_EXPECT(epm_kv_commit_shared_prefix(pfx, 50, 49, EPM_KV_ADMIT_PROMISE, &useq), EPM_STATUS_INVALID_ARGUMENT,
            "max_tokens below n_tokens");
  MU_EXPECT(epm_kv_commit_shared_prefix(pfx, 50, UINT64_MAX, EPM_KV_ADMIT_ON_DEMAND, &useq),
            EPM_STATUS_INVALID_ARGUMENT, "max_tokens UINT64_MAX");
  MU_EXPECT(epm_kv_commit_shared_prefix(pfx, 50, 200, 7, &useq), EPM_STATUS_INVALID_ARGUMENT, "admit mode 7");
  MU_EXPECT(epm_kv_commit_shared_prefix(pfx, 50, 100000, EPM_KV_ADMIT_PROMISE, &useq), EPM_STATUS_OUT_OF_BUDGET,
            "a promise beyond the budget");
  CHECK(useq == NULL);

  /* Lifetimes: the pool handle goes first, then the origin; the sharer
   * still works, and the prefix lives while pinned. */
  REQUIRE_OK(epm_kv_commit_shared_prefix(pfx, 100, 300, EPM_KV_ADMIT_PROMISE, &sharer));
  REQUIRE_OK(epm_kv_pool_destroy(kv));
  MU_EXPECT(epm_kv_pool_get_stats(kv, &st), EPM_STATUS_INVALID_HANDLE, "a destroyed pool handle");
  kv = NULL;
  REQUIRE_OK(epm_kv_seq_destroy(origin));
  MU_EXPECT(epm_kv_seq_prepare_append(origin, 1, f->s), EPM_STATUS_INVALID_HANDLE, "a destroyed sequence");
  MU_EXPECT(epm_kv_prefix_pin(origin, 1, f->s, &upfx), EPM_STATUS_INVALID_HANDLE, "a destroyed sequence");
  MU_EXPECT(epm_kv_seq_destroy(origin), EPM_STATUS_INVALID_HANDLE, "a double destroy");
  origin = NULL;
  CHECK_OK(epm_kv_seq_prepare_append(sharer, 50, f->s)); /* copies the boundary granule on write */
  si.size = sizeof si;
  CHECK_OK(epm_kv_seq_get_info(sharer, &si));
  CHECK(si.len_tokens == 150);

  /* Unpin while shared: the handle dies at once, the prefix lives on. */
  REQUIRE_OK(epm_kv_prefix_unpin(pfx));
  BAD_DESTROY(EpmKvPrefix, h, sharer, pfx, epm_kv_prefix_unpin(h));
  MU_EXPECT(epm_kv_commit_shared_prefix(pfx, 10, 20, EPM_KV_ADMIT_PROMISE, &useq), EPM_STATUS_INVALID_HANDLE,
            "an unpinned prefix");
  pfx = NULL;
  CHECK_OK(epm_kv_seq_get_info(sharer, &si));
  CHECK_OK(epm_kv_seq_destroy(sharer));
  MU_EXPECT(epm_kv_seq_get_info(sharer, &si), EPM_STATUS_INVALID_HANDLE, "a sequence whose pool is gone");
  sharer = NULL;

cleanup:
  epm_kv_seq_destroy(sharer);
  epm_kv_seq_destroy(origin);
  epm_kv_prefix_unpin(pfx);
  epm_kv_pool_destroy(kv);
}

int main(void) {
  MuFx f;
  if (mu_open(&f)) {
    RUN_FX(test_layout_and_pool, &f);
    RUN_FX(test_sequences, &f);
    RUN_FX(test_prefixes_and_lifetimes, &f);
  }
  mu_close(&f);
  TEST_SUMMARY();
}
