/*
 * The deprecated names (docs/ABI.md, "Names"; src/ffi/deprecated.rs): a
 * program written against the old names still compiles and works, and each
 * old function misbehaves exactly as its new twin does on bad input. The
 * header marks them deprecated, so this file silences that one warning
 * (tests/header.rs checks the warning fires without it).
 */
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
#include "misuse.h"

static EpmKvLayout small_layout(void) {
  EpmKvLayout l;
  memset(&l, 0, sizeof l);
  l.size = sizeof l;
  if (epm_kv_layout_token_major(2, 2, 64, 2, &l) != EPM_STATUS_OK) l.size = 0;
  return l;
}

/* The old type name is the new type: handles pass either way, no cast. */
static void test_old_names_work(MuFx *f) {
  EpmKvArena *old = NULL;
  EpmKvPool *same = NULL;
  EpmKvSeq *seq = NULL;
  EpmKvStats a, b;
  EpmKvLayout l = small_layout();
  REQUIRE(l.size == sizeof l);

  /* The old admission constant is the new one. */
  CHECK(EPM_KV_ADMIT_RESERVE == EPM_KV_ADMIT_PROMISE);
  REQUIRE_OK(epm_kv_arena_create(f->dev, 64ull << 20, &old));
  same = old;
  REQUIRE_OK(epm_kv_seq_create(old, &l, 4096, EPM_KV_ADMIT_RESERVE, &seq));
  REQUIRE_OK(epm_kv_seq_prepare_append(seq, 100, f->s));
  memset(&a, 0, sizeof a);
  memset(&b, 0, sizeof b);
  a.size = sizeof a;
  b.size = sizeof b;
  CHECK_OK(epm_kv_arena_get_stats(old, &a));
  CHECK_OK(epm_kv_pool_get_stats(same, &b));
  CHECK(a.size == sizeof a && memcmp(&a, &b, sizeof a) == 0);
  CHECK(a.sequences == 1 && a.committed_granules >= 1 && a.owned_bytes >= 2 * f->info.granularity);
  CHECK_OK(epm_kv_seq_destroy(seq));
  seq = NULL;
  CHECK_OK(epm_kv_arena_destroy(old));
  MU_EXPECT(epm_kv_pool_get_stats(same, &b), EPM_STATUS_INVALID_HANDLE, "a pool destroyed by its old name");
  old = NULL;

  /* And the other way: made by the new name, ended by the old one. */
  REQUIRE_OK(epm_kv_pool_create(f->dev, 64ull << 20, &same));
  CHECK_OK(epm_kv_arena_destroy(same));
  MU_EXPECT(epm_kv_arena_get_stats(same, &a), EPM_STATUS_INVALID_HANDLE, "a pool destroyed by its old name");
  same = NULL;

cleanup:
  epm_kv_seq_destroy(seq);
  epm_kv_arena_destroy(old);
  epm_kv_pool_destroy(same);
}

static void test_old_names_misuse(MuFx *f) {
  EpmKvArena *kv = NULL, *dead = NULL, *ukv = NULL;
  EpmKvStats st;

  REQUIRE_OK(epm_kv_arena_create(f->dev, 64ull << 20, &kv));
  REQUIRE_OK(epm_kv_arena_create(f->dev, 64ull << 20, &dead));
  REQUIRE_OK(epm_kv_arena_destroy(dead));

  BAD_HANDLES(EpmDevice, h, f->s, f->dead_dev, epm_kv_arena_create(h, 64ull << 20, &ukv));
  MU_EXPECT(epm_kv_arena_create(f->dev, 64ull << 20, NULL), EPM_STATUS_NULL_POINTER, "NULL out");
  MU_EXPECT(epm_kv_arena_create(f->dev, 0, &ukv), EPM_STATUS_OUT_OF_BUDGET, "budget 0");
  CHECK(ukv == NULL);

  memset(&st, 0xab, sizeof st);
  st.size = sizeof st;
  BAD_HANDLES(EpmKvArena, h, f->s, dead, epm_kv_arena_get_stats(h, &st));
  MU_EXPECT(epm_kv_arena_get_stats(kv, NULL), EPM_STATUS_NULL_POINTER, "NULL out");
  st.size = 1;
  MU_EXPECT(epm_kv_arena_get_stats(kv, &st), EPM_STATUS_INVALID_ARGUMENT, "size 1");
  CHECK(st.size == 1 && st.budget_bytes == 0xababababababababull);

  BAD_DESTROY(EpmKvArena, h, f->s, dead, epm_kv_arena_destroy(h));

cleanup:
  epm_kv_arena_destroy(kv);
}

int main(void) {
  MuFx f;
  if (mu_open(&f)) {
    RUN_FX(test_old_names_work, &f);
    RUN_FX(test_old_names_misuse, &f);
  }
  mu_close(&f);
  TEST_SUMMARY();
}
