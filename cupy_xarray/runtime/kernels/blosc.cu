// Blosc on the GPU: batched copies of stored streams, and the unshuffle of every block.
extern "C" __global__ void batched_copy(const unsigned char* src, unsigned char* dst,
        const long long* soff, const long long* doff, const long long* len) {
    long long seg = blockIdx.x;
    const unsigned char* s = src + soff[seg];
    unsigned char* d = dst + doff[seg];
    for (long long i = threadIdx.x; i < len[seg]; i += blockDim.x) d[i] = s[i];
}

/* where a block's unshuffled bytes go: one run at o (w == 0), or a box of the output (the
   chunk's bytes are planes of h rows of w bytes, rows dp apart, planes pp apart, from o; the
   block starts at byte c0 of the chunk). Boxes have w % 64 == 0, c0 % 64 == 0 and o, dp, pp
   16-byte aligned, so that no store of up to 64 bytes at a multiple of its width in the block
   crosses a row, and a byte's alignment is that of its place in the chunk. */
struct Dst {
    unsigned char* o;
    unsigned int w, c0, h;
    long long dp, pp;
};

__device__ __forceinline__ unsigned char* at(const Dst& d, int i) {
    if (d.w == 0) return d.o + i;
    unsigned int c = d.c0 + (unsigned int)i;
    unsigned int q = c / d.w, col = c - q * d.w;
    unsigned int plane = q / d.h, row = q - plane * d.h;
    return d.o + plane * d.pp + row * d.dp + col;
}

/* the alignment a store at byte 0 of the block sees */
__device__ __forceinline__ unsigned long long base_addr(const Dst& d) {
    return d.w == 0 ? (unsigned long long)d.o : (unsigned long long)d.c0;
}

/* byte i of a block's shuffled bytes: in its only stream, or in split stream i / neblock */
__device__ __forceinline__ unsigned char shuffled_at(const unsigned char* const* sp, int ns, int neblock,
        int i) {
    return ns == 1 ? sp[0][i] : sp[i / neblock][i % neblock];
}

/* the 8x8 bit matrix in x (row k = byte k, column m = bit m), transposed */
__device__ __forceinline__ unsigned long long transpose8(unsigned long long x) {
    unsigned long long t;
    t = (x ^ (x >> 7)) & 0x00AA00AA00AA00AAULL;  x = x ^ t ^ (t << 7);
    t = (x ^ (x >> 14)) & 0x0000CCCC0000CCCCULL; x = x ^ t ^ (t << 14);
    t = (x ^ (x >> 28)) & 0x00000000F0F0F0F0ULL; x = x ^ t ^ (t << 28);
    return x;
}

/* NW 4-byte words stored at d with 16-, 8-, 4- or 1-byte writes (d aligned to the width; the
   16-byte writes need NW % 4 == 0, the 8-byte ones NW % 2 == 0) */
template <int NW>
__device__ __forceinline__ void store_words(unsigned char* d, const unsigned int (&w)[NW], int store) {
    if (store == 16) {
#pragma unroll
        for (int i = 0; i < NW / 4; i++) {
            uint4 v;
            v.x = w[4 * i]; v.y = w[4 * i + 1]; v.z = w[4 * i + 2]; v.w = w[4 * i + 3];
            ((uint4*)d)[i] = v;
        }
    } else if (store == 8) {
#pragma unroll
        for (int i = 0; i < NW / 2; i++) {
            uint2 v;
            v.x = w[2 * i]; v.y = w[2 * i + 1];
            ((uint2*)d)[i] = v;
        }
    } else if (store == 4) {
#pragma unroll
        for (int i = 0; i < NW; i++) ((unsigned int*)d)[i] = w[i];
    } else {
#pragma unroll
        for (int i = 0; i < 4 * NW; i++) d[i] = (unsigned char)(w[i >> 2] >> ((i & 3) * 8));
    }
}

/* bit unshuffle for a typesize known at compile time: one thread builds the TS bytes of 8
   elements in registers and stores them with wide writes (byte writes at a stride of TS
   made the old kernel write-bound) */
template <int TS>
__device__ void bit_unshuffle(const unsigned char* const* sp, int ns, int neblock, const Dst& o,
        int row, int start, int stride) {
    unsigned long long addr = base_addr(o);
    int store = (TS % 2 == 0 && addr % 16 == 0) ? 16 : (addr % 8 == 0 ? 8 : 1);
    for (int r = start; r < row; r += stride) {
        unsigned int w[2 * TS];
#pragma unroll
        for (int i = 0; i < 2 * TS; i++) w[i] = 0;
#pragma unroll
        for (int b = 0; b < TS; b++) {
            unsigned long long x = 0;
#pragma unroll
            for (int k = 0; k < 8; k++)
                x |= (unsigned long long)shuffled_at(sp, ns, neblock, (b * 8 + k) * row + r) << (8 * k);
            x = transpose8(x);
#pragma unroll
            for (int m = 0; m < 8; m++) {
                int i = m * TS + b;
                w[i >> 2] |= (unsigned int)((x >> (8 * m)) & 0xFF) << ((i & 3) * 8);
            }
        }
        store_words<2 * TS>(at(o, r * 8 * TS), w, store);  /* the 8 * TS bytes of 8 elements */
    }
}

/* bit_unshuffle for a block held in one stream whose rows are 4-byte aligned: one thread
   reads 4 consecutive bytes of each of the 8 * TS bit planes with word loads and builds 4
   rows (32 elements) */
template <int TS>
__device__ void bit_unshuffle4(const unsigned char* s, const Dst& o, int row, int start, int stride) {
    unsigned long long addr = base_addr(o);
    int store = (TS % 2 == 0 && addr % 16 == 0) ? 16 : (addr % 8 == 0 ? 8 : 1);
    int units = row / 4;
    for (int u = start; u < units; u += stride) {
        int r0 = 4 * u;
        unsigned int in[TS][8];
#pragma unroll
        for (int b = 0; b < TS; b++) {
#pragma unroll
            for (int k = 0; k < 8; k++) in[b][k] = *(const unsigned int*)(s + (b * 8 + k) * row + r0);
        }
#pragma unroll
        for (int j = 0; j < 4; j++) {
            unsigned int w[2 * TS];
#pragma unroll
            for (int i = 0; i < 2 * TS; i++) w[i] = 0;
#pragma unroll
            for (int b = 0; b < TS; b++) {
                unsigned long long x = 0;
#pragma unroll
                for (int k = 0; k < 8; k++)
                    x |= (unsigned long long)((in[b][k] >> (8 * j)) & 0xFF) << (8 * k);
                x = transpose8(x);
#pragma unroll
                for (int m = 0; m < 8; m++) {
                    int i = m * TS + b;
                    w[i >> 2] |= (unsigned int)((x >> (8 * m)) & 0xFF) << ((i & 3) * 8);
                }
            }
            store_words<2 * TS>(at(o, (r0 + j) * 8 * TS), w, store);
        }
    }
}

/* byte unshuffle for a typesize known at compile time: one thread reads 4 bytes of each byte
   plane and writes the TS bytes of 4 elements with word stores (single-byte stores at a
   stride of TS made the byte path write-bound). Plane b is split stream b, or the b-th run of
   n bytes of the block's one stream. Elements past the last multiple of 4: the caller. */
template <int TS>
__device__ void byte_unshuffle(const unsigned char* const* sp, bool planes, int n, const Dst& o,
        int start, int stride) {
    const unsigned char* p[TS];
    bool aligned_in = true;
#pragma unroll
    for (int b = 0; b < TS; b++) {
        p[b] = planes ? sp[b] : sp[0] + b * n;
        aligned_in = aligned_in && ((unsigned long long)p[b] % 4 == 0);
    }
    unsigned long long addr = base_addr(o);
    int store = (TS >= 4 && addr % 16 == 0) ? 16 : (addr % 4 == 0 ? 4 : 1);
    int units = n / 4;
    for (int u = start; u < units; u += stride) {
        int e = u * 4;
        unsigned int x[TS];
#pragma unroll
        for (int b = 0; b < TS; b++) {
            const unsigned char* q = p[b] + e;
            x[b] = aligned_in ? *(const unsigned int*)q
                              : (unsigned int)q[0] | (unsigned int)q[1] << 8 | (unsigned int)q[2] << 16
                                    | (unsigned int)q[3] << 24;
        }
        unsigned int w[TS];
#pragma unroll
        for (int i = 0; i < TS; i++) {
            unsigned int v = 0;
#pragma unroll
            for (int j = 0; j < 4; j++) {
                int pos = 4 * i + j;  /* output byte pos of the 4 elements: element pos / TS, byte pos % TS */
                v |= ((x[pos % TS] >> (8 * (pos / TS))) & 0xFF) << (8 * j);
            }
            w[i] = v;
        }
        store_words<TS>(at(o, e * TS), w, store);
    }
}

/* 32-bit indices (a Blosc block is < 2 GiB): 64-bit division is emulated and was the cost.
   bgeo: per block w, c0, h, dp, pp of its Dst (w == 0: its bytes are one run at bdst). */
extern "C" __global__ void blosc_unshuffle(const unsigned long long* bdst,
        const int* bsize, const int* bts, const int* bmode, const int* bns, const long long* bs0,
        const unsigned long long* sptr, const long long* bgeo) {
    int blk = blockIdx.y;
    int size = bsize[blk], ts = bts[blk], mode = bmode[blk], ns = bns[blk];
    const unsigned char* const* sp = (const unsigned char* const*)(sptr + bs0[blk]);
    int neblock = size / ns;
    const long long* g = bgeo + 5 * (long long)blk;
    Dst o = {(unsigned char*)bdst[blk], (unsigned int)g[0], (unsigned int)g[1], (unsigned int)g[2], g[3], g[4]};
    int n = size / ts;
    int n8 = n - n % 8;
    int start = blockIdx.x * blockDim.x + threadIdx.x;
    int stride = gridDim.x * blockDim.x;
    int done = 0;  /* bytes [0, done) are written by a shuffle path, the rest copied as stored */
    if ((mode == 2 || (mode == 3 && n % 8 == 0)) && n8 > 0) {
        int row = n8 / 8;
        bool words = ns == 1 && row % 4 == 0 && (unsigned long long)sp[0] % 4 == 0;
#define BIT_CASE(T) case T: \
            if (words) bit_unshuffle4<T>(sp[0], o, row, start, stride); \
            else bit_unshuffle<T>(sp, ns, neblock, o, row, start, stride); \
            break;
        switch (ts) {
        BIT_CASE(1)
        BIT_CASE(2)
        BIT_CASE(4)
        BIT_CASE(8)
        default: {
            /* one unit = byte b of elements 8r..8r+7: eight bit-plane bytes in, eight bytes out */
            int units = row * ts;
            for (int u = start; u < units; u += stride) {
                int b = u / row, r = u - b * row;
                unsigned char x[8];
                for (int k = 0; k < 8; k++) x[k] = shuffled_at(sp, ns, neblock, (b * 8 + k) * row + r);
                for (int m = 0; m < 8; m++) {
                    unsigned char v = 0;
                    for (int k = 0; k < 8; k++) v |= ((x[k] >> m) & 1) << k;
                    *at(o, (r * 8 + m) * ts + b) = v;
                }
            }
        }
        }
        done = n8 * ts;
    } else if (mode == 1 && ts > 1) {
        /* byte b of an element comes from plane b (split stream b, or the b-th run of n bytes
           of the one stream) */
        bool planes = ns == ts && neblock == n;
        int first = 0;  /* elements [0, first) written by a word-wide path */
        if (planes || ns == 1) {
            switch (ts) {
            case 2: byte_unshuffle<2>(sp, planes, n, o, start, stride); first = n - n % 4; break;
            case 4: byte_unshuffle<4>(sp, planes, n, o, start, stride); first = n - n % 4; break;
            case 8: byte_unshuffle<8>(sp, planes, n, o, start, stride); first = n - n % 4; break;
            default: break;
            }
        }
        for (int e = first + start; e < n; e += stride) {
            for (int b = 0; b < ts; b++)
                *at(o, e * ts + b) = planes ? sp[b][e] : shuffled_at(sp, ns, neblock, b * n + e);
        }
        done = n * ts;
    }
    for (int p = done + start; p < size; p += stride) *at(o, p) = shuffled_at(sp, ns, neblock, p);
}
