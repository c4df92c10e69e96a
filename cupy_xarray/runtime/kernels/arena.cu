/* Copies of many byte ranges in one launch (a batch's streams into the decoder process's
   arena): a copy per range from the host costs about 10 us each, 10 ms for a thousand. */

/* Copy lens[s] bytes from srcs[s] to dst + offs[s], for each of count ranges. blockIdx.y
   strides over the ranges, blockIdx.x and threadIdx.x over each range's bytes: 16 at a
   time where both ends are 16-aligned, else one. */
extern "C" __global__ void copy_ranges(unsigned char* dst, const long long* offs,
                                       const unsigned long long* srcs, const long long* lens,
                                       int count) {
  long long stride = (long long)gridDim.x * blockDim.x;
  long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  for (int s = blockIdx.y; s < count; s += gridDim.y) {
    const unsigned char* src = (const unsigned char*)srcs[s];
    unsigned char* out = dst + offs[s];
    long long n = lens[s];
    if ((((unsigned long long)src | (unsigned long long)out) & 15) == 0) {
      long long words = n >> 4;
      const uint4* s16 = (const uint4*)src;
      uint4* d16 = (uint4*)out;
      for (long long k = first; k < words; k += stride) d16[k] = s16[k];
      for (long long k = (words << 4) + first; k < n; k += stride) out[k] = src[k];
    } else {
      for (long long k = first; k < n; k += stride) out[k] = src[k];
    }
  }
}
