/*
 * epmem_hello: the smallest program built with CMake against an installed
 * epmem (see CMakeLists.txt). It checks that the header it was compiled with
 * and the library it loaded agree, opens a device (EPM_DEVICE=auto|cuda|host)
 * and allocates, fills and reads back one block of device memory.
 */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include <epmem.h>

int main(void) {
  EpmDevice *dev = NULL;
  EpmStream *stream = NULL;
  EpmDeviceInfo info;
  EpmDevicePtr block = 0;
  unsigned char back[4096];
  EpmStatus st;
  int rc = 1;

  if (epm_version() >> 16 != EPM_VERSION_MAJOR) {
    fprintf(stderr, "epmem_hello: header %d.%d.%d, library %s: majors differ\n", EPM_VERSION_MAJOR,
            EPM_VERSION_MINOR, EPM_VERSION_PATCH, epm_version_string());
    return 1;
  }
  if ((st = epm_device_open(0, &dev))) goto cleanup;
  info.size = sizeof info;
  if ((st = epm_device_get_info(dev, &info))) goto cleanup;
  if ((st = epm_device_alloc(dev, sizeof back, &block))) goto cleanup;
  if ((st = epm_stream_create(dev, &stream))) goto cleanup;
  if ((st = epm_memset_d8_async(dev, block, 0x5a, sizeof back, stream))) goto cleanup;
  if ((st = epm_stream_synchronize(stream))) goto cleanup;
  if ((st = epm_memcpy_dtoh(dev, back, block, sizeof back))) goto cleanup;
  for (size_t i = 0; i < sizeof back; i++)
    if (back[i] != 0x5a) {
      fprintf(stderr, "epmem_hello: byte %zu read back as %#x, not 0x5a\n", i, back[i]);
      goto cleanup;
    }
  printf("epmem_hello: epmem %s on %s: 4 KiB written and read back\n", epm_version_string(), info.name);
  rc = 0;

cleanup:
  if (st != EPM_STATUS_OK)
    fprintf(stderr, "epmem_hello: %s: %s\n", epm_status_name((int)st), epm_last_error_message());
  epm_stream_destroy(stream);
  if (block) epm_device_free(dev, block);
  epm_device_destroy(dev);
  return rc;
}
