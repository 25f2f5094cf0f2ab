// The baseline decode kernel (codes staged in shared memory, each value
// extracted with run-time shifts, one global load per escape): the reference
// scripts/codec-kernel-bench.cu times beside src/device/cuda/codec.cu on the
// same data (scripts/codec-gpu.sh --variants). Same entry point and
// parameter block; not shipped.
#define EPM_BLOCK_VALUES 4096
#define EPM_THREADS 256
#define EPM_PER_THREAD 16

struct EpmDecodeParams {
  unsigned long long dst;       // decoded weight, 16-byte aligned
  unsigned long long offsets;   // u32 escape index, one per block (+ total)
  unsigned long long codes;     // code stream, 16-byte aligned, padded to 16
  unsigned long long lows;      // low-byte stream, 16-byte aligned, padded to 16
  unsigned long long escapes;   // escaped exponents, one byte each
  unsigned long long n_values;
  unsigned long long n_escapes;
  unsigned int dtype;           // 1 = bf16, 2 = fp16
  unsigned int k;               // exponent code width, 1..4
  unsigned int code_bits;       // W = k (bf16) or k + 3 (fp16)
  unsigned int blocks;
  unsigned char table[16];      // 2^k - 1 exponents
};

__device__ __forceinline__ unsigned int code_at(unsigned long long lo, unsigned long long hi, unsigned int bit,
                                                unsigned int w) {
  unsigned long long v;
  if (bit >= 64) v = hi >> (bit - 64);
  else if (bit == 0) v = lo;
  else v = (lo >> bit) | (hi << (64 - bit));
  return (unsigned int)v & ((1u << w) - 1u);
}

extern "C" __global__ void __launch_bounds__(EPM_THREADS) epm_codec_decode(const EpmDecodeParams p) {
  __shared__ uint4 s_codes[EPM_BLOCK_VALUES * 8 / 8 / 16];
  __shared__ unsigned char s_table[16];
  __shared__ unsigned int s_warp[EPM_THREADS / 32];

  const unsigned int t = threadIdx.x;
  const unsigned long long first = (unsigned long long)blockIdx.x * EPM_BLOCK_VALUES;
  if (first >= p.n_values) return;  // the whole block: uniform
  const unsigned long long left = p.n_values - first;
  const unsigned int count = left < EPM_BLOCK_VALUES ? (unsigned int)left : EPM_BLOCK_VALUES;
  const unsigned int w = p.code_bits, k = p.k;

  const unsigned int code_bytes = (count * w + 7) / 8;
  const uint4 *gcodes = (const uint4 *)(p.codes + (unsigned long long)blockIdx.x * (EPM_BLOCK_VALUES / 8) * w);
  for (unsigned int i = t; i < (code_bytes + 15) / 16; i += EPM_THREADS) s_codes[i] = gcodes[i];
  // Constant indexes only: a variable index into the parameter block would
  // make the compiler copy all of it to local memory.
  if (t == 0) {
#pragma unroll
    for (unsigned int j = 0; j < 16; j++) s_table[j] = p.table[j];
  }

  const unsigned int v0 = t * EPM_PER_THREAD;
  const bool active = v0 < count;
  uint4 lows = make_uint4(0, 0, 0, 0);
  if (active) lows = *(const uint4 *)(p.lows + first + v0);
  __syncthreads();

  // This thread's 16 codes: 2W bytes at byte 2Wt (u16-aligned) of the block.
  unsigned long long lo = 0, hi = 0;
  const unsigned short *s16 = (const unsigned short *)s_codes + w * t;
#pragma unroll
  for (unsigned int j = 0; j < 8; j++) {
    if (j < w) {
      const unsigned long long x = s16[j];
      if (j < 4) lo |= x << (16 * j);
      else hi |= x << (16 * (j - 4));
    }
  }
  const unsigned int esc = (1u << k) - 1u;
  const unsigned int mine = active ? (count - v0 < EPM_PER_THREAD ? count - v0 : EPM_PER_THREAD) : 0;
  unsigned int n_esc = 0;
#pragma unroll
  for (unsigned int i = 0; i < EPM_PER_THREAD; i++)
    n_esc += (i < mine && (code_at(lo, hi, i * w, w) & esc) == esc) ? 1u : 0u;

  // Exclusive scan of the escape counts over the block.
  const unsigned int lane = t & 31, warp = t >> 5;
  unsigned int incl = n_esc;
#pragma unroll
  for (unsigned int d = 1; d < 32; d <<= 1) {
    const unsigned int y = __shfl_up_sync(0xffffffffu, incl, d);
    if (lane >= d) incl += y;
  }
  if (lane == 31) s_warp[warp] = incl;
  __syncthreads();
  unsigned int before = 0;
#pragma unroll
  for (unsigned int i = 0; i < EPM_THREADS / 32; i++)
    if (i < warp) before += s_warp[i];
  const unsigned int block_first = ((const unsigned int *)p.offsets)[blockIdx.x];
  unsigned long long e = (unsigned long long)block_first + before + incl - n_esc;

  const unsigned char *lb = (const unsigned char *)&lows;
  unsigned int out[EPM_PER_THREAD / 2];
#pragma unroll
  for (unsigned int i = 0; i < EPM_PER_THREAD; i++) {
    const unsigned int c = code_at(lo, hi, i * w, w);
    const unsigned int code = c & esc;
    unsigned int exp;
    if (code == esc) {
      exp = (i < mine && e < p.n_escapes) ? ((const unsigned char *)p.escapes)[e] : 0u;
      e += 1;
    } else {
      exp = s_table[code];
    }
    const unsigned int low = lb[i];
    unsigned int v;
    if (p.dtype == 2) {
      const unsigned int extra = c >> k;
      v = ((extra & 4u) << 13) | ((exp & 0x1Fu) << 10) | ((extra & 3u) << 8) | low;
    } else {
      v = ((low & 0x80u) << 8) | ((exp & 0xFFu) << 7) | (low & 0x7Fu);
    }
    if (i & 1) out[i / 2] |= v << 16;
    else out[i / 2] = v;
  }
  if (!active) return;
  unsigned short *dst = (unsigned short *)p.dst + first + v0;
  if (mine == EPM_PER_THREAD) {
    uint4 *d4 = (uint4 *)dst;
    d4[0] = make_uint4(out[0], out[1], out[2], out[3]);
    d4[1] = make_uint4(out[4], out[5], out[6], out[7]);
  } else {
    // Unrolled with constant indexes, so `out` stays in registers.
#pragma unroll
    for (unsigned int i = 0; i < EPM_PER_THREAD; i++)
      if (i < mine) dst[i] = (unsigned short)(out[i / 2] >> (16 * (i & 1)));
  }
}
