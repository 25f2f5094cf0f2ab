/*
 * The misuse suite, part 1: devices, streams, events, plain memory, logging,
 * status names and versions. Every case checks the exact status and a
 * non-empty last-error message; failed creates leave their out-param alone.
 * Parts 2 and 3: test_misuse_mem.c (arenas, staging, residency) and
 * test_misuse_kv.c. tests/misuse_coverage.rs requires every function of the
 * header to appear in a case here or there.
 */
#define _POSIX_C_SOURCE 200809L
#include "misuse.h"

/* Configuration errors, before any device (and its threads) exists, since
 * setenv is not thread-safe. */
static void test_open_config(void) {
  EpmDevice *dev = NULL;
  const char *saved = getenv("EPM_DEVICE");
  char *keep = saved ? strdup(saved) : NULL;

  MU_EXPECT(epm_device_open(0, NULL), EPM_STATUS_NULL_POINTER, "NULL out");
  MU_EXPECT(epm_device_open_select("host", 0, NULL), EPM_STATUS_NULL_POINTER, "NULL out");
  MU_EXPECT(epm_device_open_select("tpu", 0, &dev), EPM_STATUS_INVALID_CONFIG, "an unknown kind");
  MU_EXPECT(epm_device_open_select("\xff\xfe", 0, &dev), EPM_STATUS_INVALID_ARGUMENT, "non-UTF-8");
  CHECK(dev == NULL);
  setenv("EPM_DEVICE", "tpu", 1);
  MU_EXPECT(epm_device_open(0, &dev), EPM_STATUS_INVALID_CONFIG, "EPM_DEVICE=tpu");
  MU_EXPECT(epm_device_open_select(NULL, 0, &dev), EPM_STATUS_INVALID_CONFIG, "select NULL, EPM_DEVICE=tpu");
  CHECK(dev == NULL);
  if (keep) setenv("EPM_DEVICE", keep, 1);
  else unsetenv("EPM_DEVICE");
  setenv("EPM_FAULT", "warp:1", 1);
  MU_EXPECT(epm_device_open(0, &dev), EPM_STATUS_INVALID_CONFIG, "EPM_FAULT=warp:1");
  setenv("EPM_FAULT", "map:0", 1);
  MU_EXPECT(epm_device_open(0, &dev), EPM_STATUS_INVALID_CONFIG, "EPM_FAULT=map:0");
  unsetenv("EPM_FAULT");
  CHECK(dev == NULL);
  free(keep);
}

static void test_device(MuFx *f) {
  EpmDeviceInfo info;
  uint64_t a = 11, b = 22;

  info.size = sizeof info;
  BAD_HANDLES(EpmDevice, h, f->s, f->dead_dev, epm_device_get_info(h, &info));
  MU_EXPECT(epm_device_get_info(f->dev, NULL), EPM_STATUS_NULL_POINTER, "NULL out");
  info.size = 0;
  MU_EXPECT(epm_device_get_info(f->dev, &info), EPM_STATUS_INVALID_ARGUMENT, "size 0");
  info.size = 4;
  MU_EXPECT(epm_device_get_info(f->dev, &info), EPM_STATUS_INVALID_ARGUMENT, "size 4");
  CHECK(info.size == 4);

  BAD_HANDLES(EpmDevice, h, f->ev, f->dead_dev, epm_device_mem_info(h, &a, &b));
  MU_EXPECT(epm_device_mem_info(f->dev, NULL, &b), EPM_STATUS_NULL_POINTER, "NULL free_bytes");
  MU_EXPECT(epm_device_mem_info(f->dev, &a, NULL), EPM_STATUS_NULL_POINTER, "NULL total_bytes");
  CHECK(a == 11 && b == 22);

  BAD_HANDLES(EpmDevice, h, f->s, f->dead_dev, epm_device_synchronize(h));
  BAD_DESTROY(EpmDevice, h, f->s, f->dead_dev, epm_device_destroy(h));
  CHECK_OK(epm_stream_synchronize(f->s)); /* the wrong-typed destroy freed nothing */
}

static void test_stream(MuFx *f) {
  EpmStream *s = NULL;
  void *native = (void *)&native;

  BAD_HANDLES(EpmDevice, h, f->s, f->dead_dev, epm_stream_create(h, &s));
  MU_EXPECT(epm_stream_create(f->dev, NULL), EPM_STATUS_NULL_POINTER, "NULL out");
  BAD_HANDLES(EpmDevice, h, f->ev, f->dead_dev, epm_stream_wrap_native(h, (void *)1, &s));
  MU_EXPECT(epm_stream_wrap_native(f->dev, NULL, &s), EPM_STATUS_NULL_POINTER, "NULL native");
  MU_EXPECT(epm_stream_wrap_native(f->dev, (void *)1, NULL), EPM_STATUS_NULL_POINTER, "NULL out");
  if (mu_is_host(f))
    MU_EXPECT(epm_stream_wrap_native(f->dev, (void *)1, &s), EPM_STATUS_UNSUPPORTED, "the host device");
  CHECK(s == NULL);

  BAD_HANDLES(EpmStream, h, f->ev, f->dead_s, epm_stream_native(h, &native));
  MU_EXPECT(epm_stream_native(f->s, NULL), EPM_STATUS_NULL_POINTER, "NULL out");
  CHECK(native == (void *)&native);
  BAD_HANDLES(EpmStream, h, f->dev, f->dead_s, epm_stream_synchronize(h));
  BAD_HANDLES(EpmStream, h, f->ev, f->dead_s, epm_stream_wait_event(h, f->ev));
  BAD_HANDLES(EpmEvent, h, f->s, f->dead_ev, epm_stream_wait_event(f->s, h));
  BAD_DESTROY(EpmStream, h, f->dev, f->dead_s, epm_stream_destroy(h));
}

static void test_event(MuFx *f) {
  EpmEvent *e = NULL, *plain = NULL, *fresh = NULL;
  EpmEvent *other = NULL;
  float ms = -1.0f;

  BAD_HANDLES(EpmDevice, h, f->s, f->dead_dev, epm_event_create(h, 0, &e));
  MU_EXPECT(epm_event_create(f->dev, 0, NULL), EPM_STATUS_NULL_POINTER, "NULL out");
  MU_EXPECT(epm_event_create(f->dev, 2, &e), EPM_STATUS_INVALID_ARGUMENT, "flags 2");
  MU_EXPECT(epm_event_create(f->dev, UINT32_MAX, &e), EPM_STATUS_INVALID_ARGUMENT, "flags ~0");
  CHECK(e == NULL);

  BAD_HANDLES(EpmEvent, h, f->s, f->dead_ev, epm_event_record(h, f->s));
  BAD_HANDLES(EpmStream, h, f->ev, f->dead_s, epm_event_record(f->ev, h));
  MU_EXPECT(epm_event_record(f->ev, f->s2), EPM_STATUS_INVALID_ARGUMENT, "a stream of another device");
  BAD_HANDLES(EpmEvent, h, f->dev, f->dead_ev, epm_event_query(h));
  BAD_HANDLES(EpmEvent, h, f->dev, f->dead_ev, epm_event_synchronize(h));

  REQUIRE_OK(epm_event_create(f->dev, 0, &plain));
  REQUIRE_OK(epm_event_create(f->dev, EPM_EVENT_TIMING, &fresh));
  REQUIRE_OK(epm_event_create(f->dev2, EPM_EVENT_TIMING, &other));
  REQUIRE_OK(epm_event_record(f->ev, f->s));
  REQUIRE_OK(epm_event_record(plain, f->s));
  REQUIRE_OK(epm_event_record(other, f->s2));
  REQUIRE_OK(epm_stream_synchronize(f->s));
  REQUIRE_OK(epm_stream_synchronize(f->s2));
  BAD_HANDLES(EpmEvent, h, f->s, f->dead_ev, epm_event_elapsed_ms(h, f->ev, &ms));
  BAD_HANDLES(EpmEvent, h, f->s, f->dead_ev, epm_event_elapsed_ms(f->ev, h, &ms));
  MU_EXPECT(epm_event_elapsed_ms(f->ev, f->ev, NULL), EPM_STATUS_NULL_POINTER, "NULL out_ms");
  MU_EXPECT(epm_event_elapsed_ms(f->ev, other, &ms), EPM_STATUS_INVALID_ARGUMENT, "events of two devices");
  MU_EXPECT(epm_event_elapsed_ms(plain, f->ev, &ms), EPM_STATUS_INVALID_ARGUMENT, "an event without timing");
  MU_EXPECT(epm_event_elapsed_ms(fresh, f->ev, &ms), EPM_STATUS_INVALID_STATE, "a never-recorded event");
  CHECK(ms == -1.0f);
  BAD_DESTROY(EpmEvent, h, f->s, f->dead_ev, epm_event_destroy(h));

cleanup:
  epm_event_destroy(plain);
  epm_event_destroy(fresh);
  epm_event_destroy(other);
}

static void test_memory(MuFx *f) {
  EpmDevicePtr p = 77, d = f->d;
  EpmGate *gate = NULL, *dead_gate = NULL;
  unsigned char buf[64] = {0};
  const void *top = (const void *)(UINTPTR_MAX - 8);

  BAD_HANDLES(EpmDevice, h, f->s, f->dead_dev, epm_device_alloc(h, 16, &p));
  MU_EXPECT(epm_device_alloc(f->dev, 16, NULL), EPM_STATUS_NULL_POINTER, "NULL out");
  MU_EXPECT(epm_device_alloc(f->dev, 0, &p), EPM_STATUS_INVALID_ARGUMENT, "0 bytes");
  /* The fake libcuda of the CI run rounds SIZE_MAX up to 0 and "succeeds". */
  if (strstr(f->info.name, "Fake") == NULL)
    MU_EXPECT(epm_device_alloc(f->dev, SIZE_MAX, &p), EPM_STATUS_OUT_OF_DEVICE_MEMORY, "SIZE_MAX bytes");
  CHECK(p == 77);

  BAD_HANDLES(EpmDevice, h, f->s, f->dead_dev, epm_device_free(h, d));
  MU_EXPECT(epm_device_free(f->dev, d + 16), EPM_STATUS_INVALID_ARGUMENT, "an interior address");
  MU_EXPECT(epm_device_free(f->dev, 0x1000), EPM_STATUS_INVALID_ARGUMENT, "a foreign address");
  REQUIRE_OK(epm_device_alloc(f->dev, 64, &p));
  MU_EXPECT(epm_device_free(f->dev2, p), EPM_STATUS_INVALID_ARGUMENT, "another device's address");
  REQUIRE_OK(epm_device_free(f->dev, p));
  MU_EXPECT(epm_device_free(f->dev, p), EPM_STATUS_INVALID_ARGUMENT, "a double free");

  BAD_HANDLES(EpmDevice, h, f->s, f->dead_dev, epm_memcpy_htod(h, d, buf, sizeof buf));
  MU_EXPECT(epm_memcpy_htod(f->dev, d, NULL, 16), EPM_STATUS_NULL_POINTER, "NULL src");
  MU_EXPECT(epm_memcpy_htod(f->dev, d, buf, 0), EPM_STATUS_INVALID_ARGUMENT, "0 bytes");
  MU_EXPECT(epm_memcpy_htod(f->dev, d, buf, SIZE_MAX), EPM_STATUS_INVALID_ARGUMENT, "SIZE_MAX bytes");
  MU_EXPECT(epm_memcpy_htod(f->dev, d, top, 64), EPM_STATUS_INVALID_ARGUMENT, "src+len overflows");
  MU_EXPECT(epm_memcpy_htod(f->dev, UINT64_MAX - 8, buf, 64), EPM_STATUS_INVALID_ARGUMENT, "dst+len overflows");
  BAD_HANDLES(EpmDevice, h, f->s, f->dead_dev, epm_memcpy_dtoh(h, buf, d, sizeof buf));
  MU_EXPECT(epm_memcpy_dtoh(f->dev, NULL, d, 16), EPM_STATUS_NULL_POINTER, "NULL dst");
  MU_EXPECT(epm_memcpy_dtoh(f->dev, buf, d, 0), EPM_STATUS_INVALID_ARGUMENT, "0 bytes");
  MU_EXPECT(epm_memcpy_dtoh(f->dev, (void *)(uintptr_t)top, d, 64), EPM_STATUS_INVALID_ARGUMENT, "dst+len overflows");
  MU_EXPECT(epm_memcpy_dtoh(f->dev, buf, UINT64_MAX - 8, 64), EPM_STATUS_INVALID_ARGUMENT, "src+len overflows");
  if (mu_is_host(f)) { /* a GPU may have memory mapped right after the allocation */
    MU_EXPECT(epm_memcpy_htod(f->dev, d + 4096 - 8, buf, 64), EPM_STATUS_INVALID_ARGUMENT, "a range past the allocation");
    MU_EXPECT(epm_memcpy_dtoh(f->dev, buf, 0x1000, 64), EPM_STATUS_INVALID_ARGUMENT, "an unallocated address");
  }

  BAD_HANDLES(EpmDevice, h, f->s, f->dead_dev, epm_memcpy_htod_async(h, d, buf, 16, f->s));
  BAD_HANDLES(EpmStream, h, f->ev, f->dead_s, epm_memcpy_htod_async(f->dev, d, buf, 16, h));
  MU_EXPECT(epm_memcpy_htod_async(f->dev, d, buf, 16, f->s2), EPM_STATUS_INVALID_ARGUMENT, "another device's stream");
  MU_EXPECT(epm_memcpy_htod_async(f->dev, d, NULL, 16, f->s), EPM_STATUS_NULL_POINTER, "NULL src");
  MU_EXPECT(epm_memcpy_htod_async(f->dev, d, buf, 0, f->s), EPM_STATUS_INVALID_ARGUMENT, "0 bytes");
  MU_EXPECT(epm_memcpy_htod_async(f->dev, d, top, 64, f->s), EPM_STATUS_INVALID_ARGUMENT, "src+len overflows");
  BAD_HANDLES(EpmDevice, h, f->s, f->dead_dev, epm_memcpy_dtoh_async(h, buf, d, 16, f->s));
  BAD_HANDLES(EpmStream, h, f->ev, f->dead_s, epm_memcpy_dtoh_async(f->dev, buf, d, 16, h));
  MU_EXPECT(epm_memcpy_dtoh_async(f->dev, NULL, d, 16, f->s), EPM_STATUS_NULL_POINTER, "NULL dst");
  MU_EXPECT(epm_memcpy_dtoh_async(f->dev, buf, d, SIZE_MAX, f->s), EPM_STATUS_INVALID_ARGUMENT, "SIZE_MAX bytes");
  MU_EXPECT(epm_memcpy_dtoh_async(f->dev, buf, d, 16, f->s2), EPM_STATUS_INVALID_ARGUMENT, "another device's stream");
  BAD_HANDLES(EpmDevice, h, f->s, f->dead_dev, epm_memcpy_dtod_async(h, d, d + 64, 16, f->s));
  BAD_HANDLES(EpmStream, h, f->ev, f->dead_s, epm_memcpy_dtod_async(f->dev, d, d + 64, 16, h));
  MU_EXPECT(epm_memcpy_dtod_async(f->dev, d, d + 64, 0, f->s), EPM_STATUS_INVALID_ARGUMENT, "0 bytes");
  MU_EXPECT(epm_memcpy_dtod_async(f->dev, UINT64_MAX - 8, d, 64, f->s), EPM_STATUS_INVALID_ARGUMENT, "dst+len overflows");
  MU_EXPECT(epm_memcpy_dtod_async(f->dev, d, UINT64_MAX - 8, 64, f->s), EPM_STATUS_INVALID_ARGUMENT, "src+len overflows");
  MU_EXPECT(epm_memcpy_dtod_async(f->dev, d, d + 64, 16, f->s2), EPM_STATUS_INVALID_ARGUMENT, "another device's stream");
  BAD_HANDLES(EpmDevice, h, f->s, f->dead_dev, epm_memset_d8_async(h, d, 1, 16, f->s));
  BAD_HANDLES(EpmStream, h, f->ev, f->dead_s, epm_memset_d8_async(f->dev, d, 1, 16, h));
  MU_EXPECT(epm_memset_d8_async(f->dev, d, 1, 0, f->s), EPM_STATUS_INVALID_ARGUMENT, "0 bytes");
  MU_EXPECT(epm_memset_d8_async(f->dev, UINT64_MAX - 8, 1, 64, f->s), EPM_STATUS_INVALID_ARGUMENT, "dst+len overflows");
  MU_EXPECT(epm_memset_d8_async(f->dev, d, 1, 16, f->s2), EPM_STATUS_INVALID_ARGUMENT, "another device's stream");

  BAD_HANDLES(EpmDevice, h, f->s, f->dead_dev, epm_device_checksum_async(h, d, 64, f->s, d + 1024));
  BAD_HANDLES(EpmStream, h, f->ev, f->dead_s, epm_device_checksum_async(f->dev, d, 64, h, d + 1024));
  MU_EXPECT(epm_device_checksum_async(f->dev, d, 0, f->s, d + 1024), EPM_STATUS_INVALID_ARGUMENT, "0 bytes");
  MU_EXPECT(epm_device_checksum_async(f->dev, d, 63, f->s, d + 1024), EPM_STATUS_INVALID_ARGUMENT, "63 bytes");
  MU_EXPECT(epm_device_checksum_async(f->dev, UINT64_MAX - 7, 64, f->s, d), EPM_STATUS_INVALID_ARGUMENT, "ptr+len overflows");
  MU_EXPECT(epm_device_checksum_async(f->dev, d, 64, f->s2, d + 1024), EPM_STATUS_INVALID_ARGUMENT, "another device's stream");

  BAD_HANDLES(EpmDevice, h, f->s, f->dead_dev, epm_device_spin_async(h, 1, f->s));
  BAD_HANDLES(EpmStream, h, f->dev, f->dead_s, epm_device_spin_async(f->dev, 1, h));
  MU_EXPECT(epm_device_spin_async(f->dev, 1, f->s2), EPM_STATUS_INVALID_ARGUMENT, "another device's stream");

  REQUIRE_OK(epm_device_hold_async(f->dev, f->s, &dead_gate));
  REQUIRE_OK(epm_gate_destroy(dead_gate)); /* opens it: f->s runs on */
  BAD_HANDLES(EpmDevice, h, f->s, f->dead_dev, epm_device_hold_async(h, f->s, &gate));
  BAD_HANDLES(EpmStream, h, f->dev, f->dead_s, epm_device_hold_async(f->dev, h, &gate));
  MU_EXPECT(epm_device_hold_async(f->dev, f->s, NULL), EPM_STATUS_NULL_POINTER, "NULL out");
  MU_EXPECT(epm_device_hold_async(f->dev, f->s2, &gate), EPM_STATUS_INVALID_ARGUMENT, "another device's stream");
  CHECK(gate == NULL);
  BAD_HANDLES(EpmGate, h, f->s, dead_gate, epm_gate_open(h));
  BAD_DESTROY(EpmGate, h, f->s, dead_gate, epm_gate_destroy(h));

  /* None of the refused calls queued anything that fails later. */
  CHECK_OK(epm_stream_synchronize(f->s));
  CHECK_OK(epm_device_synchronize(f->dev));
cleanup:;
}

/* Functions that return a value: no status, and they leave the last error alone. */
static void test_value_functions(MuFx *f) {
  MU_EXPECT(epm_device_alloc(f->dev, 0, NULL), EPM_STATUS_NULL_POINTER, "NULL out (sets the last error)");
  CHECK(epm_checksum_host(NULL, 64) == 0);
  CHECK(epm_checksum_host(f->host, 0) == 0);
  CHECK(epm_checksum_host(f->host, 3) == 0);
  CHECK(strcmp(epm_status_name(-1), "EPM_STATUS_UNKNOWN") == 0);
  CHECK(strcmp(epm_status_name(8), "EPM_STATUS_UNKNOWN") == 0);
  CHECK(strcmp(epm_status_name(902), "EPM_STATUS_UNKNOWN") == 0);
  CHECK(epm_version() >> 16 == EPM_VERSION_MAJOR);
  CHECK(epm_version_string() != NULL && epm_version_string()[0] != '\0');
  CHECK(epm_last_error_message() != NULL && strstr(epm_last_error_message(), "`out`") != NULL);

  CHECK_STATUS(epm_set_log_callback(NULL, NULL, EPM_LOG_LEVEL_TRACE + 1), EPM_STATUS_INVALID_ARGUMENT);
  CHECK_STATUS(epm_set_log_callback(NULL, NULL, UINT32_MAX), EPM_STATUS_INVALID_ARGUMENT);
  CHECK_OK(epm_set_log_callback(NULL, NULL, EPM_LOG_LEVEL_OFF));
  CHECK(epm_last_error_message()[0] == '\0');
}

int main(void) {
  MuFx f;
  RUN(test_open_config);
  if (!mu_open(&f)) {
    mu_close(&f);
    TEST_SUMMARY();
  }
  RUN_FX(test_device, &f);
  RUN_FX(test_stream, &f);
  RUN_FX(test_event, &f);
  RUN_FX(test_memory, &f);
  RUN_FX(test_value_functions, &f);
  mu_close(&f);
  TEST_SUMMARY();
}
