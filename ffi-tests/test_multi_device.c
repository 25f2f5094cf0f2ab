/*
 * Several devices through the C API: one host copy of the
 * weights, page-locked once by epm_shared_host_registration_create, feeds
 * the residency managers of devices 0 and 1, which copy from it directly and
 * register nothing themselves; it is unregistered after the last holder.
 * Device 1's memory is not device 0's.
 *
 * Devices 0 and 1 are of the kind EPM_DEVICE names: two host-device
 * instances in CI, cuda:0 and cuda:1 on a GPU machine. With one GPU it
 * prints "skipped: 1 device" and exits 0.
 *   make test-c   (or target/ffi-tests/test_multi_device)
 */
#include <stdint.h>
#include <stdlib.h>

#include "testhelper.h"

#define MIB (1u << 20)
#define NW 6
#define WBYTES (1u << 20)

static EpmStatus make_res(EpmDevice *dev, uint64_t budget, EpmResidency **out) {
  EpmResidencyConfig cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.size = sizeof cfg;
  EpmStatus st = epm_residency_config_default(&cfg);
  if (st) return st;
  cfg.budget_bytes = budget;
  cfg.fill_threads = 1;
  cfg.coalesce_below_bytes = 0;
  return epm_residency_create(dev, &cfg, out);
}

static int stats(EpmResidency *res, EpmResidencyStats *s) {
  memset(s, 0, sizeof *s);
  s->size = sizeof *s;
  return epm_residency_get_stats(res, s) == EPM_STATUS_OK;
}

/* Every weight acquired for the host and compared byte for byte. */
static int all_match(EpmDevice *dev, EpmResidency *res, const EpmWeightId *w, const unsigned char *host,
                     unsigned char *back) {
  for (int i = 0; i < NW; i++) {
    EpmDevicePtr p = 0;
    if (epm_residency_acquire_host(res, w[i], &p) != EPM_STATUS_OK) return 0;
    int ok = epm_memcpy_dtoh(dev, back, p, WBYTES) == EPM_STATUS_OK &&
             memcmp(back, host + (size_t)i * WBYTES, WBYTES) == 0;
    if (epm_residency_release_host(res, w[i]) != EPM_STATUS_OK || !ok) return 0;
  }
  return 1;
}

int main(void) {
  EpmDevice *d0 = NULL, *d1 = NULL;
  EpmResidency *r0 = NULL, *r1 = NULL;
  EpmSharedHostRegistration *reg = NULL, *reg2 = NULL;
  EpmHostRangeId a0 = 0, a1 = 0, own = 0;
  EpmWeightId w0[NW], w1[NW];
  EpmDeviceInfo info;
  EpmResidencyStats s0, s1;
  EpmDevicePtr p0 = 0, p1 = 0;
  size_t total = (size_t)NW * WBYTES;
  unsigned char *raw = malloc(total + 4096), *back = malloc(WBYTES);
  REQUIRE(raw && back);
  /* Page-aligned, so the registration starts on a page of its own. */
  unsigned char *host = raw + ((4096 - ((uintptr_t)raw & 4095)) & 4095);
  th_fill_random(host, total, 18);

  REQUIRE_OK(epm_device_open(0, &d0));
  info.size = sizeof info;
  REQUIRE_OK(epm_device_get_info(d0, &info));
  const char *kind = info.kind == EPM_DEVICE_KIND_HOST ? "host" : "cuda";
  EpmStatus st = epm_device_open_select(kind, 1, &d1);
  if (st == EPM_STATUS_DEVICE_UNAVAILABLE) {
    printf("skipped: 1 device (%s)\n", epm_last_error_message());
    goto cleanup;
  }
  REQUIRE_OK(st);

  REQUIRE_OK(epm_shared_host_registration_create(d0, host, total, &reg));
  /* Page-locked already: neither device may register the bytes again. */
  CHECK_STATUS(epm_shared_host_registration_create(d1, host, total, &reg2), EPM_STATUS_INVALID_STATE);
  CHECK(reg2 == NULL);

  REQUIRE_OK(make_res(d0, total, &r0));
  REQUIRE_OK(make_res(d1, total / 2, &r1)); /* a budget of its own */
  CHECK_STATUS(epm_residency_register_host_range(r1, host, WBYTES, &own), EPM_STATUS_INVALID_STATE);
  REQUIRE_OK(epm_residency_attach_host_registration(r0, reg, &a0));
  REQUIRE_OK(epm_residency_attach_host_registration(r1, reg, &a1));
  /* The managers hold it now; the caller's handle can go. */
  REQUIRE_OK(epm_shared_host_registration_destroy(reg));
  reg = NULL;
  for (int i = 0; i < NW; i++) {
    REQUIRE_OK(epm_residency_register_weight(r0, host + (size_t)i * WBYTES, WBYTES, &w0[i]));
    REQUIRE_OK(epm_residency_register_weight(r1, host + (size_t)i * WBYTES, WBYTES, &w1[i]));
  }
  REQUIRE_OK(epm_residency_declare_cycle(r0, w0, NW));
  REQUIRE_OK(epm_residency_declare_cycle(r1, w1, NW));
  for (int step = 0; step < 2; step++) {
    CHECK(all_match(d0, r0, w0, host, back));
    CHECK(all_match(d1, r1, w1, host, back));
  }
  REQUIRE(stats(r0, &s0) && stats(r1, &s1));
  CHECK(s0.page_ins > 0 && s1.page_ins > 0);
  CHECK(s0.staged_page_ins == 0 && s1.staged_page_ins == 0);
  CHECK(s0.bypassed_page_ins == s0.page_ins && s1.bypassed_page_ins == s1.page_ins);
  CHECK(s0.source_registrations == 0 && s1.source_registrations == 0);
  CHECK(s0.registered_bytes == 0 && s1.registered_bytes == 0);
  CHECK(s0.attached_bytes == total && s1.attached_bytes == total);
  CHECK(s0.budget_bytes == total && s1.budget_bytes == total / 2);
  CHECK(s1.peak_resident_bytes <= total / 2 && s1.evictions > 0);

  /* Detach one: the other still copies directly; after both, the bytes are
   * free to register again (nothing stale left registered). */
  CHECK_OK(epm_residency_unregister_host_range(r0, a0));
  CHECK(all_match(d1, r1, w1, host, back));
  CHECK(stats(r1, &s1) && s1.staged_page_ins == 0);
  CHECK_STATUS(epm_residency_register_host_range(r0, host, WBYTES, &own), EPM_STATUS_INVALID_STATE);
  CHECK_OK(epm_residency_unregister_host_range(r1, a1));
  CHECK_STATUS(epm_residency_unregister_host_range(r1, a1), EPM_STATUS_INVALID_ARGUMENT);
  REQUIRE_OK(epm_residency_register_host_range(r1, host, total, &own));
  CHECK_OK(epm_residency_unregister_host_range(r1, own));

  /* Device memory: distinct ranges; a host device refuses the other's address. */
  REQUIRE_OK(epm_device_alloc(d0, MIB, &p0));
  REQUIRE_OK(epm_device_alloc(d1, MIB, &p1));
  CHECK(p1 + MIB <= p0 || p0 + MIB <= p1);
  if (info.kind == EPM_DEVICE_KIND_HOST) {
    CHECK(epm_memcpy_dtoh(d0, back, p1, 4096) != EPM_STATUS_OK);
    CHECK(epm_memcpy_htod(d1, p0, host, 4096) != EPM_STATUS_OK);
    CHECK_STATUS(epm_device_free(d0, p1), EPM_STATUS_INVALID_ARGUMENT);
  }

cleanup:
  if (p0) epm_device_free(d0, p0);
  if (p1) epm_device_free(d1, p1);
  epm_shared_host_registration_destroy(reg);
  epm_residency_destroy(r0);
  epm_residency_destroy(r1);
  epm_device_destroy(d1);
  epm_device_destroy(d0);
  free(raw);
  free(back);
  TEST_SUMMARY();
}
