// The length of each zstd frame by its block headers: the GPU twin of zstd.frame_length.
extern "C" __global__ void zstd_frame_length(const unsigned char* buf, const long long* offs,
                                             const long long* lens, long long* out, int count) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= count) return;
  const unsigned char* b = buf + offs[i];
  long long n = lens[i];
  out[i] = -1;
  if (n < 6 || b[0] != 0x28 || b[1] != 0xb5 || b[2] != 0x2f || b[3] != 0xfd) return;
  int fhd = b[4];
  int single = (fhd >> 5) & 1;
  const int dict[4] = {0, 1, 2, 4};
  const int fcs[4] = {single ? 1 : 0, 2, 4, 8};
  long long pos = 5 + (single ? 0 : 1) + dict[fhd & 3] + fcs[fhd >> 6];
  while (true) {
    if (pos + 3 > n) return;
    unsigned int h = b[pos] | (b[pos + 1] << 8) | (b[pos + 2] << 16);
    int last = h & 1, kind = (h >> 1) & 3;
    long long size = h >> 3;
    if (kind == 3) return;
    pos += 3 + (kind == 1 ? 1 : size);
    if (last) break;
  }
  if ((fhd >> 2) & 1) pos += 4;
  out[i] = pos <= n ? pos : -1;
}
