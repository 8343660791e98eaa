// Grouped int8 GEMM of the W8A8 MoE on tensor cores: mma.sync m16n8k32 s8 x s8 -> s32 (sm_80+).
// Rows of `a` ([rows, K] int8, grouped by expert as expert_offsets [E+1] says) times expert e's
// weights w[e] ([N, K] int8, row-major: each weight row is an mma B column), exact int32
// accumulation, out[r, n] = acc * a_scale[r] * w_scale[e, n] in fp32, stored in DTYPE (the
// CPU path's epilogue, in the same order). K % 4 == 0 (4-byte loads). Grid:
// (ceil(N / 64), ceil(rows / 16) + E); 128 threads: warp w computes columns 16w .. 16w + 15 of
// the block's 64 (two n8 tiles) for the block's 16 rows; block y walks the experts' 16-row
// tiles and returns past the last one.

__device__ __forceinline__ void w8a8_mma(int* c, const unsigned* a, unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Four int8 of a row at column kk (a multiple of 4); zero past K or for a missing row.
__device__ __forceinline__ unsigned w8a8_load4(const signed char* row, int kk, int k) {
    return (row && kk < k) ? *(const unsigned*)(row + kk) : 0u;
}

extern "C" __global__ void __launch_bounds__(128, 1) SUFFIX(w8a8_imma_gemm)(
    const signed char* __restrict__ a, const float* __restrict__ a_scale,
    const signed char* __restrict__ w, const float* __restrict__ w_scale,
    const int* __restrict__ expert_offsets, int experts, int n, int k, act_t* __restrict__ out) {
    int e = 0, row_end = 0;
    int row0 = moeq_expert_tile(expert_offsets, experts, blockIdx.y, &e, &row_end);
    if (row0 < 0) return;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int gq = lane >> 2, t = lane & 3;
    int r0 = row0 + gq, r1 = r0 + 8;
    const signed char* a0 = r0 < row_end ? a + (long)r0 * k : 0;
    const signed char* a1 = r1 < row_end ? a + (long)r1 * k : 0;
    int cb = blockIdx.x * 64 + warp * 16;
    // This lane's B columns: weight rows cb + gq and cb + 8 + gq.
    const signed char* w0 = cb + gq < n ? w + ((long)e * n + cb + gq) * k : 0;
    const signed char* w1 = cb + 8 + gq < n ? w + ((long)e * n + cb + 8 + gq) * k : 0;
    int acc[2][4] = {{0, 0, 0, 0}, {0, 0, 0, 0}};
    for (int kb = 0; kb < k; kb += 32) {
        // A fragment: rows gq and gq + 8, bytes 4t..4t+3 and 16+4t..16+4t+3 of the k-step.
        unsigned af[4] = {w8a8_load4(a0, kb + 4 * t, k), w8a8_load4(a1, kb + 4 * t, k),
                          w8a8_load4(a0, kb + 16 + 4 * t, k),
                          w8a8_load4(a1, kb + 16 + 4 * t, k)};
        w8a8_mma(acc[0], af, w8a8_load4(w0, kb + 4 * t, k), w8a8_load4(w0, kb + 16 + 4 * t, k));
        w8a8_mma(acc[1], af, w8a8_load4(w1, kb + 4 * t, k), w8a8_load4(w1, kb + 16 + 4 * t, k));
    }
    // C fragment: acc[j][0..1] are row r0, columns 2t and 2t + 1 of n8 tile j; [2..3] row r1.
#pragma unroll
    for (int j = 0; j < 2; ++j) {
#pragma unroll
        for (int h = 0; h < 4; ++h) {
            int r = h < 2 ? r0 : r1;
            int c = cb + 8 * j + 2 * t + (h & 1);
            if (r < row_end && c < n)
                act_store(out, (long)r * n + c,
                          (float)acc[j][h] * a_scale[r] * w_scale[(long)e * n + c]);
        }
    }
}
