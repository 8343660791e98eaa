// Header-free helpers shared by every moeq_rs kernel (NVRTC compiles them with no include
// path): fp16/bf16 <-> fp32, dtype-generic loads and stores, constants.
//
// DTYPE (a -D define of each program): 0 = fp32, 1 = fp16, 2 = bf16. Kernels that move
// activations are compiled once per DTYPE; their names carry the suffix SUFFIX.

typedef unsigned short moeq_u16;

#define MOEQ_NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float moeq_bf16_to_f32(moeq_u16 v) {
    return __int_as_float(((int)v) << 16);
}

// Round to nearest even; NaN stays a (quiet) NaN.
__device__ __forceinline__ moeq_u16 moeq_f32_to_bf16(float f) {
    unsigned u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (moeq_u16)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (moeq_u16)(u >> 16);
}

__device__ __forceinline__ float moeq_f16_to_f32(moeq_u16 v) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v));
    return f;
}

__device__ __forceinline__ moeq_u16 moeq_f32_to_f16(float f) {
    moeq_u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

#if DTYPE == 0
typedef float act_t;
__device__ __forceinline__ float act_load(const act_t* p, long i) { return p[i]; }
__device__ __forceinline__ void act_store(act_t* p, long i, float v) { p[i] = v; }
#define SUFFIX(name) name##_f32
#elif DTYPE == 1
typedef moeq_u16 act_t;
__device__ __forceinline__ float act_load(const act_t* p, long i) { return moeq_f16_to_f32(p[i]); }
__device__ __forceinline__ void act_store(act_t* p, long i, float v) { p[i] = moeq_f32_to_f16(v); }
#define SUFFIX(name) name##_f16
#else
typedef moeq_u16 act_t;
__device__ __forceinline__ float act_load(const act_t* p, long i) { return moeq_bf16_to_f32(p[i]); }
__device__ __forceinline__ void act_store(act_t* p, long i, float v) { p[i] = moeq_f32_to_bf16(v); }
#define SUFFIX(name) name##_bf16
#endif

// The grouped GEMMs' block-to-work map: block y walks the experts' 16-row tiles of the sorted
// rows (expert_offsets [E+1]); the grid has ceil(rows / 16) + E blocks in y, so some find none.
// Returns the first sorted row of this block's tile and sets *expert and *row_end, or returns
// -1 when the block has no tile.
__device__ __forceinline__ int moeq_expert_tile(const int* expert_offsets, int experts, int tile,
                                                int* expert, int* row_end) {
    for (int e = 0; e < experts; ++e) {
        int begin = expert_offsets[e];
        int tiles = (expert_offsets[e + 1] - begin + 15) >> 4;
        if (tile < tiles) {
            *expert = e;
            *row_end = expert_offsets[e + 1];
            return begin + tile * 16;
        }
        tile -= tiles;
    }
    return -1;
}
