// int8 activation quantisation as DESIGN.md defines it: dynamic per token
// s = max|x| / 127 (a zero row gives s = 0 and q = 0), q = clamp(rne(x / s), -128, 127); or
// static scales given per row. Per token: one block of 256 threads per row.

__device__ __forceinline__ signed char moeq_quant(float x, float s) {
    if (!(s > 0.f)) return 0;
    float q = x / s;
    if (q != q) return 0;
    q = fminf(fmaxf(q, -128.f), 127.f);
    return (signed char)__float2int_rn(q);
}

extern "C" __global__ void SUFFIX(quant_int8_per_token)(const act_t* __restrict__ x, int rows,
                                                        int cols, signed char* __restrict__ q,
                                                        float* __restrict__ scales) {
    __shared__ float partial[256];
    int r = blockIdx.x;
    if (r >= rows) return;
    float m = 0.f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        float v = fabsf(act_load(x, (long)r * cols + c));
        m = v > m ? v : m;  // NaN never wins, as in the CPU reference
    }
    partial[threadIdx.x] = m;
    __syncthreads();
    for (int stride = blockDim.x / 2; stride > 0; stride >>= 1) {
        if (threadIdx.x < stride) {
            float o = partial[threadIdx.x + stride];
            if (o > partial[threadIdx.x]) partial[threadIdx.x] = o;
        }
        __syncthreads();
    }
    float s = partial[0] / 127.f;
    if (threadIdx.x == 0) scales[r] = s;
    for (int c = threadIdx.x; c < cols; c += blockDim.x)
        q[(long)r * cols + c] = moeq_quant(act_load(x, (long)r * cols + c), s);
}

// Static scales given per row (a row's expert's input_scale, DESIGN.md: never a maximum over
// experts): q[r, c] = quant(x[r, c], row_scales[r]). Grid: ceil(rows * cols / 256) blocks of 256.
extern "C" __global__ void SUFFIX(quant_int8_static)(const act_t* __restrict__ x, int rows,
                                                     int cols,
                                                     const float* __restrict__ row_scales,
                                                     signed char* __restrict__ q) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < (long)rows * cols) q[i] = moeq_quant(act_load(x, i), row_scales[i / cols]);
}
