/*
 * The weight codec's C API: plan, encode into a caller-kept buffer, validate,
 * decode; every bf16 and fp16 bit pattern round trips bit-exactly, weights
 * the codec keeps raw say why, and corrupt or truncated buffers are refused
 * with a message.
 */
#include <stdint.h>
#include <stdlib.h>

#include "testhelper.h"

static EpmCodecOptions opts_encode_anything(void) {
  EpmCodecOptions o;
  o.size = sizeof o;
  epm_codec_options_default(&o);
  o.min_bytes = 0;
  o.max_ratio = 1e9;
  o.threads = 2;
  return o;
}

/* Plan, encode into a buffer of exactly the planned size, validate, decode. */
static void round_trip(const uint16_t *v, size_t n, uint32_t dtype, const EpmCodecOptions *o, const char *what) {
  EpmCodecInfo plan, enc, val;
  unsigned char *buf = NULL;
  uint16_t *out = calloc(n ? n : 1, 2);
  plan.size = enc.size = val.size = sizeof plan;
  REQUIRE(out != NULL);
  REQUIRE_OK(epm_codec_plan(v, n * 2, dtype, o, &plan));
  REQUIRE(plan.outcome == EPM_CODEC_CODED && plan.size == sizeof plan);
  buf = malloc(plan.encoded_bytes);
  REQUIRE(buf != NULL);
  REQUIRE_OK(epm_codec_encode(v, n * 2, dtype, o, buf, plan.encoded_bytes, &enc));
  CHECK(enc.encoded_bytes == plan.encoded_bytes && enc.k == plan.k && enc.escapes == plan.escapes);
  REQUIRE_OK(epm_codec_validate(buf, enc.encoded_bytes, &val));
  CHECK(val.outcome == EPM_CODEC_CODED && val.dtype == dtype && val.values == n && val.raw_bytes == n * 2);
  CHECK(val.format_version == enc.format_version && val.encoded_bytes == enc.encoded_bytes);
  CHECK(val.k2 == enc.k2 && val.escapes3 == enc.escapes3 && val.escapes3 <= val.escapes);
  /* v1 has no escape code; v2 always has one; format_version 1 forces v1, k2 forces v2. */
  CHECK((val.format_version == 1 && val.k2 == 0 && val.escapes3 == 0) || (val.format_version == 2 && val.k2 >= 1 && val.k2 <= 4));
  if (o->format_version == 1) CHECK(val.format_version == 1);
  if (o->k2 != 0) CHECK(val.format_version == 2 && val.k2 == o->k2);
  CHECK(val.ratio * (double)(n * 2) > (double)enc.encoded_bytes - 1e-6 && val.ratio * (double)(n * 2) < (double)enc.encoded_bytes + 1e-6);
  REQUIRE_OK(epm_codec_decode(buf, enc.encoded_bytes, out, n * 2, 0));
  if (memcmp(out, v, n * 2) != 0) {
    size_t i = 0;
    while (out[i] == v[i]) i++;
    TH_FAIL("%s: value %zu of %zu decodes to %#06x, want %#06x", what, i, n, out[i], v[i]);
  }
cleanup:
  free(buf);
  free(out);
}

static void test_every_bit_pattern(void) {
  uint16_t *all = malloc(65536 * 2);
  REQUIRE(all != NULL);
  for (uint32_t i = 0; i < 65536; i++) all[i] = (uint16_t)i;
  for (uint32_t k = 0; k <= 4; k++) {
    EpmCodecOptions o = opts_encode_anything();
    o.k = k;
    round_trip(all, 65536, EPM_CODEC_DTYPE_BF16, &o, "all bf16 patterns");
    round_trip(all, 65536, EPM_CODEC_DTYPE_FP16, &o, "all fp16 patterns");
    o.format_version = 1; /* v1 only */
    round_trip(all, 65536, EPM_CODEC_DTYPE_BF16, &o, "all bf16 patterns, v1");
    o.format_version = 0;
    for (uint32_t k2 = 1; k2 <= 4; k2++) {
      o.k2 = k2;
      round_trip(all, 65536, EPM_CODEC_DTYPE_BF16, &o, "all bf16 patterns, v2");
      round_trip(all, 65536, EPM_CODEC_DTYPE_FP16, &o, "all fp16 patterns, v2");
    }
  }
cleanup:
  free(all);
}

/* bf16 of a rough N(0, 0.02): a sum of four uniforms. */
static void weight_like(uint16_t *v, size_t n, unsigned seed) {
  srand(seed);
  for (size_t i = 0; i < n; i++) {
    float x = 0;
    for (int j = 0; j < 4; j++) x += (float)rand() / (float)RAND_MAX;
    x = (x - 2.0f) * 0.035f;
    uint32_t b;
    memcpy(&b, &x, 4);
    v[i] = (uint16_t)(b >> 16);
  }
}

static void test_odd_lengths_and_ratio(void) {
  size_t lens[] = {1, 7, 4095, 4096, 4097, 3 * 4096 + 17};
  uint16_t *v = malloc((1u << 20) * 2);
  EpmCodecOptions o = opts_encode_anything();
  EpmCodecInfo info;
  REQUIRE(v != NULL);
  weight_like(v, 1u << 20, 3);
  for (size_t i = 0; i < sizeof lens / sizeof lens[0]; i++) round_trip(v, lens[i], EPM_CODEC_DTYPE_BF16, &o, "odd length");
  /* Defaults on a 2 MiB weight-like tensor: encoded in format v2, below v1's size. */
  info.size = sizeof info;
  REQUIRE_OK(epm_codec_plan(v, (1u << 20) * 2, EPM_CODEC_DTYPE_BF16, NULL, &info));
  CHECK(info.outcome == EPM_CODEC_CODED && info.ratio > 0.6 && info.ratio < 0.75 && info.format_version == 2);
  printf("   2 MiB weight-like bf16: %.4f x raw, v%u, k=%u, k2=%u\n", info.ratio, info.format_version, info.k, info.k2);
  {
    EpmCodecInfo v1;
    EpmCodecOptions only_v1;
    only_v1.size = sizeof only_v1;
    REQUIRE_OK(epm_codec_options_default(&only_v1));
    only_v1.format_version = 1;
    v1.size = sizeof v1;
    REQUIRE_OK(epm_codec_plan(v, (1u << 20) * 2, EPM_CODEC_DTYPE_BF16, &only_v1, &v1));
    CHECK(v1.format_version == 1 && v1.k2 == 0 && v1.encoded_bytes > info.encoded_bytes);
    /* Options out of range or in conflict are refused. */
    only_v1.k2 = 3;
    CHECK_STATUS(epm_codec_plan(v, 1u << 20, EPM_CODEC_DTYPE_BF16, &only_v1, &v1), EPM_STATUS_INVALID_ARGUMENT);
    CHECK_MESSAGE_HAS("format v2");
    only_v1.format_version = 3;
    only_v1.k2 = 0;
    CHECK_STATUS(epm_codec_plan(v, 1u << 20, EPM_CODEC_DTYPE_BF16, &only_v1, &v1), EPM_STATUS_INVALID_ARGUMENT);
    only_v1.format_version = 0;
    only_v1.k2 = 5;
    CHECK_STATUS(epm_codec_plan(v, 1u << 20, EPM_CODEC_DTYPE_BF16, &only_v1, &v1), EPM_STATUS_INVALID_ARGUMENT);
  }
cleanup:
  free(v);
}

static void test_raw_outcomes_say_why(void) {
  uint16_t small[100];
  unsigned char *noise = malloc(4u << 20);
  EpmCodecInfo info;
  EpmCodecOptions o;
  REQUIRE(noise != NULL);
  weight_like(small, 100, 1);
  info.size = sizeof info;
  /* Raw: dst may be NULL and is never written. */
  REQUIRE_OK(epm_codec_encode(small, sizeof small, EPM_CODEC_DTYPE_BF16, NULL, NULL, 0, &info));
  CHECK(info.outcome == EPM_CODEC_RAW_TOO_SMALL && info.encoded_bytes == 0 && info.raw_bytes == sizeof small);
  th_fill_random(noise, 4u << 20, 5);
  REQUIRE_OK(epm_codec_encode(noise, 4u << 20, EPM_CODEC_DTYPE_BF16, NULL, NULL, 0, &info));
  CHECK(info.outcome == EPM_CODEC_RAW_NO_GAIN && info.ratio >= 0.9);
  REQUIRE_OK(epm_codec_plan(noise, 4u << 20, EPM_CODEC_DTYPE_OTHER, NULL, &info));
  CHECK(info.outcome == EPM_CODEC_RAW_UNSUPPORTED_DTYPE && info.raw_bytes == 4u << 20);
  /* The documented defaults. */
  o.size = sizeof o;
  REQUIRE_OK(epm_codec_options_default(&o));
  CHECK(o.max_ratio == 0.9 && o.min_bytes == 1u << 20 && o.k == 0 && o.threads == 0);
  CHECK(o.format_version == 0 && o.k2 == 0);
cleanup:
  free(noise);
}

static void test_corrupt_and_truncated_buffers_are_refused(void) {
  uint16_t v[9000];
  unsigned char *buf = NULL;
  uint16_t out[9000];
  EpmCodecOptions o = opts_encode_anything();
  EpmCodecInfo info;
  info.size = sizeof info;
  weight_like(v, 9000, 9);
  REQUIRE_OK(epm_codec_plan(v, sizeof v, EPM_CODEC_DTYPE_BF16, &o, &info));
  buf = malloc(info.encoded_bytes);
  REQUIRE(buf != NULL);
  REQUIRE_OK(epm_codec_encode(v, sizeof v, EPM_CODEC_DTYPE_BF16, &o, buf, info.encoded_bytes, &info));
  size_t len = info.encoded_bytes;
  for (size_t at = 0; at < len; at += 61) {
    buf[at] ^= 0x10;
    CHECK_STATUS(epm_codec_validate(buf, len, &info), EPM_STATUS_INVALID_ARGUMENT);
    CHECK_MESSAGE_HAS("refused");
    memset(out, 0x5A, sizeof out);
    CHECK_STATUS(epm_codec_decode(buf, len, out, sizeof out, 1), EPM_STATUS_INVALID_ARGUMENT);
    CHECK(out[0] == 0x5A5A && out[8999] == 0x5A5A); /* never decoded into */
    buf[at] ^= 0x10;
  }
  CHECK_STATUS(epm_codec_validate(buf, len - 1, &info), EPM_STATUS_INVALID_ARGUMENT);
  CHECK_MESSAGE_HAS("truncated");
  CHECK_STATUS(epm_codec_validate(buf, 100, &info), EPM_STATUS_INVALID_ARGUMENT);
  CHECK_MESSAGE_HAS("truncated");
  CHECK_OK(epm_codec_validate(buf, len, &info));
cleanup:
  free(buf);
}

int main(void) {
  RUN(test_every_bit_pattern);
  RUN(test_odd_lengths_and_ratio);
  RUN(test_raw_outcomes_say_why);
  RUN(test_corrupt_and_truncated_buffers_are_refused);
  TEST_SUMMARY();
}
