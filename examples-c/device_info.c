/*
 * device_info: open a device and print what it is.
 *
 * Build and run against an installed epmem (make install, or make install
 * PREFIX=$HOME/.local and PKG_CONFIG_PATH=$HOME/.local/lib/pkgconfig):
 *   cc -std=c11 device_info.c $(pkg-config --cflags --libs epmem) -o device_info
 *   ./device_info
 * EPM_DEVICE=auto|cuda|host picks the device (default auto: CUDA if present).
 * `make test` builds and runs it this way from a temporary prefix.
 */
#include <inttypes.h>
#include <stdio.h>

#include <epmem.h>

int main(void) {
  EpmDevice *dev = NULL;
  EpmDeviceInfo info;
  uint64_t free_bytes = 0, total_bytes = 0;
  EpmStatus st;
  int rc = 1;

  if (epm_version() != EPM_VERSION) {
    fprintf(stderr, "header %d.%d.%d does not match library %s\n", EPM_VERSION_MAJOR,
            EPM_VERSION_MINOR, EPM_VERSION_PATCH, epm_version_string());
    return 1;
  }

  st = epm_device_open(0, &dev);
  if (st != EPM_STATUS_OK) goto cleanup;

  info.size = sizeof info; /* the struct is versioned by its size */
  st = epm_device_get_info(dev, &info);
  if (st != EPM_STATUS_OK) goto cleanup;
  st = epm_device_mem_info(dev, &free_bytes, &total_bytes);
  if (st != EPM_STATUS_OK) goto cleanup;

  printf("epmem %s\n", epm_version_string());
  /* The host device's name already says what it is ("host (memfd VMM)"). */
  if (info.kind == EPM_DEVICE_KIND_CUDA)
    printf("device %" PRIu32 ": %s (CUDA)\n", info.ordinal, info.name);
  else
    printf("device %" PRIu32 ": %s, no GPU: the CPU stands in for one\n", info.ordinal, info.name);
  printf("  memory       %.1f GiB total, %.1f GiB free\n", (double)total_bytes / (1 << 30),
         (double)free_bytes / (1 << 30));
  printf("  granularity  %" PRIu64 " KiB (VMM)\n", info.granularity >> 10);
  if (info.kind == EPM_DEVICE_KIND_CUDA) {
    printf("  compute      %" PRIu32 ".%" PRIu32 "\n", info.compute_capability_major,
           info.compute_capability_minor);
    printf("  driver       %" PRIu32 ".%" PRIu32 "\n", info.driver_version / 1000,
           info.driver_version % 1000 / 10);
    printf("  pci bus      %s\n", info.pci_bus_id);
  }
  rc = 0;

cleanup:
  if (st != EPM_STATUS_OK)
    fprintf(stderr, "device_info: %s\n", epm_last_error_message());
  epm_device_destroy(dev);
  return rc;
}
