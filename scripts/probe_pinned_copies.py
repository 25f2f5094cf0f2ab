#!/usr/bin/env python3
"""Does the speed of host->device copies from page-locked memory depend on how
the memory was allocated (cuMemHostAlloc; mmap + MADV_HUGEPAGE +
cuMemHostRegister; plain mmap + cuMemHostRegister) or on what the process
allocated and freed before (big pageable tensors, many pinned buffers freed
in random order)? Three rounds, each: 20 buffers of each kind (61 MiB + 12
KiB each, about a compressed small-shape weight), copies timed with CUDA events
(best of 5), everything freed, then the churn.

    python3 scripts/probe_pinned_copies.py        # on the GPU machine (torch, libcuda)

Environment: SZ (MiB per buffer, default 61), NB (buffers, default 20).
A probe, not a benchmark: it prints one line per round.
"""
import torch
torch.zeros(1, device="cuda")
cu = ctypes.CDLL("libcuda.so.1")
libc = ctypes.CDLL("libc.so.6", use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
cu.cuMemcpyHtoDAsync_v2.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
cu.cuMemHostAlloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_uint]
cu.cuMemFreeHost.argtypes = [ctypes.c_void_p]
cu.cuMemHostRegister_v2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
cu.cuMemHostUnregister.argtypes = [ctypes.c_void_p]
MB = 1 << 20
SZ = int(os.environ.get("SZ", 61)) * MB + 4096 * 3   # like a compressed small-shape weight
N = int(os.environ.get("NB", 20))
def ck(r, what):
    if r != 0: raise RuntimeError(f"{what}: CUresult {r}")
dev = torch.empty(SZ, dtype=torch.uint8, device="cuda")
stream = torch.cuda.current_stream()
def rate(ptrs):
    best = 0
    for _ in range(5):
        a = torch.cuda.Event(enable_timing=True); b = torch.cuda.Event(enable_timing=True)
        a.record(stream)
        for p in ptrs:
            ck(cu.cuMemcpyHtoDAsync_v2(dev.data_ptr(), p, SZ, stream.cuda_stream), "copy")
        b.record(stream); b.synchronize()
        best = max(best, len(ptrs) * SZ / (a.elapsed_time(b) / 1e3) / 1e9)
    return best
def alloc_host(n):
    out = []
    for _ in range(n):
        p = ctypes.c_void_p(); ck(cu.cuMemHostAlloc(ctypes.byref(p), SZ, 0), "hostalloc"); ctypes.memset(p, 1, SZ); out.append(p.value)
    return out
def free_host(ps):
    for p in ps: ck(cu.cuMemFreeHost(p), "freehost")
H = 2 * MB
def alloc_thp(n, advise=True):
    out = []
    for _ in range(n):
        ln = (SZ + H - 1) // H * H
        raw = libc.mmap(None, ln + H, 3, 0x22, -1, 0)
        al = (raw + H - 1) // H * H
        if advise: libc.madvise(al, ln, 14)
        ctypes.memset(al, 1, SZ)
        ck(cu.cuMemHostRegister_v2(al, ln, 0), "register")
        out.append((raw, al, ln))
    return out
def free_thp(ps):
    for raw, al, ln in ps:
        ck(cu.cuMemHostUnregister(al), "unreg"); libc.munmap(raw, ln + H)
def meminfo(k):
    for l in open("/proc/meminfo"):
        if l.startswith(k): return l.split(":")[1].strip()
for f in ["enabled", "defrag"]:
    try: print("thp", f, open(f"/sys/kernel/mm/transparent_hugepage/{f}").read().strip())
    except Exception as e: print("thp", f, e)
def churn():
    # what a bench process does between offloads: big pageable model tensors, many pinned allocs, freed in random order
    ts = [torch.randn(4096, 11008 // 2) for _ in range(24)]
    ps = alloc_host(60)
    random.seed(1); random.shuffle(ps); free_host(ps[:30])
    ts2 = [torch.randn(4096, 4096) for _ in range(16)]
    free_host(ps[30:]); del ts; del ts2
res = {}
for rnd in range(3):
    a = alloc_host(N); res[f"hostalloc{rnd}"] = rate(a)
    t = alloc_thp(N); res[f"thp{rnd}"] = rate([x[1] for x in t])
    n = alloc_thp(N, advise=False); res[f"mmap_noadvise{rnd}"] = rate([x[1] for x in n])
    print(rnd, {k: round(v, 2) for k, v in res.items() if k.endswith(str(rnd))}, "AnonHuge", meminfo("AnonHugePages"), flush=True)
    free_host(a); free_thp(t); free_thp(n)
    churn()
