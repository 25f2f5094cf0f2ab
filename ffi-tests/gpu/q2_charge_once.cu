/*
 * Q2: charge-once against the real ledger. A 2,048-token qwen14b prefix
 * (192 granules) shared by 8 sequences is charged once; it stays alive until
 * the last sharer and the pin are gone; admission is measured by admitting
 * until the ledger refuses.
 *   ffi-tests/gpu/build.sh OUT && OUT/q2_charge_once
 */
#include "probe.h"

/* Requests of `total` tokens, the first `prefix` shared or not, admitted (RESERVE) until refused. */
static unsigned count_admitted(Probe &p, uint64_t budget, uint64_t prefix, uint64_t total, bool share) {
  EpmKvPool *a = nullptr;
  EPM(epm_kv_pool_create(p.dev, budget + p.granule /* the dummy */, &a));
  std::vector<EpmKvSeq *> seqs;
  EpmKvSeq *o = nullptr;
  EpmKvPrefix *pin = nullptr;
  EPM(epm_kv_seq_create(a, &p.layout, total, EPM_KV_ADMIT_PROMISE, &o));
  EPM(epm_kv_seq_prepare_append(o, prefix, p.stream));
  EPM(epm_kv_prefix_pin(o, prefix, p.stream, &pin));
  seqs.push_back(o);
  for (;;) {
    EpmKvSeq *q = nullptr;
    EpmStatus st = share ? epm_kv_commit_shared_prefix(pin, prefix, total, EPM_KV_ADMIT_PROMISE, &q)
                         : epm_kv_seq_create(a, &p.layout, total, EPM_KV_ADMIT_PROMISE, &q);
    if (st == EPM_STATUS_OUT_OF_BUDGET) break;
    EXPECT(st == EPM_STATUS_OK, "admission: %s", epm_last_error_message());
    seqs.push_back(q);
  }
  unsigned n = (unsigned)seqs.size();
  for (auto *q : seqs) EPM(epm_kv_seq_destroy(q));
  EPM(epm_kv_prefix_unpin(pin));
  EPM(epm_kv_pool_destroy(a));
  return n;
}

int main() {
  Probe p = probe_open("q2_charge_once", 64ull << 30);
  const uint64_t T = 2048, MiB = 1ull << 20;
  const uint64_t prefix_bytes = T * p.layout.token_stride; /* 384 MiB */
  std::vector<unsigned char> bytes;
  EpmKvPrefix *prefix = nullptr;
  size_t f0, f1, f2, total;
  RT(cudaMemGetInfo(&f0, &total));
  EpmKvSeq *o = origin_with_prefix(p, T, T + 64, bytes, &prefix);
  RT(cudaMemGetInfo(&f1, &total));
  const uint64_t owned1 = stats(p.arena).owned_bytes;
  EXPECT(owned1 == prefix_bytes + p.granule, "owned %llu, want prefix %llu + dummy", (unsigned long long)owned1,
         (unsigned long long)prefix_bytes);
  EpmKvSeq *q[8];
  for (int i = 0; i < 7; i++) EPM(epm_kv_commit_shared_prefix(prefix, T, T + 64, EPM_KV_ADMIT_ON_DEMAND, &q[i]));
  RT(cudaMemGetInfo(&f2, &total));
  EpmKvStats st = stats(p.arena);
  EXPECT(st.owned_bytes == owned1, "7 more sharers changed owned bytes %llu -> %llu", (unsigned long long)owned1,
         (unsigned long long)st.owned_bytes);
  EXPECT(st.mapped_bytes == 8 * prefix_bytes, "mapped %llu", (unsigned long long)st.mapped_bytes);
  const double saved = (double)(st.mapped_bytes - (st.owned_bytes - p.granule)) / MiB;
  printf("8 sharers of 2,048 tokens: mapped %llu MiB, owned %llu MiB (dummy incl.), saved %.0f MiB (seed: 2,688 MiB)\n",
         (unsigned long long)(st.mapped_bytes / MiB), (unsigned long long)(st.owned_bytes / MiB), saved);
  printf("driver free memory: prefix took %.0f MiB, 7 sharers took %.1f MiB\n", ((double)f0 - f1) / MiB,
         ((double)f1 - f2) / MiB);
  EXPECT(saved == 2688.0, "saved %.0f MiB", saved);
  EXPECT((double)f1 - f2 < 7.0 * prefix_bytes / 100, "7 sharers took %.1f MiB of device memory", ((double)f1 - f2) / MiB);

  /* Lifetime: the origin goes, the pin goes; the prefix lives until the last sharer. */
  EPM(epm_kv_seq_destroy(o));
  EPM(epm_kv_prefix_unpin(prefix));
  for (int i = 0; i < 7; i++) {
    EXPECT(stats(p.arena).owned_bytes == owned1, "sharer %d: prefix freed early", i);
    EPM(epm_kv_seq_destroy(q[i]));
  }
  st = stats(p.arena);
  EXPECT(st.owned_bytes == p.granule, "after the last sharer: owned %llu", (unsigned long long)st.owned_bytes);
  EXPECT(st.charges - st.credits == 1, "charges %llu credits %llu", (unsigned long long)st.charges,
         (unsigned long long)st.credits);

  /* Admission: 3.0 GiB budget, 2,048 shared + 2,048 private tokens. */
  EpmKvRequestCost c;
  memset(&c, 0, sizeof c);
  c.size = sizeof c;
  EPM(epm_kv_request_cost(p.arena, &p.layout, T, 2 * T, &c));
  EpmKvAdmission ad;
  memset(&ad, 0, sizeof ad);
  ad.size = sizeof ad;
  EPM(epm_kv_admissible(3ull << 30, c.prefix_bytes, c.private_bytes, &ad));
  unsigned unshared = count_admitted(p, 3ull << 30, T, 2 * T, false);
  unsigned shared = count_admitted(p, 3ull << 30, T, 2 * T, true);
  printf("3.0 GiB budget, 50/50: admitted %u unshared, %u shared (arithmetic %llu / %llu; shorthand 4 -> 8 via "
         "1+floor((B-P)/Q) = %llu, one more than fits)\n",
         unshared, shared, (unsigned long long)ad.without_sharing, (unsigned long long)ad.with_sharing,
         (unsigned long long)ad.seed_formula);
  EXPECT(unshared == ad.without_sharing && shared == ad.with_sharing, "measured %u/%u", unshared, shared);
  probe_close(p);
  printf("PASS q2_charge_once: 8 sharers charged once (%.0f MiB saved), freed with the last sharer, admission %u -> %u\n",
         saved, unshared, shared);
  return 0;
}
