/*
 * Logging: a host callback receives epmem's records up to its level, from
 * any thread; NULL restores the default (stderr when EPM_LOG is set).
 */
#include <stdint.h>
#include <stdlib.h>

#include "testhelper.h"

struct seen {
  int records;
  int above_level;
  char last[256];
};

static void on_log(void *user_data, EpmLogLevel level, const char *message) {
  struct seen *s = user_data;
  s->records++;
  if (level > EPM_LOG_LEVEL_INFO) s->above_level++;
  snprintf(s->last, sizeof s->last, "%s", message);
}

static void test_callback_receives_records(void) {
  struct seen seen = {0, 0, ""};
  EpmDevice *dev = NULL;
  int before;

  REQUIRE_OK(epm_set_log_callback(on_log, &seen, EPM_LOG_LEVEL_INFO));
  /* "auto" says at info level which device it chose. */
  REQUIRE_OK(epm_device_open_select("auto", 0, &dev));
  CHECK(seen.records > 0);
  CHECK(seen.above_level == 0);
  CHECK(strstr(seen.last, "chose") != NULL);
  REQUIRE_OK(epm_set_log_callback(NULL, NULL, EPM_LOG_LEVEL_OFF));
  before = seen.records;
  epm_device_destroy(dev);
  dev = NULL;
  REQUIRE_OK(epm_device_open_select("auto", 0, &dev));
  CHECK(seen.records == before);

cleanup:
  epm_set_log_callback(NULL, NULL, EPM_LOG_LEVEL_OFF);
  epm_device_destroy(dev);
}

int main(void) {
  RUN(test_callback_receives_records);
  TEST_SUMMARY();
}
