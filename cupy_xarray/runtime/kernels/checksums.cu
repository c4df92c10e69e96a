/* Checksums of decoded streams, computed where the bytes are (one launch per batch).
 *
 * Every kernel takes the streams as device addresses and lengths (ptrs[i], lens[i]).
 *   xxh64_streams     XXH64 (seed 0) per stream: a zstd frame's content checksum is its low 32 bits
 *   crc32_segments    a reflected CRC-32 per stream: zlib's (gzip's trailer) or CRC-32C (zarr's
 *                     crc32c codec), by its polynomial; SEG bytes per thread, combined with the
 *                     GF(2) shift operators zlib's crc32_combine uses
 *   adler32_segments  the two Adler-32 sums (zlib's trailer) per stream, SEG bytes per thread
 *   stream_ends       the first and last 8 bytes of every stream (framing and stored checksums)
 */

#define SEG 2048

/* ---------------------------------------------------------------- XXH64 */
#define XXP1 11400714785074694791ULL
#define XXP2 14029467366897019727ULL
#define XXP3 1609587929392839161ULL
#define XXP4 9650029242287828579ULL
#define XXP5 2870177450012600261ULL

__device__ __forceinline__ unsigned long long rotl64(unsigned long long x, int r) {
  return (x << r) | (x >> (64 - r));
}

__device__ __forceinline__ unsigned long long xx_round(unsigned long long acc, unsigned long long in) {
  acc += in * XXP2;
  acc = rotl64(acc, 31);
  return acc * XXP1;
}

__device__ __forceinline__ unsigned long long xx_merge(unsigned long long h, unsigned long long v) {
  h ^= xx_round(0, v);
  return h * XXP1 + XXP4;
}

__device__ __forceinline__ unsigned long long load_le64(const unsigned char* q) {
  unsigned long long x = 0;
  for (int b = 0; b < 8; ++b) x |= (unsigned long long)q[b] << (8 * b);
  return x;
}

/* one block of 32 threads per stream: the warp stages 4 KiB tiles in shared memory, threads
   0-3 run the four accumulator lanes over them (XXH64 is sequential within a lane) */
extern "C" __global__ void xxh64_streams(const unsigned long long* ptrs, const long long* lens,
                                         unsigned long long* out, int count) {
  __shared__ unsigned long long tile[512];
  __shared__ unsigned long long lanes[4];
  int s = blockIdx.x;
  if (s >= count) return;
  const unsigned char* p = (const unsigned char*)ptrs[s];
  long long n = lens[s];
  long long body = (n / 32) * 32;
  int t = threadIdx.x;
  unsigned long long v = t == 0 ? XXP1 + XXP2 : t == 1 ? XXP2 : t == 2 ? 0ULL : 0ULL - XXP1;
  bool aligned = ((unsigned long long)p & 7) == 0;
  for (long long base = 0; base < body; base += 4096) {
    long long take = body - base < 4096 ? body - base : 4096;
    int words = (int)(take / 8);
    for (int w = t; w < words; w += blockDim.x) {
      const unsigned char* q = p + base + 8LL * w;
      tile[w] = aligned ? *(const unsigned long long*)q : load_le64(q);
    }
    __syncthreads();
    if (t < 4)
      for (int i = t; i < words; i += 4) v = xx_round(v, tile[i]);
    __syncthreads();
  }
  if (t < 4) lanes[t] = v;
  __syncthreads();
  if (t != 0) return;
  unsigned long long h;
  if (n >= 32) {
    unsigned long long v1 = lanes[0], v2 = lanes[1], v3 = lanes[2], v4 = lanes[3];
    h = rotl64(v1, 1) + rotl64(v2, 7) + rotl64(v3, 12) + rotl64(v4, 18);
    h = xx_merge(h, v1);
    h = xx_merge(h, v2);
    h = xx_merge(h, v3);
    h = xx_merge(h, v4);
  } else {
    h = XXP5;
  }
  h += (unsigned long long)n;
  const unsigned char* q = p + body;
  long long rem = n - body;
  while (rem >= 8) {
    h ^= xx_round(0, load_le64(q));
    h = rotl64(h, 27) * XXP1 + XXP4;
    q += 8;
    rem -= 8;
  }
  if (rem >= 4) {
    unsigned long long w = (unsigned long long)q[0] | (unsigned long long)q[1] << 8 |
                           (unsigned long long)q[2] << 16 | (unsigned long long)q[3] << 24;
    h ^= w * XXP1;
    h = rotl64(h, 23) * XXP2 + XXP3;
    q += 4;
    rem -= 4;
  }
  while (rem > 0) {
    h ^= (unsigned long long)(*q) * XXP5;
    h = rotl64(h, 11) * XXP1;
    ++q;
    --rem;
  }
  h ^= h >> 33;
  h *= XXP2;
  h ^= h >> 29;
  h *= XXP3;
  h ^= h >> 32;
  out[s] = h;
}

/* ---------------------------------------------------------------- segments of streams */
/* this thread's segment: its stream s (seg_first[i] is stream i's first segment), the stream's
   length n and the segment's bytes [start, end); false past the last segment */
__device__ __forceinline__ bool segment_of(const long long* seg_first, const long long* lens, int count,
                                           long long nseg, int* s, long long* n, long long* start,
                                           long long* end) {
  long long g = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (g >= nseg) return false;
  int lo = 0, hi = count - 1;
  while (lo < hi) {
    int mid = (lo + hi + 1) >> 1;
    if (seg_first[mid] <= g) lo = mid; else hi = mid - 1;
  }
  *s = lo;
  *n = lens[lo];
  *start = (g - seg_first[lo]) * SEG;
  if (*start > 0 && *start >= *n) return false;  /* lens on the device, segments for a bound */
  *end = *start + SEG < *n ? *start + SEG : *n;
  return true;
}

/* ---------------------------------------------------------------- CRC-32, CRC-32C */

/* a(x) * b(x) modulo the CRC polynomial, bit-reflected (zlib's multmodp) */
__device__ unsigned int multmodp(unsigned int a, unsigned int b, unsigned int poly) {
  unsigned int p = 0;
  for (int i = 31; i >= 0; --i) {
    if (a & (1u << i)) p ^= b;
    b = (b & 1) ? (b >> 1) ^ poly : b >> 1;
  }
  return p;
}

/* x^(8 n) modulo the polynomial: the operator that appends n zero bytes (zlib's x2nmodp(n, 3));
   x2n[k] = x^(2^k) */
__device__ unsigned int zeros_operator(long long n, const unsigned int* x2n, unsigned int poly) {
  unsigned int p = 1u << 31;
  int k = 3;
  while (n) {
    if (n & 1) p = multmodp(x2n[k & 31], p, poly);
    n >>= 1;
    ++k;
  }
  return p;
}

extern "C" __global__ void crc32_segments(const unsigned long long* ptrs, const long long* lens,
                                          const long long* seg_first, int count, long long nseg,
                                          const unsigned int* x2n, unsigned int poly, unsigned int* out) {
  __shared__ unsigned int table[256];
  for (int e = threadIdx.x; e < 256; e += blockDim.x) {
    unsigned int c = e;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ poly : c >> 1;
    table[e] = c;
  }
  __syncthreads();
  int s;
  long long n, start, end;
  if (!segment_of(seg_first, lens, count, nseg, &s, &n, &start, &end)) return;
  const unsigned char* p = (const unsigned char*)ptrs[s] + start;
  long long len = end - start;
  unsigned int c = 0;  /* the segment's CRC without the initial and final inversion: linear */
  long long i = 0;
  if (((unsigned long long)p & 3) == 0) {
    for (; i + 4 <= len; i += 4) {
      unsigned int w = *(const unsigned int*)(p + i);
      c ^= w;
      c = table[c & 0xff] ^ (c >> 8);
      c = table[c & 0xff] ^ (c >> 8);
      c = table[c & 0xff] ^ (c >> 8);
      c = table[c & 0xff] ^ (c >> 8);
    }
  }
  for (; i < len; ++i) c = table[(c ^ p[i]) & 0xff] ^ (c >> 8);
  unsigned int v = multmodp(zeros_operator(n - end, x2n, poly), c, poly);
  if (start == 0)  /* the initial 0xffffffff shifted through the whole stream, and the final xor */
    v ^= multmodp(zeros_operator(n, x2n, poly), 0xffffffffu, poly) ^ 0xffffffffu;
  atomicXor(out + s, v);
}

/* ---------------------------------------------------------------- Adler-32 */
#define ADLER_MOD 65521ULL

/* sums[2 i] += sum of bytes, sums[2 i + 1] += sum of (n - j) * byte j, each segment's part
   reduced modulo 65521; A = 1 + sums[2 i], B = n + sums[2 i + 1] (mod 65521) */
extern "C" __global__ void adler32_segments(const unsigned long long* ptrs, const long long* lens,
                                            const long long* seg_first, int count, long long nseg,
                                            unsigned long long* sums) {
  int s;
  long long n, start, end;
  if (!segment_of(seg_first, lens, count, nseg, &s, &n, &start, &end)) return;
  const unsigned char* p = (const unsigned char*)ptrs[s];
  unsigned long long a = 0, w = 0;
  for (long long j = start; j < end; ++j) {
    unsigned long long d = p[j];
    a += d;
    w += (unsigned long long)(end - j) * d;
  }
  a %= ADLER_MOD;
  w = (w % ADLER_MOD + ((unsigned long long)(n - end) % ADLER_MOD) * a) % ADLER_MOD;
  atomicAdd(sums + 2 * s, a);
  atomicAdd(sums + 2 * s + 1, w);
}

/* ---------------------------------------------------------------- framing bytes */
/* out[16 i .. 16 i + 7]: the first 8 bytes of stream i, out[16 i + 8 .. 16 i + 15]: its last 8
   (zero where the stream is shorter) */
extern "C" __global__ void stream_ends(const unsigned long long* ptrs, const long long* lens,
                                       unsigned char* out, int count) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= count) return;
  const unsigned char* p = (const unsigned char*)ptrs[i];
  long long n = lens[i];
  for (int k = 0; k < 8; ++k) {
    out[16 * i + k] = k < n ? p[k] : 0;
    long long j = n - 8 + k;
    out[16 * i + 8 + k] = j >= 0 ? p[j] : 0;
  }
}

/* ---------------------------------------------------------------- LZ4 block structure */
/* status[i] = 0 when stream i is an LZ4 block that decodes to exactly want[i] bytes under the
   rules liblz4's LZ4_decompress_safe enforces (every length inside the input, every match
   offset inside the output so far, a match never ending within 5 bytes of the end, the block
   ending on literals), else 1 + the input position where it fails. nvCOMP's LZ4 decoder
   checks none of this: a truncated block decodes to garbage of the right size. Only the
   lengths are read (literals are skipped), one warp per stream: the warp reads a window of
   the stream into shared memory with 16-byte loads, and every lane walks the same sequences
   in it (the same values, so the lanes never diverge), the window read again where the walk
   leaves it. A walk is a chain of dependent reads: from shared memory, each is short, and the
   streams spread over every multiprocessor (a thread per stream reading device memory took
   twice as long on 4 MiB blocks). */
#define LZ4_WARPS 4
#define LZ4_WINDOW 2048

struct Lz4Window {
  const unsigned char* p;
  long long n, lo, hi;   /* the window holds p[lo, hi) */
  unsigned char* bytes;  /* LZ4_WINDOW + 16 bytes of shared memory */
  int lane;

  __device__ unsigned int at(long long q) {
    if (q < lo || q >= hi) {
      __syncwarp();  /* every lane is done with the window before it is read again */
      unsigned long long start = (unsigned long long)(p + q) & ~15ull;
      const uint4* words = (const uint4*)start;
      /* only words that hold a byte of the stream: none past its allocation */
      long long count = ((long long)((unsigned long long)(p + n) - start) + 15) >> 4;
      if (count > LZ4_WINDOW / 16) count = LZ4_WINDOW / 16;
      for (int k = lane; k < count; k += 32) ((uint4*)bytes)[k] = words[k];
      __syncwarp();
      lo = (long long)(start - (unsigned long long)p);
      hi = lo + count * 16;
      if (hi > n) hi = n;
    }
    return bytes[q - lo];
  }

  /* an LZ4 length whose 4-bit field is value, continued by bytes of 255 at *pos; -1 when
     the input ends first */
  __device__ long long length(long long* pos, long long value) {
    if (value != 15) return value;
    unsigned int b;
    do {
      if (*pos >= n) return -1;
      b = at((*pos)++);
      value += b;
    } while (b == 255);
    return value;
  }
};

extern "C" __global__ void lz4_walk_warps(const unsigned long long* ptrs, const long long* lens,
                                         const long long* want, long long* status, int count) {
  __shared__ __align__(16) unsigned char windows[LZ4_WARPS][LZ4_WINDOW + 16];
  int warp = threadIdx.x >> 5;
  int i = blockIdx.x * LZ4_WARPS + warp;
  if (i >= count) return;  /* the whole warp */
  Lz4Window w;
  w.p = (const unsigned char*)ptrs[i];
  w.n = lens[i];
  w.lo = w.hi = 0;
  w.bytes = windows[warp];
  w.lane = threadIdx.x & 31;
  long long n = w.n, expected = want[i];
  long long pos = 0, out = 0;
  long long bad = 0;
  while (true) {
    if (pos >= n) { bad = pos + 1; break; }
    unsigned int token = w.at(pos++);
    long long lit = w.length(&pos, token >> 4);
    if (lit < 0) { bad = n + 1; break; }
    long long cpy = out + lit;
    if (lit > n - pos || cpy > expected) { bad = pos + 1; break; }
    if (cpy > expected - 12 || pos + lit > n - 8) {  /* necessarily the last sequence */
      if (pos + lit != n || cpy != expected) bad = pos + 1;
      break;
    }
    pos += lit;
    out = cpy;
    if (n - pos < 2) { bad = pos + 1; break; }
    long long offset = (long long)w.at(pos) | ((long long)w.at(pos + 1) << 8);
    pos += 2;
    if (offset == 0 || offset > out) { bad = pos - 1; break; }
    long long ml = w.length(&pos, token & 15);
    if (ml < 0) { bad = n + 1; break; }
    out += ml + 4;
    if (out > expected - 5) { bad = pos + 1; break; }
  }
  if (w.lane == 0) status[i] = bad;
}
