/*
 * The misuse suite, part 2: arenas, the staging pool, copy engine, fences and
 * host registrations, and the residency manager. Same rules as
 * test_misuse.c: exact status, non-empty message, out-params untouched.
 */
#include "misuse.h"

static void test_arena(MuFx *f) {
  EpmArenaConfig cfg, small;
  EpmArenaStats st;
  EpmArena *a = NULL, *pa = NULL, *dead = NULL, *untouched = NULL;
  uint64_t addr = 0, out = 99;

  MU_EXPECT(epm_arena_config_default(NULL), EPM_STATUS_NULL_POINTER, "NULL out");
  small.size = 4;
  MU_EXPECT(epm_arena_config_default(&small), EPM_STATUS_INVALID_ARGUMENT, "size 4");
  cfg.size = sizeof cfg;
  REQUIRE_OK(epm_arena_config_default(&cfg));
  cfg.capacity_bytes = 64ull << 20;

  BAD_HANDLES(EpmDevice, h, f->s, f->dead_dev, epm_arena_create_device(h, &cfg, &untouched));
  BAD_HANDLES(EpmDevice, h, f->ev, f->dead_dev, epm_arena_create_pinned(h, &cfg, &untouched));
  MU_EXPECT(epm_arena_create_device(f->dev, NULL, &untouched), EPM_STATUS_NULL_POINTER, "NULL cfg");
  MU_EXPECT(epm_arena_create_pinned(f->dev, &cfg, NULL), EPM_STATUS_NULL_POINTER, "NULL out");
  small = cfg;
  small.size = 8;
  MU_EXPECT(epm_arena_create_device(f->dev, &small, &untouched), EPM_STATUS_INVALID_ARGUMENT, "cfg->size 8");
  small = cfg;
  small.capacity_bytes = 0;
  MU_EXPECT(epm_arena_create_device(f->dev, &small, &untouched), EPM_STATUS_INVALID_ARGUMENT, "capacity 0");
  MU_EXPECT(epm_arena_create_pinned(f->dev, &small, &untouched), EPM_STATUS_INVALID_ARGUMENT, "capacity 0");
  small.capacity_bytes = UINT64_MAX;
  MU_EXPECT(epm_arena_create_device(f->dev, &small, &untouched), EPM_STATUS_INVALID_ARGUMENT, "capacity UINT64_MAX");
  small = cfg;
  small.chunk_bytes = UINT64_MAX;
  MU_EXPECT(epm_arena_create_device(f->dev, &small, &untouched), EPM_STATUS_INVALID_ARGUMENT, "chunk UINT64_MAX");
  CHECK(untouched == NULL);

  REQUIRE_OK(epm_arena_create_device(f->dev, &cfg, &a));
  REQUIRE_OK(epm_arena_create_pinned(f->dev, &cfg, &pa));
  REQUIRE_OK(epm_arena_create_device(f->dev, &cfg, &dead));
  REQUIRE_OK(epm_arena_destroy(dead));

  BAD_HANDLES(EpmArena, h, f->dev, dead, epm_arena_alloc(h, 256, 0, &out));
  MU_EXPECT(epm_arena_alloc(a, 256, 0, NULL), EPM_STATUS_NULL_POINTER, "NULL out_addr");
  MU_EXPECT(epm_arena_alloc(a, 0, 0, &out), EPM_STATUS_INVALID_ARGUMENT, "0 bytes");
  MU_EXPECT(epm_arena_alloc(a, 256, 3, &out), EPM_STATUS_INVALID_ARGUMENT, "alignment 3");
  MU_EXPECT(epm_arena_alloc(a, 256, (size_t)1 << 40, &out), EPM_STATUS_INVALID_ARGUMENT, "alignment 1 TiB");
  MU_EXPECT(epm_arena_alloc(a, SIZE_MAX, 0, &out), EPM_STATUS_OUT_OF_BUDGET, "SIZE_MAX bytes");
  MU_EXPECT(epm_arena_alloc(a, (64u << 20) + 1, 0, &out), EPM_STATUS_OUT_OF_BUDGET, "capacity + 1 bytes");
  MU_EXPECT(epm_arena_alloc(pa, SIZE_MAX, 0, &out), EPM_STATUS_OUT_OF_BUDGET, "SIZE_MAX pinned bytes");
  CHECK(out == 99);

  REQUIRE_OK(epm_arena_alloc(a, 4096, 0, &addr));
  BAD_HANDLES(EpmArena, h, f->dev, dead, epm_arena_free(h, addr));
  MU_EXPECT(epm_arena_free(pa, addr), EPM_STATUS_INVALID_ARGUMENT, "another arena's address");
  MU_EXPECT(epm_arena_free(a, addr + 256), EPM_STATUS_INVALID_ARGUMENT, "an interior address");
  MU_EXPECT(epm_arena_free(a, UINT64_MAX), EPM_STATUS_INVALID_ARGUMENT, "address UINT64_MAX");
  REQUIRE_OK(epm_arena_free(a, addr));
  MU_EXPECT(epm_arena_free(a, addr), EPM_STATUS_INVALID_ARGUMENT, "a double free");
  CHECK_OK(epm_arena_free(a, 0));

  BAD_HANDLES(EpmArena, h, f->s, dead, epm_arena_trim(h, &out));
  CHECK_OK(epm_arena_trim(a, NULL));
  st.size = sizeof st;
  BAD_HANDLES(EpmArena, h, f->dev, dead, epm_arena_get_stats(h, &st));
  MU_EXPECT(epm_arena_get_stats(a, NULL), EPM_STATUS_NULL_POINTER, "NULL out");
  st.size = 7;
  MU_EXPECT(epm_arena_get_stats(a, &st), EPM_STATUS_INVALID_ARGUMENT, "size 7");
  st.size = sizeof st;
  REQUIRE_OK(epm_arena_get_stats(a, &st));
  CHECK(st.live_allocations == 0 && st.in_use_bytes == 0);
  BAD_DESTROY(EpmArena, h, f->dev, dead, epm_arena_destroy(h));

cleanup:
  epm_arena_destroy(a);
  epm_arena_destroy(pa);
}

static void test_staging(MuFx *f) {
  EpmStagingPool *pool = NULL, *tiny = NULL, *dead_pool = NULL, *upool = NULL;
  EpmCopyEngine *eng = NULL, *dead_eng = NULL, *ueng = NULL;
  EpmFence *fence = NULL, *dead_fence = NULL, *ufence = NULL;
  EpmHostRegistration *reg = NULL, *dead_reg = NULL, *ureg = NULL;
  EpmCopyEngineConfig cfg, bad;
  EpmStagingStats st;
  size_t freed = 5;
  unsigned char *page = NULL;
  const void *top = (const void *)(UINTPTR_MAX - 8);

  BAD_HANDLES(EpmDevice, h, f->s, f->dead_dev, epm_staging_pool_create(h, 0, 0, &upool));
  MU_EXPECT(epm_staging_pool_create(f->dev, 0, 0, NULL), EPM_STATUS_NULL_POINTER, "NULL out");
  CHECK(upool == NULL);
  REQUIRE_OK(epm_staging_pool_create(f->dev, 0, 0, &pool));
  REQUIRE_OK(epm_staging_pool_create(f->dev, 1, 0, &tiny));
  REQUIRE_OK(epm_staging_pool_create(f->dev, 0, 0, &dead_pool));
  REQUIRE_OK(epm_staging_pool_destroy(dead_pool));
  BAD_HANDLES(EpmStagingPool, h, f->dev, dead_pool, epm_staging_pool_trim(h, &freed));
  CHECK(freed == 5);
  st.size = sizeof st;
  BAD_HANDLES(EpmStagingPool, h, f->s, dead_pool, epm_staging_pool_get_stats(h, &st));
  MU_EXPECT(epm_staging_pool_get_stats(pool, NULL), EPM_STATUS_NULL_POINTER, "NULL out");
  st.size = 3;
  MU_EXPECT(epm_staging_pool_get_stats(pool, &st), EPM_STATUS_INVALID_ARGUMENT, "size 3");

  MU_EXPECT(epm_copy_engine_config_default(NULL), EPM_STATUS_NULL_POINTER, "NULL out");
  bad.size = 2;
  MU_EXPECT(epm_copy_engine_config_default(&bad), EPM_STATUS_INVALID_ARGUMENT, "size 2");
  cfg.size = sizeof cfg;
  REQUIRE_OK(epm_copy_engine_config_default(&cfg));
  cfg.fill_threads = 2;
  cfg.chunk_bytes = 1u << 20;
  BAD_HANDLES(EpmStagingPool, h, f->dev, dead_pool, epm_copy_engine_create(h, &cfg, &ueng));
  MU_EXPECT(epm_copy_engine_create(pool, &cfg, NULL), EPM_STATUS_NULL_POINTER, "NULL out");
  bad = cfg; bad.size = 4;
  MU_EXPECT(epm_copy_engine_create(pool, &bad, &ueng), EPM_STATUS_INVALID_ARGUMENT, "config->size 4");
  bad = cfg; bad.flags = 0x80;
  MU_EXPECT(epm_copy_engine_create(pool, &bad, &ueng), EPM_STATUS_INVALID_ARGUMENT, "unknown flags");
  bad = cfg; bad.slots = 1;
  MU_EXPECT(epm_copy_engine_create(pool, &bad, &ueng), EPM_STATUS_INVALID_CONFIG, "1 slot");
  bad = cfg; bad.slots = 5;
  MU_EXPECT(epm_copy_engine_create(pool, &bad, &ueng), EPM_STATUS_INVALID_CONFIG, "5 slots");
  bad = cfg; bad.fill_threads = 0;
  MU_EXPECT(epm_copy_engine_create(pool, &bad, &ueng), EPM_STATUS_INVALID_CONFIG, "0 fill threads");
  bad = cfg; bad.fill_threads = 65;
  MU_EXPECT(epm_copy_engine_create(pool, &bad, &ueng), EPM_STATUS_INVALID_CONFIG, "65 fill threads");
  bad = cfg; bad.chunk_bytes = 4096;
  MU_EXPECT(epm_copy_engine_create(pool, &bad, &ueng), EPM_STATUS_INVALID_CONFIG, "4 KiB chunks");
  bad = cfg; bad.chunk_bytes = UINT64_MAX;
  MU_EXPECT(epm_copy_engine_create(pool, &bad, &ueng), EPM_STATUS_INVALID_CONFIG, "UINT64_MAX chunks");
  bad = cfg; bad.target_chunks = 0;
  MU_EXPECT(epm_copy_engine_create(pool, &bad, &ueng), EPM_STATUS_INVALID_CONFIG, "0 target chunks");
  bad = cfg; bad.target_chunks = 257;
  MU_EXPECT(epm_copy_engine_create(pool, &bad, &ueng), EPM_STATUS_INVALID_CONFIG, "257 target chunks");
  MU_EXPECT(epm_copy_engine_create(tiny, &cfg, &ueng), EPM_STATUS_INVALID_CONFIG, "a pool retaining 1 buffer");
  CHECK(ueng == NULL);

  REQUIRE_OK(epm_copy_engine_create(pool, &cfg, &eng));
  REQUIRE_OK(epm_copy_engine_create(pool, &cfg, &dead_eng));
  REQUIRE_OK(epm_copy_engine_destroy(dead_eng));
  BAD_HANDLES(EpmCopyEngine, h, pool, dead_eng, epm_copy_engine_htod(h, f->d, f->host, 64, NULL, &ufence));
  /* A NULL stream is allowed (no ordering); every other bad one is refused. */
  BAD_HANDLES_X(EpmStream, h, f->ev, f->dead_s, 1, epm_copy_engine_htod(eng, f->d, f->host, 64, h, NULL));
  MU_EXPECT(epm_copy_engine_htod(eng, f->d, NULL, 64, NULL, &ufence), EPM_STATUS_NULL_POINTER, "NULL src");
  MU_EXPECT(epm_copy_engine_htod(eng, f->d, f->host, 0, NULL, &ufence), EPM_STATUS_INVALID_ARGUMENT, "0 bytes");
  MU_EXPECT(epm_copy_engine_htod(eng, f->d, top, 64, NULL, &ufence), EPM_STATUS_INVALID_ARGUMENT, "src+len overflows");
  MU_EXPECT(epm_copy_engine_htod(eng, UINT64_MAX - 8, f->host, 64, NULL, &ufence), EPM_STATUS_INVALID_ARGUMENT,
            "dst+len overflows");
  MU_EXPECT(epm_copy_engine_htod(eng, f->d, f->host, 64, f->s2, &ufence), EPM_STATUS_INVALID_ARGUMENT,
            "another device's stream");
  if (mu_is_host(f))
    MU_EXPECT(epm_copy_engine_htod(eng, 0x1000, f->host, 64, NULL, &ufence), EPM_STATUS_INVALID_ARGUMENT,
              "an unallocated dst");
  CHECK(ufence == NULL);
  /* The engine stays usable after every refusal. */
  REQUIRE_OK(epm_copy_engine_htod(eng, f->d, f->host, sizeof f->host, NULL, &fence));
  REQUIRE_OK(epm_copy_engine_htod(eng, f->d, f->host, 64, NULL, &dead_fence));
  REQUIRE_OK(epm_fence_destroy(dead_fence));
  BAD_HANDLES(EpmFence, h, eng, dead_fence, epm_fence_query(h));
  BAD_HANDLES(EpmFence, h, f->ev, dead_fence, epm_fence_wait(h));
  BAD_HANDLES(EpmFence, h, f->ev, dead_fence, epm_fence_stream_wait(h, f->s));
  BAD_HANDLES(EpmStream, h, fence, f->dead_s, epm_fence_stream_wait(fence, h));
  MU_EXPECT(epm_fence_stream_wait(fence, f->s2), EPM_STATUS_INVALID_ARGUMENT, "another device's stream");
  CHECK_OK(epm_fence_wait(fence));
  BAD_DESTROY(EpmFence, h, eng, dead_fence, epm_fence_destroy(h));

  page = aligned_alloc(4096, 8192);
  REQUIRE(page != NULL);
  memset(page, 3, 8192);
  BAD_HANDLES(EpmCopyEngine, h, pool, dead_eng, epm_copy_engine_register(h, page, 8192, &ureg));
  MU_EXPECT(epm_copy_engine_register(eng, NULL, 8192, &ureg), EPM_STATUS_NULL_POINTER, "NULL ptr");
  MU_EXPECT(epm_copy_engine_register(eng, page, 8192, NULL), EPM_STATUS_NULL_POINTER, "NULL out");
  MU_EXPECT(epm_copy_engine_register(eng, page, 0, &ureg), EPM_STATUS_INVALID_ARGUMENT, "0 bytes");
  MU_EXPECT(epm_copy_engine_register(eng, top, 64, &ureg), EPM_STATUS_INVALID_ARGUMENT, "ptr+len overflows");
  CHECK(ureg == NULL);
  REQUIRE_OK(epm_copy_engine_register(eng, page, 4096, &reg));
  MU_EXPECT(epm_copy_engine_register(eng, page, 8192, &ureg), EPM_STATUS_INVALID_STATE, "an overlapping range");
  REQUIRE_OK(epm_copy_engine_register(eng, page + 4096, 4096, &dead_reg));
  REQUIRE_OK(epm_host_registration_destroy(dead_reg));
  BAD_DESTROY(EpmHostRegistration, h, eng, dead_reg, epm_host_registration_destroy(h));

  BAD_HANDLES(EpmCopyEngine, h, pool, dead_eng, epm_copy_engine_synchronize(h));
  st.size = sizeof st;
  BAD_HANDLES(EpmCopyEngine, h, f->dev, dead_eng, epm_copy_engine_get_stats(h, &st));
  MU_EXPECT(epm_copy_engine_get_stats(eng, NULL), EPM_STATUS_NULL_POINTER, "NULL out");
  st.size = 1;
  MU_EXPECT(epm_copy_engine_get_stats(eng, &st), EPM_STATUS_INVALID_ARGUMENT, "size 1");
  BAD_DESTROY(EpmCopyEngine, h, pool, dead_eng, epm_copy_engine_destroy(h));
  BAD_DESTROY(EpmStagingPool, h, eng, dead_pool, epm_staging_pool_destroy(h));
  CHECK_OK(epm_copy_engine_synchronize(eng));

cleanup:
  epm_host_registration_destroy(reg);
  epm_fence_destroy(fence);
  epm_copy_engine_destroy(eng);
  epm_staging_pool_destroy(pool);
  epm_staging_pool_destroy(tiny);
  free(page);
}

static void test_residency(MuFx *f) {
  EpmResidencyConfig cfg, bad;
  EpmResidencyStats st;
  EpmResidency *res = NULL, *dead = NULL, *ures = NULL;
  EpmWeightId w = 0, w2 = 0, uw = 777, order[3];
  EpmHostRangeId range = 0, ur = 888;
  EpmDevicePtr p = 0, up = 999;
  size_t issued = 55;
  const void *top = (const void *)(UINTPTR_MAX - 8);

  MU_EXPECT(epm_residency_config_default(NULL), EPM_STATUS_NULL_POINTER, "NULL out");
  bad.size = 8;
  MU_EXPECT(epm_residency_config_default(&bad), EPM_STATUS_INVALID_ARGUMENT, "size 8");
  cfg.size = sizeof cfg;
  REQUIRE_OK(epm_residency_config_default(&cfg));
  cfg.budget_bytes = 3 * 1024;
  cfg.fill_threads = 2;
  cfg.register_sources = EPM_REGISTER_NEVER;

  BAD_HANDLES(EpmDevice, h, f->s, f->dead_dev, epm_residency_create(h, &cfg, &ures));
  MU_EXPECT(epm_residency_create(f->dev, NULL, &ures), EPM_STATUS_NULL_POINTER, "NULL cfg");
  MU_EXPECT(epm_residency_create(f->dev, &cfg, NULL), EPM_STATUS_NULL_POINTER, "NULL out");
  bad = cfg; bad.size = 4;
  MU_EXPECT(epm_residency_create(f->dev, &bad, &ures), EPM_STATUS_INVALID_ARGUMENT, "cfg->size 4");
  bad = cfg; bad.budget_bytes = 0;
  MU_EXPECT(epm_residency_create(f->dev, &bad, &ures), EPM_STATUS_INVALID_ARGUMENT, "budget 0");
  bad = cfg; bad.policy = 9;
  MU_EXPECT(epm_residency_create(f->dev, &bad, &ures), EPM_STATUS_INVALID_ARGUMENT, "policy 9");
  bad = cfg; bad.register_sources = 3;
  MU_EXPECT(epm_residency_create(f->dev, &bad, &ures), EPM_STATUS_INVALID_ARGUMENT, "register_sources 3");
  bad = cfg; bad.staging_slots = 9;
  MU_EXPECT(epm_residency_create(f->dev, &bad, &ures), EPM_STATUS_INVALID_CONFIG, "9 staging slots");
  CHECK(ures == NULL);
  REQUIRE_OK(epm_residency_create(f->dev, &cfg, &res));
  REQUIRE_OK(epm_residency_create(f->dev, &cfg, &dead));
  REQUIRE_OK(epm_residency_destroy(dead));

  BAD_HANDLES(EpmResidency, h, f->dev, dead, epm_residency_register_weight(h, f->host, 1024, &uw));
  MU_EXPECT(epm_residency_register_weight(res, NULL, 1024, &uw), EPM_STATUS_NULL_POINTER, "NULL host");
  MU_EXPECT(epm_residency_register_weight(res, f->host, 1024, NULL), EPM_STATUS_NULL_POINTER, "NULL out_weight");
  MU_EXPECT(epm_residency_register_weight(res, f->host, 0, &uw), EPM_STATUS_INVALID_ARGUMENT, "0 bytes");
  MU_EXPECT(epm_residency_register_weight(res, top, 64, &uw), EPM_STATUS_INVALID_ARGUMENT, "host+bytes overflows");
  MU_EXPECT(epm_residency_register_weight(res, f->host, 4096, &uw), EPM_STATUS_OUT_OF_BUDGET, "more than the budget");
  CHECK(uw == 777);
  {
    /* Compressed weights: 4 KiB of fp16 decoded is over this 3 KiB budget. */
    static uint16_t vals[2048];
    static unsigned char enc[8192];
    EpmCompressedWeight cw, bw;
    EpmCodecOptions co;
    EpmCodecInfo ci;
    for (int i = 0; i < 2048; i++) vals[i] = (uint16_t)(0x3C00 + (i % 7));
    co.size = sizeof co;
    REQUIRE_OK(epm_codec_options_default(&co));
    co.min_bytes = 0;
    ci.size = sizeof ci;
    REQUIRE_OK(epm_codec_encode(vals, sizeof vals, EPM_CODEC_DTYPE_FP16, &co, enc, sizeof enc, &ci));
    REQUIRE(ci.outcome == EPM_CODEC_CODED);
    memset(&cw, 0, sizeof cw);
    cw.size = sizeof cw;
    cw.data = enc;
    cw.bytes = ci.encoded_bytes;
    cw.dtype = EPM_CODEC_DTYPE_ENCODED;
    BAD_HANDLES(EpmResidency, h, f->dev, dead, epm_residency_register_compressed(h, &cw, &uw, NULL));
    MU_EXPECT(epm_residency_register_compressed(res, NULL, &uw, NULL), EPM_STATUS_NULL_POINTER, "NULL weight");
    MU_EXPECT(epm_residency_register_compressed(res, &cw, NULL, NULL), EPM_STATUS_NULL_POINTER, "NULL out_weight");
    bw = cw; bw.data = NULL;
    MU_EXPECT(epm_residency_register_compressed(res, &bw, &uw, NULL), EPM_STATUS_NULL_POINTER, "NULL data");
    bw = cw; bw.bytes = 0;
    MU_EXPECT(epm_residency_register_compressed(res, &bw, &uw, NULL), EPM_STATUS_INVALID_ARGUMENT, "0 bytes");
    bw = cw; bw.size = 4;
    MU_EXPECT(epm_residency_register_compressed(res, &bw, &uw, NULL), EPM_STATUS_INVALID_ARGUMENT, "size 4");
    bw = cw; bw.dtype = 9;
    MU_EXPECT(epm_residency_register_compressed(res, &bw, &uw, NULL), EPM_STATUS_INVALID_ARGUMENT, "dtype 9");
    bw = cw; bw.reserved = 1;
    MU_EXPECT(epm_residency_register_compressed(res, &bw, &uw, NULL), EPM_STATUS_INVALID_ARGUMENT, "reserved 1");
    bw = cw; bw.bytes = cw.bytes - 16;
    MU_EXPECT(epm_residency_register_compressed(res, &bw, &uw, NULL), EPM_STATUS_INVALID_ARGUMENT, "truncated buffer");
    bw = cw; bw.data = f->host;
    MU_EXPECT(epm_residency_register_compressed(res, &bw, &uw, NULL), EPM_STATUS_INVALID_ARGUMENT, "not a compressed buffer");
    bw = cw; bw.dtype = EPM_CODEC_DTYPE_FP16; bw.data = vals; bw.bytes = 3;
    MU_EXPECT(epm_residency_register_compressed(res, &bw, &uw, NULL), EPM_STATUS_INVALID_ARGUMENT, "odd raw length");
    MU_EXPECT(epm_residency_register_compressed(res, &cw, &uw, NULL), EPM_STATUS_OUT_OF_BUDGET, "over the budget");
    CHECK(uw == 777);
  }
  REQUIRE_OK(epm_residency_register_weight(res, f->host, 1024, &w));
  REQUIRE_OK(epm_residency_register_weight(res, f->host + 1024, 1024, &w2));

  BAD_HANDLES(EpmResidency, h, f->dev, dead, epm_residency_register_host_range(h, f->host, 4096, &ur));
  MU_EXPECT(epm_residency_register_host_range(res, NULL, 4096, &ur), EPM_STATUS_NULL_POINTER, "NULL host");
  MU_EXPECT(epm_residency_register_host_range(res, f->host, 4096, NULL), EPM_STATUS_NULL_POINTER, "NULL out");
  MU_EXPECT(epm_residency_register_host_range(res, f->host, 0, &ur), EPM_STATUS_INVALID_ARGUMENT, "0 bytes");
  MU_EXPECT(epm_residency_register_host_range(res, top, 64, &ur), EPM_STATUS_INVALID_ARGUMENT, "overflow");
  CHECK(ur == 888);
  BAD_HANDLES(EpmResidency, h, f->s, dead, epm_residency_unregister_host_range(h, range));
  MU_EXPECT(epm_residency_unregister_host_range(res, 12345), EPM_STATUS_INVALID_ARGUMENT, "an unknown range");

  order[0] = w; order[1] = w2; order[2] = w;
  BAD_HANDLES(EpmResidency, h, f->dev, dead, epm_residency_declare_cycle(h, order, 2));
  MU_EXPECT(epm_residency_declare_cycle(res, NULL, 2), EPM_STATUS_NULL_POINTER, "NULL order, n 2");
  MU_EXPECT(epm_residency_declare_cycle(res, order, 3), EPM_STATUS_INVALID_ARGUMENT, "a repeated weight");
  MU_EXPECT(epm_residency_declare_cycle(res, order, SIZE_MAX), EPM_STATUS_INVALID_ARGUMENT, "n SIZE_MAX");
  order[2] = 4242;
  MU_EXPECT(epm_residency_declare_cycle(res, order + 1, 2), EPM_STATUS_INVALID_ARGUMENT, "an unknown weight");
  CHECK_OK(epm_residency_declare_cycle(res, NULL, 0));

  BAD_HANDLES(EpmResidency, h, f->dev, dead, epm_residency_prefetch(h, order, 1, &issued));
  MU_EXPECT(epm_residency_prefetch(res, NULL, 1, &issued), EPM_STATUS_NULL_POINTER, "NULL weights");
  MU_EXPECT(epm_residency_prefetch(res, order + 2, 1, &issued), EPM_STATUS_INVALID_ARGUMENT, "an unknown weight");
  MU_EXPECT(epm_residency_prefetch(res, order, SIZE_MAX, &issued), EPM_STATUS_INVALID_ARGUMENT, "n SIZE_MAX");
  CHECK(issued == 55);

  BAD_HANDLES(EpmResidency, h, f->dev, dead, epm_residency_acquire(h, w, f->s, &up));
  BAD_HANDLES(EpmStream, h, f->ev, f->dead_s, epm_residency_acquire(res, w, h, &up));
  MU_EXPECT(epm_residency_acquire(res, w, f->s, NULL), EPM_STATUS_NULL_POINTER, "NULL out_ptr");
  MU_EXPECT(epm_residency_acquire(res, 4242, f->s, &up), EPM_STATUS_INVALID_ARGUMENT, "an unknown weight");
  MU_EXPECT(epm_residency_acquire(res, w, f->s2, &up), EPM_STATUS_INVALID_ARGUMENT, "another device's stream");
  CHECK(up == 999);
  MU_EXPECT(epm_residency_release(res, w, f->s), EPM_STATUS_INVALID_STATE, "release without acquire");
  REQUIRE_OK(epm_residency_acquire(res, w, f->s, &p));
  MU_EXPECT(epm_residency_unregister_weight(res, w), EPM_STATUS_INVALID_STATE, "an acquired weight");
  BAD_HANDLES(EpmResidency, h, f->s, dead, epm_residency_release(h, w, f->s));
  BAD_HANDLES(EpmStream, h, f->dev, f->dead_s, epm_residency_release(res, w, h));
  MU_EXPECT(epm_residency_release(res, 4242, f->s), EPM_STATUS_INVALID_ARGUMENT, "an unknown weight");
  MU_EXPECT(epm_residency_release(res, w, f->s2), EPM_STATUS_INVALID_ARGUMENT, "another device's stream");
  REQUIRE_OK(epm_residency_release(res, w, f->s));
  MU_EXPECT(epm_residency_release(res, w, f->s), EPM_STATUS_INVALID_STATE, "a second release");

  /* The host path: acquire_host / release_host. */
  BAD_HANDLES(EpmResidency, h, f->dev, dead, epm_residency_acquire_host(h, w, &up));
  MU_EXPECT(epm_residency_acquire_host(res, w, NULL), EPM_STATUS_NULL_POINTER, "NULL out_ptr");
  MU_EXPECT(epm_residency_acquire_host(res, 4242, &up), EPM_STATUS_INVALID_ARGUMENT, "an unknown weight");
  CHECK(up == 999);
  MU_EXPECT(epm_residency_release_host(res, w), EPM_STATUS_INVALID_STATE, "host release without acquire");
  REQUIRE_OK(epm_residency_acquire_host(res, w, &p));
  BAD_HANDLES(EpmResidency, h, f->dev, dead, epm_residency_release_host(h, w));
  MU_EXPECT(epm_residency_release_host(res, 4242), EPM_STATUS_INVALID_ARGUMENT, "an unknown weight");
  REQUIRE_OK(epm_residency_release_host(res, w));
  MU_EXPECT(epm_residency_release_host(res, w), EPM_STATUS_INVALID_STATE, "a second host release");

  BAD_HANDLES(EpmResidency, h, f->dev, dead, epm_residency_unregister_weight(h, w2));
  MU_EXPECT(epm_residency_unregister_weight(res, 4242), EPM_STATUS_INVALID_ARGUMENT, "an unknown weight");
  REQUIRE_OK(epm_residency_unregister_weight(res, w2));
  MU_EXPECT(epm_residency_unregister_weight(res, w2), EPM_STATUS_INVALID_ARGUMENT, "a double unregister");
  MU_EXPECT(epm_residency_acquire(res, w2, f->s, &up), EPM_STATUS_INVALID_ARGUMENT, "an unregistered weight");

  BAD_HANDLES(EpmResidency, h, f->s, dead, epm_residency_synchronize(h));
  st.size = sizeof st;
  BAD_HANDLES(EpmResidency, h, f->dev, dead, epm_residency_get_stats(h, &st));
  MU_EXPECT(epm_residency_get_stats(res, NULL), EPM_STATUS_NULL_POINTER, "NULL out");
  st.size = 15;
  MU_EXPECT(epm_residency_get_stats(res, &st), EPM_STATUS_INVALID_ARGUMENT, "size 15");
  st.size = sizeof st;
  REQUIRE_OK(epm_residency_synchronize(res));
  REQUIRE_OK(epm_residency_get_stats(res, &st));
  CHECK(st.acquires == 2 && /* acquire + acquire_host */ st.registered_weights == 1);
  BAD_DESTROY(EpmResidency, h, f->dev, dead, epm_residency_destroy(h));

cleanup:
  epm_residency_destroy(res);
}

/* capacity_bytes is the arena's bound: an 8 MiB arena refuses 16 MiB and
 * then 12 MiB (never both from one 32 MiB chunk), and what it
 * hands out and commits stays within 8 MiB (rounded up to the granularity
 * for the device arena: 2 MiB on the H200 and the host device, so exactly 8). */
static void test_arena_capacity_is_the_bound(MuFx *f) {
  EpmArenaConfig cfg;
  EpmArenaStats st;
  EpmArena *arenas[2] = {NULL, NULL}, *untouched = NULL;
  uint64_t bound, x = 0, y = 0, out = 7, g = f->info.granularity;
  int i;

  cfg.size = sizeof cfg;
  REQUIRE_OK(epm_arena_config_default(&cfg));
  cfg.capacity_bytes = 8ull << 20;
  REQUIRE_OK(epm_arena_create_device(f->dev, &cfg, &arenas[0]));
  REQUIRE_OK(epm_arena_create_pinned(f->dev, &cfg, &arenas[1]));
  for (i = 0; i < 2; i++) {
    EpmArena *a = arenas[i];
    bound = i == 0 ? (cfg.capacity_bytes + g - 1) / g * g : cfg.capacity_bytes;
    MU_EXPECT(epm_arena_alloc(a, 16u << 20, 0, &out), EPM_STATUS_OUT_OF_BUDGET, "16 MiB of an 8 MiB arena");
    CHECK_MESSAGE_HAS("capacity");
    MU_EXPECT(epm_arena_alloc(a, 12u << 20, 0, &out), EPM_STATUS_OUT_OF_BUDGET, "12 MiB of an 8 MiB arena");
    CHECK(out == 7);
    REQUIRE_OK(epm_arena_alloc(a, 6u << 20, 0, &x));
    MU_EXPECT(epm_arena_alloc(a, 4u << 20, 0, &out), EPM_STATUS_OUT_OF_BUDGET, "6 + 4 MiB of an 8 MiB arena");
    REQUIRE_OK(epm_arena_alloc(a, 2u << 20, 0, &y)); /* exactly the rest */
    st.size = sizeof st;
    REQUIRE_OK(epm_arena_get_stats(a, &st));
    CHECK(st.in_use_bytes == 8ull << 20);
    CHECK(st.committed_bytes <= bound);
    CHECK(st.reserved_bytes <= bound);
    REQUIRE_OK(epm_arena_free(a, x));
    REQUIRE_OK(epm_arena_free(a, y));
  }
  /* Past the sub-allocator's range: a message naming the argument and the limit in bytes. */
  cfg.capacity_bytes = 1ull << 41;
  MU_EXPECT(epm_arena_create_device(f->dev, &cfg, &untouched), EPM_STATUS_INVALID_ARGUMENT, "2 TiB capacity");
  CHECK_MESSAGE_HAS("capacity_bytes 2199023255552 exceeds the limit of 1099511627520 bytes");
  CHECK(untouched == NULL);

cleanup:
  epm_arena_destroy(arenas[0]);
  epm_arena_destroy(arenas[1]);
}

int main(void) {
  MuFx f;
  if (mu_open(&f)) {
    RUN_FX(test_arena, &f);
    RUN_FX(test_arena_capacity_is_the_bound, &f);
    RUN_FX(test_staging, &f);
    RUN_FX(test_residency, &f);
  }
  mu_close(&f);
  TEST_SUMMARY();
}
