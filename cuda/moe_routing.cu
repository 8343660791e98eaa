// Router: softmax over E logits per token, top-k, optional renormalisation of the k weights.
// One warp per token (E <= 4096, k <= 64): lanes stride the experts, and each of the k rounds
// is a warp-wide argmax over the experts ranked below the previous round's pick, so no lane
// keeps a list of taken experts. Experts are ranked by their softmax scores, as the CPU path
// (and vLLM) rank them, with the CPU path's order (torch.topk's): NaN above every number (an
// earlier NaN first), then larger scores, ties to the lower expert index. (Ranked by the raw
// logits, a row holding a NaN, whose scores are all NaN, picked its NaN expert first where the
// CPU picks experts 0, 1, ...; scores that underflow to 0 tied differently too.)
// (One thread per token, reading its own earlier picks back from global memory for every
// expert, took 178 us for one token of Qwen3-30B-A3B's 128 experts on an H200.)

// Whether (va, ia) ranks above (vb, ib).
__device__ __forceinline__ bool moeq_ranks_above(float va, int ia, float vb, int ib) {
    bool na = va != va, nb = vb != vb;
    if (na != nb) return na;
    if (!na && va != vb) return va > vb;
    return ia < ib;
}

extern "C" __global__ void moe_softmax_topk(const float* __restrict__ logits, int tokens,
                                            int experts, int k, int renormalize,
                                            float* __restrict__ topk_weights,
                                            int* __restrict__ topk_ids) {
    const unsigned full = 0xffffffffu;
    long t = ((long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    // Uniform per warp: the whole warp leaves together.
    if (t >= tokens) return;
    const float* l = logits + t * experts;
    float mx = MOEQ_NEG_INF;
    for (int e = lane; e < experts; e += 32) mx = fmaxf(mx, l[e]);
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(full, mx, o));
    float denom = 0.f;
    for (int e = lane; e < experts; e += 32) denom += expf(l[e] - mx);
    for (int o = 16; o > 0; o >>= 1) denom += __shfl_xor_sync(full, denom, o);
    float prev_v = 0.f, picked = 0.f;
    int prev_i = -1;
    for (int j = 0; j < k; ++j) {
        float best_v = 0.f;
        int best_i = -1;
        for (int e = lane; e < experts; e += 32) {
            float v = expf(l[e] - mx) / denom;
            bool below = prev_i < 0 || moeq_ranks_above(prev_v, prev_i, v, e);
            if (below && (best_i < 0 || moeq_ranks_above(v, e, best_v, best_i))) {
                best_v = v;
                best_i = e;
            }
        }
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(full, best_v, o);
            int oi = __shfl_xor_sync(full, best_i, o);
            if (oi >= 0 && (best_i < 0 || moeq_ranks_above(ov, oi, best_v, best_i))) {
                best_v = ov;
                best_i = oi;
            }
        }
        // Every lane now holds the same pick (k <= experts, so there is one), and its score.
        float w = best_v;
        if (lane == 0) {
            topk_ids[t * k + j] = best_i;
            topk_weights[t * k + j] = w;
        }
        picked += w;
        prev_v = best_v;
        prev_i = best_i;
    }
    if (renormalize && picked > 0.f) {
        // Lane 0's stores above are visible to the warp after the barrier.
        __syncwarp();
        for (int j = lane; j < k; j += 32) topk_weights[t * k + j] /= picked;
    }
}
