// Placing decoded chunks into the output: many 2-D copies with one launch.

/* Table rows: source address, destination address, width, height, source pitch,
   destination pitch (bytes). A block takes copies strided by gridDim.x and, within a copy,
   (row, segment of _SEGMENT bytes) units strided by gridDim.y; its threads move 16, 4 or 1
   bytes each, the widest every address and pitch of the copy allows. */
extern "C" __global__ void copy_boxes(const long long* table, int n, long long segment) {
    for (int c = blockIdx.x; c < n; c += gridDim.x) {
        const long long* r = table + 6 * (long long)c;
        const unsigned char* src = (const unsigned char*)r[0];
        unsigned char* dst = (unsigned char*)r[1];
        long long width = r[2], height = r[3], sp = r[4], dp = r[5];
        long long segs = (width + segment - 1) / segment;
        long long units = height * segs;
        long long bits = r[0] | r[1] | width | sp | dp;
        int step = (bits & 15) == 0 ? 16 : ((bits & 3) == 0 ? 4 : 1);
        for (long long u = blockIdx.y; u < units; u += gridDim.y) {
            long long row = u / segs;
            long long lo = (u % segs) * segment;
            long long hi = lo + segment < width ? lo + segment : width;
            const unsigned char* s = src + row * sp;
            unsigned char* d = dst + row * dp;
            if (step == 16) {
                for (long long i = lo + 16 * threadIdx.x; i < hi; i += 16 * blockDim.x)
                    *(uint4*)(d + i) = *(const uint4*)(s + i);
            } else if (step == 4) {
                for (long long i = lo + 4 * threadIdx.x; i < hi; i += 4 * blockDim.x)
                    *(unsigned int*)(d + i) = *(const unsigned int*)(s + i);
            } else {
                for (long long i = lo + threadIdx.x; i < hi; i += blockDim.x) d[i] = s[i];
            }
        }
    }
}
