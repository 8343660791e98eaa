// Grouped int8 GEMM of the W8A8 MoE (a baseline with dp4a, not yet tensor cores): rows of
// `a` ([M, K] int8, grouped by expert as expert_offsets says) times expert e's weights
// w[e] ([N, K] int8), int32 accumulation, out[m, n] = acc * a_scale[m] * w_scale[e, n] in
// DTYPE. K % 4 == 0 and 4-byte aligned rows. Grid: (ceil(N / 16), ceil(M / 16), E); block
// 16 x 16; each 16 x 16 tile of the output stages 16 x 64 bytes of a and w in shared memory.

// dp4a by its PTX instruction: NVRTC 12.1 does not resolve the `__dp4a` intrinsic.
__device__ __forceinline__ int dot4_s8(int a, int b, int acc) {
    int d;
    asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(acc));
    return d;
}

extern "C" __global__ void SUFFIX(w8a8_grouped_gemm)(
    const signed char* __restrict__ a, const float* __restrict__ a_scale,
    const signed char* __restrict__ w, const float* __restrict__ w_scale,
    const int* __restrict__ expert_offsets, int n, int k, act_t* __restrict__ out) {
    __shared__ int sa[16][17];
    __shared__ int sw[16][17];
    int e = blockIdx.z;
    int begin = expert_offsets[e], end = expert_offsets[e + 1];
    int row = begin + blockIdx.y * 16 + threadIdx.y;
    int col = blockIdx.x * 16 + threadIdx.x;
    if (begin + blockIdx.y * 16 >= end) return;  // whole block past this expert's rows
    const int* a4 = (const int*)a;
    const int* w4 = (const int*)(w + (long)e * n * k);
    int k4 = k / 4;
    int acc = 0;
    for (int k0 = 0; k0 < k4; k0 += 16) {
        int kk = k0 + threadIdx.x;
        int arow = begin + blockIdx.y * 16 + threadIdx.y;
        sa[threadIdx.y][threadIdx.x] = (arow < end && kk < k4) ? a4[(long)arow * k4 + kk] : 0;
        int wrow = blockIdx.x * 16 + threadIdx.y;
        sw[threadIdx.y][threadIdx.x] = (wrow < n && kk < k4) ? w4[(long)wrow * k4 + kk] : 0;
        __syncthreads();
#pragma unroll
        for (int i = 0; i < 16; ++i) acc = dot4_s8(sa[threadIdx.y][i], sw[threadIdx.x][i], acc);
        __syncthreads();
    }
    if (row < end && col < n)
        act_store(out, (long)row * n + col, (float)acc * a_scale[row] * w_scale[(long)e * n + col]);
}
