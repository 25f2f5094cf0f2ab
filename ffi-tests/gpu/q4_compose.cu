/*
 * Q4: a read-only shared prefix, a read-write private granule and the
 * read-only dummy tail coexist in one reservation, with the access postures
 * the driver reports; a kernel (and a captured graph) reads the whole range;
 * and prepare_append fences the stream before remapping the tail a queued
 * kernel is still reading.
 *   ffi-tests/gpu/build.sh OUT && OUT/q4_compose
 */
#include "probe.h"

__global__ void fill_kernel(unsigned int *p, size_t words, unsigned int v) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < words; i += (size_t)gridDim.x * blockDim.x) p[i] = v;
}

static unsigned long long access_of(uint64_t va) {
  CUmemLocation loc;
  memset(&loc, 0, sizeof loc);
  loc.type = CU_MEM_LOCATION_TYPE_DEVICE;
  loc.id = 0;
  unsigned long long flags = 0;
  DRV(cuMemGetAccess(&flags, &loc, (CUdeviceptr)va));
  return flags;
}

static CUmemGenericAllocationHandle handle_of(uint64_t va) {
  CUmemGenericAllocationHandle h;
  DRV(cuMemRetainAllocationHandle(&h, (void *)va));
  DRV(cuMemRelease(h)); /* retain took a reference; the value identifies the allocation */
  return h;
}

int main() {
  Probe p = probe_open("q4_compose", 1ull << 30);
  const uint64_t g = p.granule;
  /* 32 tokens x 196,608 B = exactly 3 granules of prefix. */
  const uint64_t T = 3 * g / p.layout.token_stride;
  EXPECT(T * p.layout.token_stride == 3 * g, "granule %llu does not hold a whole number of tokens",
         (unsigned long long)g);
  std::vector<unsigned char> bytes;
  EpmKvPrefix *prefix = nullptr;
  EpmKvSeq *o = origin_with_prefix(p, T, T, bytes, &prefix);
  EpmKvSeq *q = nullptr;
  const uint64_t max = 2 * T; /* 6 granules */
  EPM(epm_kv_commit_shared_prefix(prefix, T, max, EPM_KV_ADMIT_ON_DEMAND, &q));
  EPM(epm_kv_seq_prepare_append(q, 5, p.stream)); /* granule 3 private */
  EpmKvSeqInfo qi = seq_info(q);
  EXPECT(qi.reserved_bytes == 6 * g && qi.shared_granules == 3 && qi.private_granules == 1, "layout of the reservation");
  const uint64_t b = qi.base;

  /* Postures: RO shared, RW private, RO dummy. */
  const char *names[6] = {"shared", "shared", "shared", "private", "dummy", "dummy"};
  const unsigned long long want[6] = {CU_MEM_ACCESS_FLAGS_PROT_READ, CU_MEM_ACCESS_FLAGS_PROT_READ,
                                      CU_MEM_ACCESS_FLAGS_PROT_READ, CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
                                      CU_MEM_ACCESS_FLAGS_PROT_READ, CU_MEM_ACCESS_FLAGS_PROT_READ};
  for (int i = 0; i < 6; i++) {
    unsigned long long a = access_of(b + i * g);
    printf("granule %d (%s): access flags %llu\n", i, names[i], a);
    EXPECT(a == want[i], "granule %d (%s): access %llu, want %llu", i, names[i], a, want[i]);
  }
  EXPECT(handle_of(b + 4 * g) == handle_of(b + 5 * g), "the tail granules are one dummy allocation");
  EXPECT(handle_of(b) == handle_of(seq_info(o).base), "the shared granule is the origin's allocation");
  EXPECT(handle_of(b + 3 * g) != handle_of(b + 4 * g), "the private granule is its own allocation");

  /* Host copies: refused into the prefix and the tail, accepted into the private granule. */
  std::vector<unsigned char> junk(4096, 0x5A);
  EXPECT(cudaMemcpy((void *)b, junk.data(), junk.size(), cudaMemcpyHostToDevice) != cudaSuccess, "copy into prefix");
  cudaGetLastError();
  EXPECT(cudaMemcpy((void *)(b + 4 * g), junk.data(), junk.size(), cudaMemcpyHostToDevice) != cudaSuccess, "copy into dummy");
  cudaGetLastError();
  RT(cudaMemcpy((void *)(b + 3 * g), junk.data(), junk.size(), cudaMemcpyHostToDevice));

  /* A kernel writes the private granule and reads the whole reservation. */
  fill_kernel<<<64, 256, 0, p.cs>>>((unsigned int *)(b + 3 * g), g / 4, 3u);
  const unsigned int *ptrs[4] = {(const unsigned int *)b, (const unsigned int *)(b + 3 * g),
                                 (const unsigned int *)(b + 4 * g), (const unsigned int *)b};
  const unsigned int **d_ptrs = nullptr;
  unsigned long long *d_out = nullptr, out[4];
  RT(cudaMalloc(&d_ptrs, sizeof ptrs));
  RT(cudaMalloc(&d_out, sizeof out));
  RT(cudaMemcpy(d_ptrs, ptrs, sizeof ptrs, cudaMemcpyHostToDevice));
  RT(cudaMemsetAsync(d_out, 0, sizeof out, p.cs));
  /* ptrs[3] reads all 6 granules in one sweep. */
  checksum_kernel<<<dim3(64, 3), 256, 0, p.cs>>>(d_ptrs, g / 4, d_out);
  checksum_kernel<<<dim3(64, 1), 256, 0, p.cs>>>(d_ptrs + 3, 6 * g / 4, d_out + 3);
  RT(cudaStreamSynchronize(p.cs));
  RT(cudaMemcpy(out, d_out, sizeof out, cudaMemcpyDeviceToHost));
  std::vector<unsigned int> threes(g / 4, 3u);
  EXPECT(out[0] == epm_checksum_host(bytes.data(), g), "prefix granule 0 reads the prefix");
  EXPECT(out[1] == epm_checksum_host((const unsigned char *)threes.data(), g), "private granule reads what the kernel wrote");
  EXPECT(out[2] == 0, "the dummy tail reads zeros");
  printf("one sweep over all 6 granules: checksum %llx\n", out[3]);

  /* Fence: a queued kernel still reading the tail when prepare_append remaps it.
   * The spin keeps the stream busy ~50 ms; prepare_append must wait for the
   * read before unmapping the dummy, or the read faults (error 700). */
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  RT(cudaStreamBeginCapture(p.cs, cudaStreamCaptureModeThreadLocal));
  spin_kernel<<<1, 1, 0, p.cs>>>(100000000LL);
  checksum_kernel<<<dim3(64, 1), 256, 0, p.cs>>>(d_ptrs + 3, 6 * g / 4, d_out + 3);
  RT(cudaStreamEndCapture(p.cs, &graph));
  RT(cudaGraphInstantiate(&exec, graph, 0));
  RT(cudaGraphLaunch(exec, p.cs));
  const double t0 = now_us();
  EPM(epm_kv_seq_prepare_append(q, max - T - 5, p.stream)); /* granules 4 and 5 become private */
  const double waited = now_us() - t0;
  RT(cudaStreamSynchronize(p.cs));
  RT(cudaGraphLaunch(exec, p.cs)); /* the same captured graph over the new mappings */
  RT(cudaStreamSynchronize(p.cs));
  printf("prepare_append waited %.1f ms for the queued read before remapping the tail\n", waited / 1e3);
  EXPECT(waited > 10e3, "prepare_append returned after %.1f ms: it did not wait for the queued kernel", waited / 1e3);
  EXPECT(access_of(b + 5 * g) == CU_MEM_ACCESS_FLAGS_PROT_READWRITE, "tail is private now");

  RT(cudaGraphExecDestroy(exec));
  RT(cudaGraphDestroy(graph));
  RT(cudaFree(d_ptrs));
  RT(cudaFree(d_out));
  EPM(epm_kv_seq_destroy(q));
  EPM(epm_kv_seq_destroy(o));
  EPM(epm_kv_prefix_unpin(prefix));
  probe_close(p);
  printf("PASS q4_compose: RO shared prefix + RW private + RO dummy tail in one reservation; whole-range reads and "
         "graph replay fault-free; remap fenced behind a queued read (%.0f ms)\n", waited / 1e3);
  return 0;
}
