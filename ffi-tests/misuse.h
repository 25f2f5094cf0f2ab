/*
 * Shared by the test_misuse*.c programs: a fixture holding a live object of
 * every handle type plus a destroyed one of each, and BAD_HANDLES, which
 * feeds a call every kind of bad handle (NULL, three garbage values, a
 * wrong-typed handle, a destroyed handle). tests/misuse_coverage.rs fails
 * when a function of include/epmem.h appears in no misuse case.
 */
#ifndef EPM_MISUSE_H
#define EPM_MISUSE_H

#include <stdint.h>
#include <stdlib.h>

#include "testhelper.h"

/* Fails unless `call` returns `want` with a non-empty message; names the case. */
#define MU_EXPECT(call, want, kind)                                                     \
  do {                                                                                 \
    EpmStatus mu_got = (call);                                                         \
    const char *mu_msg = epm_last_error_message();                                     \
    th_checks++;                                                                       \
    if (mu_got != (want) || mu_msg[0] == '\0')                                         \
      TH_FAIL("%s with %s: got %s, want %s (message: \"%s\")", #call, (kind),          \
              epm_status_name((int)mu_got), epm_status_name((int)(want)), mu_msg);     \
  } while (0)

static int mu_not_a_handle;

/* RUN for a test that takes the fixture. */
#define RUN_FX(test, fx)                                                       \
  do {                                                                         \
    int th_before = th_failures;                                               \
    test(fx);                                                                  \
    printf("%s %s\n", th_failures == th_before ? "ok  " : "FAIL", #test);      \
  } while (0)

/* `call` (which uses `h`, of type `T *`) with every bad handle of type T:
 * INVALID_HANDLE each time. `nullable` is 1 for destroy-like functions,
 * where NULL is a no-op returning OK instead. */
#define BAD_HANDLES_X(T, h, wrong, dead, nullable, call)                               \
  do {                                                                                 \
    T *mu_bad[6] = {NULL, (T *)(uintptr_t)0x40, (T *)UINTPTR_MAX,                      \
                    (T *)(void *)&mu_not_a_handle, (T *)(void *)(wrong),               \
                    (T *)(void *)(dead)};                                              \
    static const char *const mu_kind[6] = {"a NULL handle", "handle 0x40",            \
                                           "handle UINTPTR_MAX", "a host address",     \
                                           "a wrong-typed handle", "a destroyed handle"}; \
    for (int mu_i = 0; mu_i < 6; mu_i++) {                                             \
      T *h = mu_bad[mu_i];                                                             \
      if (mu_i == 0 && (nullable)) {                                                   \
        CHECK_OK(call);                                                                \
        continue;                                                                      \
      }                                                                                \
      MU_EXPECT(call, EPM_STATUS_INVALID_HANDLE, mu_kind[mu_i]);                       \
    }                                                                                  \
  } while (0)

#define BAD_HANDLES(T, h, wrong, dead, call) BAD_HANDLES_X(T, h, wrong, dead, 0, call)
#define BAD_DESTROY(T, h, wrong, dead, call) BAD_HANDLES_X(T, h, wrong, dead, 1, call)

/* A live object of every type (and a second device, for cross-device
 * misuse), and a destroyed handle of every type. */
typedef struct {
  EpmDevice *dev, *dev2, *dead_dev;
  EpmStream *s, *s2, *dead_s;
  EpmEvent *ev, *dead_ev;
  EpmDeviceInfo info;
  EpmDevicePtr d; /* 4096 device bytes */
  unsigned char host[4096];
} MuFx;

static inline int mu_is_host(const MuFx *f) { return f->info.kind == EPM_DEVICE_KIND_HOST; }

static inline int mu_open(MuFx *f) {
  memset(f, 0, sizeof *f);
  REQUIRE_OK(epm_device_open(0, &f->dev));
  REQUIRE_OK(epm_device_open(0, &f->dev2));
  REQUIRE_OK(epm_device_open(0, &f->dead_dev));
  REQUIRE_OK(epm_device_destroy(f->dead_dev));
  f->info.size = sizeof f->info;
  REQUIRE_OK(epm_device_get_info(f->dev, &f->info));
  REQUIRE_OK(epm_stream_create(f->dev, &f->s));
  REQUIRE_OK(epm_stream_create(f->dev2, &f->s2));
  REQUIRE_OK(epm_stream_create(f->dev, &f->dead_s));
  REQUIRE_OK(epm_stream_destroy(f->dead_s));
  REQUIRE_OK(epm_event_create(f->dev, EPM_EVENT_TIMING, &f->ev));
  REQUIRE_OK(epm_event_create(f->dev, 0, &f->dead_ev));
  REQUIRE_OK(epm_event_destroy(f->dead_ev));
  REQUIRE_OK(epm_device_alloc(f->dev, sizeof f->host, &f->d));
  th_fill_random(f->host, sizeof f->host, 7);
  return 1;
cleanup:
  return 0;
}

static inline void mu_close(MuFx *f) {
  if (f->d) CHECK_OK(epm_device_free(f->dev, f->d));
  CHECK_OK(epm_event_destroy(f->ev));
  CHECK_OK(epm_stream_destroy(f->s));
  CHECK_OK(epm_stream_destroy(f->s2));
  CHECK_OK(epm_device_destroy(f->dev));
  CHECK_OK(epm_device_destroy(f->dev2));
}

#endif /* EPM_MISUSE_H */
