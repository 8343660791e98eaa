// int8 activation quantisation as DESIGN.md defines it: dynamic per token
// s = max|x| / 127 (a zero row gives s = 0 and q = 0), q = clamp(rne(x / s), -128, 127); or
// static scales given per row. Per token: one block of 256 threads per row.
// A row whose products are NaN in that arithmetic (a NaN in it; with a dynamic scale also an
// infinity, since inf / inf is NaN) gets a NaN scale, which the GEMM epilogue multiplies into
// every output of the row: the codes cannot carry it (NaN quantises to 0), as in the CPU path.

#define MOEQ_NAN __int_as_float(0x7fc00000)

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
    int nan = 0;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        float v = fabsf(act_load(x, (long)r * cols + c));
        nan |= v != v;
        m = v > m ? v : m;  // NaN never wins the maximum; `nan` records it
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
    nan = __syncthreads_or(nan);
    float s = partial[0] / 127.f;
    if (nan || !isfinite(s)) s = MOEQ_NAN;
    if (threadIdx.x == 0) scales[r] = s;
    for (int c = threadIdx.x; c < cols; c += blockDim.x)
        q[(long)r * cols + c] = moeq_quant(act_load(x, (long)r * cols + c), s);
}

// Static scales given per row (a row's expert's input_scale, DESIGN.md: never a maximum over
// experts): q[r, c] = quant(x[r, c], row_scales[r]). Grid: ceil(rows * cols / 256) blocks of 256.
// `row_scales` is this call's own per-row copy: a NaN in row r sets row_scales[r] to NaN (an
// infinity clamps to 127 under a static scale, finite as in DESIGN.md's arithmetic). Threads
// of the row that read the NaN scale write code 0, which the NaN scale overrides anyway.
extern "C" __global__ void SUFFIX(quant_int8_static)(const act_t* __restrict__ x, int rows,
                                                     int cols, float* __restrict__ row_scales,
                                                     signed char* __restrict__ q) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < (long)rows * cols) {
        float v = act_load(x, i);
        q[i] = moeq_quant(v, row_scales[i / cols]);
        if (v != v) row_scales[i / cols] = MOEQ_NAN;
    }
}
