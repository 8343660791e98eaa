// WNA16 grouped MoE GEMM on the Marlin layout that `moeq repack --target marlin` writes
// (byte-identical to vLLM's): int4 (uint4b8, or uint4 with 4-bit zero points) and int8
// (uint8b128) codes in 16 x 64 tiles, scales in Marlin's permuted [G, N] order, optional
// act-order (sorted g_idx plus the sort indices). Tensor cores: mma.sync m16n8k16 with fp16 or
// bf16 operands and fp32 accumulation (sm_80+).
//
// A tile's words are laid out so that lane 4*col + t of warp w holds, for the columns
// c = 16w + col and c + 8, the k-rows {2t, 2t+1, 2t+8, 2t+9}: exactly the mma B fragment. Each
// weight is dequantised as (code - bias) * scale in fp32 and rounded once to the activation
// dtype, which equals compressed-tensors' (q - zp) * scale in that dtype (one rounding of an
// exact product).
//
// Rows: sorted row i (grouped by expert, expert_offsets [E+1]) reads activation row
// sorted_slots[i] / a_div of `a` ([*, K]); out is [rows, N] in sorted order. Grid:
// (N / 64, ceil(rows / 16) + E, 1), 128 threads (4 warps, 16 columns each); block y walks the
// experts' 16-row tiles and returns past the last one. K % 16 == 0, N % 64 == 0, and
// group_size % 16 == 0 (the channelwise caller passes K).

#if DTYPE == 0
#error "wna16_gemm takes 16-bit activations (mma.sync f16/bf16)"
#endif

// Two floats rounded (to nearest even) to the activation dtype and packed, `lo` in the low half.
__device__ __forceinline__ unsigned wna16_pack(float lo, float hi) {
    unsigned d;
#if DTYPE == 1
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
#else
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
#endif
    return d;
}

__device__ __forceinline__ void wna16_mma(float* c, const unsigned* a, unsigned b0, unsigned b1) {
#if DTYPE == 1
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// Position of column c in Marlin's permuted scale rows: the grouped table permutes every 64
// columns (output j holds column j / 8 + 8 (j % 8)), the single one every 32 (output
// 8i + m holds column 2i + {0,1,8,9,16,17,24,25}[m]).
__device__ __forceinline__ int wna16_scale_pos(int c, int grouped) {
    if (grouped) {
        int cc = c & 63;
        return (c & ~63) + 8 * (cc & 7) + (cc >> 3);
    }
    int cc = c & 31, r = cc & 7;
    return (c & ~31) + 8 * (r >> 1) + 2 * (cc >> 3) + (r & 1);
}

// The 4-bit zero-point code of (group g, column c): Marlin's zero points take the grouped
// table, then the interleave [0,2,4,6,1,3,5,7] within every 8, packed 8 per word.
__device__ __forceinline__ float wna16_zero_point(const unsigned* zp, int n, int g, int c) {
    int p = wna16_scale_pos(c, 1);
    int x = p & 7;
    int slot = (x >> 1) + 4 * (x & 1);  // the inverse of the interleave
    unsigned word = zp[((long)g * n + p) >> 3];
    return (float)((word >> (4 * slot)) & 15u);
}

// Two consecutive k-columns (Marlin rows kk, kk + 1) of one activation row as a packed pair;
// zero for a row past the expert's end. With act-order, Marlin row r is column perm[r].
__device__ __forceinline__ unsigned wna16_a_pair(const act_t* row, const int* perm, int kk) {
    if (!row) return 0u;
    if (perm) return (unsigned)row[perm[kk]] | ((unsigned)row[perm[kk + 1]] << 16);
    return *(const unsigned*)(row + kk);
}

extern "C" __global__ void __launch_bounds__(128, 1) SUFFIX(wna16_moe_gemm)(
    const act_t* __restrict__ a, int a_div, const int* __restrict__ sorted_slots,
    const int* __restrict__ expert_offsets, int experts, const unsigned* __restrict__ w,
    const act_t* __restrict__ scales, const unsigned* __restrict__ zp,
    const int* __restrict__ g_idx, const int* __restrict__ perm, int n, int k, int groups,
    int group_size, int bits, int grouped_table, act_t* __restrict__ out) {
    int e = 0, row_end = 0;
    int row0 = moeq_expert_tile(expert_offsets, experts, blockIdx.y, &e, &row_end);
    if (row0 < 0) return;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int gq = lane >> 2, t = lane & 3;
    int nt = blockIdx.x, n_tiles = n >> 6;
    int words = bits == 4 ? 128 : 256;
    const unsigned* we = w + (long)e * (k >> 4) * n_tiles * words;
    const act_t* se = scales + (long)e * groups * n;
    const unsigned* ze = zp ? zp + (long)e * groups * (n >> 3) : 0;
    const int* ge = g_idx ? g_idx + (long)e * k : 0;
    const int* pe = perm ? perm + (long)e * k : 0;
    int r0 = row0 + gq, r1 = r0 + 8;
    const act_t* a0 = r0 < row_end ? a + (long)(sorted_slots[r0] / a_div) * k : 0;
    const act_t* a1 = r1 < row_end ? a + (long)(sorted_slots[r1] / a_div) * k : 0;
    // This lane's B columns (n8 tiles 0 and 1 of the warp's 16) and their scale positions.
    int col[2] = {nt * 64 + warp * 16 + gq, nt * 64 + warp * 16 + gq + 8};
    int spos[2] = {wna16_scale_pos(col[0], grouped_table), wna16_scale_pos(col[1], grouped_table)};
    float bias = bits == 4 ? 8.0f : 128.0f;
    float acc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
    for (int kt = 0; kt < (k >> 4); ++kt) {
        int kb = kt * 16;
        unsigned af[4];
        af[0] = wna16_a_pair(a0, pe, kb + 2 * t);
        af[1] = wna16_a_pair(a1, pe, kb + 2 * t);
        af[2] = wna16_a_pair(a0, pe, kb + 2 * t + 8);
        af[3] = wna16_a_pair(a1, pe, kb + 2 * t + 8);
        // codes[j][i]: column col[j], k-row kb + {2t, 2t+1, 2t+8, 2t+9}[i].
        unsigned codes[2][4];
        const unsigned* tw = we + ((long)kt * n_tiles + nt) * words;
        if (bits == 4) {
            // nibble slot = 4 (kk % 2) + 2 half + kk / 8
            unsigned q = tw[4 * lane + warp];
            const int slot[2][4] = {{0, 4, 1, 5}, {2, 6, 3, 7}};
#pragma unroll
            for (int j = 0; j < 2; ++j)
#pragma unroll
                for (int i = 0; i < 4; ++i) codes[j][i] = (q >> (4 * slot[j][i])) & 15u;
        } else {
            // byte slot = 2 (kk % 2) + kk / 8, half 0 in word 0 and half 1 in word 1
            const int slot[4] = {0, 2, 1, 3};
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                unsigned q = tw[8 * lane + 2 * warp + j];
#pragma unroll
                for (int i = 0; i < 4; ++i) codes[j][i] = (q >> (8 * slot[i])) & 255u;
            }
        }
        // Without act-order a k-tile lies in one group (group_size % 16 == 0); with it, each
        // k-row has its own (sorted) group.
        int tile_group = kb / group_size;
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            float v[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                int g = ge ? ge[kb + 2 * t + (i & 1) + 8 * (i >> 1)] : tile_group;
                float s = act_load(se, (long)g * n + spos[j]);
                float z = ze ? wna16_zero_point(ze, n, g, col[j]) : bias;
                v[i] = ((float)codes[j][i] - z) * s;
            }
            wna16_mma(acc[j], af, wna16_pack(v[0], v[1]), wna16_pack(v[2], v[3]));
        }
    }
    // C fragment: acc[j][0..1] are row r0, columns 2t and 2t + 1 of n8 tile j; [2..3] row r1.
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        int c = nt * 64 + warp * 16 + 8 * j + 2 * t;
        if (r0 < row_end) {
            act_store(out, (long)r0 * n + c, acc[j][0]);
            act_store(out, (long)r0 * n + c + 1, acc[j][1]);
        }
        if (r1 < row_end) {
            act_store(out, (long)r1 * n + c, acc[j][2]);
            act_store(out, (long)r1 * n + c + 1, acc[j][3]);
        }
    }
}
