/*
 * offload_decode: decode a synthetic model whose weights do not fit the VRAM
 * budget, paging them in through epmem's residency manager, and prove on the
 * device that every weight a kernel read was bit-exact.
 *
 * The acquisition pattern that streams the fewest bytes: declare the order of
 * a step once (epm_residency_declare_cycle), then acquire each weight just
 * before the kernel that reads it and release it right after, on the stream
 * that runs the kernel. A step then copies the whole-weight floor: (weights
 * - budget) + one weight (the one being read while the next arrives), at any
 * --prefetch depth. Holding several weights at once (--hold N: acquire N
 * layers, read them, release them, as a framework hook around a whole block
 * does) keeps all N resident for the block's whole compute, so with B blocks
 * a step copies at least (weights - budget) x B / (B - 1) (docs/RESIDENCY.md,
 * "Holding whole blocks"). The demo prints the steady-state bytes per step
 * against those floors.
 *
 * Each step acquires every layer in order on one stream, queues device reads
 * of the device copy (four 4 KiB samples, head to tail, copied into pinned
 * host memory on the same stream, where a kernel of yours would read it), and
 * releases it. At the end of each token the samples are compared with the
 * host weights: a staging buffer or a device block reused too early would
 * show as a mismatch. It uses only the stable API (include/epmem.h). It
 * then prints tokens/s, the
 * residency stats, and the streamed GB/s against the pinned H2D peak measured
 * here with a quick copy from pinned memory. Each figure is followed by a line
 * saying what it means; the last line is the verdict: PASS when every weight
 * a kernel read was bit-exact and residency stayed within the budget.
 *
 * Build and run against an installed epmem (make install, or make install
 * PREFIX=$HOME/.local and PKG_CONFIG_PATH=$HOME/.local/lib/pkgconfig):
 *   cc -std=c11 -O2 offload_decode.c $(pkg-config --cflags --libs epmem) -o offload_decode
 *   ./offload_decode
 * `make demo` does exactly that from a temporary prefix. EPM_DEVICE=auto|cuda|host
 * picks the device (auto: CUDA if present, else the host device, whose
 * timings are the CPU's and say nothing about a GPU).
 *
 * Options (defaults finish in seconds on a small machine):
 *   --layers N        layers (48)              --layer-kib K   bytes per layer (512 KiB)
 *   --budget-pct P    VRAM budget, % of model (50)
 *   --steps S         decode steps (8)
 *   --prefetch D      prefetch depth (1)       --policy cyclic|lru
 *   --hold N          acquire N layers together, then release them (1: around each weight)
 *   --register memlock|never|always            --sync          the host waits for every page-in
 * On the H200:  EPM_DEVICE=cuda ./offload_decode --layer-kib 65536 --steps 16
 */
#define _POSIX_C_SOURCE 200809L
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include <epmem.h>

typedef struct {
  uint32_t layers, steps, prefetch, sync, budget_pct, hold;
  uint32_t policy, reg;
  size_t layer_bytes;
} Options;

static double now_ms(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec * 1e3 + (double)t.tv_nsec / 1e6;
}

/* One line under a figure saying what it means. */
static void means(const char *what) { printf(what[0] == ' ' ? "    %s\n" : "    - %s\n", what); }

static int parse(int argc, char **argv, Options *o) {
  *o = (Options){.layers = 48, .steps = 8, .prefetch = 1, .budget_pct = 50, .hold = 1,
                 .policy = EPM_POLICY_CYCLIC, .reg = EPM_REGISTER_WITHIN_MEMLOCK,
                 .layer_bytes = 512u << 10};
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (!strcmp(a, "--sync")) { o->sync = 1; continue; }
    if (!v) { fprintf(stderr, "%s needs a value\n", a); return -1; }
    i++;
    if (!strcmp(a, "--layers")) o->layers = (uint32_t)strtoul(v, NULL, 10);
    else if (!strcmp(a, "--layer-kib")) o->layer_bytes = (size_t)strtoull(v, NULL, 10) << 10;
    else if (!strcmp(a, "--budget-pct")) o->budget_pct = (uint32_t)strtoul(v, NULL, 10);
    else if (!strcmp(a, "--steps")) o->steps = (uint32_t)strtoul(v, NULL, 10);
    else if (!strcmp(a, "--prefetch")) o->prefetch = (uint32_t)strtoul(v, NULL, 10);
    else if (!strcmp(a, "--hold")) o->hold = (uint32_t)strtoul(v, NULL, 10);
    else if (!strcmp(a, "--policy")) o->policy = !strcmp(v, "lru") ? EPM_POLICY_LRU : EPM_POLICY_CYCLIC;
    else if (!strcmp(a, "--register"))
      o->reg = !strcmp(v, "never") ? EPM_REGISTER_NEVER
             : !strcmp(v, "always") ? EPM_REGISTER_ALWAYS : EPM_REGISTER_WITHIN_MEMLOCK;
    else { fprintf(stderr, "unknown option %s\n", a); return -1; }
  }
  if (o->layers < 2 || o->steps < 1 || o->layer_bytes < 4096 || o->budget_pct < 1 || o->budget_pct > 100 ||
      o->hold < 1 || o->hold > o->layers) {
    fprintf(stderr, "need --layers >= 2, --steps >= 1, --layer-kib >= 4, --budget-pct in 1..100\n");
    return -1;
  }
  return 0;
}

/* Deterministic pseudo-random weights (xorshift64*). */
static void fill_random(unsigned char *p, size_t n, uint64_t seed) {
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (size_t i = 0; i + 8 <= n; i += 8) {
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    uint64_t v = x * 0x2545F4914F6CDD1Dull;
    memcpy(p + i, &v, 8);
  }
}

/* The samples read back per acquire: SAMPLES x SAMPLE_BYTES, head to tail. */
#define SAMPLES 4
#define SAMPLE_BYTES 4096
static size_t sample_offset(size_t layer_bytes, int i) {
  return (size_t)i * (layer_bytes - SAMPLE_BYTES) / (SAMPLES - 1);
}

/* Pinned H2D peak: back-to-back copies of one layer from a pinned arena block. */
static EpmStatus measure_peak(EpmDevice *dev, EpmStream *s, size_t bytes, double *gbps) {
  EpmArena *pinned = NULL;
  EpmEvent *t0 = NULL, *t1 = NULL;
  EpmArenaConfig acfg;
  uint64_t host = 0;
  EpmDevicePtr dst = 0;
  float ms = 0;
  const int reps = 8;
  EpmStatus st;
  acfg.size = sizeof acfg;
  if ((st = epm_arena_config_default(&acfg))) goto cleanup;
  acfg.capacity_bytes = bytes + (64u << 20);
  if ((st = epm_arena_create_pinned(dev, &acfg, &pinned))) goto cleanup;
  if ((st = epm_arena_alloc(pinned, bytes, 0, &host))) goto cleanup;
  memset((void *)(uintptr_t)host, 1, bytes);
  if ((st = epm_device_alloc(dev, bytes, &dst))) goto cleanup;
  if ((st = epm_event_create(dev, EPM_EVENT_TIMING, &t0))) goto cleanup;
  if ((st = epm_event_create(dev, EPM_EVENT_TIMING, &t1))) goto cleanup;
  for (int round = 0; round < 2; round++) { /* the first round warms up */
    if ((st = epm_event_record(t0, s))) goto cleanup;
    for (int i = 0; i < reps; i++)
      if ((st = epm_memcpy_htod_async(dev, dst, (const void *)(uintptr_t)host, bytes, s))) goto cleanup;
    if ((st = epm_event_record(t1, s))) goto cleanup;
    if ((st = epm_event_synchronize(t1))) goto cleanup;
  }
  if ((st = epm_event_elapsed_ms(t0, t1, &ms))) goto cleanup;
  *gbps = (double)bytes * reps / ((double)ms * 1e-3) / 1e9;
cleanup:
  epm_event_destroy(t0);
  epm_event_destroy(t1);
  if (dst) epm_device_free(dev, dst);
  if (host) epm_arena_free(pinned, host);
  epm_arena_destroy(pinned);
  return st;
}

int main(int argc, char **argv) {
  Options o;
  EpmDevice *dev = NULL;
  EpmStream *stream = NULL;
  EpmResidency *res = NULL;
  EpmDeviceInfo info;
  EpmResidencyConfig cfg;
  EpmResidencyStats stats, warm;
  unsigned char *model = NULL, *samples = NULL;
  EpmArena *pinned = NULL;
  EpmArenaConfig acfg;
  uint64_t samples_addr = 0;
  EpmWeightId *ids = NULL;
  EpmStatus st = EPM_STATUS_OK;
  uint64_t mismatches = 0;
  memset(&warm, 0, sizeof warm);
  double peak = 0, t_start = 0, t_decode = 0;
  int rc = 1, host = 1;

  if (parse(argc, argv, &o)) return 2;
  size_t stride = (o.layer_bytes + 4095) & ~(size_t)4095; /* page-aligned layers */
  size_t total = (size_t)o.layers * o.layer_bytes;
  uint64_t budget = (uint64_t)total * o.budget_pct / 100;

  if ((st = epm_device_open(0, &dev))) goto cleanup;
  info.size = sizeof info;
  if ((st = epm_device_get_info(dev, &info))) goto cleanup;
  if ((st = epm_stream_create(dev, &stream))) goto cleanup;

  model = aligned_alloc(4096, stride * o.layers);
  ids = calloc(o.layers, sizeof *ids);
  if (!model || !ids) { fprintf(stderr, "out of host memory\n"); goto cleanup; }
  /* Pinned, so the read-backs queued on the stream stay asynchronous. */
  acfg.size = sizeof acfg;
  if ((st = epm_arena_config_default(&acfg))) goto cleanup;
  { /* one segment, rounded up to the device's granularity */
    uint64_t g = info.granularity ? info.granularity : 4096, need = (uint64_t)o.layers * SAMPLES * SAMPLE_BYTES;
    acfg.capacity_bytes = (need + g - 1) / g * g;
    acfg.chunk_bytes = acfg.capacity_bytes;
  }
  if ((st = epm_arena_create_pinned(dev, &acfg, &pinned))) goto cleanup;
  if ((st = epm_arena_alloc(pinned, (size_t)o.layers * SAMPLES * SAMPLE_BYTES, 0, &samples_addr))) goto cleanup;
  samples = (unsigned char *)(uintptr_t)samples_addr;

  cfg.size = sizeof cfg;
  if ((st = epm_residency_config_default(&cfg))) goto cleanup;
  cfg.budget_bytes = budget;
  cfg.policy = o.policy;
  cfg.register_sources = o.reg;
  cfg.prefetch_depth = o.prefetch;
  cfg.sync_page_in = o.sync;
  { /* fill threads spin while they wait for work: no more than the cores */
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    cfg.fill_threads = cores > 0 && cores < 8 ? (uint32_t)cores : 8;
  }
  if ((st = epm_residency_create(dev, &cfg, &res))) goto cleanup;
  for (uint32_t l = 0; l < o.layers; l++) {
    unsigned char *w = model + (size_t)l * stride;
    fill_random(w, o.layer_bytes, l + 1);
    if ((st = epm_residency_register_weight(res, w, o.layer_bytes, &ids[l]))) goto cleanup;
  }
  if ((st = epm_residency_declare_cycle(res, ids, o.layers))) goto cleanup;

  host = info.kind != EPM_DEVICE_KIND_CUDA;
  printf("offload_decode: %" PRIu32 " layers x %zu KiB = %.1f MiB of weights, budget %.1f MiB (%" PRIu32 "%%), %" PRIu32
         " steps\n", o.layers, o.layer_bytes >> 10, total / 1048576.0, budget / 1048576.0, o.budget_pct, o.steps);
  if (host)
    printf("device: %s: no GPU; the CPU plays one, so every time and GB/s below measures this machine's\n"
           "    memory copies and means nothing about a GPU (run with EPM_DEVICE=cuda on a GPU machine)\n", info.name);
  else
    printf("device: %s (CUDA, compute capability %" PRIu32 ".%" PRIu32 ", pci %s)\n", info.name,
           info.compute_capability_major, info.compute_capability_minor, info.pci_bus_id);

  /* A caller holding whole blocks is re-planned once its holds were seen over
   * a whole cycle: the first steps are not steady state. */
  uint32_t warm_steps = o.steps > 4 ? 3 : 1;
  t_start = now_ms();
  for (uint32_t step = 0; step < o.steps; step++) {
    if (step == warm_steps) { /* the steady state: the plan learnt, the resident set filled */
      if ((st = epm_residency_synchronize(res))) goto cleanup;
      warm.size = sizeof warm;
      if ((st = epm_residency_get_stats(res, &warm))) goto cleanup;
    }
    for (uint32_t l0 = 0; l0 < o.layers; l0 += o.hold) {
      uint32_t l1 = l0 + o.hold < o.layers ? l0 + o.hold : o.layers;
      for (uint32_t l = l0; l < l1; l++) {
        EpmDevicePtr p = 0;
        if ((st = epm_residency_acquire(res, ids[l], stream, &p))) goto cleanup;
        /* Device reads of the weight, ordered after its page-in by the stream
         * (as a kernel launched here would be) and before its release. */
        for (int i = 0; i < SAMPLES; i++) {
          size_t off = sample_offset(o.layer_bytes, i);
          unsigned char *dst = samples + ((size_t)l * SAMPLES + (size_t)i) * SAMPLE_BYTES;
          if ((st = epm_memcpy_dtoh_async(dev, dst, p + off, SAMPLE_BYTES, stream))) goto cleanup;
        }
      }
      for (uint32_t l = l0; l < l1; l++)
        if ((st = epm_residency_release(res, ids[l], stream))) goto cleanup;
    }
    /* End of a token: the host needs the result (here, the samples). */
    if ((st = epm_stream_synchronize(stream))) goto cleanup;
    for (uint32_t l = 0; l < o.layers; l++) {
      for (int i = 0; i < SAMPLES; i++) {
        size_t off = sample_offset(o.layer_bytes, i);
        const unsigned char *got = samples + ((size_t)l * SAMPLES + (size_t)i) * SAMPLE_BYTES;
        if (memcmp(got, model + (size_t)l * stride + off, SAMPLE_BYTES) != 0) {
          if (mismatches < 10)
            fprintf(stderr, "step %" PRIu32 " layer %" PRIu32 ": device bytes at offset %zu differ from the host weight\n",
                    step, l, off);
          mismatches++;
        }
      }
    }
  }
  t_decode = now_ms() - t_start;
  if ((st = epm_residency_synchronize(res))) goto cleanup;
  stats.size = sizeof stats;
  if ((st = epm_residency_get_stats(res, &stats))) goto cleanup;
  if ((st = measure_peak(dev, stream, o.layer_bytes, &peak))) goto cleanup;

  double gbps = (double)stats.htod_bytes / (t_decode * 1e-3) / 1e9;
  uint64_t expected = (uint64_t)o.steps * o.layers;
  double chunk_mib = 16.0 * (double)info.granularity / 1048576.0; /* the arena's default growth step */
  struct rlimit memlock;
  char limit[64] = "unknown";
  if (getrlimit(RLIMIT_MEMLOCK, &memlock) == 0) {
    if (memlock.rlim_cur == RLIM_INFINITY) snprintf(limit, sizeof limit, "unlimited");
    else snprintf(limit, sizeof limit, "%.1f MiB", (double)memlock.rlim_cur / 1048576.0);
  }

  printf("decoded %" PRIu32 " tokens in %.1f ms: %.2f tokens/s\n", o.steps, t_decode, o.steps / (t_decode * 1e-3));
  printf("verified %" PRIu64 " acquires on the device (%d samples of %d bytes each): %" PRIu64 " mismatches\n",
         stats.acquires, SAMPLES, SAMPLE_BYTES, mismatches);
  means("a token is one pass over every layer: acquire it (paging it in if absent), read samples of the device");
  means("  copy on the stream, release it");
  means("the samples (head to tail of each weight) are compared with the host weight; a mismatch means corrupt");
  means("  or too-early reused memory");
  printf("page_ins %" PRIu64 " (prefetch %" PRIu64 ", bypassed %" PRIu64 ", staged %" PRIu64 "), hits %" PRIu64
         ", hit_rate %.3f, evictions %" PRIu64 " (handed on behind readers %" PRIu64 ", host waited %" PRIu64 ")\n",
         stats.page_ins, stats.prefetch_page_ins, stats.bypassed_page_ins, stats.staged_page_ins, stats.hits,
         stats.hit_rate, stats.evictions, stats.ordered_reuses, stats.eviction_waits);
  means("page_ins: copies to the device (prefetch: ahead of use; bypassed: straight from registered memory;");
  means("  staged: through pinned buffers); hits: acquires already resident; hit_rate: hits / acquires;");
  means("  evictions: weights dropped to make room (handed on: their block reused with no host wait)");
  printf("coalesced weights %" PRIu64 "\n", stats.coalesced_weights);
  means("weights under 1 MiB adjacent in memory and in the cycle, paged in as one unit (copies of a few hundred");
  means("  KiB never reach the link's peak)");
  printf("sources registered %" PRIu64 " (refused %" PRIu64 ", %.1f MiB), pinned_alloc_calls %" PRIu64
         ", pinned_reuses %" PRIu64 "\n",
         stats.source_registrations, stats.register_refusals, stats.registered_bytes / 1048576.0,
         stats.pinned_alloc_calls, stats.pinned_reuses);
  if (o.reg == EPM_REGISTER_NEVER)
    means("registration is off (--register never): every page-in is staged through pinned buffers");
  else
    printf("    - registered weights are page-locked and copied directly; refused: registering more would pass the locked-memory\n"
           "      limit (RLIMIT_MEMLOCK, `ulimit -l`, here %s) or the device said no, so those are staged (slower on a GPU)\n",
           limit);
  means("pinned_alloc_calls: staging buffers allocated (flat after warm-up); pinned_reuses: times one was used again");
  printf("htod %.1f MiB: fill_ms %.1f, htod_ms %.1f, stall_ms %.1f (device %.1f, host %.1f)\n",
         stats.htod_bytes / 1048576.0, stats.fill_ms, stats.htod_ms, stats.stall_ms, stats.device_stall_ms,
         stats.host_stall_ms);
  means("htod: bytes copied to the device; fill_ms: CPU time filling staging buffers; htod_ms: device time of the");
  means("  copies; stall_ms: time work waited for a page-in (device: a stream waited; host: the caller blocked)");
  printf("resident %.1f MiB (peak %.1f of %.1f), arena: %" PRIu64 " driver allocs, %.1f MiB committed, "
         "fragmentation %.3f\n",
         stats.resident_bytes / 1048576.0, stats.peak_resident_bytes / 1048576.0, stats.budget_bytes / 1048576.0,
         stats.arena_driver_alloc_calls, stats.arena_committed_bytes / 1048576.0, stats.arena_fragmentation);
  printf("    - resident: weight bytes on the device (never above the budget); the arena they live in commits device memory\n"
         "      in %.0f MiB chunks, so committed can exceed the budget (the bound is under budget_bytes in epmem.h);\n"
         "      driver allocs: chunks committed (flat after warm-up); fragmentation: 1 - largest free range / free bytes\n",
         chunk_mib);
  if (o.steps > 1) {
    double per_step = (double)(stats.htod_bytes - warm.htod_bytes) / (o.steps - warm_steps);
    double forced = (double)(total > budget ? total - budget : 0);
    uint32_t blocks = (o.layers + o.hold - 1) / o.hold;
    printf("steady state: %.1f MiB streamed per step = %.3f x (weights - budget) %.1f MiB\n", per_step / 1048576.0,
           forced > 0 ? per_step / forced : 0.0, forced / 1048576.0);
    if (o.hold == 1) {
      means("around each weight a step copies about (weights - budget) + the largest unit streamed, at any");
      means("  --prefetch depth (a unit: a weight, or a run of small ones coalesced into one copy)");
    } else if (blocks > 1) {
      printf("    - %" PRIu32 " layers held together: each block's weights stay resident for its whole compute, so a step\n"
             "      copies at least (weights - budget) x %" PRIu32 " / %" PRIu32 " = %.1f MiB; --hold 1 streams less\n",
             o.hold, blocks, blocks - 1, forced * blocks / (blocks - 1) / 1048576.0);
    }
  }
  printf("streamed %.2f GB/s over the decode = %.0f%% of the pinned H2D peak %.2f GB/s measured here\n", gbps,
         100.0 * gbps / peak, peak);
  means("bytes copied to the device / decode time, against back-to-back copies from pinned memory timed just");
  means("  now; hits copy nothing, so this is below the peak whenever the decode does other work");

  if (mismatches)
    printf("FAIL: %" PRIu64 " of %" PRIu64 " weight reads on the device differed from the host weights\n", mismatches,
           stats.acquires);
  else if (stats.acquires != expected)
    printf("FAIL: the manager counted %" PRIu64 " acquires, the demo made %" PRIu64 "\n", stats.acquires, expected);
  else if (stats.peak_resident_bytes > stats.budget_bytes)
    printf("FAIL: resident weights peaked at %" PRIu64 " bytes, over the budget of %" PRIu64 "\n",
           stats.peak_resident_bytes, stats.budget_bytes);
  else
    printf("PASS: all %" PRIu64 " weight reads on the device were bit-exact, resident bytes stayed within the budget%s\n",
           stats.acquires, host ? " (host device: the speeds above are this CPU's, not a GPU's)" : "");
  rc = mismatches || stats.acquires != expected || stats.peak_resident_bytes > stats.budget_bytes ? 3 : 0;

cleanup:
  if (st != EPM_STATUS_OK) {
    fprintf(stderr, "offload_decode: %s: %s\n", epm_status_name((int)st), epm_last_error_message());
    printf("FAIL: epmem returned %s before the decode finished: %s\n", epm_status_name((int)st), epm_last_error_message());
  }
  if (samples_addr) epm_arena_free(pinned, samples_addr);
  epm_arena_destroy(pinned);
  epm_residency_destroy(res);
  epm_stream_destroy(stream);
  epm_device_destroy(dev);
  free(model);
  free(ids);
  return rc;
}
