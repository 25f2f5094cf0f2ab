// Times decode-kernel variants (PTX files with the epm_codec_decode entry,
// each JIT-loaded by the driver as epmem loads codec.ptx, launched with
// epmem's grid, one block per 4096 values, of 256 threads or the count after
// the variant's @; epmem's own codec.ptx takes 128) on the cases
// `bench_codec --dump DIR` wrote, and checks every decode bit-exact against
// the case's raw input, with guard bytes behind the output.
//
//   nvcc -O2 -o codec-kernel-bench scripts/codec-kernel-bench.cu -lcuda
//   codec-kernel-bench DIR RUNS NAME=PTX[@THREADS] [NAME=PTX[@THREADS] ...]
//
// Prints each variant's registers, spills, shared memory and resident blocks
// per SM, then a table: per case, each variant's output GB/s (decoded bytes
// over the event time, median of RUNS) and a D2D copy of the same size.
// Exit status 1 on any mismatch or CUDA error. scripts/codec-gpu.sh
// --variants builds and runs it.
//
// Cases may be format v1 or v2 (v2's fields of the parameter block filled
// from the header as tools/codec-emu/emulate.cpp does). A variant whose
// entry takes the 88-byte v1 parameter block (the baseline,
// scripts/codec-kernel-v1.cu, or a codec.cu from before v2) cannot decode
// v2: it is skipped on v2 cases, said so in its table cell and in a line
// after the table, and is not a failure.
#include <cuda.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

// codec.cu's EpmDecodeParams, field for field. A v1-only kernel's block is
// the first 88 bytes (the driver copies the size the entry declares).
struct Params {
  uint64_t dst, offsets, codes, lows, escapes, n_values, n_escapes;
  uint32_t dtype, k, code_bits, blocks;
  uint8_t table[16];
  // Format v2 (all 0 for a v1 case).
  uint64_t offsets3, escapes3, n_escapes3;
  uint32_t k2, reserved;
  uint8_t table2[16];
};
static_assert(sizeof(Params) == 136, "EpmDecodeParams is 136 bytes");
static_assert(offsetof(Params, table) == 72 && offsetof(Params, offsets3) == 88 && offsetof(Params, k2) == 112 &&
                  offsetof(Params, table2) == 120,
              "EpmDecodeParams' layout");

static void check(CUresult r, const char *what) {
  if (r != CUDA_SUCCESS) {
    const char *s = nullptr;
    cuGetErrorString(r, &s);
    fprintf(stderr, "codec-kernel-bench: FAIL: %s: %s\n", what, s ? s : "unknown error");
    exit(1);
  }
}
#define CK(x) check((x), #x)

static std::vector<unsigned char> slurp(const std::string &path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) {
    fprintf(stderr, "codec-kernel-bench: FAIL: cannot read %s\n", path.c_str());
    exit(1);
  }
  return std::vector<unsigned char>(std::istreambuf_iterator<char>(f), {});
}

static uint64_t u64_at(const std::vector<unsigned char> &b, size_t at) {
  uint64_t v;
  memcpy(&v, b.data() + at, 8);
  return v;
}

struct Variant {
  std::string name;
  CUmodule mod;
  CUfunction f;
  unsigned int threads;
  int param_bytes;  // the entry's parameter block as the PTX declares it (-1: not found)
};

// The size of epm_codec_decode's parameter block in PTX text: the number in
// ".param .align 8 .b8 epm_codec_decode_param_0[N]", or -1.
static int ptx_param_bytes(const std::vector<unsigned char> &ptx) {
  const std::string text(ptx.begin(), ptx.end());
  const std::string key = "epm_codec_decode_param_0[";
  const size_t at = text.find(key);
  if (at == std::string::npos) return -1;
  return atoi(text.c_str() + at + key.size());
}

int main(int argc, char **argv) {
  if (argc < 4) {
    fprintf(stderr, "usage: %s DIR RUNS NAME=PTX[@THREADS] [NAME=PTX[@THREADS] ...]\n", argv[0]);
    return 2;
  }
  const std::string dir = argv[1];
  const int runs = std::max(1, atoi(argv[2]));
  CK(cuInit(0));
  CUdevice dev;
  CK(cuDeviceGet(&dev, 0));
  CUcontext ctx;
  CK(cuDevicePrimaryCtxRetain(&ctx, dev));
  CK(cuCtxSetCurrent(ctx));
  char dev_name[256];
  CK(cuDeviceGetName(dev_name, sizeof dev_name, dev));
  int sms = 0;
  CK(cuDeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev));
  printf("codec-kernel-bench on %s (%d SMs), %d runs per figure\n\n", dev_name, sms, runs);

  std::vector<Variant> vs;
  printf("| variant | threads/block | parameter bytes | registers | local (spill) bytes | static shared bytes | blocks/SM |\n|---|---|---|---|---|---|---|\n");
  for (int i = 3; i < argc; i++) {
    const std::string arg = argv[i];
    const size_t eq = arg.find('=');
    if (eq == std::string::npos) {
      fprintf(stderr, "codec-kernel-bench: %s is not NAME=PTX\n", arg.c_str());
      return 2;
    }
    std::string path = arg.substr(eq + 1);
    unsigned int threads = 256;
    const size_t at = path.rfind('@');
    if (at != std::string::npos) {
      threads = (unsigned int)atoi(path.c_str() + at + 1);
      path = path.substr(0, at);
      if (threads == 0 || threads > 1024) {
        fprintf(stderr, "codec-kernel-bench: %s: bad thread count\n", arg.c_str());
        return 2;
      }
    }
    std::vector<unsigned char> ptx = slurp(path);
    ptx.push_back(0);
    Variant v{arg.substr(0, eq), nullptr, nullptr, threads, ptx_param_bytes(ptx)};
    CK(cuModuleLoadData(&v.mod, ptx.data()));
    CK(cuModuleGetFunction(&v.f, v.mod, "epm_codec_decode"));
    int regs = 0, local = 0, shared = 0, occ = 0;
    CK(cuFuncGetAttribute(&regs, CU_FUNC_ATTRIBUTE_NUM_REGS, v.f));
    CK(cuFuncGetAttribute(&local, CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, v.f));
    CK(cuFuncGetAttribute(&shared, CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, v.f));
    CK(cuOccupancyMaxActiveBlocksPerMultiprocessor(&occ, v.f, (int)threads, 0));
    printf("| %s | %u | %d | %d | %d | %d | %d |\n", v.name.c_str(), threads, v.param_bytes, regs, local, shared, occ);
    vs.push_back(v);
  }

  std::ifstream list(dir + "/cases.txt");
  if (!list) {
    fprintf(stderr, "codec-kernel-bench: FAIL: no %s/cases.txt (run bench_codec --dump %s)\n", dir.c_str(), dir.c_str());
    return 1;
  }
  printf("\nGB/s of decoded output (median of %d); every decode checked bit-exact first\n\n| case | MiB | ratio | k | escapes | k2 | level-3 |", runs);
  for (auto &v : vs) printf(" %s |", v.name.c_str());
  printf(" D2D |\n|---|---|---|---|---|---|---|");
  for (size_t i = 0; i <= vs.size(); i++) printf("---|");
  printf("\n");

  CUstream s;
  CK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  CUevent a, b;
  CK(cuEventCreate(&a, CU_EVENT_DEFAULT));
  CK(cuEventCreate(&b, CU_EVENT_DEFAULT));
  const size_t guard = 256;
  int fails = 0, cases = 0;
  std::vector<std::string> skipped;
  std::vector<double> worst(vs.size(), 1e30);
  std::string name;
  while (std::getline(list, name)) {
    if (name.empty()) continue;
    cases++;
    const std::vector<unsigned char> buf = slurp(dir + "/" + name + ".epmz");
    const std::vector<unsigned char> raw = slurp(dir + "/" + name + ".raw");
    const unsigned int version = buf.size() < 128 ? 0u : (unsigned int)buf[4] | (unsigned int)buf[5] << 8;
    if (buf.size() < 128 || memcmp(buf.data(), "EPMZ", 4) != 0 || (version != 1 && version != 2) ||
        u64_at(buf, 64) != buf.size() || u64_at(buf, 16) * 2 != raw.size()) {
      fprintf(stderr, "codec-kernel-bench: FAIL: %s: not a format v1 or v2 buffer of its raw file\n", name.c_str());
      return 1;
    }
    const uint64_t n = u64_at(buf, 16);
    CUdeviceptr src, dst, copy;
    CK(cuMemAlloc(&src, buf.size()));
    CK(cuMemAlloc(&dst, raw.size() + guard));
    CK(cuMemAlloc(&copy, raw.size()));
    CK(cuMemcpyHtoD(src, buf.data(), buf.size()));
    Params p;
    memset(&p, 0, sizeof p);
    p.dst = dst;
    p.offsets = src + u64_at(buf, 32);
    p.codes = src + u64_at(buf, 40);
    p.lows = src + u64_at(buf, 48);
    p.escapes = src + u64_at(buf, 56);
    p.n_values = n;
    p.n_escapes = u64_at(buf, 24);
    p.dtype = buf[8];
    p.k = buf[9];
    p.code_bits = buf[10];
    p.blocks = (uint32_t)((n + 4095) / 4096);
    memcpy(p.table, buf.data() + 72, 16);
    if (version == 2) {
      // The escape stream is k2-bit codes; the level-3 index follows the
      // escape index (both B + 1 u32, each padded to 16 bytes).
      p.k2 = buf[11];
      memcpy(p.table2, buf.data() + 88, 16);
      p.n_escapes3 = u64_at(buf, 104);
      p.escapes3 = src + u64_at(buf, 112);
      p.offsets3 = src + 128 + ((((uint64_t)p.blocks + 1) * 4 + 15) & ~(uint64_t)15);
    }
    void *args[] = {&p};
    printf("| %s | %.1f | %.4f | %u | %.2f%% | %u | %.3f%% |", name.c_str(), raw.size() / 1048576.0,
           (double)buf.size() / raw.size(), p.k, 100.0 * p.n_escapes / n, p.k2, 100.0 * p.n_escapes3 / n);
    fflush(stdout);
    std::vector<unsigned char> out(raw.size() + guard);
    auto time = [&](auto &&launch) {
      launch();  // warm-up
      std::vector<double> gbps;
      for (int r = 0; r < runs; r++) {
        CK(cuEventRecord(a, s));
        launch();
        CK(cuEventRecord(b, s));
        CK(cuEventSynchronize(b));
        float ms = 0;
        CK(cuEventElapsedTime(&ms, a, b));
        gbps.push_back(raw.size() / (ms * 1e6));
      }
      std::sort(gbps.begin(), gbps.end());
      return gbps[gbps.size() / 2];
    };
    for (size_t i = 0; i < vs.size(); i++) {
      if (version == 2 && vs[i].param_bytes >= 0 && vs[i].param_bytes < (int)sizeof(Params)) {
        // A v1-only kernel (88-byte parameter block) cannot decode v2.
        printf(" skipped (v2) |");
        fflush(stdout);
        skipped.push_back(vs[i].name + " on " + name);
        continue;
      }
      auto launch = [&] { CK(cuLaunchKernel(vs[i].f, p.blocks, 1, 1, vs[i].threads, 1, 1, 0, s, args, nullptr)); };
      CK(cuMemsetD8Async(dst, 0xA5, raw.size() + guard, s));
      launch();
      CK(cuMemcpyDtoHAsync(out.data(), dst, out.size(), s));
      CK(cuStreamSynchronize(s));
      size_t bad = raw.size();
      for (size_t j = 0; j < raw.size(); j++)
        if (out[j] != raw[j]) {
          bad = j;
          break;
        }
      bool guard_ok = true;
      for (size_t j = raw.size(); j < out.size(); j++) guard_ok &= out[j] == 0xA5;
      if (bad != raw.size() || !guard_ok) {
        fails++;
        printf(" MISMATCH |");
        fprintf(stderr, "codec-kernel-bench: FAIL: %s with %s: %s\n", name.c_str(), vs[i].name.c_str(),
                bad != raw.size() ? ("first difference at byte " + std::to_string(bad)).c_str()
                                  : "wrote past the destination");
        continue;
      }
      const double g = time(launch);
      if (name.rfind("all-", 0) != 0 && name.rfind("odd-", 0) != 0) worst[i] = std::min(worst[i], g);
      printf(" %.1f |", g);
      fflush(stdout);
    }
    const double d2d = time([&] { CK(cuMemcpyDtoDAsync(copy, dst, raw.size(), s)); });
    printf(" %.1f |\n", d2d);
    CK(cuMemFree(src));
    CK(cuMemFree(dst));
    CK(cuMemFree(copy));
  }
  if (cases == 0) {
    fprintf(stderr, "codec-kernel-bench: FAIL: %s/cases.txt lists no case\n", dir.c_str());
    return 1;
  }
  printf("\nslowest distribution case per variant (all-* and odd-* left out: too small to time; the issue's target: >= 1000 GB/s):");
  for (size_t i = 0; i < vs.size(); i++) {
    if (worst[i] < 1e29) printf(" %s %.1f GB/s;", vs[i].name.c_str(), worst[i]);
    else printf(" %s none timed;", vs[i].name.c_str());
  }
  printf("\n");
  for (const std::string &sk : skipped)
    printf("skipped: %s (a format v2 case; the variant takes the v1 parameter block)\n", sk.c_str());
  if (fails) {
    printf("codec-kernel-bench: %d decode(s) NOT bit-exact\n", fails);
    return 1;
  }
  printf("codec-kernel-bench: all %d cases bit-exact with every variant (%zu variant-case pairs skipped: v1-only on v2)\n",
         cases, skipped.size());
  return 0;
}
