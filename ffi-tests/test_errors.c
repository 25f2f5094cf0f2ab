/*
 * Misuse gives a status and a message, never a crash: destroyed, wrong-typed,
 * garbage and NULL handles; NULL out-params; bad sizes; objects of two
 * different devices. Out-params stay untouched on failure.
 */
#include <stdint.h>
#include <stdlib.h>

#include "testhelper.h"

static void test_destroy_null_is_ok(void) {
  CHECK_OK(epm_device_destroy(NULL));
  CHECK_OK(epm_stream_destroy(NULL));
  CHECK_OK(epm_event_destroy(NULL));
  CHECK(epm_last_error_message()[0] == '\0');
}

static void test_destroyed_handle(void) {
  EpmDevice *dev = NULL;
  EpmStream *s = NULL;
  EpmDeviceInfo info;

  REQUIRE_OK(epm_device_open(0, &dev));
  REQUIRE_OK(epm_stream_create(dev, &s));
  REQUIRE_OK(epm_stream_destroy(s));
  CHECK_STATUS(epm_stream_synchronize(s), EPM_STATUS_INVALID_HANDLE);
  CHECK_MESSAGE_HAS("EpmStream");
  CHECK_MESSAGE_HAS("destroyed");
  CHECK_MESSAGE_HAS("`stream`");
  /* Double destroy is reported, not ignored and not a crash. */
  CHECK_STATUS(epm_stream_destroy(s), EPM_STATUS_INVALID_HANDLE);
  s = NULL;

  REQUIRE_OK(epm_device_destroy(dev));
  info.size = sizeof info;
  CHECK_STATUS(epm_device_get_info(dev, &info), EPM_STATUS_INVALID_HANDLE);
  CHECK_MESSAGE_HAS("EpmDevice");
  CHECK_STATUS(epm_stream_create(dev, &s), EPM_STATUS_INVALID_HANDLE);
  CHECK(s == NULL);
  CHECK_STATUS(epm_device_destroy(dev), EPM_STATUS_INVALID_HANDLE);
  dev = NULL;

  /* A success afterwards clears the message. */
  CHECK_OK(epm_device_destroy(NULL));
  CHECK(epm_last_error_message()[0] == '\0');

cleanup:
  epm_stream_destroy(s);
  epm_device_destroy(dev);
}

static void test_wrong_type_and_garbage(void) {
  EpmDevice *dev = NULL;
  EpmStream *s = NULL;
  EpmEvent *e = NULL;
  EpmDeviceInfo info;

  REQUIRE_OK(epm_device_open(0, &dev));
  REQUIRE_OK(epm_stream_create(dev, &s));
  REQUIRE_OK(epm_event_create(dev, 0, &e));

  info.size = sizeof info;
  CHECK_STATUS(epm_device_get_info((EpmDevice *)s, &info), EPM_STATUS_INVALID_HANDLE);
  CHECK_MESSAGE_HAS("expected an EpmDevice handle, got an EpmStream handle");
  CHECK_STATUS(epm_stream_synchronize((EpmStream *)e), EPM_STATUS_INVALID_HANDLE);
  CHECK_MESSAGE_HAS("expected an EpmStream handle, got an EpmEvent handle");
  CHECK_STATUS(epm_event_record(e, (EpmStream *)dev), EPM_STATUS_INVALID_HANDLE);
  CHECK_MESSAGE_HAS("`stream`");
  /* A wrong-typed destroy frees nothing: the stream still works after. */
  CHECK_STATUS(epm_event_destroy((EpmEvent *)s), EPM_STATUS_INVALID_HANDLE);
  CHECK_OK(epm_stream_synchronize(s));

  /* Garbage: a real address, a small integer, all ones. */
  CHECK_STATUS(epm_device_get_info((EpmDevice *)&info, &info), EPM_STATUS_INVALID_HANDLE);
  CHECK_MESSAGE_HAS("not an epmem handle");
  CHECK_STATUS(epm_stream_synchronize((EpmStream *)(uintptr_t)0x40), EPM_STATUS_INVALID_HANDLE);
  CHECK_STATUS(epm_event_query((EpmEvent *)UINTPTR_MAX), EPM_STATUS_INVALID_HANDLE);
  CHECK_STATUS(epm_device_destroy((EpmDevice *)(uintptr_t)0xdeadbeef), EPM_STATUS_INVALID_HANDLE);

  /* NULL handles. */
  CHECK_STATUS(epm_device_get_info(NULL, &info), EPM_STATUS_INVALID_HANDLE);
  CHECK_MESSAGE_HAS("NULL EpmDevice");
  CHECK_STATUS(epm_stream_wait_event(s, NULL), EPM_STATUS_INVALID_HANDLE);
  CHECK_MESSAGE_HAS("`event`");

cleanup:
  epm_event_destroy(e);
  epm_stream_destroy(s);
  epm_device_destroy(dev);
}

static void test_null_out_params(void) {
  EpmDevice *dev = NULL;
  EpmStream *s = NULL;
  EpmEvent *e = NULL;
  uint64_t total = 0;
  unsigned char buf[16] = {0};
  EpmDevicePtr d = 0;

  CHECK_STATUS(epm_device_open(0, NULL), EPM_STATUS_NULL_POINTER);
  CHECK_MESSAGE_HAS("`out`");
  REQUIRE_OK(epm_device_open(0, &dev));
  CHECK_STATUS(epm_device_get_info(dev, NULL), EPM_STATUS_NULL_POINTER);
  CHECK_STATUS(epm_device_mem_info(dev, NULL, &total), EPM_STATUS_NULL_POINTER);
  CHECK_MESSAGE_HAS("`free_bytes`");
  CHECK(total == 0);
  CHECK_STATUS(epm_stream_create(dev, NULL), EPM_STATUS_NULL_POINTER);
  CHECK_STATUS(epm_event_create(dev, 0, NULL), EPM_STATUS_NULL_POINTER);
  CHECK_STATUS(epm_device_alloc(dev, 16, NULL), EPM_STATUS_NULL_POINTER);
  REQUIRE_OK(epm_stream_create(dev, &s));
  REQUIRE_OK(epm_event_create(dev, EPM_EVENT_TIMING, &e));
  CHECK_STATUS(epm_stream_native(s, NULL), EPM_STATUS_NULL_POINTER);
  CHECK_STATUS(epm_event_elapsed_ms(e, e, NULL), EPM_STATUS_NULL_POINTER);
  CHECK_MESSAGE_HAS("`out_ms`");
  REQUIRE_OK(epm_device_alloc(dev, sizeof buf, &d));
  CHECK_STATUS(epm_memcpy_htod(dev, d, NULL, sizeof buf), EPM_STATUS_NULL_POINTER);
  CHECK_MESSAGE_HAS("`src`");
  CHECK_STATUS(epm_memcpy_dtoh(dev, NULL, d, sizeof buf), EPM_STATUS_NULL_POINTER);
  CHECK_MESSAGE_HAS("`dst`");
  CHECK_STATUS(epm_device_open_select("host", 0, NULL), EPM_STATUS_NULL_POINTER);

cleanup:
  epm_device_free(dev, d);
  epm_event_destroy(e);
  epm_stream_destroy(s);
  epm_device_destroy(dev);
}

static void test_bad_sizes_and_flags(void) {
  EpmDevice *dev = NULL;
  EpmStream *s = NULL;
  EpmEvent *e = NULL;
  EpmDevicePtr d = 0, untouched = 12345;
  unsigned char buf[16] = {0};

  REQUIRE_OK(epm_device_open(0, &dev));
  REQUIRE_OK(epm_stream_create(dev, &s));
  CHECK_STATUS(epm_device_alloc(dev, 0, &untouched), EPM_STATUS_INVALID_ARGUMENT);
  CHECK(untouched == 12345);
  REQUIRE_OK(epm_device_alloc(dev, sizeof buf, &d));
  CHECK_STATUS(epm_memcpy_htod(dev, d, buf, 0), EPM_STATUS_INVALID_ARGUMENT);
  CHECK_MESSAGE_HAS("size is 0");
  CHECK_STATUS(epm_memcpy_htod_async(dev, UINT64_MAX - 4, buf, sizeof buf, s), EPM_STATUS_INVALID_ARGUMENT);
  CHECK_MESSAGE_HAS("overflow");
  CHECK_STATUS(epm_memcpy_dtoh(dev, buf, d, SIZE_MAX), EPM_STATUS_INVALID_ARGUMENT);
  CHECK_STATUS(epm_memset_d8_async(dev, d, 1, 0, s), EPM_STATUS_INVALID_ARGUMENT);
  CHECK_STATUS(epm_event_create(dev, 0x80, &e), EPM_STATUS_INVALID_ARGUMENT);
  CHECK_MESSAGE_HAS("flags");
  CHECK(e == NULL);
  CHECK_STATUS(epm_set_log_callback(NULL, NULL, 99), EPM_STATUS_INVALID_ARGUMENT);
  CHECK_OK(epm_device_free(dev, 0));

cleanup:
  epm_device_free(dev, d);
  epm_stream_destroy(s);
  epm_device_destroy(dev);
}

/* Two opens are two devices: mixing their objects is refused. */
static void test_objects_of_two_devices_do_not_mix(void) {
  EpmDevice *d1 = NULL, *d2 = NULL;
  EpmStream *s1 = NULL;
  EpmEvent *e2 = NULL;

  REQUIRE_OK(epm_device_open(0, &d1));
  REQUIRE_OK(epm_device_open(0, &d2));
  REQUIRE_OK(epm_stream_create(d1, &s1));
  REQUIRE_OK(epm_event_create(d2, 0, &e2));
  CHECK_STATUS(epm_event_record(e2, s1), EPM_STATUS_INVALID_ARGUMENT);
  CHECK_MESSAGE_HAS("different devices");
  CHECK_STATUS(epm_stream_wait_event(s1, e2), EPM_STATUS_INVALID_ARGUMENT);
  CHECK_STATUS(epm_device_spin_async(d2, 1, s1), EPM_STATUS_INVALID_ARGUMENT);

cleanup:
  epm_event_destroy(e2);
  epm_stream_destroy(s1);
  epm_device_destroy(d1);
  epm_device_destroy(d2);
}

int main(void) {
  RUN(test_destroy_null_is_ok);
  RUN(test_destroyed_handle);
  RUN(test_wrong_type_and_garbage);
  RUN(test_null_out_params);
  RUN(test_bad_sizes_and_flags);
  RUN(test_objects_of_two_devices_do_not_mix);
  TEST_SUMMARY();
}
