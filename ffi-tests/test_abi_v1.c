/*
 * The ABI across versions: a client built against the FIRST published
 * version of every versioned struct (ffi-tests/abi/v1_structs.h, frozen)
 * runs against today's library, and no published size or offset moved.
 *
 * - the published layout: sizeof of each v1 copy is its EPM_*_SIZE_V1, and
 *   every v1 field sits at the same offset, with the same size, in today's
 *   header (fails the moment a field is inserted, reordered or resized);
 * - a v1 client: every function that fills a versioned struct accepts
 *   size = EPM_*_SIZE_V1, writes exactly that many bytes (guard bytes after
 *   stay untouched) and reports the count in `size`; every function that
 *   reads one accepts a v1 struct;
 * - one byte short of the first version is INVALID_ARGUMENT, naming the
 *   minimum, and nothing is written;
 * - a client newer than the library (size larger than today's struct) gets
 *   today's fields and `size` = sizeof today's struct, and nothing past it.
 *
 * Runs on the device EPM_DEVICE names (host in CI, cuda on a GPU machine).
 *   make test-c
 */
#include <stdint.h>
#include <stdlib.h>

#include "testhelper.h"
#include "abi/v1_structs.h"

#define GUARD 64

static int bytes_are(const unsigned char *p, size_t n, unsigned char v) {
  for (size_t i = 0; i < n; i++)
    if (p[i] != v) return 0;
  return 1;
}

static void set_size(unsigned char *buf, size_t size) { memcpy(buf, &size, sizeof size); }
static size_t get_size(const unsigned char *buf) {
  size_t s;
  memcpy(&s, buf, sizeof s);
  return s;
}

static void test_published_layout(void) {
#define CHECK_SIZE(T, V1)                                                                      \
  do {                                                                                         \
    th_checks++;                                                                               \
    if (sizeof(T##_v1) != (V1)) TH_FAIL(#V1 " is %zu but the frozen " #T " is %zu bytes", (size_t)(V1), sizeof(T##_v1)); \
    if (sizeof(T) < (V1)) TH_FAIL(#T " shrank: %zu < " #V1 " %zu", sizeof(T), (size_t)(V1));  \
  } while (0);
  EPM_V1_STRUCTS(CHECK_SIZE)
#undef CHECK_SIZE
#define CHECK_FIELD(T, f)                                                                      \
  do {                                                                                         \
    th_checks++;                                                                               \
    if (offsetof(T, f) != offsetof(T##_v1, f) || sizeof(((T *)0)->f) != sizeof(((T##_v1 *)0)->f)) \
      TH_FAIL(#T "." #f " moved: offset %zu size %zu, published offset %zu size %zu", offsetof(T, f), \
              sizeof(((T *)0)->f), offsetof(T##_v1, f), sizeof(((T##_v1 *)0)->f));            \
  } while (0);
  EPM_V1_ALL_FIELDS(CHECK_FIELD)
#undef CHECK_FIELD
}

/* One function filling a versioned struct `T` through `p`, three clients:
 * v1, one byte short of v1, newer than the library. */
#define OUT_CASES(T, V1, call)                                                                 \
  do {                                                                                         \
    _Alignas(16) unsigned char buf[sizeof(T) + GUARD], before[sizeof(T) + GUARD];              \
    char v1_text[32];                                                                          \
    T *p = (T *)(void *)buf;                                                                   \
    snprintf(v1_text, sizeof v1_text, "%zu", (size_t)(V1));                                    \
    /* a client built against the first version */                                            \
    memset(buf, 0xA5, sizeof buf);                                                             \
    set_size(buf, sizeof(T##_v1));                                                             \
    CHECK_OK(call);                                                                            \
    CHECK(get_size(buf) == (V1));                                                              \
    CHECK(bytes_are(buf + (V1), sizeof buf - (V1), 0xA5));                                     \
    /* one byte short of the first version: refused, nothing written */                       \
    memset(buf, 0x5A, sizeof buf);                                                             \
    set_size(buf, (V1) - 1);                                                                   \
    memcpy(before, buf, sizeof buf);                                                           \
    CHECK_STATUS(call, EPM_STATUS_INVALID_ARGUMENT);                                           \
    CHECK_MESSAGE_HAS(v1_text);                                                                \
    CHECK(memcmp(before, buf, sizeof buf) == 0);                                               \
    /* a client newer than the library: today's fields, nothing past them */                  \
    memset(buf, 0xA5, sizeof buf);                                                             \
    set_size(buf, sizeof buf);                                                                 \
    CHECK_OK(call);                                                                            \
    CHECK(get_size(buf) == sizeof(T));                                                         \
    CHECK(bytes_are(buf + sizeof(T), GUARD, 0xA5));                                            \
  } while (0)

static void test_v1_client_against_todays_library(void) {
  EpmDevice *dev = NULL;
  EpmStream *s = NULL;
  EpmResidency *res = NULL;
  EpmStagingPool *pool = NULL;
  EpmCopyEngine *engine = NULL;
  EpmArena *arena = NULL;
  EpmKvPool *kv = NULL;
  EpmKvSeq *seq = NULL;
  EpmKvPrefix *prefix = NULL;
  EpmKvBatch *batch = NULL;
  EpmKvSeq *slot = NULL;
  EpmWeightId w = 0;
  EpmDevicePtr dptr = 0;
  unsigned char *weight = malloc(1 << 20);
  REQUIRE(weight);
  th_fill_random(weight, 1 << 20, 7);

  REQUIRE_OK(epm_device_open(0, &dev));
  REQUIRE_OK(epm_stream_create(dev, &s));
  OUT_CASES(EpmDeviceInfo, EPM_DEVICE_INFO_SIZE_V1, epm_device_get_info(dev, p));

  /* Residency: config default and create with v1 structs, stats. */
  OUT_CASES(EpmResidencyConfig, EPM_RESIDENCY_CONFIG_SIZE_V1, epm_residency_config_default(p));
  {
    EpmResidencyConfig_v1 cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.size = sizeof cfg;
    REQUIRE_OK(epm_residency_config_default((EpmResidencyConfig *)(void *)&cfg));
    cfg.budget_bytes = 8u << 20;
    cfg.size = EPM_RESIDENCY_CONFIG_SIZE_V1 - 1;
    CHECK_STATUS(epm_residency_create(dev, (const EpmResidencyConfig *)(const void *)&cfg, &res),
                 EPM_STATUS_INVALID_ARGUMENT);
    CHECK(res == NULL);
    cfg.size = sizeof cfg;
    REQUIRE_OK(epm_residency_create(dev, (const EpmResidencyConfig *)(const void *)&cfg, &res));
  }
  REQUIRE_OK(epm_residency_register_weight(res, weight, 1 << 20, &w));
  REQUIRE_OK(epm_residency_acquire(res, w, s, &dptr));
  REQUIRE_OK(epm_residency_release(res, w, s));
  REQUIRE_OK(epm_residency_synchronize(res));
  OUT_CASES(EpmResidencyStats, EPM_RESIDENCY_STATS_SIZE_V1, epm_residency_get_stats(res, p));

  /* Staging: engine config default and create with v1 structs, stats. */
  REQUIRE_OK(epm_staging_pool_create(dev, 0, 0, &pool));
  OUT_CASES(EpmStagingStats, EPM_STAGING_STATS_SIZE_V1, epm_staging_pool_get_stats(pool, p));
  OUT_CASES(EpmCopyEngineConfig, EPM_COPY_ENGINE_CONFIG_SIZE_V1, epm_copy_engine_config_default(p));
  {
    EpmCopyEngineConfig_v1 cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.size = sizeof cfg;
    REQUIRE_OK(epm_copy_engine_config_default((EpmCopyEngineConfig *)(void *)&cfg));
    cfg.fill_threads = 1;
    cfg.size = EPM_COPY_ENGINE_CONFIG_SIZE_V1 - 1;
    CHECK_STATUS(epm_copy_engine_create(pool, (const EpmCopyEngineConfig *)(const void *)&cfg, &engine),
                 EPM_STATUS_INVALID_ARGUMENT);
    CHECK(engine == NULL);
    cfg.size = sizeof cfg;
    REQUIRE_OK(epm_copy_engine_create(pool, (const EpmCopyEngineConfig *)(const void *)&cfg, &engine));
  }
  OUT_CASES(EpmStagingStats, EPM_STAGING_STATS_SIZE_V1, epm_copy_engine_get_stats(engine, p));

  /* Arena. */
  OUT_CASES(EpmArenaConfig, EPM_ARENA_CONFIG_SIZE_V1, epm_arena_config_default(p));
  {
    EpmArenaConfig_v1 cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.size = sizeof cfg;
    REQUIRE_OK(epm_arena_config_default((EpmArenaConfig *)(void *)&cfg));
    cfg.capacity_bytes = 64u << 20;
    cfg.size = EPM_ARENA_CONFIG_SIZE_V1 - 1;
    CHECK_STATUS(epm_arena_create_device(dev, (const EpmArenaConfig *)(const void *)&cfg, &arena),
                 EPM_STATUS_INVALID_ARGUMENT);
    CHECK(arena == NULL);
    cfg.size = sizeof cfg;
    REQUIRE_OK(epm_arena_create_device(dev, (const EpmArenaConfig *)(const void *)&cfg, &arena));
  }
  OUT_CASES(EpmArenaStats, EPM_ARENA_STATS_SIZE_V1, epm_arena_get_stats(arena, p));

  /* KV: the layout follows the size protocol both ways. */
  OUT_CASES(EpmKvLayout, EPM_KV_LAYOUT_SIZE_V1, epm_kv_layout_token_major(2, 2, 64, 2, p));
  REQUIRE_OK(epm_kv_pool_create(dev, 64u << 20, &kv));
  OUT_CASES(EpmKvStats, EPM_KV_STATS_SIZE_V1, epm_kv_pool_get_stats(kv, p));
  {
    EpmKvLayout_v1 l;
    memset(&l, 0, sizeof l);
    l.size = sizeof l;
    REQUIRE_OK(epm_kv_layout_token_major(2, 2, 64, 2, (EpmKvLayout *)(void *)&l));
    CHECK(l.size == EPM_KV_LAYOUT_SIZE_V1 && l.token_stride == 2u * 2 * 2 * 64 * 2);
    l.size = EPM_KV_LAYOUT_SIZE_V1 - 1;
    CHECK_STATUS(epm_kv_seq_create(kv, (const EpmKvLayout *)(const void *)&l, 4096, EPM_KV_ADMIT_ON_DEMAND, &seq),
                 EPM_STATUS_INVALID_ARGUMENT);
    CHECK(seq == NULL);
    l.size = sizeof l;
    REQUIRE_OK(epm_kv_seq_create(kv, (const EpmKvLayout *)(const void *)&l, 4096, EPM_KV_ADMIT_ON_DEMAND, &seq));
    OUT_CASES(EpmKvRequestCost, EPM_KV_REQUEST_COST_SIZE_V1,
              epm_kv_request_cost(kv, (const EpmKvLayout *)(const void *)&l, 16, 64, p));
  }
  REQUIRE_OK(epm_kv_seq_prepare_append(seq, 32, s));
  OUT_CASES(EpmKvSeqInfo, EPM_KV_SEQ_INFO_SIZE_V1, epm_kv_seq_get_info(seq, p));
  {
    /* The flat layout fields of a v1 EpmKvSeqInfo are the layout's. */
    EpmKvSeqInfo_v1 i;
    memset(&i, 0, sizeof i);
    i.size = sizeof i;
    REQUIRE_OK(epm_kv_seq_get_info(seq, (EpmKvSeqInfo *)(void *)&i));
    CHECK(i.layers == 2 && i.kv_heads == 2 && i.head_dim == 64 && i.elem_bytes == 2);
    CHECK(i.token_stride == 1024 && i.max_tokens == 4096 && i.len_tokens == 32);
  }
  REQUIRE_OK(epm_kv_prefix_pin(seq, 16, s, &prefix));
  OUT_CASES(EpmKvPrefixInfo, EPM_KV_PREFIX_INFO_SIZE_V1, epm_kv_prefix_get_info(prefix, p));
  OUT_CASES(EpmKvAdmission, EPM_KV_ADMISSION_SIZE_V1, epm_kv_admissible(1u << 30, 1u << 20, 1u << 20, p));

  /* KV batch: created from a v1 layout; its descriptor and a slot's info. */
  {
    EpmKvLayout_v1 l;
    memset(&l, 0, sizeof l);
    l.size = sizeof l;
    REQUIRE_OK(epm_kv_layout_token_major(2, 2, 64, 2, (EpmKvLayout *)(void *)&l));
    l.size = EPM_KV_LAYOUT_SIZE_V1 - 1;
    CHECK_STATUS(epm_kv_batch_create(kv, (const EpmKvLayout *)(const void *)&l, 4096, 4, &batch),
                 EPM_STATUS_INVALID_ARGUMENT);
    CHECK(batch == NULL);
    l.size = sizeof l;
    REQUIRE_OK(epm_kv_batch_create(kv, (const EpmKvLayout *)(const void *)&l, 4096, 4, &batch));
  }
  REQUIRE_OK(epm_kv_batch_take_slot(batch, 2, EPM_KV_ADMIT_ON_DEMAND, &slot));
  REQUIRE_OK(epm_kv_seq_prepare_append(slot, 40, s));
  OUT_CASES(EpmKvBatchDesc, EPM_KV_BATCH_DESC_SIZE_V1, epm_kv_batch_get_desc(batch, p));
  OUT_CASES(EpmKvBatchSlotInfo, EPM_KV_BATCH_SLOT_INFO_SIZE_V1, epm_kv_batch_slot_get_info(slot, p));
  {
    /* What a v1 client reads is today's values, at the published places. */
    EpmKvBatchDesc_v1 d;
    EpmKvBatchSlotInfo_v1 i;
    memset(&d, 0, sizeof d);
    memset(&i, 0, sizeof i);
    d.size = sizeof d;
    i.size = sizeof i;
    REQUIRE_OK(epm_kv_batch_get_desc(batch, (EpmKvBatchDesc *)(void *)&d));
    REQUIRE_OK(epm_kv_batch_slot_get_info(slot, (EpmKvBatchSlotInfo *)(void *)&i));
    CHECK(d.max_slots == 4 && d.layers == 2 && d.kv_heads == 2 && d.head_dim == 64 && d.elem_bytes == 2);
    CHECK(d.max_tokens == 4096 && d.token_stride == 1024 && d.live_slots == 1);
    CHECK(d.slot_stride % d.granule_bytes == 0 && d.reserved_bytes == 4 * d.slot_stride);
    CHECK(i.slot == 2 && i.max_slots == 4 && i.len_tokens == 40 && i.max_tokens == 4096);
    CHECK(i.base == d.base + 2 * d.slot_stride);
  }

cleanup:
  epm_kv_seq_destroy(slot);
  epm_kv_batch_destroy(batch);
  epm_kv_prefix_unpin(prefix);
  epm_kv_seq_destroy(seq);
  epm_kv_pool_destroy(kv);
  epm_arena_destroy(arena);
  epm_copy_engine_destroy(engine);
  epm_staging_pool_destroy(pool);
  epm_residency_destroy(res);
  epm_stream_destroy(s);
  epm_device_destroy(dev);
  free(weight);
}

int main(void) {
  RUN(test_published_layout);
  RUN(test_v1_client_against_todays_library);
  TEST_SUMMARY();
}
