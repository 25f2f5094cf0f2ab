/*
 * KV batch reservations through the C API: slots at a fixed
 * stride behind one base pointer; each slot reads and writes only its own
 * granules; a prefix shared into many slots is charged once; copy-on-write in
 * one slot leaves the others intact; slots join and leave while the others
 * keep their addresses and bytes; misuse is a status with a message.
 * Runs on the device EPM_DEVICE names (host in CI, the fake libcuda in
 * `make test-c`, cuda on a GPU machine).
 *   make test-c      (or: cc -std=c11 -Iinclude ffi-tests/test_kv_batch.c -Ltarget/release -lepmem)
 */
#include <stdint.h>
#include <stdlib.h>

#include "testhelper.h"

#define GIB (1ull << 30)
#define BPT 196608u /* qwen14b: 48 x 2 x 8 x 128 x 2 bytes per token */

static EpmKvLayout qwen14b(void) {
  EpmKvLayout l;
  memset(&l, 0, sizeof l);
  l.size = sizeof l;
  if (epm_kv_layout_token_major(48, 8, 128, 2, &l) != EPM_STATUS_OK) l.size = 0;
  return l;
}

static EpmKvStats stats(EpmKvPool *a) {
  EpmKvStats s;
  memset(&s, 0, sizeof s);
  s.size = sizeof s;
  if (epm_kv_pool_get_stats(a, &s) != EPM_STATUS_OK) s.owned_bytes = UINT64_MAX;
  return s;
}

static EpmKvBatchSlotInfo slot_info(EpmKvSeq *q) {
  EpmKvBatchSlotInfo i;
  memset(&i, 0, sizeof i);
  i.size = sizeof i;
  if (epm_kv_batch_slot_get_info(q, &i) != EPM_STATUS_OK) i.slot = UINT32_MAX;
  return i;
}

static EpmKvBatchDesc desc_of(EpmKvBatch *b) {
  EpmKvBatchDesc d;
  memset(&d, 0, sizeof d);
  d.size = sizeof d;
  if (epm_kv_batch_get_desc(b, &d) != EPM_STATUS_OK) d.base = 0;
  return d;
}

/* 1 if the first `n` bytes at device address `p` are all zero. */
static int zeros_at(EpmDevice *dev, uint64_t p, size_t n) {
  unsigned char *buf = malloc(n);
  int ok = buf && epm_memcpy_dtoh(dev, buf, p, n) == EPM_STATUS_OK;
  for (size_t i = 0; ok && i < n; i++) ok = buf[i] == 0;
  free(buf);
  return ok;
}

/* 1 if the `n` bytes at `p` equal `want`. */
static int bytes_at(EpmDevice *dev, uint64_t p, const unsigned char *want, size_t n) {
  unsigned char *buf = malloc(n);
  int ok = buf && epm_memcpy_dtoh(dev, buf, p, n) == EPM_STATUS_OK && memcmp(buf, want, n) == 0;
  free(buf);
  return ok;
}

static void test_descriptor_and_stride(void) {
  EpmDevice *dev = NULL;
  EpmKvPool *a = NULL;
  EpmKvBatch *b = NULL;
  EpmKvSeq *q[3] = {0};
  EpmKvLayout l = qwen14b();
  EpmKvBatchDesc d;
  EpmDeviceInfo di;
  uint64_t g = 0, owned = 0;

  CHECK(sizeof(EpmKvBatchDesc) == EPM_KV_BATCH_DESC_SIZE_V1);
  CHECK(sizeof(EpmKvBatchSlotInfo) == EPM_KV_BATCH_SLOT_INFO_SIZE_V1);
  REQUIRE_OK(epm_device_open(0, &dev));
  memset(&di, 0, sizeof di);
  di.size = sizeof di;
  REQUIRE_OK(epm_device_get_info(dev, &di));
  g = di.granularity;
  REQUIRE_OK(epm_kv_pool_create(dev, GIB, &a));
  owned = stats(a).owned_bytes;
  REQUIRE_OK(epm_kv_batch_create(a, &l, 40, 16, &b));
  CHECK(stats(a).owned_bytes == owned); /* a batch charges nothing */
  d = desc_of(b);
  CHECK(d.size == sizeof d);
  CHECK(d.base != 0 && d.base % g == 0);
  CHECK(d.slot_stride == (40ull * BPT + g - 1) / g * g);
  CHECK(d.max_slots == 16 && d.max_tokens == 40 && d.live_slots == 0);
  CHECK(d.token_stride == BPT && d.layer_stride == l.layer_stride && d.kv_stride == l.kv_stride &&
        d.head_stride == l.head_stride);
  CHECK(d.layers == 48 && d.kv_heads == 8 && d.head_dim == 128 && d.elem_bytes == 2);
  CHECK(d.granule_bytes == g && d.reserved_bytes == 16 * d.slot_stride);
  /* The whole range is mapped: the head of every granule reads zeros. */
  for (uint64_t off = 0; off < d.reserved_bytes; off += g) CHECK(zeros_at(dev, d.base + off, 4096));
  REQUIRE_OK(epm_kv_batch_take_slot(b, 5, EPM_KV_ADMIT_ON_DEMAND, &q[0]));
  REQUIRE_OK(epm_kv_batch_take_slot(b, EPM_KV_BATCH_ANY_SLOT, EPM_KV_ADMIT_ON_DEMAND, &q[1]));
  REQUIRE_OK(epm_kv_batch_take_slot(b, EPM_KV_BATCH_ANY_SLOT, EPM_KV_ADMIT_PROMISE, &q[2]));
  {
    EpmKvBatchSlotInfo i0 = slot_info(q[0]), i1 = slot_info(q[1]), i2 = slot_info(q[2]);
    EpmKvSeqInfo si;
    CHECK(i0.slot == 5 && i1.slot == 0 && i2.slot == 1);
    CHECK(i0.base == d.base + 5 * d.slot_stride && i1.base == d.base && i2.base == d.base + d.slot_stride);
    CHECK(i0.max_slots == 16 && i0.max_tokens == 40 && i0.len_tokens == 0 && i0.committed_tokens == 0);
    CHECK(i2.promised_granules == d.slot_stride / g);
    /* A slot is an EpmKvSeq: the sequence functions see the same base. */
    memset(&si, 0, sizeof si);
    si.size = sizeof si;
    CHECK_OK(epm_kv_seq_get_info(q[0], &si));
    CHECK(si.base == i0.base && si.reserved_bytes == d.slot_stride);
  }
  CHECK(desc_of(b).live_slots == 3);

cleanup:
  for (int i = 0; i < 3; i++) CHECK_OK(epm_kv_seq_destroy(q[i])); /* destroy releases a slot too */
  CHECK_OK(epm_kv_batch_destroy(b));
  if (a) CHECK(stats(a).owned_bytes == owned && stats(a).sequences == 0);
  epm_kv_pool_destroy(a);
  epm_device_destroy(dev);
}

static void test_sharing_cow_join_leave(void) {
  enum { SLOTS = 10, P = 50 };
  EpmDevice *dev = NULL;
  EpmStream *s = NULL;
  EpmKvPool *a = NULL;
  EpmKvBatch *b = NULL;
  EpmKvSeq *q[SLOTS] = {0}, *joined = NULL;
  EpmKvPrefix *p = NULL;
  EpmKvLayout l = qwen14b();
  EpmKvBatchDesc d;
  EpmDeviceInfo di;
  size_t n = (size_t)P * BPT;
  unsigned char *prompt = malloc(n), *mine = malloc(BPT);
  uint64_t g = 0, owned = 0, free0 = 0, free1 = 0, total = 0, k = 0, base3 = 0;

  REQUIRE(prompt && mine);
  th_fill_random(prompt, n, 14);
  th_fill_random(mine, BPT, 15);
  REQUIRE_OK(epm_device_open(0, &dev));
  memset(&di, 0, sizeof di);
  di.size = sizeof di;
  REQUIRE_OK(epm_device_get_info(dev, &di));
  g = di.granularity;
  k = (n + g - 1) / g;
  REQUIRE_OK(epm_stream_create(dev, &s));
  REQUIRE_OK(epm_kv_pool_create(dev, 4 * GIB, &a));
  REQUIRE_OK(epm_kv_batch_create(a, &l, 128, SLOTS, &b));
  d = desc_of(b);
  /* Slot 0 holds the prompt; pinned, it is mapped into slots 1..9. */
  REQUIRE_OK(epm_kv_batch_take_slot(b, 0, EPM_KV_ADMIT_ON_DEMAND, &q[0]));
  REQUIRE_OK(epm_kv_seq_prepare_append(q[0], P, s));
  REQUIRE_OK(epm_memcpy_htod(dev, d.base, prompt, n));
  REQUIRE_OK(epm_kv_prefix_pin(q[0], P, s, &p));
  owned = stats(a).owned_bytes;
  CHECK(owned == g + k * g);
  REQUIRE_OK(epm_device_mem_info(dev, &free0, &total));
  for (int i = 1; i < SLOTS; i++) {
    REQUIRE_OK(epm_kv_batch_take_shared_slot(b, EPM_KV_BATCH_ANY_SLOT, p, P, EPM_KV_ADMIT_ON_DEMAND, s, &q[i]));
    CHECK(slot_info(q[i]).slot == (uint32_t)i);
    CHECK(slot_info(q[i]).len_tokens == P && slot_info(q[i]).shared_granules == k);
  }
  CHECK(stats(a).owned_bytes == owned); /* nine sharers: one physical copy */
  CHECK(stats(a).mapped_bytes == SLOTS * k * g);
  REQUIRE_OK(epm_device_mem_info(dev, &free1, &total));
  if (di.kind == EPM_DEVICE_KIND_CUDA) CHECK(free0 - free1 <= 2 * g || free1 >= free0); /* and the driver agrees */
  for (int i = 0; i < SLOTS; i++) CHECK(bytes_at(dev, d.base + (uint64_t)i * d.slot_stride, prompt, n));
  /* Shared bytes are read-only in every slot; the tail past them is the dummy. */
  CHECK(epm_memcpy_htod(dev, d.base + 4 * d.slot_stride, mine, 4096) != EPM_STATUS_OK);
  CHECK(epm_last_error_message()[0] != '\0');
  CHECK(zeros_at(dev, d.base + 4 * d.slot_stride + k * g, 4096));

  /* Copy-on-write in slot 2: token 50 lies in the shared boundary granule. */
  REQUIRE_OK(epm_kv_seq_prepare_append(q[2], 1, s));
  REQUIRE_OK(epm_stream_synchronize(s));
  CHECK(stats(a).owned_bytes == owned + g);
  CHECK(stats(a).cow_granules == 1);
  REQUIRE_OK(epm_memcpy_htod(dev, d.base + 2 * d.slot_stride + n, mine, BPT));
  CHECK(bytes_at(dev, d.base + 2 * d.slot_stride, prompt, n));
  CHECK(bytes_at(dev, d.base + 2 * d.slot_stride + n, mine, BPT));
  for (int i = 0; i < SLOTS; i++) {
    if (i == 2) continue;
    CHECK(bytes_at(dev, d.base + (uint64_t)i * d.slot_stride, prompt, n));
    CHECK(zeros_at(dev, d.base + (uint64_t)i * d.slot_stride + k * g, 4096)); /* the dummy past the prefix */
  }

  /* Slot 2 leaves: its private granule returns to the pool, the slot reads
   * zeros, and every other slot keeps its base and bytes. */
  CHECK_OK(epm_kv_batch_release_slot(q[2], s));
  q[2] = NULL;
  CHECK(stats(a).owned_bytes == owned);
  CHECK(stats(a).pool_retained >= 1);
  CHECK(zeros_at(dev, d.base + 2 * d.slot_stride, 4096));
  CHECK(desc_of(b).live_slots == SLOTS - 1);
  base3 = slot_info(q[3]).base;
  /* A new sequence joins in the freed slot, declaring the prompt's tokens. */
  {
    uint32_t toks[P];
    uint64_t shared = 99;
    for (int i = 0; i < P; i++) toks[i] = 7000 + (uint32_t)i;
    CHECK_OK(epm_kv_seq_declare_tokens(q[0], toks, P));
    CHECK_OK(epm_kv_prefix_unpin(p));
    p = NULL;
    REQUIRE_OK(epm_kv_prefix_pin(q[0], P, s, &p));
    REQUIRE_OK(epm_kv_batch_take_slot_for_tokens(b, EPM_KV_BATCH_ANY_SLOT, toks, P, EPM_KV_ADMIT_ON_DEMAND, s, &joined,
                                                 &shared));
    CHECK(shared == 48); /* three whole 16-token blocks */
    CHECK(slot_info(joined).slot == 2);
    CHECK(bytes_at(dev, d.base + 2 * d.slot_stride, prompt, 48u * BPT));
  }
  CHECK(slot_info(q[3]).base == base3);
  CHECK(bytes_at(dev, base3, prompt, n));

cleanup:
  if (joined) CHECK_OK(epm_kv_batch_release_slot(joined, s));
  for (int i = 0; i < SLOTS; i++)
    if (q[i]) CHECK_OK(epm_kv_batch_release_slot(q[i], s));
  CHECK_OK(epm_kv_prefix_unpin(p));
  CHECK_OK(epm_kv_batch_destroy(b));
  if (a) CHECK(stats(a).owned_bytes == g);
  epm_kv_pool_destroy(a);
  epm_stream_destroy(s);
  epm_device_destroy(dev);
  free(prompt);
  free(mine);
}

static void test_misuse(void) {
  EpmDevice *dev = NULL;
  EpmStream *s = NULL;
  EpmKvPool *a = NULL, *a2 = NULL;
  EpmKvBatch *b = NULL, *b2 = NULL;
  EpmKvSeq *q0 = NULL, *q1 = NULL, *x = NULL, *plain = NULL, *other = NULL;
  EpmKvPrefix *foreign = NULL;
  EpmKvLayout l = qwen14b();
  EpmKvBatchDesc d;
  EpmKvBatchSlotInfo si;

  REQUIRE_OK(epm_device_open(0, &dev));
  REQUIRE_OK(epm_stream_create(dev, &s));
  REQUIRE_OK(epm_kv_pool_create(dev, GIB, &a));
  CHECK_STATUS(epm_kv_batch_create(a, &l, 0, 2, &b), EPM_STATUS_INVALID_ARGUMENT);
  CHECK_STATUS(epm_kv_batch_create(a, &l, 16, 0, &b), EPM_STATUS_INVALID_ARGUMENT);
  CHECK_STATUS(epm_kv_batch_create(a, &l, 16, EPM_KV_BATCH_ANY_SLOT, &b), EPM_STATUS_INVALID_ARGUMENT);
  CHECK_STATUS(epm_kv_batch_create(a, NULL, 16, 2, &b), EPM_STATUS_NULL_POINTER);
  CHECK(b == NULL);
  REQUIRE_OK(epm_kv_batch_create(a, &l, 16, 2, &b));
  CHECK_STATUS(epm_kv_batch_take_slot(b, 2, 0, &q0), EPM_STATUS_INVALID_ARGUMENT); /* index out of range */
  CHECK_MESSAGE_HAS("slot 2");
  CHECK_STATUS(epm_kv_batch_take_slot(b, 0, 9, &q0), EPM_STATUS_INVALID_ARGUMENT);
  CHECK_MESSAGE_HAS("admit mode");
  REQUIRE_OK(epm_kv_batch_take_slot(b, 0, EPM_KV_ADMIT_ON_DEMAND, &q0));
  CHECK_STATUS(epm_kv_batch_take_slot(b, 0, 0, &x), EPM_STATUS_INVALID_STATE); /* taken */
  REQUIRE_OK(epm_kv_batch_take_slot(b, EPM_KV_BATCH_ANY_SLOT, EPM_KV_ADMIT_ON_DEMAND, &q1));
  CHECK_STATUS(epm_kv_batch_take_slot(b, EPM_KV_BATCH_ANY_SLOT, 0, &x), EPM_STATUS_ALL_IN_USE); /* > max_slots */
  CHECK_MESSAGE_HAS("all 2 slots");
  CHECK(x == NULL);
  /* Append past max_tokens. */
  CHECK_OK(epm_kv_seq_prepare_append(q0, 16, s));
  CHECK_STATUS(epm_kv_seq_prepare_append(q0, 1, s), EPM_STATUS_INVALID_ARGUMENT);
  /* Destroying the batch with live slots: refused, the batch still works. */
  CHECK_STATUS(epm_kv_batch_destroy(b), EPM_STATUS_INVALID_STATE);
  CHECK_MESSAGE_HAS("taken slot");
  d = desc_of(b);
  CHECK(d.live_slots == 2);
  /* Wrong handle types. */
  CHECK_STATUS(epm_kv_batch_take_slot((EpmKvBatch *)(void *)a, 0, 0, &x), EPM_STATUS_INVALID_HANDLE);
  CHECK_MESSAGE_HAS("EpmKvBatch");
  CHECK_STATUS(epm_kv_batch_release_slot((EpmKvSeq *)(void *)b, s), EPM_STATUS_INVALID_HANDLE);
  CHECK_MESSAGE_HAS("EpmKvSeq");
  CHECK_STATUS(epm_kv_seq_prepare_append((EpmKvSeq *)(void *)b, 1, s), EPM_STATUS_INVALID_HANDLE);
  /* A plain sequence is not a slot. */
  REQUIRE_OK(epm_kv_seq_create(a, &l, 16, 0, &plain));
  CHECK_STATUS(epm_kv_batch_release_slot(plain, s), EPM_STATUS_INVALID_ARGUMENT);
  CHECK_MESSAGE_HAS("not a slot");
  memset(&si, 0, sizeof si);
  si.size = sizeof si;
  CHECK_STATUS(epm_kv_batch_slot_get_info(plain, &si), EPM_STATUS_INVALID_ARGUMENT);
  si.size = 8;
  CHECK_STATUS(epm_kv_batch_slot_get_info(q0, &si), EPM_STATUS_INVALID_ARGUMENT);
  memset(&d, 0, sizeof d);
  d.size = EPM_KV_BATCH_DESC_SIZE_V1 - 8;
  CHECK_STATUS(epm_kv_batch_get_desc(b, &d), EPM_STATUS_INVALID_ARGUMENT);
  /* A prefix of another pool. */
  REQUIRE_OK(epm_kv_pool_create(dev, GIB, &a2));
  REQUIRE_OK(epm_kv_seq_create(a2, &l, 16, 0, &other));
  REQUIRE_OK(epm_kv_seq_prepare_append(other, 4, s));
  REQUIRE_OK(epm_kv_prefix_pin(other, 4, s, &foreign));
  REQUIRE_OK(epm_kv_batch_create(a2, &l, 16, 1, &b2));
  CHECK_OK(epm_kv_batch_release_slot(q1, s));
  q1 = NULL;
  CHECK_STATUS(epm_kv_batch_take_shared_slot(b, EPM_KV_BATCH_ANY_SLOT, foreign, 4, 0, s, &x), EPM_STATUS_INVALID_ARGUMENT);
  CHECK_MESSAGE_HAS("another KV pool");
  CHECK(desc_of(b).live_slots == 1);
  /* Released handles are stale. */
  CHECK_OK(epm_kv_batch_release_slot(q0, s));
  CHECK_STATUS(epm_kv_batch_release_slot(q0, s), EPM_STATUS_INVALID_HANDLE);
  CHECK_STATUS(epm_kv_seq_prepare_append(q0, 1, s), EPM_STATUS_INVALID_HANDLE);
  q0 = NULL;
  CHECK_OK(epm_kv_batch_destroy(b));
  CHECK_STATUS(epm_kv_batch_destroy(b), EPM_STATUS_INVALID_HANDLE);
  CHECK_STATUS(epm_kv_batch_take_slot(b, 0, 0, &x), EPM_STATUS_INVALID_HANDLE);
  b = NULL;
  CHECK_OK(epm_kv_batch_destroy(NULL));
  /* The pool handle may go first: batches keep it alive. */
  CHECK_OK(epm_kv_pool_destroy(a2));
  a2 = NULL;
  CHECK_OK(epm_kv_batch_take_shared_slot(b2, 0, foreign, 4, 0, s, &x));
  CHECK_OK(epm_kv_batch_release_slot(x, s));
  x = NULL;

cleanup:
  epm_kv_seq_destroy(q0);
  epm_kv_seq_destroy(q1);
  epm_kv_seq_destroy(x);
  epm_kv_seq_destroy(plain);
  epm_kv_seq_destroy(other);
  epm_kv_prefix_unpin(foreign);
  epm_kv_batch_destroy(b);
  CHECK_OK(epm_kv_batch_destroy(b2));
  epm_kv_pool_destroy(a2);
  epm_kv_pool_destroy(a);
  epm_stream_destroy(s);
  epm_device_destroy(dev);
}

int main(void) {
  RUN(test_descriptor_and_stride);
  RUN(test_sharing_cow_join_leave);
  RUN(test_misuse);
  TEST_SUMMARY();
}
