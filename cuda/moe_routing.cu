// Router: softmax over E logits per token, top-k (ties to the lower expert index), optional
// renormalisation of the k weights. One thread per token; E <= 4096 and k <= 64.

extern "C" __global__ void moe_softmax_topk(const float* __restrict__ logits, int tokens,
                                            int experts, int k, int renormalize,
                                            float* __restrict__ topk_weights,
                                            int* __restrict__ topk_ids) {
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= tokens) return;
    const float* l = logits + (long)t * experts;
    float mx = MOEQ_NEG_INF;
    for (int e = 0; e < experts; ++e) mx = fmaxf(mx, l[e]);
    float denom = 0.f;
    for (int e = 0; e < experts; ++e) denom += expf(l[e] - mx);
    float picked = 0.f;
    for (int j = 0; j < k; ++j) {
        int best = -1;
        float best_v = MOEQ_NEG_INF;
        for (int e = 0; e < experts; ++e) {
            bool taken = false;
            for (int q = 0; q < j; ++q) taken |= topk_ids[(long)t * k + q] == e;
            if (!taken && (best < 0 || l[e] > best_v)) {
                best = e;
                best_v = l[e];
            }
        }
        float w = expf(best_v - mx) / denom;
        topk_ids[(long)t * k + j] = best;
        topk_weights[(long)t * k + j] = w;
        picked += w;
    }
    if (renormalize && picked > 0.f) {
        for (int j = 0; j < k; ++j) topk_weights[(long)t * k + j] /= picked;
    }
}
