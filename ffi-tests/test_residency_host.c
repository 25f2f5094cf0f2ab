/*
 * Residency contracts through the C API:
 *
 * - host-side use of an acquired weight: epm_residency_acquire_host waits for
 *   the page-in, so a synchronous epm_memcpy_dtoh right after it reads the
 *   weight's bytes. (epm_residency_acquire + epm_memcpy_dtoh does not: the
 *   copy is not ordered after the page-in queued for the stream. Build with
 *   -DEPM_NAIVE_ACQUIRE to run this test that way and watch it fail on the
 *   host device, whose page-ins run on a worker thread.)
 * - declare_cycle refuses only while a COALESCED weight is acquired, names
 *   the coalesced weights, and changes nothing when it refuses;
 * - unregister of a weight whose coalesced sibling is acquired names the
 *   weight and its unit, not the sibling as if it were the weight;
 * - compressed weights (epm_residency_register_compressed): an encoded
 *   buffer and raw values the manager encodes both read back bit-exact after
 *   page-ins under eviction, a weight the codec keeps raw says why, and the
 *   stats count compressed bytes, decodes and the staging.
 *
 * Runs on the device EPM_DEVICE names (host in CI, cuda on a GPU machine).
 *   make test-c
 */
#define _POSIX_C_SOURCE 200809L /* nanosleep under -std=c11 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

#include "testhelper.h"

#define MIB (1u << 20)

static uint64_t coalesced(EpmResidency *res) {
  EpmResidencyStats s;
  memset(&s, 0, sizeof s);
  s.size = sizeof s;
  if (epm_residency_get_stats(res, &s) != EPM_STATUS_OK) return UINT64_MAX;
  return s.coalesced_weights;
}

/* A manager of `budget` with `reg` sources and 2 fill threads; `caller_fills`
 * and `fill_waits_on_host` as given, and the config passed with `size` bytes
 * (sizeof for today's). */
static EpmStatus make_res_modes(EpmDevice *dev, uint64_t budget, uint32_t reg, uint32_t caller_fills,
                                uint32_t host_waits, size_t size, EpmResidency **out) {
  EpmResidencyConfig cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.size = sizeof cfg;
  EpmStatus st = epm_residency_config_default(&cfg);
  if (st) return st;
  cfg.budget_bytes = budget;
  cfg.register_sources = reg;
  cfg.fill_threads = 2;
  cfg.caller_fills = caller_fills;
  cfg.fill_waits_on_host = host_waits;
  cfg.size = size;
  return epm_residency_create(dev, &cfg, out);
}

static EpmStatus make_res_with(EpmDevice *dev, uint64_t budget, uint32_t reg, uint32_t caller_fills, size_t size,
                               EpmResidency **out) {
  return make_res_modes(dev, budget, reg, caller_fills, 1, size, out);
}

static EpmStatus make_res(EpmDevice *dev, uint64_t budget, uint32_t reg, EpmResidency **out) {
  return make_res_with(dev, budget, reg, 0, sizeof(EpmResidencyConfig), out);
}

/* Acquire for the host, read back synchronously, compare every byte. */
static int host_read_matches(EpmDevice *dev, EpmResidency *res, EpmStream *s, EpmWeightId w,
                             const unsigned char *want, unsigned char *back, size_t n) {
  EpmDevicePtr p = 0;
  int ok = 0;
  memset(back, 0, n);
#ifdef EPM_NAIVE_ACQUIRE
  if (epm_residency_acquire(res, w, s, &p) != EPM_STATUS_OK) return 0;
#else
  (void)s;
  if (epm_residency_acquire_host(res, w, &p) != EPM_STATUS_OK) return 0;
#endif
  if (epm_memcpy_dtoh(dev, back, p, n) == EPM_STATUS_OK) ok = memcmp(back, want, n) == 0;
#ifdef EPM_NAIVE_ACQUIRE
  epm_residency_release(res, w, s);
#else
  if (epm_residency_release_host(res, w) != EPM_STATUS_OK) ok = 0;
#endif
  return ok;
}

static void test_acquire_host_then_sync_read_sees_the_weight(void) {
  /* Large enough that the page-in is still running when a naive synchronous
   * read starts; two weights under a budget for one, so each read follows a
   * fresh page-in into a block that held the other weight's bytes. */
  const size_t n = 64u * MIB;
  EpmDevice *dev = NULL;
  EpmStream *s = NULL;
  EpmResidency *res = NULL;
  EpmHostRangeId range = 0;
  int registered = 0;
  EpmWeightId w[2] = {0, 0};
  unsigned char *host = aligned_alloc(4096, 2 * n), *back = malloc(n);
  REQUIRE(host && back);
  th_fill_random(host, n, 11);
  th_fill_random(host + n, n, 12);
  REQUIRE_OK(epm_device_open(0, &dev));
  REQUIRE_OK(epm_stream_create(dev, &s));
  for (int pass = 0; pass < 2; pass++) {
    /* pass 0: staged from pageable memory; pass 1: copied directly from a
     * registered range (the whole weight in one asynchronous copy). */
    REQUIRE_OK(make_res(dev, n + n / 2, EPM_REGISTER_NEVER, &res));
    for (int i = 0; i < 2; i++) REQUIRE_OK(epm_residency_register_weight(res, host + (size_t)i * n, n, &w[i]));
    registered = pass == 1 && epm_residency_register_host_range(res, host, 2 * n, &range) == EPM_STATUS_OK;
    if (pass == 1 && !registered) printf("  (registering the host range was refused: %s; staged again)\n", epm_last_error_message());
    for (int round = 0; round < 3; round++) {
      for (int i = 0; i < 2; i++) {
        th_checks++;
        if (!host_read_matches(dev, res, s, w[i], host + (size_t)i * n, back, n))
          TH_FAIL("pass %d round %d weight %d: the synchronous read after acquire did not see the weight (%s)", pass,
                  round, i, epm_last_error_message());
      }
    }
    REQUIRE_OK(epm_residency_synchronize(res));
    if (registered) CHECK_OK(epm_residency_unregister_host_range(res, range));
    CHECK_OK(epm_residency_destroy(res));
    res = NULL;
  }
  /* Misuse of the host path. */
  REQUIRE_OK(make_res(dev, 2 * n, EPM_REGISTER_NEVER, &res));
  REQUIRE_OK(epm_residency_register_weight(res, host, n, &w[0]));
  {
    EpmDevicePtr p = 7;
    CHECK_STATUS(epm_residency_acquire_host(res, w[0], NULL), EPM_STATUS_NULL_POINTER);
    CHECK_STATUS(epm_residency_acquire_host(res, 9999, &p), EPM_STATUS_INVALID_ARGUMENT);
    CHECK(p == 7);
    CHECK_STATUS(epm_residency_acquire_host(NULL, w[0], &p), EPM_STATUS_INVALID_HANDLE);
    CHECK_STATUS(epm_residency_release_host(res, w[0]), EPM_STATUS_INVALID_STATE);
    CHECK_STATUS(epm_residency_release_host(NULL, w[0]), EPM_STATUS_INVALID_HANDLE);
    REQUIRE_OK(epm_residency_acquire_host(res, w[0], &p));
    /* INVALID_STATE as documented: unregistering an acquired weight. */
    CHECK_STATUS(epm_residency_unregister_weight(res, w[0]), EPM_STATUS_INVALID_STATE);
    CHECK_OK(epm_residency_release_host(res, w[0]));
    CHECK_STATUS(epm_residency_release_host(res, w[0]), EPM_STATUS_INVALID_STATE);
    CHECK_OK(epm_residency_unregister_weight(res, w[0]));
  }
cleanup:
  epm_residency_destroy(res);
  epm_stream_destroy(s);
  epm_device_destroy(dev);
  free(host);
  free(back);
}

static void test_cycle_and_unregister_name_the_coalesced_weights(void) {
  enum { SMALL = 256 * 1024 };
  EpmDevice *dev = NULL;
  EpmStream *s = NULL;
  EpmResidency *res = NULL;
  EpmWeightId pad[5], a = 0, b = 0, c = 0, d = 0;
  EpmDevicePtr p = 0;
  char unit[96], named[192];
  unsigned char *small = aligned_alloc(4096, 3 * SMALL), *big = aligned_alloc(4096, 2 * MIB);
  REQUIRE(small && big);
  th_fill_random(small, 3 * SMALL, 3);
  th_fill_random(big, 2 * MIB, 4);
  REQUIRE_OK(epm_device_open(0, &dev));
  REQUIRE_OK(epm_stream_create(dev, &s));
  REQUIRE_OK(make_res(dev, 64u * MIB, EPM_REGISTER_NEVER, &res));
  /* Spend a few ids first, so the ids in messages are not small numbers
   * that appear by accident ("1 time(s)"). */
  for (int i = 0; i < 5; i++) REQUIRE_OK(epm_residency_register_weight(res, big, 4096, &pad[i]));
  REQUIRE_OK(epm_residency_register_weight(res, small, SMALL, &a));
  REQUIRE_OK(epm_residency_register_weight(res, small + SMALL, SMALL, &b));
  REQUIRE_OK(epm_residency_register_weight(res, small + 2 * SMALL, SMALL, &c));
  REQUIRE_OK(epm_residency_register_weight(res, big, 2 * MIB, &d));
  snprintf(unit, sizeof unit, "{%u, %u, %u}", a, b, c);
  {
    EpmWeightId order[4] = {a, b, c, d};
    REQUIRE_OK(epm_residency_declare_cycle(res, order, 4));
  }
  REQUIRE(coalesced(res) == 3);

  /* A weight that is not coalesced may stay acquired across a declaration. */
  REQUIRE_OK(epm_residency_acquire(res, d, s, &p));
  {
    EpmWeightId order[4] = {d, a, b, c};
    CHECK_OK(epm_residency_declare_cycle(res, order, 4));
  }
  CHECK(coalesced(res) == 3);
  CHECK_OK(epm_residency_release(res, d, s));

  /* A coalesced one may not: refused, naming the unit, nothing undone. */
  REQUIRE_OK(epm_residency_acquire(res, b, s, &p));
  {
    EpmWeightId order[4] = {a, b, c, d};
    CHECK_STATUS(epm_residency_declare_cycle(res, order, 4), EPM_STATUS_INVALID_STATE);
    CHECK_MESSAGE_HAS(unit);
  }
  CHECK(coalesced(res) == 3);

  /* Unregistering c while its sibling b is acquired names c and its unit. */
  CHECK_STATUS(epm_residency_unregister_weight(res, c), EPM_STATUS_INVALID_STATE);
  snprintf(named, sizeof named, "weight %u is coalesced into one page-in with weights %s", c, unit);
  CHECK_MESSAGE_HAS(named);
  CHECK_OK(epm_residency_release(res, b, s));
  CHECK_OK(epm_residency_unregister_weight(res, c));
  {
    EpmWeightId order[3] = {a, b, d};
    CHECK_OK(epm_residency_declare_cycle(res, order, 3));
  }
  CHECK_OK(epm_residency_synchronize(res));
cleanup:
  epm_residency_destroy(res);
  epm_stream_destroy(s);
  epm_device_destroy(dev);
  free(small);
  free(big);
}

/* `count` weights of `n` random bytes in one page-aligned host buffer, a
 * read-back buffer, the device and a stream: what the background-fill tests
 * share. */
typedef struct {
  EpmDevice *dev;
  EpmStream *s;
  unsigned char *host, *back;
  size_t n;
  int count;
} Weights;

static int weights_open(Weights *f, int count, size_t n, unsigned long long seed) {
  memset(f, 0, sizeof *f);
  f->n = n;
  f->count = count;
  f->host = aligned_alloc(4096, (size_t)count * n);
  f->back = malloc(n);
  REQUIRE(f->host && f->back);
  for (int i = 0; i < count; i++) th_fill_random(f->host + (size_t)i * n, n, seed + (unsigned long long)i);
  REQUIRE_OK(epm_device_open(0, &f->dev));
  REQUIRE_OK(epm_stream_create(f->dev, &f->s));
  return 1;
cleanup:
  return 0;
}

static void weights_close(Weights *f) {
  epm_stream_destroy(f->s);
  epm_device_destroy(f->dev);
  free(f->host);
  free(f->back);
}

/* Register every weight with `res` and declare them, in order, as the cycle. */
static EpmStatus weights_register(const Weights *f, EpmResidency *res, EpmWeightId *w) {
  for (int i = 0; i < f->count; i++) {
    EpmStatus st = epm_residency_register_weight(res, f->host + (size_t)i * f->n, f->n, &w[i]);
    if (st) return st;
  }
  return epm_residency_declare_cycle(res, w, (size_t)f->count);
}

/* `rounds` passes over the cycle, each weight read on the host and compared. */
static void weights_read_rounds(const Weights *f, EpmResidency *res, const EpmWeightId *w, int rounds, int mode) {
  for (int round = 0; round < rounds; round++)
    for (int i = 0; i < f->count; i++) {
      th_checks++;
      if (!host_read_matches(f->dev, res, f->s, w[i], f->host + (size_t)i * f->n, f->back, f->n))
        TH_FAIL("mode %d round %d weight %d: the read did not see the weight (%s)", mode, round, i,
                epm_last_error_message());
    }
}

/* Who fills staged prefetches: the manager's background thread (caller_fills
 * 0, the default, also for a caller passing the v1 config size, which has no
 * such field) or the releasing thread (caller_fills 1); and who waits for a
 * fill not enqueued yet: the host (fill_waits_on_host 1, the default and the
 * only value accepted: 0, a device-side wait for a copy not yet issued,
 * deadlocks on CUDA and is refused). Every read sees the weight's bytes, and
 * the counters say which thread filled. */
static void test_staged_prefetches_fill_in_the_background_unless_the_caller_fills(void) {
  enum { W = 4 };
  const size_t n = 4u * MIB;
  Weights f;
  EpmResidency *res = NULL;
  EpmWeightId w[W];
  if (!weights_open(&f, W, n, 40)) goto cleanup;
  EpmDevice *dev = f.dev;
  {
    EpmResidencyConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.size = sizeof cfg;
    REQUIRE_OK(epm_residency_config_default(&cfg));
    CHECK(cfg.caller_fills == 0);
    CHECK(cfg.fill_waits_on_host == 1);
  }
  {
    /* fill_waits_on_host 0 is refused, with a message, and creates nothing. */
    EpmStatus st = make_res_modes(dev, 2 * n + n / 2, EPM_REGISTER_NEVER, 0, 0, sizeof(EpmResidencyConfig), &res);
    CHECK(st == EPM_STATUS_UNSUPPORTED);
    CHECK(res == NULL);
    CHECK(strstr(epm_last_error_message(), "fill_waits_on_host") != NULL);
    res = NULL;
  }
  for (int mode = 0; mode < 3; mode++) {
    /* mode 0: caller_fills 0; 1: caller_fills 1; 2: the v1 size (default). */
    REQUIRE_OK(make_res_modes(dev, 2 * n + n / 2, EPM_REGISTER_NEVER, mode == 1, 1,
                              mode == 2 ? EPM_RESIDENCY_CONFIG_SIZE_V1 : sizeof(EpmResidencyConfig), &res));
    REQUIRE_OK(weights_register(&f, res, w));
    weights_read_rounds(&f, res, w, 3, mode);
    REQUIRE_OK(epm_residency_synchronize(res));
    EpmResidencyStats st;
    memset(&st, 0, sizeof st);
    st.size = sizeof st;
    REQUIRE_OK(epm_residency_get_stats(res, &st));
    CHECK(st.size == sizeof st);
    CHECK(st.staged_page_ins == st.page_ins && st.prefetch_page_ins > 0);
    CHECK(st.slot_wait_ms >= 0.0);
    if (mode == 1) {
      CHECK(st.background_page_ins == 0 && st.background_waits == 0 && st.background_wait_ms == 0.0);
      CHECK(st.background_busy_ms == 0.0);
    } else {
      CHECK(st.background_busy_ms > 0.0);
      CHECK(st.background_page_ins == st.prefetch_page_ins);
      CHECK(st.background_waits <= st.background_page_ins && st.background_wait_ms >= 0.0);
    }
    CHECK_OK(epm_residency_destroy(res));
    res = NULL;
  }
cleanup:
  epm_residency_destroy(res);
  weights_close(&f);
}

/* fill_ahead_chunks: EPM_FILL_AHEAD_ALL_SLOTS by default (also for a caller
 * passing the v1 size or the size before the field, 80 bytes, whatever lies
 * past that size), which means as many chunks as there are staging slots,
 * whatever staging_slots is; 0 turns it off; any other value above the slots
 * is refused. When on, prefetching the first weight makes the background
 * thread fill the second's first chunks ahead, the second's page-in uses
 * them, and every read sees the weights' bytes. */
static void test_fill_ahead_through_c(void) {
  enum { W = 3 };
  const size_t n = 4u * MIB;
  Weights f;
  EpmResidency *res = NULL;
  EpmWeightId w[W];
  if (!weights_open(&f, W, n, 60)) goto cleanup;
  EpmDevice *dev = f.dev;
  EpmResidencyConfig cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.size = sizeof cfg;
  REQUIRE_OK(epm_residency_config_default(&cfg));
  CHECK(cfg.fill_ahead_chunks == EPM_FILL_AHEAD_ALL_SLOTS);
  CHECK(offsetof(EpmResidencyConfig, fill_ahead_chunks) == 80);
  cfg.budget_bytes = W * n + n;
  cfg.register_sources = EPM_REGISTER_NEVER;
  cfg.fill_threads = 2;
  cfg.staging_slots = 3;
  {
    EpmResidencyConfig bad = cfg;
    bad.fill_ahead_chunks = 4;
    CHECK(epm_residency_create(dev, &bad, &res) == EPM_STATUS_INVALID_CONFIG);
    CHECK(res == NULL);
    CHECK(strstr(epm_last_error_message(), "fill_ahead_chunks 4 exceeds the staging slots (3)") != NULL);
    res = NULL;
  }
  for (int mode = 0; mode < 5; mode++) {
    /* mode 0: today's size, 2 chunks ahead; 1: off (0); 2: all slots with 2
     * slots; 3: 80 bytes and 4: the v1 size, each with a value past its size
     * that would be refused if read (they get the default, all slots). */
    EpmResidencyConfig c = cfg;
    c.fill_ahead_chunks = mode == 0 ? 2 : mode == 1 ? 0 : mode == 2 ? EPM_FILL_AHEAD_ALL_SLOTS : 1000;
    if (mode == 2) c.staging_slots = 2;
    c.size = mode <= 2 ? sizeof c : mode == 3 ? offsetof(EpmResidencyConfig, fill_ahead_chunks) : EPM_RESIDENCY_CONFIG_SIZE_V1;
    const int on = mode != 1;
    REQUIRE_OK(epm_residency_create(dev, &c, &res));
    REQUIRE_OK(weights_register(&f, res, w));
    size_t issued = 0;
    REQUIRE_OK(epm_residency_prefetch(res, w, 1, &issued));
    CHECK(issued == 1);
    EpmResidencyStats st;
    memset(&st, 0, sizeof st);
    st.size = sizeof st;
    if (on) {
      /* The background thread fills ahead once the first fill is issued. */
      for (int tries = 0; tries < 30000; tries++) {
        REQUIRE_OK(epm_residency_get_stats(res, &st));
        if (st.fill_ahead_bytes > 0) break;
        struct timespec ts = {0, 2000000};
        nanosleep(&ts, NULL);
      }
      CHECK(st.fill_ahead_bytes > 0);
    }
    weights_read_rounds(&f, res, w, 3, mode);
    REQUIRE_OK(epm_residency_synchronize(res));
    REQUIRE_OK(epm_residency_get_stats(res, &st));
    if (on) {
      /* Every hint was right: each byte filled ahead was used. */
      CHECK(st.fill_ahead_bytes > 0 && st.fill_ahead_used_bytes == st.fill_ahead_bytes);
      if (st.fill_ahead_bytes == 0 || st.fill_ahead_used_bytes != st.fill_ahead_bytes)
        fprintf(stderr, "  mode %d: filled ahead %llu, used %llu\n", mode,
                (unsigned long long)st.fill_ahead_bytes, (unsigned long long)st.fill_ahead_used_bytes);
    } else {
      CHECK(st.fill_ahead_bytes == 0 && st.fill_ahead_used_bytes == 0);
    }
    CHECK_OK(epm_residency_destroy(res));
    res = NULL;
  }
cleanup:
  epm_residency_destroy(res);
  weights_close(&f);
}

/* bf16 values near N(0, 0.02): exponents 116..122 mostly, random sign and mantissa. */
static void fill_bf16(uint16_t *v, size_t n, uint64_t seed) {
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (size_t i = 0; i < n; i++) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    uint16_t e = (uint16_t)(116 + (x >> 40) % 7 - ((x >> 50) % 16 == 0 ? 20 : 0));
    v[i] = (uint16_t)(((x >> 8) & 0x8000) | (e << 7) | (x & 0x7F));
  }
}

static void test_compressed_weights_read_back_bit_exact(void) {
  const size_t n = 300000; /* values: 600,000 bytes per weight */
  EpmDevice *dev = NULL;
  EpmStream *s = NULL;
  EpmResidency *res = NULL;
  uint16_t *v[3] = {NULL, NULL, NULL};
  unsigned char *enc = NULL, *back = malloc(2 * n), *noise = malloc(2 * n);
  EpmWeightId w[4] = {0, 0, 0, 0};
  EpmCodecOptions o;
  EpmCodecInfo info;
  EpmCompressedWeight cw;
  EpmResidencyStats st;
  REQUIRE(back && noise);
  for (int i = 0; i < 3; i++) {
    v[i] = malloc(2 * n);
    REQUIRE(v[i] != NULL);
    fill_bf16(v[i], n, 40 + (uint64_t)i);
  }
  th_fill_random(noise, 2 * n, 9);
  REQUIRE_OK(epm_device_open(0, &dev));
  REQUIRE_OK(epm_stream_create(dev, &s));
  o.size = sizeof o;
  REQUIRE_OK(epm_codec_options_default(&o));
  o.min_bytes = 4096;
  info.size = sizeof info;
  REQUIRE_OK(epm_codec_plan(v[0], 2 * n, EPM_CODEC_DTYPE_BF16, &o, &info));
  REQUIRE(info.outcome == EPM_CODEC_CODED);
  enc = malloc(info.encoded_bytes);
  REQUIRE(enc != NULL);
  REQUIRE_OK(epm_codec_encode(v[0], 2 * n, EPM_CODEC_DTYPE_BF16, &o, enc, info.encoded_bytes, &info));
  /* Two weights of room beside the staging (two buffers of ~0.7 × 600 KB):
   * four weights evict each other every round. */
  REQUIRE_OK(make_res(dev, 2 * 2 * n + 2 * 2 * n, EPM_REGISTER_NEVER, &res));
  memset(&cw, 0, sizeof cw);
  cw.size = sizeof cw;
  cw.data = enc;
  cw.bytes = info.encoded_bytes;
  cw.dtype = EPM_CODEC_DTYPE_ENCODED;
  REQUIRE_OK(epm_residency_register_compressed(res, &cw, &w[0], NULL));
  memset(enc, 0, info.encoded_bytes); /* the manager keeps its own copy */
  cw.dtype = EPM_CODEC_DTYPE_BF16;
  cw.options = &o;
  for (int i = 1; i < 3; i++) {
    cw.data = v[i];
    cw.bytes = 2 * n;
    info.size = sizeof info;
    REQUIRE_OK(epm_residency_register_compressed(res, &cw, &w[i], &info));
    CHECK(info.outcome == EPM_CODEC_CODED && info.raw_bytes == 2 * n && info.ratio < 0.8);
  }
  cw.data = noise;
  REQUIRE_OK(epm_residency_register_compressed(res, &cw, &w[3], &info));
  CHECK(info.outcome == EPM_CODEC_RAW_NO_GAIN);
  for (int round = 0; round < 4; round++) {
    for (int i = 0; i < 4; i++) {
      const unsigned char *want = i < 3 ? (const unsigned char *)v[i] : noise;
      th_checks++;
      if (!host_read_matches(dev, res, s, w[i], want, back, 2 * n))
        TH_FAIL("round %d weight %d: not bit-exact after its page-in (%s)", round, i, epm_last_error_message());
    }
  }
  REQUIRE_OK(epm_residency_synchronize(res));
  memset(&st, 0, sizeof st);
  st.size = sizeof st;
  REQUIRE_OK(epm_residency_get_stats(res, &st));
  CHECK(st.size == sizeof st);
  CHECK(st.compressed_weights == 3 && st.compressed_raw_bytes == 3 * 2 * n);
  CHECK(st.compressed_host_bytes < st.compressed_raw_bytes * 8 / 10);
  CHECK(st.decodes >= 6 && st.decoded_bytes == st.decodes * 2 * n);
  CHECK(st.compressed_htod_bytes < st.decoded_bytes && st.decode_staging_bytes > 0);
  CHECK(st.evictions > 0 && st.resident_bytes + st.decode_staging_bytes <= st.budget_bytes);
  /* A v1 stats struct gets the v1 fields only. */
  {
    /* The buffer is smaller than today's struct: only the library writes
       through it as one; the test reads and writes `size` bytewise (a
       compiler's bounds check rightly refuses a member access through a
       pointer to a struct larger than the object). */
    unsigned char v1[EPM_RESIDENCY_STATS_SIZE_V1 + 8];
    size_t sz = EPM_RESIDENCY_STATS_SIZE_V1;
    memset(v1, 0xAB, sizeof v1);
    memcpy(v1 + offsetof(EpmResidencyStats, size), &sz, sizeof sz);
    REQUIRE_OK(epm_residency_get_stats(res, (EpmResidencyStats *)(void *)v1));
    memcpy(&sz, v1 + offsetof(EpmResidencyStats, size), sizeof sz);
    CHECK(sz == EPM_RESIDENCY_STATS_SIZE_V1 && v1[EPM_RESIDENCY_STATS_SIZE_V1] == 0xAB);
  }
  /* Corrupt and truncated buffers are refused with a message. */
  REQUIRE_OK(epm_codec_encode(v[0], 2 * n, EPM_CODEC_DTYPE_BF16, &o, enc, info.encoded_bytes + 1000000, &info));
  cw.data = enc;
  cw.bytes = info.encoded_bytes;
  cw.dtype = EPM_CODEC_DTYPE_ENCODED;
  enc[info.encoded_bytes / 2] ^= 1;
  {
    EpmWeightId x = 77;
    CHECK_STATUS(epm_residency_register_compressed(res, &cw, &x, NULL), EPM_STATUS_INVALID_ARGUMENT);
    CHECK(strstr(epm_last_error_message(), "checksum") != NULL);
    enc[info.encoded_bytes / 2] ^= 1;
    cw.bytes -= 16;
    CHECK_STATUS(epm_residency_register_compressed(res, &cw, &x, NULL), EPM_STATUS_INVALID_ARGUMENT);
    CHECK(strstr(epm_last_error_message(), "truncated") != NULL);
    CHECK(x == 77);
  }
cleanup:
  epm_residency_destroy(res);
  epm_stream_destroy(s);
  epm_device_destroy(dev);
  for (int i = 0; i < 3; i++) free(v[i]);
  free(enc);
  free(back);
  free(noise);
}

int main(void) {
  RUN(test_compressed_weights_read_back_bit_exact);
  RUN(test_acquire_host_then_sync_read_sees_the_weight);
  RUN(test_cycle_and_unregister_name_the_coalesced_weights);
  RUN(test_staged_prefetches_fill_in_the_background_unless_the_caller_fills);
  RUN(test_fill_ahead_through_c);
  TEST_SUMMARY();
}
