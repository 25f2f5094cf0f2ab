/*
 * A handle whose call panicked is poisoned: the call returns
 * EPM_STATUS_PANIC, and every later call with that handle returns
 * EPM_STATUS_INVALID_STATE ("poisoned by an earlier panic") instead of
 * running on state the panic may have left half-updated. Destroy still
 * works; other handles are unaffected. A KV pool whose lock was held by the
 * panicking call answers so through every one of its handles.
 *
 * The panics come from the test hooks of include/epmem_testing.h (testing
 * build only).
 *   make test-c
 */
#include <stdint.h>
#include <stdlib.h>

#include "testhelper.h"

static void test_device_handle(void) {
  EpmDevice *dev = NULL, *other = NULL;
  EpmStream *s = NULL;
  EpmDeviceInfo info;
  REQUIRE_OK(epm_device_open(0, &dev));
  REQUIRE_OK(epm_device_open(0, &other));
  CHECK_STATUS(epm_testing_panic_device(dev), EPM_STATUS_PANIC);
  CHECK_MESSAGE_HAS("a panic on purpose");
  memset(&info, 0, sizeof info);
  info.size = sizeof info;
  CHECK_STATUS(epm_device_get_info(dev, &info), EPM_STATUS_INVALID_STATE);
  CHECK_MESSAGE_HAS("poisoned by an earlier panic");
  CHECK_STATUS(epm_stream_create(dev, &s), EPM_STATUS_INVALID_STATE);
  CHECK(s == NULL);
  CHECK_STATUS(epm_device_synchronize(dev), EPM_STATUS_INVALID_STATE);
  /* Still poisoned on the next call, not just the first. */
  CHECK_STATUS(epm_device_get_info(dev, &info), EPM_STATUS_INVALID_STATE);
  /* Another handle of the same device is another object: unaffected. */
  CHECK_OK(epm_device_get_info(other, &info));
  REQUIRE_OK(epm_stream_create(other, &s));
  CHECK_OK(epm_device_destroy(dev));
  CHECK_STATUS(epm_device_get_info(dev, &info), EPM_STATUS_INVALID_HANDLE);
  dev = NULL;
  /* A handle that reuses the slot starts clean. */
  REQUIRE_OK(epm_device_open(0, &dev));
  CHECK_OK(epm_device_get_info(dev, &info));
cleanup:
  epm_stream_destroy(s);
  epm_device_destroy(other);
  epm_device_destroy(dev);
}

static void test_residency_handle(void) {
  EpmDevice *dev = NULL;
  EpmStream *s = NULL;
  EpmResidency *res = NULL;
  EpmResidencyConfig cfg;
  EpmWeightId w = 0;
  EpmDevicePtr p = 0;
  static unsigned char weight[65536];
  REQUIRE_OK(epm_device_open(0, &dev));
  REQUIRE_OK(epm_stream_create(dev, &s));
  memset(&cfg, 0, sizeof cfg);
  cfg.size = sizeof cfg;
  REQUIRE_OK(epm_residency_config_default(&cfg));
  cfg.budget_bytes = 1u << 20;
  REQUIRE_OK(epm_residency_create(dev, &cfg, &res));
  REQUIRE_OK(epm_residency_register_weight(res, weight, sizeof weight, &w));
  CHECK_STATUS(epm_testing_panic_residency(res), EPM_STATUS_PANIC);
  CHECK_STATUS(epm_residency_acquire(res, w, s, &p), EPM_STATUS_INVALID_STATE);
  CHECK_MESSAGE_HAS("EpmResidency");
  CHECK(p == 0);
  CHECK_STATUS(epm_residency_acquire_host(res, w, &p), EPM_STATUS_INVALID_STATE);
  CHECK_STATUS(epm_residency_register_weight(res, weight, sizeof weight, &w), EPM_STATUS_INVALID_STATE);
  /* The stream was not used by the panicking call: still fine. */
  CHECK_OK(epm_stream_synchronize(s));
  CHECK_OK(epm_residency_destroy(res));
  res = NULL;
cleanup:
  epm_residency_destroy(res);
  epm_stream_destroy(s);
  epm_device_destroy(dev);
}

static void test_kv_pool_and_its_sequences(void) {
  EpmDevice *dev = NULL;
  EpmStream *s = NULL;
  EpmKvPool *arena = NULL;
  EpmKvSeq *seq = NULL, *seq2 = NULL;
  EpmKvLayout l;
  EpmKvSeqInfo info;
  EpmKvStats st;
  REQUIRE_OK(epm_device_open(0, &dev));
  REQUIRE_OK(epm_stream_create(dev, &s));
  REQUIRE_OK(epm_kv_pool_create(dev, 64u << 20, &arena));
  memset(&l, 0, sizeof l);
  l.size = sizeof l;
  REQUIRE_OK(epm_kv_layout_token_major(2, 2, 64, 2, &l));
  REQUIRE_OK(epm_kv_seq_create(arena, &l, 1024, EPM_KV_ADMIT_ON_DEMAND, &seq));
  REQUIRE_OK(epm_kv_seq_prepare_append(seq, 8, s));
  CHECK_STATUS(epm_testing_panic_kv_pool(arena), EPM_STATUS_PANIC);
  memset(&st, 0, sizeof st);
  st.size = sizeof st;
  CHECK_STATUS(epm_kv_pool_get_stats(arena, &st), EPM_STATUS_INVALID_STATE);
  /* The sequence's handle was not in the panicking call, but its arena's
   * books were: it answers INVALID_STATE too. */
  memset(&info, 0, sizeof info);
  info.size = sizeof info;
  CHECK_STATUS(epm_kv_seq_get_info(seq, &info), EPM_STATUS_INVALID_STATE);
  CHECK_MESSAGE_HAS("KV pool is poisoned");
  CHECK_STATUS(epm_kv_seq_prepare_append(seq, 8, s), EPM_STATUS_INVALID_STATE);
  CHECK_STATUS(epm_kv_seq_create(arena, &l, 1024, EPM_KV_ADMIT_ON_DEMAND, &seq2), EPM_STATUS_INVALID_STATE);
  CHECK(seq2 == NULL);
  /* Destroying a sequence of a poisoned arena ends its handle and says so. */
  CHECK_STATUS(epm_kv_seq_destroy(seq), EPM_STATUS_INVALID_STATE);
  CHECK_STATUS(epm_kv_seq_get_info(seq, &info), EPM_STATUS_INVALID_HANDLE);
  seq = NULL;
  CHECK_OK(epm_kv_pool_destroy(arena));
  arena = NULL;
cleanup:
  epm_kv_seq_destroy(seq);
  epm_kv_pool_destroy(arena);
  epm_stream_destroy(s);
  epm_device_destroy(dev);
}

int main(void) {
  RUN(test_device_handle);
  RUN(test_residency_handle);
  RUN(test_kv_pool_and_its_sequences);
  TEST_SUMMARY();
}
