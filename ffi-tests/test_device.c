/*
 * Device open/info/destroy, device selection, and the version.
 * Runs on the device EPM_DEVICE names (host in CI, cuda on a GPU machine).
 */
#define _POSIX_C_SOURCE 200809L
#include <stdint.h>
#include <stdlib.h>

#include "testhelper.h"

static void test_version_matches_header(void) {
  char want[64];
  CHECK(epm_version() == EPM_VERSION);
  CHECK((epm_version() >> 16) == EPM_VERSION_MAJOR);
  CHECK(((epm_version() >> 8) & 0xff) == EPM_VERSION_MINOR);
  CHECK((epm_version() & 0xff) == EPM_VERSION_PATCH);
  snprintf(want, sizeof want, "%d.%d.%d", EPM_VERSION_MAJOR, EPM_VERSION_MINOR, EPM_VERSION_PATCH);
  CHECK(strcmp(epm_version_string(), want) == 0);
}

static void test_open_info_destroy(void) {
  EpmDevice *dev = NULL;
  EpmDeviceInfo info;
  uint64_t free_bytes = 0, total_bytes = 0;

  REQUIRE_OK(epm_device_open(0, &dev));
  REQUIRE(dev != NULL);
  CHECK(epm_last_error_message()[0] == '\0');

  memset(&info, 0xAB, sizeof info);
  info.size = sizeof info;
  REQUIRE_OK(epm_device_get_info(dev, &info));
  CHECK(info.size == sizeof info);
  CHECK(info.kind == EPM_DEVICE_KIND_CUDA || info.kind == EPM_DEVICE_KIND_HOST);
  CHECK(info.ordinal == 0);
  CHECK(info.name[0] != '\0');
  CHECK(memchr(info.name, '\0', sizeof info.name) != NULL);
  CHECK(memchr(info.pci_bus_id, '\0', sizeof info.pci_bus_id) != NULL);
  CHECK(info.total_memory > 0);
  CHECK(info.granularity > 0 && (info.granularity & (info.granularity - 1)) == 0);
  if (info.kind == EPM_DEVICE_KIND_CUDA) {
    CHECK(info.compute_capability_major >= 5);
    CHECK(info.driver_version >= 12000);
    CHECK(info.pci_bus_id[0] != '\0');
  } else {
    CHECK(info.compute_capability_major == 0 && info.driver_version == 0);
  }

  REQUIRE_OK(epm_device_mem_info(dev, &free_bytes, &total_bytes));
  CHECK(total_bytes > 0);
  CHECK(free_bytes <= total_bytes);
  CHECK_OK(epm_device_synchronize(dev));

cleanup:
  CHECK_OK(epm_device_destroy(dev));
}

static void test_info_size_is_checked(void) {
  EpmDevice *dev = NULL;
  EpmDeviceInfo info;

  REQUIRE_OK(epm_device_open(0, &dev));
  memset(&info, 0x5A, sizeof info);
  info.size = sizeof info - 1;
  CHECK_STATUS(epm_device_get_info(dev, &info), EPM_STATUS_INVALID_ARGUMENT);
  CHECK_MESSAGE_HAS("size");
  /* Out-params are written only on success: the struct is untouched. */
  CHECK(info.size == sizeof info - 1);
  CHECK((unsigned char)info.name[0] == 0x5A);
  info.size = 0;
  CHECK_STATUS(epm_device_get_info(dev, &info), EPM_STATUS_INVALID_ARGUMENT);

cleanup:
  epm_device_destroy(dev);
}

static void test_open_select(void) {
  EpmDevice *host = NULL, *host2 = NULL, *bad = (EpmDevice *)(uintptr_t)0x1;
  EpmDeviceInfo info;

  REQUIRE_OK(epm_device_open_select("host", 0, &host));
  REQUIRE_OK(epm_device_open_select("HOST", 0, &host2));
  CHECK(host != host2);
  info.size = sizeof info;
  REQUIRE_OK(epm_device_get_info(host, &info));
  CHECK(info.kind == EPM_DEVICE_KIND_HOST);

  CHECK_STATUS(epm_device_open_select("tpu", 0, &bad), EPM_STATUS_INVALID_CONFIG);
  CHECK_MESSAGE_HAS("tpu");
  CHECK_MESSAGE_HAS("\"auto\", \"cuda\", \"host\"");
  CHECK(bad == (EpmDevice *)(uintptr_t)0x1);
  /* The header promises INVALID_CONFIG for anything but the three names
   * (case aside): no aliases, no padding, not empty. */
  {
    static const char *const refused[] = {"gpu", "cpu", "", " host", "host ", "cuda0", "hos"};
    size_t i;
    for (i = 0; i < sizeof refused / sizeof refused[0]; i++) {
      CHECK_STATUS(epm_device_open_select(refused[i], 0, &bad), EPM_STATUS_INVALID_CONFIG);
      CHECK_MESSAGE_HAS("is not one of");
      CHECK(bad == (EpmDevice *)(uintptr_t)0x1);
    }
  }

cleanup:
  epm_device_destroy(host);
  epm_device_destroy(host2);
}

static void test_unknown_epm_device_is_invalid_config(void) {
  const char *saved = getenv("EPM_DEVICE");
  char saved_copy[64] = "";
  EpmDevice *dev = NULL;

  if (saved) snprintf(saved_copy, sizeof saved_copy, "%s", saved);
  setenv("EPM_DEVICE", "quantum", 1);
  CHECK_STATUS(epm_device_open(0, &dev), EPM_STATUS_INVALID_CONFIG);
  CHECK_MESSAGE_HAS("EPM_DEVICE");
  CHECK_MESSAGE_HAS("quantum");
  CHECK(dev == NULL);
  /* select == NULL reads EPM_DEVICE too. */
  CHECK_STATUS(epm_device_open_select(NULL, 0, &dev), EPM_STATUS_INVALID_CONFIG);
  CHECK(dev == NULL);

  if (saved) setenv("EPM_DEVICE", saved_copy, 1);
  else unsetenv("EPM_DEVICE");
  epm_device_destroy(dev);
}

/* Asking for CUDA on a machine without a driver or GPU is a status with a
 * message, never a crash; with one, it really is a CUDA device. */
static void test_cuda_is_a_device_or_a_status(void) {
  EpmDevice *dev = NULL;
  EpmDeviceInfo info;
  EpmStatus st = epm_device_open_select("cuda", 0, &dev);

  if (st == EPM_STATUS_OK) {
    info.size = sizeof info;
    REQUIRE_OK(epm_device_get_info(dev, &info));
    CHECK(info.kind == EPM_DEVICE_KIND_CUDA);
  } else {
    CHECK_STATUS(st, EPM_STATUS_DEVICE_UNAVAILABLE);
    CHECK(dev == NULL);
  }

cleanup:
  epm_device_destroy(dev);
}

static void test_status_names(void) {
  CHECK(strcmp(epm_status_name(EPM_STATUS_OK), "EPM_STATUS_OK") == 0);
  CHECK(strcmp(epm_status_name(EPM_STATUS_INVALID_HANDLE), "EPM_STATUS_INVALID_HANDLE") == 0);
  CHECK(strcmp(epm_status_name(EPM_STATUS_PANIC), "EPM_STATUS_PANIC") == 0);
  CHECK(strcmp(epm_status_name(4242), "EPM_STATUS_UNKNOWN") == 0);
}

int main(void) {
  RUN(test_version_matches_header);
  RUN(test_open_info_destroy);
  RUN(test_info_size_is_checked);
  RUN(test_open_select);
  RUN(test_unknown_epm_device_is_invalid_config);
  RUN(test_cuda_is_a_device_or_a_status);
  RUN(test_status_names);
  TEST_SUMMARY();
}
