/*
 * The misuse suite, codec part: NULLs, bad sizes, unknown dtypes, bad
 * options, short or overlapping buffers. Exact status, non-empty message,
 * out-params untouched.
 */
#include "misuse.h"

static void test_codec(void) {
  static uint16_t v[8192];
  static unsigned char buf[16384];
  static uint16_t out[8192];
  EpmCodecOptions o, small;
  EpmCodecInfo info, untouched;
  for (int i = 0; i < 8192; i++) v[i] = (uint16_t)(0x3C00 + (i % 50));
  o.size = sizeof o;
  MU_EXPECT(epm_codec_options_default(NULL), EPM_STATUS_NULL_POINTER, "NULL out");
  small.size = 8;
  MU_EXPECT(epm_codec_options_default(&small), EPM_STATUS_INVALID_ARGUMENT, "size 8");
  REQUIRE_OK(epm_codec_options_default(&o));
  o.min_bytes = 0;
  info.size = sizeof info;
  memset(&untouched, 0x77, sizeof untouched);
  untouched.size = sizeof untouched;

  MU_EXPECT(epm_codec_plan(NULL, 16, EPM_CODEC_DTYPE_BF16, &o, &info), EPM_STATUS_NULL_POINTER, "NULL src");
  MU_EXPECT(epm_codec_plan(v, 16, EPM_CODEC_DTYPE_BF16, &o, NULL), EPM_STATUS_NULL_POINTER, "NULL out");
  MU_EXPECT(epm_codec_plan(v, 0, EPM_CODEC_DTYPE_BF16, &o, &untouched), EPM_STATUS_INVALID_ARGUMENT, "0 bytes");
  MU_EXPECT(epm_codec_plan(v, 15, EPM_CODEC_DTYPE_BF16, &o, &untouched), EPM_STATUS_INVALID_ARGUMENT, "odd bytes");
  MU_EXPECT(epm_codec_plan(v, 16, 0, &o, &untouched), EPM_STATUS_INVALID_ARGUMENT, "dtype 0");
  MU_EXPECT(epm_codec_plan(v, 16, 99, &o, &untouched), EPM_STATUS_INVALID_ARGUMENT, "dtype 99");
  small = o;
  small.k = 5;
  MU_EXPECT(epm_codec_plan(v, 16, EPM_CODEC_DTYPE_FP16, &small, &untouched), EPM_STATUS_INVALID_ARGUMENT, "k 5");
  small = o;
  small.max_ratio = -1;
  MU_EXPECT(epm_codec_plan(v, 16, EPM_CODEC_DTYPE_FP16, &small, &untouched), EPM_STATUS_INVALID_ARGUMENT, "max_ratio -1");
  small = o;
  small.size = 4;
  MU_EXPECT(epm_codec_plan(v, 16, EPM_CODEC_DTYPE_FP16, &small, &untouched), EPM_STATUS_INVALID_ARGUMENT, "options size 4");
  CHECK(untouched.outcome == 0x77777777u);

  REQUIRE_OK(epm_codec_plan(v, sizeof v, EPM_CODEC_DTYPE_FP16, &o, &info));
  REQUIRE(info.outcome == EPM_CODEC_CODED && info.encoded_bytes < sizeof buf);
  MU_EXPECT(epm_codec_encode(NULL, sizeof v, EPM_CODEC_DTYPE_FP16, &o, buf, sizeof buf, &info), EPM_STATUS_NULL_POINTER, "NULL src");
  MU_EXPECT(epm_codec_encode(v, sizeof v, EPM_CODEC_DTYPE_FP16, &o, NULL, sizeof buf, &untouched), EPM_STATUS_NULL_POINTER, "NULL dst");
  MU_EXPECT(epm_codec_encode(v, sizeof v, EPM_CODEC_DTYPE_FP16, &o, buf, sizeof buf, NULL), EPM_STATUS_NULL_POINTER, "NULL out");
  MU_EXPECT(epm_codec_encode(v, sizeof v, EPM_CODEC_DTYPE_FP16, &o, buf, info.encoded_bytes - 1, &untouched), EPM_STATUS_INVALID_ARGUMENT, "dst one byte short");
  MU_EXPECT(epm_codec_encode(v, sizeof v, EPM_CODEC_DTYPE_FP16, &o, (unsigned char *)v + 2, sizeof v, &untouched), EPM_STATUS_INVALID_ARGUMENT, "dst overlapping src");
  MU_EXPECT(epm_codec_encode(v, sizeof v, 7, &o, buf, sizeof buf, &untouched), EPM_STATUS_INVALID_ARGUMENT, "dtype 7");
  CHECK(untouched.outcome == 0x77777777u);
  REQUIRE_OK(epm_codec_encode(v, sizeof v, EPM_CODEC_DTYPE_FP16, &o, buf, sizeof buf, &info));

  size_t len = info.encoded_bytes;
  MU_EXPECT(epm_codec_validate(NULL, len, &info), EPM_STATUS_NULL_POINTER, "NULL buf");
  MU_EXPECT(epm_codec_validate(buf, len, NULL), EPM_STATUS_NULL_POINTER, "NULL out");
  MU_EXPECT(epm_codec_validate(buf, 0, &untouched), EPM_STATUS_INVALID_ARGUMENT, "0 bytes");
  MU_EXPECT(epm_codec_validate(v, sizeof v, &untouched), EPM_STATUS_INVALID_ARGUMENT, "not a compressed weight");
  MU_EXPECT(epm_codec_validate(buf, len + 16, &untouched), EPM_STATUS_INVALID_ARGUMENT, "16 trailing bytes");
  CHECK(untouched.outcome == 0x77777777u);

  MU_EXPECT(epm_codec_decode(NULL, len, out, sizeof out, 0), EPM_STATUS_NULL_POINTER, "NULL buf");
  MU_EXPECT(epm_codec_decode(buf, len, NULL, sizeof out, 0), EPM_STATUS_NULL_POINTER, "NULL dst");
  MU_EXPECT(epm_codec_decode(buf, len, out, sizeof out - 2, 0), EPM_STATUS_INVALID_ARGUMENT, "dst 2 bytes short");
  MU_EXPECT(epm_codec_decode(buf, len, out, sizeof out + 2, 0), EPM_STATUS_INVALID_ARGUMENT, "dst 2 bytes long");
  MU_EXPECT(epm_codec_decode(buf, len, buf + 64, sizeof out, 0), EPM_STATUS_INVALID_ARGUMENT, "dst overlapping buf");
  REQUIRE_OK(epm_codec_decode(buf, len, out, sizeof out, 0));
  CHECK(memcmp(out, v, sizeof v) == 0);
cleanup:
  return;
}

int main(void) {
  (void)mu_not_a_handle; /* misuse.h's fixture is for handle types; the codec has none */
  RUN(test_codec);
  TEST_SUMMARY();
}
