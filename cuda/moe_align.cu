// Token-by-expert alignment: from topk_ids [T*k] (every id in 0..E), expert_offsets [E+1]
// (prefix sums of the per-expert counts) and sorted_slots [T*k] (slot indices t*k+j grouped by
// expert, in slot order within an expert, so the result is deterministic). Grid: one block of
// 256 threads per expert (E <= 1024). Block e counts the slots of lower experts (its offset),
// then walks the slots 256 at a time, placing its own by a ballot rank within each warp plus
// the counts of the warps before it: stable, and no atomics. (One block with a thread per
// expert, each scanning every slot alone, took 213 us at 8192 slots on an H200.)

#define MOEQ_ALIGN_THREADS 256
#define MOEQ_ALIGN_WARPS (MOEQ_ALIGN_THREADS / 32)

extern "C" __global__ void __launch_bounds__(MOEQ_ALIGN_THREADS)
    moe_align(const int* __restrict__ topk_ids, int slots, int experts,
              int* __restrict__ expert_offsets, int* __restrict__ sorted_slots) {
    const unsigned full = 0xffffffffu;
    __shared__ int warp_counts[MOEQ_ALIGN_WARPS];
    int e = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    int below = 0;
    for (int s = tid; s < slots; s += MOEQ_ALIGN_THREADS) below += topk_ids[s] < e;
    for (int o = 16; o > 0; o >>= 1) below += __shfl_xor_sync(full, below, o);
    if (lane == 0) warp_counts[warp] = below;
    __syncthreads();
    int at = 0;
    for (int w = 0; w < MOEQ_ALIGN_WARPS; ++w) at += warp_counts[w];
    if (tid == 0) {
        expert_offsets[e] = at;
        if (e == experts - 1) expert_offsets[experts] = slots;
    }
    for (int c = 0; c < slots; c += MOEQ_ALIGN_THREADS) {
        // warp_counts is read above (or in the previous chunk) before it is written again.
        __syncthreads();
        int s = c + tid;
        bool mine = s < slots && topk_ids[s] == e;
        unsigned m = __ballot_sync(full, mine);
        if (lane == 0) warp_counts[warp] = __popc(m);
        __syncthreads();
        int before = 0, total = 0;
        for (int w = 0; w < MOEQ_ALIGN_WARPS; ++w) {
            int n = warp_counts[w];
            before += w < warp ? n : 0;
            total += n;
        }
        if (mine) sorted_slots[at + before + __popc(m & ((1u << lane) - 1u))] = s;
        at += total;
    }
}
