/*
 * Q3: write protection of a shared prefix, Linux semantics.
 * - Host-initiated copies (cudaMemcpy, cudaMemcpyAsync, epm_memcpy_htod)
 *   into the read-only prefix are rejected; the error is not sticky (later
 *   work succeeds) and the prefix bytes are intact.
 * - A kernel store into it is run in a CHILD process (this binary re-executed
 *   with --child), because on Linux it raises error 700 and poisons the whole
 *   context; the parent reports what the child saw and checks it is unharmed.
 *   ffi-tests/gpu/build.sh OUT && OUT/q3_write_protect
 */
#include <sys/wait.h>
#include <unistd.h>

#include "probe.h"

__global__ void store_kernel(unsigned int *p) { p[threadIdx.x] = 0xDEADBEEFu; }

static int child() {
  Probe p = probe_open("q3_write_protect(child)", 1ull << 30);
  std::vector<unsigned char> bytes;
  EpmKvPrefix *prefix = nullptr;
  EpmKvSeq *o = origin_with_prefix(p, 12, 64, bytes, &prefix);
  EpmKvSeq *q = nullptr;
  EPM(epm_kv_commit_shared_prefix(prefix, 12, 64, EPM_KV_ADMIT_ON_DEMAND, &q));
  (void)o;
  store_kernel<<<1, 32, 0, p.cs>>>((unsigned int *)seq_info(q).base);
  cudaError_t launch = cudaGetLastError();
  cudaError_t sync = cudaStreamSynchronize(p.cs);
  void *x = nullptr;
  cudaError_t after = cudaMalloc(&x, 4096);
  printf("child: launch %d (%s), synchronize %d (%s), cudaMalloc afterwards %d (%s)\n", (int)launch,
         cudaGetErrorName(launch), (int)sync, cudaGetErrorName(sync), (int)after, cudaGetErrorName(after));
  fflush(stdout);
  /* Exit without cleanup: the context may be gone. 0 = the store faulted. */
  _exit(sync != cudaSuccess ? 0 : 3);
}

int main(int argc, char **argv) {
  if (argc > 1 && strcmp(argv[1], "--child") == 0) return child();
  Probe p = probe_open("q3_write_protect", 1ull << 30);
  std::vector<unsigned char> bytes;
  EpmKvPrefix *prefix = nullptr;
  EpmKvSeq *o = origin_with_prefix(p, 12, 64, bytes, &prefix); /* 12 tokens: 2 granules, the 2nd partial */
  EpmKvSeq *q = nullptr;
  EPM(epm_kv_commit_shared_prefix(prefix, 12, 64, EPM_KV_ADMIT_ON_DEMAND, &q));
  const uint64_t qb = seq_info(q).base;
  std::vector<unsigned char> junk(64 * 1024, 0xEE);

  cudaError_t e1 = cudaMemcpy((void *)qb, junk.data(), junk.size(), cudaMemcpyHostToDevice);
  cudaGetLastError();
  cudaError_t e2 = cudaMemcpyAsync((void *)(qb + p.granule), junk.data(), junk.size(), cudaMemcpyHostToDevice, p.cs);
  cudaError_t e2s = cudaStreamSynchronize(p.cs);
  cudaGetLastError();
  EpmStatus e3 = epm_memcpy_htod(p.dev, qb + 4096, junk.data(), junk.size());
  printf("host copies into the shared prefix: cudaMemcpy %s, cudaMemcpyAsync %s / sync %s, epm_memcpy_htod %s (%s)\n",
         cudaGetErrorName(e1), cudaGetErrorName(e2), cudaGetErrorName(e2s), epm_status_name(e3), epm_last_error_message());
  EXPECT(e1 != cudaSuccess, "cudaMemcpy into the read-only prefix succeeded");
  EXPECT(e2 != cudaSuccess || e2s != cudaSuccess, "cudaMemcpyAsync into the read-only prefix succeeded");
  EXPECT(e3 != EPM_STATUS_OK, "epm_memcpy_htod into the read-only prefix succeeded");

  /* Not sticky: allocation, copies and kernels still work; the bytes are intact. */
  void *scratch = nullptr;
  RT(cudaMalloc(&scratch, 4096));
  RT(cudaFree(scratch));
  EPM(epm_kv_seq_prepare_append(q, 1, p.stream));
  RT(cudaMemcpy((void *)(qb + bytes.size()), junk.data(), p.layout.token_stride, cudaMemcpyHostToDevice));
  for (EpmKvSeq *s : {o, q}) {
    std::vector<unsigned char> back(bytes.size());
    RT(cudaMemcpy(back.data(), (void *)seq_info(s).base, back.size(), cudaMemcpyDeviceToHost));
    EXPECT(back == bytes, "prefix bytes changed");
  }

  /* The kernel store, in a child process. */
  int pipefd[2];
  EXPECT(pipe(pipefd) == 0, "pipe");
  fflush(stdout);
  pid_t pid = fork();
  if (pid == 0) {
    dup2(pipefd[1], 1);
    close(pipefd[0]);
    execl("/proc/self/exe", argv[0], "--child", (char *)nullptr);
    _exit(127);
  }
  close(pipefd[1]);
  char buf[4096];
  ssize_t n, len = 0;
  while ((n = read(pipefd[0], buf + len, sizeof buf - 1 - len)) > 0) len += n;
  buf[len > 0 ? len : 0] = 0;
  int status = 0;
  waitpid(pid, &status, 0);
  printf("%s", buf);
  const bool faulted = WIFEXITED(status) && WEXITSTATUS(status) == 0;
  const bool was700 = strstr(buf, "synchronize 700") != nullptr;
  printf("child exit %d: kernel store into the read-only prefix %s%s\n", WIFEXITED(status) ? WEXITSTATUS(status) : -1,
         faulted ? "faulted" : "did NOT fault", was700 ? " with error 700 (cudaErrorIllegalAddress)" : "");
  EXPECT(faulted, "the child's kernel store into a read-only prefix did not fault (exit status %d)", status);

  /* The parent's context is unharmed and its prefix intact. */
  std::vector<unsigned char> back(bytes.size());
  RT(cudaMemcpy(back.data(), (void *)seq_info(q).base, back.size(), cudaMemcpyDeviceToHost));
  EXPECT(back == bytes, "prefix bytes changed");
  EPM(epm_kv_seq_destroy(q));
  EPM(epm_kv_seq_destroy(o));
  EPM(epm_kv_prefix_unpin(prefix));
  probe_close(p);
  printf("PASS q3_write_protect: host copies rejected (%s), not sticky, bytes intact; kernel store in a child %s\n",
         cudaGetErrorName(e1), was700 ? "raised error 700 and lost its context" : "faulted");
  return 0;
}
