/*
 * The misuse suite for the stream-ordered arena (epm_ordered_arena_*) and
 * PyTorch's allocator functions (epm_torch_*). Same rules as test_misuse.c:
 * exact status, non-empty message, out-params untouched. The torch
 * functions that return no status leave a message instead.
 */
#include "misuse.h"

static void test_ordered_arena(MuFx *f) {
  EpmArenaConfig cfg, small;
  EpmOrderedArenaStats st;
  EpmOrderedArena *a = NULL, *dead = NULL, *untouched = NULL;
  uint64_t addr = 0, other = 0, out = 99;

  cfg.size = sizeof cfg;
  REQUIRE_OK(epm_arena_config_default(&cfg));
  cfg.capacity_bytes = 64ull << 20;
  BAD_HANDLES(EpmDevice, h, f->s, f->dead_dev, epm_ordered_arena_create(h, &cfg, &untouched));
  MU_EXPECT(epm_ordered_arena_create(f->dev, NULL, &untouched), EPM_STATUS_NULL_POINTER, "NULL cfg");
  MU_EXPECT(epm_ordered_arena_create(f->dev, &cfg, NULL), EPM_STATUS_NULL_POINTER, "NULL out");
  small = cfg;
  small.capacity_bytes = 0;
  MU_EXPECT(epm_ordered_arena_create(f->dev, &small, &untouched), EPM_STATUS_INVALID_ARGUMENT, "capacity 0");
  small = cfg;
  small.size = 8;
  MU_EXPECT(epm_ordered_arena_create(f->dev, &small, &untouched), EPM_STATUS_INVALID_ARGUMENT, "cfg->size 8");
  CHECK(untouched == NULL);

  REQUIRE_OK(epm_ordered_arena_create(f->dev, &cfg, &a));
  REQUIRE_OK(epm_ordered_arena_create(f->dev, &cfg, &dead));
  REQUIRE_OK(epm_ordered_arena_destroy(dead));

  BAD_HANDLES(EpmOrderedArena, h, f->dev, dead, epm_ordered_arena_alloc(h, 256, f->s, &out));
  /* A NULL stream is allowed (no stream); every other bad one is not. */
  MU_EXPECT(epm_ordered_arena_alloc(a, 256, f->dead_s, &out), EPM_STATUS_INVALID_HANDLE, "a destroyed stream");
  MU_EXPECT(epm_ordered_arena_alloc(a, 256, (EpmStream *)(void *)f->ev, &out), EPM_STATUS_INVALID_HANDLE, "an event as stream");
  MU_EXPECT(epm_ordered_arena_alloc(a, 256, (EpmStream *)(uintptr_t)0x40, &out), EPM_STATUS_INVALID_HANDLE, "stream 0x40");
  MU_EXPECT(epm_ordered_arena_alloc(a, 256, f->s2, &out), EPM_STATUS_INVALID_ARGUMENT, "a stream of another device");
  MU_EXPECT(epm_ordered_arena_alloc(a, 256, f->s, NULL), EPM_STATUS_NULL_POINTER, "NULL out_addr");
  MU_EXPECT(epm_ordered_arena_alloc(a, 0, f->s, &out), EPM_STATUS_INVALID_ARGUMENT, "0 bytes");
  MU_EXPECT(epm_ordered_arena_alloc(a, SIZE_MAX, NULL, &out), EPM_STATUS_OUT_OF_BUDGET, "SIZE_MAX bytes");
  MU_EXPECT(epm_ordered_arena_alloc(a, (64u << 20) + 1, f->s, &out), EPM_STATUS_OUT_OF_BUDGET, "capacity + 1");
  CHECK(out == 99);

  REQUIRE_OK(epm_ordered_arena_alloc(a, 4096, f->s, &addr));
  REQUIRE_OK(epm_ordered_arena_alloc(a, 4096, NULL, &other));
  BAD_HANDLES(EpmOrderedArena, h, f->dev, dead, epm_ordered_arena_free(h, addr, NULL));
  MU_EXPECT(epm_ordered_arena_free(a, addr, f->dead_s), EPM_STATUS_INVALID_HANDLE, "a destroyed stream");
  MU_EXPECT(epm_ordered_arena_free(a, addr, (EpmStream *)(void *)f->ev), EPM_STATUS_INVALID_HANDLE, "an event as stream");
  MU_EXPECT(epm_ordered_arena_free(a, addr, f->s2), EPM_STATUS_INVALID_ARGUMENT, "a stream of another device");
  MU_EXPECT(epm_ordered_arena_free(a, addr + 256, NULL), EPM_STATUS_INVALID_ARGUMENT, "an interior address");
  MU_EXPECT(epm_ordered_arena_free(a, f->d, NULL), EPM_STATUS_INVALID_ARGUMENT, "memory of the device, not the arena");
  MU_EXPECT(epm_ordered_arena_free(a, UINT64_MAX, f->s), EPM_STATUS_INVALID_ARGUMENT, "address UINT64_MAX");
  CHECK_OK(epm_ordered_arena_free(a, 0, NULL));
  REQUIRE_OK(epm_ordered_arena_free(a, addr, NULL));
  MU_EXPECT(epm_ordered_arena_free(a, addr, f->s), EPM_STATUS_INVALID_ARGUMENT, "a double free (pending on its stream)");
  REQUIRE_OK(epm_ordered_arena_free(a, other, NULL));
  MU_EXPECT(epm_ordered_arena_free(a, other, NULL), EPM_STATUS_INVALID_ARGUMENT, "a double free");

  BAD_HANDLES(EpmOrderedArena, h, f->dev, dead, epm_ordered_arena_trim(h, &out));
  CHECK_OK(epm_ordered_arena_trim(a, NULL));
  st.size = sizeof st;
  BAD_HANDLES(EpmOrderedArena, h, f->dev, dead, epm_ordered_arena_get_stats(h, &st));
  MU_EXPECT(epm_ordered_arena_get_stats(a, NULL), EPM_STATUS_NULL_POINTER, "NULL out");
  st.size = 4;
  MU_EXPECT(epm_ordered_arena_get_stats(a, &st), EPM_STATUS_INVALID_ARGUMENT, "size 4");
  BAD_DESTROY(EpmOrderedArena, h, f->dev, dead, epm_ordered_arena_destroy(h));

cleanup:
  CHECK_OK(epm_ordered_arena_destroy(a));
}

/* Input every build rejects before touching a device. */
static void test_torch(MuFx *f) {
  EpmOrderedArenaStats st;
  uint64_t out = 99;
  (void)f;
  CHECK(epm_torch_alloc(-4096, 0, NULL) == NULL && strstr(epm_last_error_message(), "negative") != NULL);
  CHECK(epm_torch_alloc(256, -1, NULL) == NULL && epm_last_error_message()[0] != '\0');
  CHECK(epm_torch_alloc(256, 64, NULL) == NULL && epm_last_error_message()[0] != '\0');
  CHECK((epm_torch_free(&out, 8, 63, NULL), epm_last_error_message()[0] != '\0'));
  CHECK((epm_torch_free(&out, -8, 0, NULL), strstr(epm_last_error_message(), "negative") != NULL));
  CHECK((epm_torch_free(&out, 8, -3, NULL), epm_last_error_message()[0] != '\0'));
  CHECK(out == 99);
  st.size = sizeof st;
  MU_EXPECT(epm_torch_get_stats(-1, &st), EPM_STATUS_INVALID_ARGUMENT, "device -1");
  MU_EXPECT(epm_torch_get_stats(63, &st), EPM_STATUS_INVALID_STATE, "a device with no arena");
  MU_EXPECT(epm_torch_get_stats(0, NULL), EPM_STATUS_NULL_POINTER, "NULL out");
  MU_EXPECT(epm_torch_trim(-5, &out), EPM_STATUS_INVALID_ARGUMENT, "device -5");
  MU_EXPECT(epm_torch_trim(64, NULL), EPM_STATUS_INVALID_ARGUMENT, "device 64");
  CHECK(out == 99);
  CHECK_STATUS(epm_torch_set_capacity(0), EPM_STATUS_OK); /* no arena yet: allowed */
}

int main(void) {
  MuFx fx;
  if (!mu_open(&fx)) return 1;
  RUN_FX(test_ordered_arena, &fx);
  RUN_FX(test_torch, &fx);
  mu_close(&fx);
  TEST_SUMMARY();
}
