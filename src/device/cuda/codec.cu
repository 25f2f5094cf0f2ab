// The decode kernel of epmem's compressed weights (formats v1 and v2:
// src/codec/format.rs, docs/RESIDENCY.md "Compressed weights: the format").
//
// scripts/build-ptx.sh compiles this file to codec.ptx (committed, JIT-loaded
// by the driver at first use: no CUDA toolkit at build time). The parameter
// block must match `DecodeParams` in codec.rs, field for field (its 16-byte
// tables are read here as four little-endian words each).
//
// One thread block per 4096-value codec block, 128 threads, two 16-value
// slices each (EPM_SLICES).
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
// - format v2 (p.k2 = 1..4, uniform; k2 = 0 is v1, whose path is as it
//   was): an escape's exponent is a k2-bit level-2 code, not a byte. The
//   same scan; the block's level-2 codes are staged in shared memory the
//   same way; a thread's codes, consecutive there, are one 64-bit window
//   (three 4-byte shared loads) spread to nibbles and turned by byte
//   permutes into its escapes' exponents in rank order (table2 from
//   registers); each escaped value then picks its byte by its ordinal among
//   the thread's escapes (a prefix count of the flags by a multiply), four
//   values a permute: no per-escape loop. A code of all ones is a level-3
//   escape: only where the block has any (its level-3 index entries differ:
//   uniform), a second block-wide scan of the threads' level-3 counts gives
//   each its rank and the exponent is one byte of the level-3 stream, read
//   from global (a few per block). Registers: fp16's extra bits are parked
//   in shared memory across this path, so it needs no more than v1's;
// - output: two 16-byte stores per thread (scalar stores only in the
//   weight's last, partial chunk).
// Every global read is bounded: the escape range is clamped to the escape
// count and to one block's worth (v2: the level-3 range likewise, to its
// count), so a corrupt buffer yields wrong values, never a fault.

#define EPM_BLOCK_VALUES 4096
#define EPM_PER_THREAD 16
// 16-value slices per thread. The launcher's block is EPM_THREADS threads
// (codec.rs THREADS), its grid one block per 4096 values. Two slices in
// 128-thread blocks decoded 7-14% faster than one in 256 on the H100 (v2
// data) and the H200 (v1); scripts/codec-gpu.sh --variants times a build
// with one (x1) beside it.
#ifndef EPM_SLICES
#define EPM_SLICES 2
#endif
#define EPM_THREADS (256 / EPM_SLICES)
// A block's escapes as 16-byte words: at most 4096 bytes, starting anywhere
// within the first word and ending anywhere within the last.
#define EPM_ESC_WORDS (EPM_BLOCK_VALUES / 16 + 2)
// Format v2 stages its block's level-2 codes in the first words of the same
// array: at most 4096 codes of 4 bits from bit 0..127 of the first word, so
// EPM_CODE2_WORDS words hold them and every thread's 3-word window (whatever
// its rank, up to 4096); the rest parks 8 bytes for each 16-value slice.
#define EPM_CODE2_WORDS (((127 + EPM_BLOCK_VALUES * 4) / 32 + 3 + 3) / 4)
static_assert(EPM_CODE2_WORDS * 4 >= (127 + EPM_BLOCK_VALUES * 4) / 32 + 3, "a code window past the staged words' room");
static_assert(EPM_CODE2_WORDS * 16 + EPM_THREADS * EPM_SLICES * 8 <= EPM_ESC_WORDS * 16, "s_esc too small for format v2");

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
  // Format v2 (k2 > 0; all 0 for v1). `escapes` is then the level-2 code
  // stream, escape r's k2-bit code at bit r * k2 from it (LSB first).
  unsigned long long offsets3;  // u32 level-3 index, one per block (+ total)
  unsigned long long escapes3;  // level-3 exponents, one byte each: escape s at escapes3 + s
  unsigned long long n_escapes3;
  unsigned int k2;              // 0 = format v1, else the level-2 code width, 1..4
  unsigned int reserved;        // 0
  unsigned int table2[4];       // 2^k2 - 1 exponent bytes, the rest 0 (little-endian words)
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

// Format v2: the warp part of a block-wide exclusive scan of `mine` (each
// slice's count in 16 bits): returns the inclusive sum over the warp's lanes
// up to this one; lane 31 writes the warp's total to s_warp[warp]. The
// caller syncs the block before epm_scan_block.
__device__ __forceinline__ unsigned int epm_scan_warp(const unsigned int mine, unsigned int *s_warp) {
  const unsigned int lane = threadIdx.x & 31;
  unsigned int incl = mine;
#pragma unroll
  for (unsigned int d = 1; d < 32; d <<= 1) {
    const unsigned int y = __shfl_up_sync(0xffffffffu, incl, d);
    if (lane >= d) incl += y;
  }
  if (lane == 31) s_warp[threadIdx.x >> 5] = incl;
  return incl;
}

// The rest of it, after the sync: the exclusive sum before this thread and
// the block's total.
__device__ __forceinline__ unsigned int epm_scan_block(const unsigned int mine, const unsigned int incl,
                                                       const unsigned int *s_warp, unsigned int &total) {
  const unsigned int warp = threadIdx.x >> 5;
  unsigned int before = 0;
  total = 0;
#pragma unroll
  for (unsigned int i = 0; i < EPM_THREADS / 32; i++) {
    const unsigned int wsum = s_warp[i];
    if (i < warp) before += wsum;
    total += wsum;
  }
  return before + incl - mine;
}

// Byte `i` (0..15) of the four words e01 (bytes 0..7) and e23 (8..15) set to v.
__device__ __forceinline__ void epm_set_byte(unsigned long long &e01, unsigned long long &e23, const unsigned int i,
                                             const unsigned long long v) {
  const unsigned int at = (i & 7u) * 8u;
  if (i < 8) e01 = (e01 & ~(0xFFull << at)) | v << at;
  else e23 = (e23 & ~(0xFFull << at)) | v << at;
}

// Four bytes of the 16 in w[0..3], picked by the four nibbles (0..15) of `sel`.
__device__ __forceinline__ unsigned int epm_pick16(const unsigned int (&w)[4], const unsigned int sel) {
  const unsigned int lo = __byte_perm(w[0], w[1], sel & 0x7777u), hi = __byte_perm(w[2], w[3], sel & 0x7777u);
  const unsigned int upper = __byte_perm(0x0000FF00u, 0u, (sel >> 3) & 0x1111u);  // 0xFF where the nibble >= 8
  return (hi & upper) | (lo & ~upper);
}

// Format v2's escapes of a block that has some (lo_e < hi_e, its clamped
// level-1 escape range; uniform, as is everything this branches on before a
// __syncthreads). flags, n_esc, e and (fp16) xb, the extra bits, are
// epm_decode_block's. No loop over a thread's escapes: its (up to 16)
// level-2 codes, consecutive in the staged stream, become 16 exponent bytes
// in rank order (table2 through byte permutes), and each escaped value picks
// its byte by its ordinal among the thread's escapes (a prefix count of the
// flags by a multiply), four values a permute. Only level-3 escapes (a few
// per block) take a loop and a global load each.
template <int DT, int S>
__device__ __forceinline__ void epm_escapes_v2(const EpmDecodeParams &p, const unsigned int lo_e, const unsigned int hi_e,
                                               const unsigned long long (&flags)[S], const unsigned int (&n_esc)[S],
                                               unsigned int (&e)[S][4], unsigned int (&xb)[S][4], uint4 *s_esc,
                                               unsigned int *s_warp, unsigned int *s_warp3) {
  constexpr unsigned int NW = EPM_THREADS / 32;
  const unsigned int t = threadIdx.x;
  // The staged codes take s_esc's words [0, EPM_CODE2_WORDS); the rest parks
  // what this path does not use, so that it holds no registers here: fp16's
  // extra bits (3 of each byte), packed to 8 bytes a slice.
  uint2 *s_park = (uint2 *)(s_esc + EPM_CODE2_WORDS);
  if (DT == 2) {
#pragma unroll
    for (int j = 0; j < S; j++)
      s_park[t + j * EPM_THREADS] = make_uint2(xb[j][0] | xb[j][1] << 3, xb[j][2] | xb[j][3] << 3);
  }
  // The block's level-3 index entries, into s_warp3[NW..NW+1] (past the
  // warp totals) by two threads, read by all after the sync.
  if (t < 2) s_warp3[NW + t] = ((const unsigned int *)p.offsets3)[blockIdx.x + t];
  // Clamped so that a bad k2 reads within s_esc (the host validated it).
  const unsigned int k2 = p.k2 < 4u ? p.k2 : 4u, m2 = (1u << k2) - 1u;
  unsigned int mine_n = 0;
#pragma unroll
  for (int j = 0; j < S; j++) mine_n += n_esc[j] << (16 * j);
  const unsigned int incl = epm_scan_warp(mine_n, s_warp);
  // Stage the block's level-2 code bytes [(lo_e k2) >> 3, (hi_e k2 + 7) >> 3)
  // from the 16-byte word holding the first: at most 2048 bytes + 2 words.
  const unsigned long long bit_lo = (unsigned long long)lo_e * k2, bit_hi = (unsigned long long)hi_e * k2;
  const unsigned long long w0 = bit_lo >> 7;
  const unsigned int words = (unsigned int)(((bit_hi + 127u) >> 7) - w0);
  const uint4 *gesc = (const uint4 *)p.escapes + w0;
  for (unsigned int i = t; i < words; i += EPM_THREADS) s_esc[i] = gesc[i];
  __syncthreads();
  unsigned int total;
  const unsigned int excl = epm_scan_block(mine_n, incl, s_warp, total);
  const unsigned int *s32 = (const unsigned int *)s_esc;
  const unsigned int skip = (unsigned int)bit_lo & 127u;  // the block's first code's bit in the staged words
  const unsigned int tab2[4] = {p.table2[0], p.table2[1], p.table2[2], p.table2[3]};
  // epm_nibbles' masks and shifts for the run-time width k2 (k2 = 4: identity).
  const unsigned int F4 = (1u << (4u * k2)) - 1u, F2 = ((1u << (2u * k2)) - 1u) * 0x00010001u, F1 = m2 * 0x01010101u;
  const unsigned int ones = m2 * 0x11111111u;  // the level-3 code in every nibble

  // Per slice: x[j] its escapes' exponents in rank order, byte s for the
  // thread's escape s (level-3 escapes get table2's padding for now); f3[j]
  // its level-3 escapes, bit 4s for escape s.
  unsigned int x[S][4];
  unsigned long long f3[S];
  unsigned int r = 0;
#pragma unroll
  for (int j = 0; j < S; j++) {
    r += (excl >> (16 * j)) & 0xFFFFu;
    // This slice's escapes are ranks [r, r + n_esc[j]) of the block's, their
    // codes consecutive from bit skip + r k2 of the staged words: at most 64
    // bits (16 codes of at most 4). r + n_esc[j] <= 4096 whatever the
    // buffer, so the three words lie within the staged ones' room.
    const unsigned int bit = skip + r * k2, wi = bit >> 5;
    const unsigned int a0 = s32[wi], a1 = s32[wi + 1], a2 = s32[wi + 2];
    const unsigned int lo = __funnelshift_r(a0, a1, bit & 31u), hi = __funnelshift_r(a1, a2, bit & 31u);
    unsigned int sel[2] = {lo, __funnelshift_rc(lo, hi, 8u * k2)};  // codes 0..7, 8..15
    unsigned long long g3 = 0;
#pragma unroll
    for (int h = 0; h < 2; h++) {
      unsigned int v = sel[h];
      v = (v & F4) | ((v << (16u - 4u * k2)) & (F4 << 16));
      v = (v & F2) | ((v << (8u - 2u * k2)) & (F2 << 8));
      v = (v & F1) | ((v << (4u - k2)) & (F1 << 4));
      sel[h] = v;
      // Nibbles equal to the level-3 code: bit 3 of each zero nibble of z.
      const unsigned int z = v ^ ones;
      const unsigned int zero = ~(((z & 0x77777777u) + 0x77777777u) | z) & 0x88888888u;
      g3 |= (unsigned long long)(zero >> 3) << (32 * h);
    }
    const unsigned int n = n_esc[j];
    f3[j] = g3 & (n >= EPM_PER_THREAD ? ~0ull : (1ull << (4 * n)) - 1ull);
    if (k2 == 4) {  // uniform; 15 entries
#pragma unroll
      for (int g = 0; g < 4; g++) x[j][g] = epm_pick16(tab2, g & 1 ? sel[g >> 1] >> 16 : sel[g >> 1]);
    } else {  // at most 7 entries: nibbles below 8, one permute
#pragma unroll
      for (int g = 0; g < 4; g++) x[j][g] = __byte_perm(tab2[0], tab2[1], g & 1 ? sel[g >> 1] >> 16 : sel[g >> 1]);
    }
    r += ((total >> (16 * j)) & 0xFFFFu) - ((excl >> (16 * j)) & 0xFFFFu);
  }

  // Level 3, where the block has any (uniform: the same index entries).
  const unsigned int off3_0 = s_warp3[NW], off3_1 = s_warp3[NW + 1];
  const unsigned long long n_esc3_all = p.n_escapes3;
  const unsigned int lo3 = off3_0 < n_esc3_all ? off3_0 : (unsigned int)n_esc3_all;
  unsigned int hi3 = off3_1 < n_esc3_all ? off3_1 : (unsigned int)n_esc3_all;
  if (hi3 < lo3) hi3 = lo3;
  if (hi3 - lo3 > EPM_BLOCK_VALUES) hi3 = lo3 + EPM_BLOCK_VALUES;
  if (hi3 > lo3) {
    unsigned int mine3 = 0;
#pragma unroll
    for (int j = 0; j < S; j++) mine3 += (unsigned int)__popcll(f3[j]) << (16 * j);
    const unsigned int incl3 = epm_scan_warp(mine3, s_warp3);
    __syncthreads();
    unsigned int total3;
    const unsigned int excl3 = epm_scan_block(mine3, incl3, s_warp3, total3);
    // Level-3 escape rr of the block is byte lo3 + rr of the level-3 stream
    // (rr < n_blk3: never past the block's, nor the weight's, last).
    const unsigned int n_blk3 = hi3 - lo3;
    const unsigned char *esc3 = (const unsigned char *)p.escapes3 + lo3;
    unsigned int r3 = 0;
#pragma unroll
    for (int j = 0; j < S; j++) {
      r3 += (excl3 >> (16 * j)) & 0xFFFFu;
      unsigned long long f = f3[j];
      if (f) {
        unsigned int rr = r3;
        unsigned long long x01 = (unsigned long long)x[j][1] << 32 | x[j][0];
        unsigned long long x23 = (unsigned long long)x[j][3] << 32 | x[j][2];
        while (f) {
          const unsigned int i = (unsigned int)(__ffsll((long long)f) - 1) >> 2;
          f &= f - 1;
          const unsigned long long v = rr < n_blk3 ? esc3[rr] : 0u;
          rr++;
          epm_set_byte(x01, x23, i, v);
        }
        x[j][0] = (unsigned int)x01;
        x[j][1] = (unsigned int)(x01 >> 32);
        x[j][2] = (unsigned int)x23;
        x[j][3] = (unsigned int)(x23 >> 32);
      }
      r3 += ((total3 >> (16 * j)) & 0xFFFFu) - ((excl3 >> (16 * j)) & 0xFFFFu);
    }
  }

  // Each escaped value takes byte o of x, o its ordinal among the slice's
  // escapes: nibble i of (fl << 4) * 0x11111111 counts the flags below value
  // i of the eight (the second eight add the first's count; at most 15, so
  // no carry between nibbles).
#pragma unroll
  for (int j = 0; j < S; j++) {
    const unsigned int fl[2] = {(unsigned int)flags[j], (unsigned int)(flags[j] >> 32)};
#pragma unroll
    for (int h = 0; h < 2; h++) {
      const unsigned int ord = (fl[h] << 4) * 0x11111111u + (h ? (unsigned int)__popc(fl[0]) * 0x11111111u : 0u);
#pragma unroll
      for (int q = 0; q < 2; q++) {
        const unsigned int v = epm_pick16(x[j], (ord >> (16 * q)) & 0xFFFFu);
        const unsigned int m = __byte_perm(0x0000FF00u, 0u, (fl[h] >> (16 * q)) & 0x1111u);
        e[j][2 * h + q] = (v & m) | (e[j][2 * h + q] & ~m);
      }
    }
  }
  if (DT == 2) {
#pragma unroll
    for (int j = 0; j < S; j++) {
      const uint2 pk = s_park[t + j * EPM_THREADS];
      xb[j][0] = pk.x & 0x07070707u;
      xb[j][1] = (pk.x >> 3) & 0x07070707u;
      xb[j][2] = pk.y & 0x07070707u;
      xb[j][3] = (pk.y >> 3) & 0x07070707u;
    }
  }
}

// DT: 1 = bf16, 2 = fp16; K: the exponent code width. Thread t decodes the
// EPM_SLICES 16-value slices q = t + j * EPM_THREADS of the block.
template <int DT, int K>
__device__ __forceinline__ void epm_decode_block(const EpmDecodeParams &p, uint4 *s_esc, unsigned int *s_warp,
                                                 unsigned int *s_warp3) {
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
  if (hi_e > lo_e && p.k2) {
    epm_escapes_v2<DT, S>(p, lo_e, hi_e, flags, n_esc, e, x, s_esc, s_warp, s_warp3);
  } else if (hi_e > lo_e) {
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
  __shared__ unsigned int s_warp3[EPM_THREADS / 32 + 2];  // format v2: level-3 scan, level-3 index entries
  // Uniform over the grid; the host validated dtype and k.
  switch (p.dtype == 2 ? 4 + p.k : p.k) {
    case 1: epm_decode_block<1, 1>(p, s_esc, s_warp, s_warp3); break;
    case 2: epm_decode_block<1, 2>(p, s_esc, s_warp, s_warp3); break;
    case 3: epm_decode_block<1, 3>(p, s_esc, s_warp, s_warp3); break;
    case 4: epm_decode_block<1, 4>(p, s_esc, s_warp, s_warp3); break;
    case 5: epm_decode_block<2, 1>(p, s_esc, s_warp, s_warp3); break;
    case 6: epm_decode_block<2, 2>(p, s_esc, s_warp, s_warp3); break;
    case 7: epm_decode_block<2, 3>(p, s_esc, s_warp, s_warp3); break;
    case 8: epm_decode_block<2, 4>(p, s_esc, s_warp, s_warp3); break;
    default: break;
  }
}
