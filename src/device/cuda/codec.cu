// The decode kernel of epmem's compressed weights (format v1, src/codec and
// docs/RESIDENCY.md "Compressed weights: the format").
//
// scripts/build-ptx.sh compiles this file to codec.ptx (committed, JIT-loaded
// by the driver at first use: no CUDA toolkit at build time). The parameter
// block must match `DecodeParams` in codec.rs, field for field (its 16 table
// bytes are read here as four little-endian words).
//
// One thread block per 4096-value codec block, 256 threads, 16 values each.
// The kernel is specialised at compile time for each (dtype, k), so every
// shift and mask is a constant, and it works on whole registers:
// - thread t's 16 codes are the 2W bytes at byte 2Wt of the block: one to
//   four aligned 4-byte loads (one 8-byte load for W = 4), straight into
//   registers; the low bytes are one 16-byte load; the block's escape-index
//   entries are loaded beside them, so all global reads start at once;
// - the exponent codes become nibbles, eight to a register (bf16: three
//   shift-and-mask steps per eight codes; fp16, whose codes carry three raw
//   bits too, a field at a time); four nibbles are the selector of one byte
//   permute that reads the (up to 16-byte) table from registers, and two
//   more permutes interleave exponents and low bytes into two output words;
// - escapes only where the block has any (its index entries differ): each
//   thread counts its own, a block-wide exclusive scan (warp shuffles, then
//   the 8 warp totals) gives its first escape's rank, and the block's escape
//   bytes are staged in shared memory with 16-byte loads, so no thread waits
//   on one global load per escape;
// - output: two 16-byte stores per thread (scalar stores only in the
//   weight's last, partial chunk).
// Every global read is bounded: the escape range is clamped to the escape
// count and to one block's worth, so a corrupt buffer yields wrong values,
// never a fault.

#define EPM_BLOCK_VALUES 4096
#define EPM_PER_THREAD 16
// 16-value slices per thread. The launcher's block is EPM_THREADS threads,
// its grid one block per 4096 values; scripts/codec-gpu.sh --variants times
// a build with 2 (128 threads, 32 values each).
#ifndef EPM_SLICES
#define EPM_SLICES 1
#endif
#if EPM_SLICES == 1
#define EPM_THREADS 256
#else
#define EPM_THREADS (256 / EPM_SLICES)
#endif
// A block's escapes as 16-byte words: at most 4096 bytes, starting anywhere
// within the first word and ending anywhere within the last.
#define EPM_ESC_WORDS (EPM_BLOCK_VALUES / 16 + 2)

struct EpmDecodeParams {
  unsigned long long dst;       // decoded weight, 16-byte aligned
  unsigned long long offsets;   // u32 escape index, one per block (+ total)
  unsigned long long codes;     // code stream, 16-byte aligned, padded to 16
  unsigned long long lows;      // low-byte stream, 16-byte aligned, padded to 16
  unsigned long long escapes;   // escaped exponents, one byte each, padded to 16
  unsigned long long n_values;
  unsigned long long n_escapes;
  unsigned int dtype;           // 1 = bf16, 2 = fp16
  unsigned int k;               // exponent code width, 1..4
  unsigned int code_bits;       // W = k (bf16) or k + 3 (fp16)
  unsigned int blocks;
  unsigned int table[4];        // 2^k - 1 exponent bytes, the rest 0 (little-endian words)
};

// The W-bit field `i` of the little-endian bit string `c` (W and i are
// constants once the callers' loops are unrolled).
template <int W>
__device__ __forceinline__ unsigned int epm_field(const unsigned int (&c)[4], const int i) {
  const int b = W * i, j = b >> 5, s = b & 31;
  unsigned int v = c[j] >> s;
  if (s + W > 32) v |= c[j + 1] << (32 - s);
  return v & ((1u << W) - 1u);
}

// 32 bits of the bit string `c` from bit `b` (a constant once unrolled).
__device__ __forceinline__ unsigned int epm_bits(const unsigned int (&c)[4], const int b) {
  const int j = b >> 5, s = b & 31;
  return s == 0 ? c[j] : __funnelshift_r(c[j], c[j + 1 < 4 ? j + 1 : 3], s);
}

// Eight W-bit fields (W < 4, packed from bit 0 of x) spread to the eight
// nibbles of the result, each field at its nibble's bottom; higher bits of x
// are ignored.
template <int W>
__device__ __forceinline__ unsigned int epm_nibbles(unsigned int x) {
  constexpr unsigned int F4 = (1u << (4 * W)) - 1u, F2 = ((1u << (2 * W)) - 1u) * 0x00010001u,
                         F1 = ((1u << W) - 1u) * 0x01010101u;
  x = (x & F4) | ((x << (16 - 4 * W)) & (F4 << 16));  // fields 4..7 to bit 16
  x = (x & F2) | ((x << (8 - 2 * W)) & (F2 << 8));    // odd pairs to the next byte
  return (x & F1) | ((x << (4 - W)) & (F1 << 4));     // odd fields to the next nibble
}

// Thread t's 2W code bytes (at byte 2Wt of the block's codes, `blk`) into
// c[0..]; `lim` bounds the reads (a multiple of 16: the stream is padded).
template <int W>
__device__ __forceinline__ void epm_load_codes(const unsigned char *blk, const unsigned int t, const unsigned int lim,
                                               unsigned int (&c)[4]) {
  const unsigned int at = 2u * W * t;
  c[0] = c[1] = c[2] = c[3] = 0u;
  if (W == 4) {
    // 8-byte aligned: one 8-byte load (lim is a multiple of 16, so both words or neither).
    if (at < lim) {
      const uint2 v = *(const uint2 *)(blk + at);
      c[0] = v.x;
      c[1] = v.y;
    }
  } else if ((W & 1) == 0) {
    // W = 2, 6: 4-byte aligned, W/2 words.
#pragma unroll
    for (int j = 0; j < W / 2; j++)
      if (at + 4u * j < lim) c[j] = ((const unsigned int *)(blk + at))[j];
  } else {
    // W odd: 2-byte aligned. The (W+1)/2 aligned words from at & ~3 hold
    // the 2W bytes; an odd thread's start half a word in.
    const unsigned int a = at & ~3u;
    unsigned int r[(W + 1) / 2 + 1];
#pragma unroll
    for (int j = 0; j < (W + 1) / 2; j++) r[j] = a + 4u * j < lim ? ((const unsigned int *)(blk + a))[j] : 0u;
    r[(W + 1) / 2] = 0u;
    const unsigned int sh = (at & 2u) * 8u;
#pragma unroll
    for (int j = 0; j < (W + 1) / 2; j++) c[j] = __funnelshift_r(r[j], r[j + 1], sh);
  }
}

// DT: 1 = bf16, 2 = fp16; K: the exponent code width. Thread t decodes the
// EPM_SLICES 16-value slices q = t + j * EPM_THREADS of the block.
template <int DT, int K>
__device__ __forceinline__ void epm_decode_block(const EpmDecodeParams &p, uint4 *s_esc, unsigned int *s_warp) {
  constexpr int W = K + (DT == 2 ? 3 : 0), S = EPM_SLICES;
  constexpr unsigned int KMASK = (1u << K) - 1u;

  const unsigned int t = threadIdx.x, b = blockIdx.x;
  const unsigned long long first = (unsigned long long)b * EPM_BLOCK_VALUES;
  if (first >= p.n_values) return;  // the whole block: uniform
  const unsigned long long left = p.n_values - first;
  const unsigned int count = left < EPM_BLOCK_VALUES ? (unsigned int)left : EPM_BLOCK_VALUES;
  const unsigned int lim = ((count * W + 7u) / 8u + 15u) & ~15u;  // the block's code bytes, padded

  // Every global read of the block, issued together.
  const unsigned int *offsets = (const unsigned int *)p.offsets;
  const unsigned int off0 = offsets[b], off1 = offsets[b + 1];
  const unsigned char *codes = (const unsigned char *)p.codes + (unsigned long long)b * (EPM_BLOCK_VALUES / 8) * W;
  unsigned int c[S][4], mine[S];
  uint4 lows[S];
#pragma unroll
  for (int j = 0; j < S; j++) {
    const unsigned int q = t + j * EPM_THREADS, v0 = q * EPM_PER_THREAD;
    mine[j] = v0 < count ? (count - v0 < EPM_PER_THREAD ? count - v0 : EPM_PER_THREAD) : 0u;
    epm_load_codes<W>(codes, q, mine[j] ? lim : 0u, c[j]);
    lows[j] = make_uint4(0, 0, 0, 0);
    if (mine[j]) lows[j] = *(const uint4 *)(p.lows + first + v0);
  }

  // The table in four registers (constant indexes into the parameter block).
  const unsigned int t0 = p.table[0], t1 = p.table[1];
  const unsigned int t2 = K == 4 ? p.table[2] : 0u, t3 = K == 4 ? p.table[3] : 0u;

  // Per slice: the exponent codes as nibbles, eight values a word (sel[h]:
  // values 8h..8h+7); fp16's extra bits as bytes, four values a word (x[g]);
  // escape flags at bit 4i of `flags` for value i (a code of all ones);
  // exponent bytes, four values a word (e[g]; escapes get the table's
  // padding for now).
  unsigned int e[S][4], x[S][4], n_esc[S];
  unsigned long long flags[S];
#pragma unroll
  for (int j = 0; j < S; j++) {
    unsigned int sel[2];
#pragma unroll
    for (int g = 0; g < 4; g++) x[j][g] = 0;
#pragma unroll
    for (int h = 0; h < 2; h++) {
      if (DT == 1 && K == 4) {
        sel[h] = c[j][h];
      } else if (DT == 1) {
        sel[h] = epm_nibbles<(DT == 1 && K < 4) ? K : 1>(epm_bits(c[j], 8 * W * h));
      } else {
        unsigned int sh = 0;
#pragma unroll
        for (int i = 0; i < 8; i++) {
          const unsigned int f = epm_field<W>(c[j], 8 * h + i);
          sh |= (f & KMASK) << (4 * i);
          x[j][2 * h + i / 4] |= (f >> K) << (8 * (i & 3));
        }
        sel[h] = sh;
      }
    }
    unsigned int all[2] = {sel[0], sel[1]};
#pragma unroll
    for (int s = 1; s < K; s++) {
      all[0] &= sel[0] >> s;
      all[1] &= sel[1] >> s;
    }
    flags[j] = (unsigned long long)(all[1] & 0x11111111u) << 32 | (all[0] & 0x11111111u);
    flags[j] &= mine[j] >= EPM_PER_THREAD ? ~0ull : (1ull << (4 * mine[j])) - 1ull;
    n_esc[j] = __popcll(flags[j]);
#pragma unroll
    for (int g = 0; g < 4; g++) {
      const unsigned int sg = g & 1 ? sel[g >> 1] >> 16 : sel[g >> 1];  // a permute reads bits 15..0
      if (K == 4) {
        // 15 entries: the low and high 8 bytes, chosen per value by the code's bit 3.
        const unsigned int lo = __byte_perm(t0, t1, sg & 0x7777u), hi = __byte_perm(t2, t3, sg & 0x7777u);
        const unsigned int upper = __byte_perm(0x0000FF00u, 0u, (sg >> 3) & 0x1111u);  // 0xFF where code >= 8
        e[j][g] = (hi & upper) | (lo & ~upper);
      } else {
        e[j][g] = __byte_perm(t0, t1, sg);
      }
    }
  }

  // Escapes, where the block has any (uniform: every thread read the same index entries).
  const unsigned long long n_esc_all = p.n_escapes;
  const unsigned int lo_e = off0 < n_esc_all ? off0 : (unsigned int)n_esc_all;
  unsigned int hi_e = off1 < n_esc_all ? off1 : (unsigned int)n_esc_all;
  if (hi_e < lo_e) hi_e = lo_e;
  if (hi_e - lo_e > EPM_BLOCK_VALUES) hi_e = lo_e + EPM_BLOCK_VALUES;
  if (hi_e > lo_e) {
    // One scan for all slices: slice j's count in bits 16j.. (each sum < 2^16).
    unsigned int mine_n = 0;
#pragma unroll
    for (int j = 0; j < S; j++) mine_n += n_esc[j] << (16 * j);
    const unsigned int lane = t & 31, warp = t >> 5;
    unsigned int incl = mine_n;
#pragma unroll
    for (unsigned int d = 1; d < 32; d <<= 1) {
      const unsigned int y = __shfl_up_sync(0xffffffffu, incl, d);
      if (lane >= d) incl += y;
    }
    if (lane == 31) s_warp[warp] = incl;
    // Stage the block's escape bytes [lo_e, hi_e) from the 16-byte word holding lo_e.
    const unsigned int w0 = lo_e >> 4, words = ((hi_e + 15u) >> 4) - w0;
    const uint4 *gesc = (const uint4 *)p.escapes + w0;
    for (unsigned int i = t; i < words; i += EPM_THREADS) s_esc[i] = gesc[i];
    __syncthreads();
    unsigned int before = 0, total = 0;
#pragma unroll
    for (unsigned int i = 0; i < EPM_THREADS / 32; i++) {
      const unsigned int wsum = s_warp[i];
      if (i < warp) before += wsum;
      total += wsum;
    }
    const unsigned int excl = before + incl - mine_n;
    const unsigned int n_blk = hi_e - lo_e, skip = lo_e & 15u;
    const unsigned char *sb = (const unsigned char *)s_esc;
    // Slice j's escapes follow all of slices 0..j-1's, block-wide.
    unsigned int r = 0;
#pragma unroll
    for (int j = 0; j < S; j++) {
      r += (excl >> (16 * j)) & 0xFFFFu;
      // This slice's escapes are ranks [r, r + n_esc[j]) of the block's, at
      // byte skip + rank of the staged words.
      unsigned int rr = r;
      unsigned long long f = flags[j];
      unsigned long long e01 = (unsigned long long)e[j][1] << 32 | e[j][0];
      unsigned long long e23 = (unsigned long long)e[j][3] << 32 | e[j][2];
      while (f) {
        const unsigned int i = (unsigned int)(__ffsll((long long)f) - 1) >> 2;
        f &= f - 1;
        const unsigned long long v = rr < n_blk ? sb[skip + rr] : 0u;
        rr++;
        const unsigned int at = (i & 7u) * 8u;
        if (i < 8) e01 = (e01 & ~(0xFFull << at)) | v << at;
        else e23 = (e23 & ~(0xFFull << at)) | v << at;
      }
      e[j][0] = (unsigned int)e01;
      e[j][1] = (unsigned int)(e01 >> 32);
      e[j][2] = (unsigned int)e23;
      e[j][3] = (unsigned int)(e23 >> 32);
      // The next slice starts after every thread's slice j.
      r += ((total >> (16 * j)) & 0xFFFFu) - ((excl >> (16 * j)) & 0xFFFFu);
    }
  }

  // Four values a group: a high byte and a low byte each, then two permutes
  // interleave them into two output words.
#pragma unroll
  for (int j = 0; j < S; j++) {
    const unsigned int lw[4] = {lows[j].x, lows[j].y, lows[j].z, lows[j].w};
    unsigned int out[8];
#pragma unroll
    for (int g = 0; g < 4; g++) {
      unsigned int hi, lo;
      if (DT == 2) {
        // fp16: sign = extra bit 2, exponent 5 bits, mantissa's top 2 = extra bits 1..0.
        hi = ((x[j][g] << 5) & 0x80808080u) | ((e[j][g] << 2) & 0x7C7C7C7Cu) | (x[j][g] & 0x03030303u);
        lo = lw[g];
      } else {
        // bf16: sign from the low byte, then the exponent, whose low bit tops the low byte.
        hi = (lw[g] & 0x80808080u) | ((e[j][g] >> 1) & 0x7F7F7F7Fu);
        lo = ((e[j][g] << 7) & 0x80808080u) | (lw[g] & 0x7F7F7F7Fu);
      }
      out[2 * g] = __byte_perm(lo, hi, 0x5140);
      out[2 * g + 1] = __byte_perm(lo, hi, 0x7362);
    }
    unsigned short *dst = (unsigned short *)p.dst + first + (t + j * EPM_THREADS) * EPM_PER_THREAD;
    if (mine[j] == EPM_PER_THREAD) {
      uint4 *d4 = (uint4 *)dst;
      d4[0] = make_uint4(out[0], out[1], out[2], out[3]);
      d4[1] = make_uint4(out[4], out[5], out[6], out[7]);
    } else {
      // Unrolled with constant indexes, so `out` stays in registers.
#pragma unroll
      for (unsigned int i = 0; i < EPM_PER_THREAD; i++)
        if (i < mine[j]) dst[i] = (unsigned short)(out[i / 2] >> (16 * (i & 1)));
    }
  }
}

#ifdef EPM_MIN_BLOCKS
#define EPM_BOUNDS __launch_bounds__(EPM_THREADS, EPM_MIN_BLOCKS)
#else
#define EPM_BOUNDS __launch_bounds__(EPM_THREADS)
#endif

extern "C" __global__ void EPM_BOUNDS epm_codec_decode(const EpmDecodeParams p) {
  // Declared here, not in the template: one allocation, whichever (dtype, k) runs.
  __shared__ uint4 s_esc[EPM_ESC_WORDS];
  __shared__ unsigned int s_warp[EPM_THREADS / 32];
  // Uniform over the grid; the host validated dtype and k.
  switch (p.dtype == 2 ? 4 + p.k : p.k) {
    case 1: epm_decode_block<1, 1>(p, s_esc, s_warp); break;
    case 2: epm_decode_block<1, 2>(p, s_esc, s_warp); break;
    case 3: epm_decode_block<1, 3>(p, s_esc, s_warp); break;
    case 4: epm_decode_block<1, 4>(p, s_esc, s_warp); break;
    case 5: epm_decode_block<2, 1>(p, s_esc, s_warp); break;
    case 6: epm_decode_block<2, 2>(p, s_esc, s_warp); break;
    case 7: epm_decode_block<2, 3>(p, s_esc, s_warp); break;
    case 8: epm_decode_block<2, 4>(p, s_esc, s_warp); break;
    default: break;
  }
}
