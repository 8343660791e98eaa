// Token-by-expert alignment: from topk_ids [T*k], expert_offsets [E+1] (prefix sums of the
// per-expert counts) and sorted_slots [T*k] (slot indices t*k+j grouped by expert, in slot
// order within an expert, so the result is deterministic). One block, one thread per expert
// (E <= 1024).

// The bound lets a block of up to 1024 threads launch whatever registers NVRTC assigns.
extern "C" __global__ void __launch_bounds__(1024)
    moe_align(const int* __restrict__ topk_ids, int slots, int experts,
              int* __restrict__ expert_offsets, int* __restrict__ sorted_slots) {
    __shared__ int counts[1024];
    int e = threadIdx.x;
    if (e < experts) {
        int c = 0;
        for (int s = 0; s < slots; ++s) c += topk_ids[s] == e;
        counts[e] = c;
    }
    __syncthreads();
    if (e == 0) {
        int run = 0;
        for (int i = 0; i < experts; ++i) {
            expert_offsets[i] = run;
            run += counts[i];
        }
        expert_offsets[experts] = run;
    }
    __syncthreads();
    if (e < experts) {
        int at = expert_offsets[e];
        for (int s = 0; s < slots; ++s) {
            if (topk_ids[s] == e) sorted_slots[at++] = s;
        }
    }
}
