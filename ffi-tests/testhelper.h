/*
 * A tiny, dependency-free helper for epmem's C tests.
 *
 * Each test program counts failed checks and returns that count from main,
 * so the exit code is the number of failures (0 = pass). CHECK* macros keep
 * going after a failure; REQUIRE* macros jump to the function's single
 * `cleanup:` label, which destroys everything (destroy(NULL) is a no-op).
 */
#ifndef EPM_TESTHELPER_H
#define EPM_TESTHELPER_H

#include <stdio.h>
#include <string.h>

#include "epmem.h"
/* The C tests link the testing build (libepmem_testing.so): its checksum and
 * spin kernels stand in for a model's kernels. */
#include "epmem_testing.h"

static int th_checks = 0;
static int th_failures = 0;

#define TH_FAIL(...)                                        \
  do {                                                      \
    th_failures++;                                          \
    fprintf(stderr, "%s:%d: FAIL: ", __FILE__, __LINE__);   \
    fprintf(stderr, __VA_ARGS__);                           \
    fputc('\n', stderr);                                    \
  } while (0)

/* A condition that must hold. */
#define CHECK(cond)                                         \
  do {                                                      \
    th_checks++;                                            \
    if (!(cond)) TH_FAIL("%s", #cond);                      \
  } while (0)

/* A call that must return `want`; a failure with a non-empty message is also
 * required whenever `want` is not EPM_STATUS_OK. */
#define CHECK_STATUS(call, want)                                                   \
  do {                                                                             \
    EpmStatus th_got = (call);                                                     \
    const char *th_msg = epm_last_error_message();                                 \
    th_checks++;                                                                   \
    if (th_got != (want)) {                                                        \
      TH_FAIL("%s returned %s, want %s (message: \"%s\")", #call,                  \
              epm_status_name((int)th_got), epm_status_name((int)(want)), th_msg); \
    } else if ((want) != EPM_STATUS_OK && th_msg[0] == '\0') {                     \
      TH_FAIL("%s returned %s with an empty last-error message", #call,            \
              epm_status_name((int)th_got));                                       \
    }                                                                              \
  } while (0)

#define CHECK_OK(call) CHECK_STATUS(call, EPM_STATUS_OK)

/* The last error message contains `needle` (call right after the call). */
#define CHECK_MESSAGE_HAS(needle)                                                  \
  do {                                                                             \
    const char *th_msg = epm_last_error_message();                                 \
    th_checks++;                                                                   \
    if (strstr(th_msg, (needle)) == NULL)                                          \
      TH_FAIL("last error \"%s\" does not mention \"%s\"", th_msg, (needle));      \
  } while (0)

/* A call that must succeed for the rest of the test to make sense. */
#define REQUIRE_OK(call)                                                           \
  do {                                                                             \
    EpmStatus th_got = (call);                                                     \
    th_checks++;                                                                   \
    if (th_got != EPM_STATUS_OK) {                                                 \
      TH_FAIL("%s returned %s: %s", #call, epm_status_name((int)th_got),           \
              epm_last_error_message());                                           \
      goto cleanup;                                                                \
    }                                                                              \
  } while (0)

#define REQUIRE(cond)                                       \
  do {                                                      \
    th_checks++;                                            \
    if (!(cond)) {                                          \
      TH_FAIL("%s", #cond);                                 \
      goto cleanup;                                         \
    }                                                       \
  } while (0)

/* Run one test function (void name(void)) and report it. */
#define RUN(test)                                                              \
  do {                                                                         \
    int th_before = th_failures;                                               \
    test();                                                                    \
    printf("%s %s\n", th_failures == th_before ? "ok  " : "FAIL", #test);      \
  } while (0)

/* End of main: summary line, failure count as exit code (capped for the shell). */
#define TEST_SUMMARY()                                                         \
  do {                                                                         \
    printf("%s: %d checks, %d failed\n", __FILE__, th_checks, th_failures);    \
    return th_failures > 125 ? 125 : th_failures;                              \
  } while (0)

/* Deterministic pseudo-random bytes (xorshift64*), so failures reproduce. */
static inline void th_fill_random(unsigned char *p, size_t n, unsigned long long seed) {
  unsigned long long x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (size_t i = 0; i < n; i++) {
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    p[i] = (unsigned char)((x * 0x2545F4914F6CDD1Dull) >> 56);
  }
}

#endif /* EPM_TESTHELPER_H */
