/*
 * The misuse suite, part for several devices: shared host registrations and
 * attaching them to residency managers. Same rules as test_misuse.c: exact
 * status, non-empty message, out-params untouched.
 */
#include "misuse.h"

static void test_shared_registration(MuFx *f) {
  EpmSharedHostRegistration *reg = NULL, *dead = NULL, *untouched = NULL;
  EpmResidency *res = NULL, *dead_res = NULL;
  EpmResidencyConfig cfg;
  EpmHostRangeId r = 777;
  const unsigned char *top = (const unsigned char *)(uintptr_t)(UINTPTR_MAX - 31);
  unsigned char *buf = malloc(3 * 4096);
  REQUIRE(buf != NULL);
  unsigned char *page = buf + ((4096 - ((uintptr_t)buf & 4095)) & 4095);

  BAD_HANDLES(EpmDevice, h, f->s, f->dead_dev, epm_shared_host_registration_create(h, page, 4096, &untouched));
  MU_EXPECT(epm_shared_host_registration_create(f->dev, NULL, 4096, &untouched), EPM_STATUS_NULL_POINTER, "NULL host");
  MU_EXPECT(epm_shared_host_registration_create(f->dev, page, 4096, NULL), EPM_STATUS_NULL_POINTER, "NULL out");
  MU_EXPECT(epm_shared_host_registration_create(f->dev, page, 0, &untouched), EPM_STATUS_INVALID_ARGUMENT, "0 bytes");
  MU_EXPECT(epm_shared_host_registration_create(f->dev, top, 64, &untouched), EPM_STATUS_INVALID_ARGUMENT, "overflow");
  CHECK(untouched == NULL);
  REQUIRE_OK(epm_shared_host_registration_create(f->dev, page, 4096, &reg));
  MU_EXPECT(epm_shared_host_registration_create(f->dev2, page + 1024, 64, &untouched), EPM_STATUS_INVALID_STATE,
            "bytes another device registered");
  CHECK(untouched == NULL);
  REQUIRE_OK(epm_shared_host_registration_create(f->dev, page + 4096, 4096, &dead));
  REQUIRE_OK(epm_shared_host_registration_destroy(dead));

  cfg.size = sizeof cfg;
  REQUIRE_OK(epm_residency_config_default(&cfg));
  cfg.budget_bytes = 1u << 20;
  REQUIRE_OK(epm_residency_create(f->dev, &cfg, &res));
  REQUIRE_OK(epm_residency_create(f->dev, &cfg, &dead_res));
  REQUIRE_OK(epm_residency_destroy(dead_res));
  BAD_HANDLES(EpmResidency, h, f->dev, dead_res, epm_residency_attach_host_registration(h, reg, &r));
  BAD_HANDLES(EpmSharedHostRegistration, h, res, dead, epm_residency_attach_host_registration(res, h, &r));
  MU_EXPECT(epm_residency_attach_host_registration(res, reg, NULL), EPM_STATUS_NULL_POINTER, "NULL out_range");
  CHECK(r == 777);
  REQUIRE_OK(epm_residency_attach_host_registration(res, reg, &r));
  BAD_DESTROY(EpmSharedHostRegistration, h, res, dead, epm_shared_host_registration_destroy(h));
  CHECK_OK(epm_residency_unregister_host_range(res, r));

cleanup:
  epm_residency_destroy(res);
  epm_shared_host_registration_destroy(reg);
  free(buf);
}

int main(void) {
  MuFx f;
  if (mu_open(&f)) RUN_FX(test_shared_registration, &f);
  mu_close(&f);
  TEST_SUMMARY();
}
