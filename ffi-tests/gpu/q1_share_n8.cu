/*
 * Q1: one physical granule mapped into N = 8 sequences reads identically at
 * every VA, also under CUDA graph replay (the decode hot path), and stays so
 * after one sharer copies its boundary granule on write.
 *   ffi-tests/gpu/build.sh OUT && OUT/q1_share_n8
 */
#include "probe.h"

int main() {
  Probe p = probe_open("q1_share_n8", 1ull << 30);
  const int N = 8;
  const uint64_t T = 10; /* 1,966,080 B: one partial granule */
  std::vector<unsigned char> bytes;
  EpmKvPrefix *prefix = nullptr;
  EpmKvSeq *o = origin_with_prefix(p, T, 64, bytes, &prefix);
  const uint64_t expect = epm_checksum_host(bytes.data(), bytes.size());
  const uint64_t owned0 = stats(p.arena).owned_bytes;
  size_t free0 = 0, free1 = 0, total = 0;
  RT(cudaMemGetInfo(&free0, &total));

  EpmKvSeq *q[N];
  const unsigned int *bases[N];
  for (int i = 0; i < N; i++) {
    EPM(epm_kv_commit_shared_prefix(prefix, T, 64, EPM_KV_ADMIT_ON_DEMAND, &q[i]));
    bases[i] = (const unsigned int *)seq_info(q[i]).base;
  }
  RT(cudaMemGetInfo(&free1, &total));
  EpmKvStats st = stats(p.arena);
  EXPECT(st.owned_bytes == owned0, "owned %llu -> %llu after 8 sharers", (unsigned long long)owned0,
         (unsigned long long)st.owned_bytes);
  /* The driver may spend a little on page tables for 8 new mappings, never 8 copies. */
  const long long drv = (long long)free0 - (long long)free1;
  printf("driver free memory change over 8 commits: %lld bytes (8 copies would be %llu)\n", drv,
         (unsigned long long)(N * p.granule));
  EXPECT(drv < (long long)(N * p.granule), "driver free memory fell by %lld bytes after 8 sharers", drv);
  for (int i = 0; i < N; i++)
    for (int j = 0; j < i; j++) EXPECT(bases[i] != bases[j], "distinct VAs");

  const unsigned int **d_ptrs = nullptr;
  unsigned long long *d_out = nullptr;
  RT(cudaMalloc(&d_ptrs, sizeof bases));
  RT(cudaMalloc(&d_out, N * sizeof(unsigned long long)));
  RT(cudaMemcpy(d_ptrs, bases, sizeof bases, cudaMemcpyHostToDevice));
  const size_t words = bytes.size() / 4;

  /* Capture one read of all 8 VAs, replay it. */
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  RT(cudaStreamBeginCapture(p.cs, cudaStreamCaptureModeThreadLocal));
  RT(cudaMemsetAsync(d_out, 0, N * sizeof(unsigned long long), p.cs));
  checksum_kernel<<<dim3(64, N), 256, 0, p.cs>>>(d_ptrs, words, d_out);
  RT(cudaStreamEndCapture(p.cs, &graph));
  RT(cudaGraphInstantiate(&exec, graph, 0));
  unsigned long long out[N];
  auto replay_and_check = [&](const char *when) {
    for (int r = 0; r < 20; r++) {
      RT(cudaGraphLaunch(exec, p.cs));
      RT(cudaStreamSynchronize(p.cs));
      RT(cudaMemcpy(out, d_out, sizeof out, cudaMemcpyDeviceToHost));
      for (int i = 0; i < N; i++)
        EXPECT(out[i] == expect, "%s, replay %d, sharer %d: checksum %llx, want %llx", when, r, i, out[i],
               (unsigned long long)expect);
    }
  };
  replay_and_check("graph replay");
  /* Plain launch too. */
  RT(cudaMemset(d_out, 0, sizeof out));
  checksum_kernel<<<dim3(64, N), 256, 0, p.cs>>>(d_ptrs, words, d_out);
  RT(cudaStreamSynchronize(p.cs));
  RT(cudaMemcpy(out, d_out, sizeof out, cudaMemcpyDeviceToHost));
  for (int i = 0; i < N; i++) EXPECT(out[i] == expect, "plain launch, sharer %d", i);

  /* Sharer 0 diverges (COW of its boundary granule, fenced on the stream the
   * graph runs on), writes its own token; the captured graph still reads the
   * same bytes at all 8 VAs. */
  EPM(epm_kv_seq_prepare_append(q[0], 1, p.stream));
  std::vector<unsigned char> mine(p.layout.token_stride, 0xA5);
  RT(cudaMemcpyAsync((void *)((uint64_t)bases[0] + bytes.size()), mine.data(), mine.size(), cudaMemcpyHostToDevice, p.cs));
  RT(cudaStreamSynchronize(p.cs));
  replay_and_check("after sharer 0's copy-on-write");
  st = stats(p.arena);
  EXPECT(st.cow_granules == 1, "cow_granules %llu", (unsigned long long)st.cow_granules);

  RT(cudaGraphExecDestroy(exec));
  RT(cudaGraphDestroy(graph));
  RT(cudaFree(d_ptrs));
  RT(cudaFree(d_out));
  for (int i = 0; i < N; i++) EPM(epm_kv_seq_destroy(q[i]));
  EPM(epm_kv_seq_destroy(o));
  EPM(epm_kv_prefix_unpin(prefix));
  probe_close(p);
  printf("PASS q1_share_n8: one granule at 8 VAs reads identically (checksum %llx), 20 graph replays before and "
         "after a sharer's COW; 8 sharers cost 0 owned bytes\n",
         (unsigned long long)expect);
  return 0;
}
