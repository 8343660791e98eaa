// SiLU-and-mul and the weighted combine, computed in fp32 on DTYPE activations.

// out[m, i] = silu(gu[m, i]) * gu[m, I + i] for gu [M, 2I].
extern "C" __global__ void SUFFIX(silu_and_mul)(const act_t* __restrict__ gu, int rows, int inter,
                                                act_t* __restrict__ out) {
    long idx = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long)rows * inter) return;
    long m = idx / inter, i = idx % inter;
    float g = act_load(gu, m * 2 * inter + i);
    float u = act_load(gu, m * 2 * inter + inter + i);
    act_store(out, idx, g / (1.f + expf(-g)) * u);
}

// out[t, h] = sum_j w[t*k + j] * y[(t*k + j), h] for y in slot order [T*k, H].
extern "C" __global__ void SUFFIX(moe_combine)(const act_t* __restrict__ y,
                                               const float* __restrict__ weights, int tokens,
                                               int k, int hidden, act_t* __restrict__ out) {
    long idx = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long)tokens * hidden) return;
    long t = idx / hidden, h = idx % hidden;
    float acc = 0.f;
    for (int j = 0; j < k; ++j) acc += weights[t * k + j] * act_load(y, (t * k + j) * hidden + h);
    act_store(out, idx, acc);
}
