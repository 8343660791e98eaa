//! Runtime kernel dispatch ([`isa`], capped by `MOEQ_CPU_ISA`), activation quantisation and the
//! fp32 dot product of unquantized layers. The GEMM kernels live in [`super::packed`] (int8)
//! and [`super::wo`] (weight-only); every SIMD path has a scalar reference it equals.

/// The kernel family of this CPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    Scalar,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// AVX2 with AVX-VNNI (the 256-bit, VEX-encoded `vpdpbusd`) for the int8 tile.
    #[cfg(target_arch = "x86_64")]
    AvxVnni,
    #[cfg(target_arch = "x86_64")]
    Avx512,
    /// AVX-512 VNNI: `vpdpbusd` on (x + 128) as u8 times w as i8, minus 128 * sum(w).
    #[cfg(target_arch = "x86_64")]
    Avx512Vnni,
    /// AVX-512 VNNI, and AMX-INT8 tiles for int8 GEMMs of [`super::amx::MIN_ROWS`] rows or
    /// more (the same accumulators; see [`super::amx`]).
    #[cfg(target_arch = "x86_64")]
    AmxInt8,
    /// aarch64 NEON (always present there): widening `smull` int8 products.
    #[cfg(target_arch = "aarch64")]
    Neon,
}

/// The kernel family every CPU kernel dispatches to: the best this CPU runs, capped by the
/// environment variable `MOEQ_CPU_ISA` (`scalar`, `avx2`, `avx_vnni`, `avx512`, `avx512_vnni`,
/// `amx_int8`, `neon`) so that each path can be tested and compared on one machine. A cap above the CPU's
/// support, or a value that names no kernel of this architecture (in any case), is ignored.
pub fn isa() -> Isa {
    static ISA: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
    *ISA.get_or_init(|| {
        let cap = isa_cap(&std::env::var("MOEQ_CPU_ISA").unwrap_or_default());
        let detected = detect();
        match cap {
            "scalar" => Isa::Scalar,
            #[cfg(target_arch = "x86_64")]
            "avx2" if detected != Isa::Scalar => Isa::Avx2,
            #[cfg(target_arch = "x86_64")]
            // Never above the CPU's best: AVX-512 CPUs without AVX-VNNI get the AVX2 tile.
            "avx_vnni" if detected != Isa::Scalar => {
                if avx_vnni_detected() {
                    Isa::AvxVnni
                } else {
                    Isa::Avx2
                }
            }
            #[cfg(target_arch = "x86_64")]
            "avx512" if detected.avx512() => Isa::Avx512,
            #[cfg(target_arch = "x86_64")]
            "avx512_vnni" if detected.vnni() => Isa::Avx512Vnni,
            // AMX is asked for (permission, self-test) only when no cap rules it out.
            #[cfg(target_arch = "x86_64")]
            "" | "amx_int8" if detected == Isa::Avx512Vnni && super::amx::usable() => Isa::AmxInt8,
            _ => detected,
        }
    })
}

/// The cap a `MOEQ_CPU_ISA` value sets: one of this architecture's kernel names (any case,
/// surrounding blanks ignored), or `""` (no cap) for anything else, so that a misspelt value
/// leaves the CPU's best rather than the best below AMX.
pub(crate) fn isa_cap(value: &str) -> &'static str {
    #[cfg(target_arch = "x86_64")]
    const NAMES: &[&str] = &[
        "scalar",
        "avx2",
        "avx_vnni",
        "avx512",
        "avx512_vnni",
        "amx_int8",
    ];
    #[cfg(target_arch = "aarch64")]
    const NAMES: &[&str] = &["scalar", "neon"];
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    const NAMES: &[&str] = &["scalar"];
    let value = value.trim();
    NAMES
        .iter()
        .find(|n| n.eq_ignore_ascii_case(value))
        .copied()
        .unwrap_or("")
}

fn detect() -> Isa {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512bw") {
            if std::arch::is_x86_feature_detected!("avx512vnni") {
                return Isa::Avx512Vnni;
            }
            return Isa::Avx512;
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            if avx_vnni_detected() {
                return Isa::AvxVnni;
            }
            return Isa::Avx2;
        }
    }
    #[cfg(target_arch = "aarch64")]
    {
        return Isa::Neon;
    }
    #[allow(unreachable_code)]
    Isa::Scalar
}

/// How far ahead (bytes) a decode kernel's weight stream is prefetched into L1 (see
/// [`prefetch_stream`]).
#[cfg(target_arch = "x86_64")]
pub(crate) const STREAM_L1_AHEAD: usize = 2048;
/// How far ahead (bytes) the same stream is prefetched into L2.
#[cfg(target_arch = "x86_64")]
pub(crate) const STREAM_L2_AHEAD: usize = 8192;

/// The prefetches for the 64-byte line at `at` of a decode kernel's weight stream (few rows,
/// bound by reading the weights): the line [`STREAM_L1_AHEAD`] bytes on into L1 and the
/// one [`STREAM_L2_AHEAD`] on into L2. One prefetch into L1 4 KB ahead (as before) kept too
/// few lines in flight; the second, farther one into L2 starts each line's read from memory
/// earlier. Measured on the 2-core AMX VM, alternated call by call in one process (`moe_time`
/// at T=1, cold weights, random routing; medians of 100-150 calls), against the one prefetch
/// 4 KB ahead: W8A8 decode 1.55-1.57 against 1.62-1.67 ms (Qwen3-30B-A3B), 2.14-2.18 against
/// 2.39-2.43 (DeepSeek-V2-Lite), 13.3-13.6 against 15.0-15.7 (Mixtral); W4A16 with bf16
/// inputs (the fixed-point kernel) 1.02-1.21 against 1.11-1.28, 1.44-1.47 against 1.56-1.58,
/// 7.7-8.4 against 8.8-9.4; W8A16 Qwen3 1.78-1.87 against 2.04-2.10. Without any prefetch the
/// W4A16 call took 1.7 ms; the L1 prefetch alone 1-2 KB ahead did worse than 4 KB, the L2
/// one alone 4 KB ahead 2-3% better; near and far at 4 and 16 KB did as 2 and 8 KB for W8A8,
/// 3-5% better against 5-8% for W4A16.
/// The addresses may lie past the stream's end: a prefetch never faults.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn prefetch_stream<T>(at: *const T) {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0, _MM_HINT_T1};
    let at = at.cast::<u8>();
    // SAFETY: a prefetch never faults, whatever the address, and neither reads into nor
    // writes anything the program sees; SSE is in the x86-64 baseline. The addresses are
    // formed with wrapping_add.
    unsafe {
        _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(STREAM_L1_AHEAD).cast());
        _mm_prefetch::<_MM_HINT_T1>(at.wrapping_add(STREAM_L2_AHEAD).cast());
    }
}

#[cfg(target_arch = "x86_64")]
fn avx_vnni_detected() -> bool {
    std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("avxvnni")
}

impl Isa {
    /// The NEON int8 tile applies.
    pub fn neon(self) -> bool {
        #[cfg(target_arch = "aarch64")]
        {
            self == Isa::Neon
        }
        #[cfg(not(target_arch = "aarch64"))]
        {
            false
        }
    }
    /// The AVX-512 VNNI int8 kernels apply.
    pub fn vnni(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            matches!(self, Isa::Avx512Vnni | Isa::AmxInt8)
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    }
    /// The AVX-512F (fp32) kernels apply.
    pub fn avx512(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            matches!(self, Isa::Avx512 | Isa::Avx512Vnni | Isa::AmxInt8)
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    }
    /// The AMX-INT8 tiles apply (to int8 GEMMs from [`super::amx::MIN_ROWS`] rows).
    pub fn amx(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            self == Isa::AmxInt8
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    }
    /// The AVX2 + FMA fp32 kernels apply (AVX2 CPUs without AVX-512).
    pub fn avx2_fma(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            matches!(self, Isa::Avx2 | Isa::AvxVnni) && std::arch::is_x86_feature_detected!("fma")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    }
    /// The AVX-VNNI (256-bit) int8 tile applies.
    pub fn avx_vnni(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            self == Isa::AvxVnni
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    }
    /// The AVX2 int8 tile applies (no VNNI).
    pub fn avx2_int8(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            matches!(self, Isa::Avx2 | Isa::Avx512)
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    }
}

/// The bf16 dot-product kernels (AVX512-BF16 `vdpbf16ps`, with AVX512-BW's word permute for
/// 4-bit codes) apply: the CPU has them and
/// `MOEQ_CPU_ISA` leaves AVX-512 on. `MOEQ_CPU_BF16=0` switches them off, so weight-only layers
/// with bf16 inputs compute in fp32 as with any other input.
pub fn bf16_dot() -> bool {
    static BF16: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *BF16.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            isa().avx512()
                && std::arch::is_x86_feature_detected!("avx512bf16")
                && std::arch::is_x86_feature_detected!("avx512bw")
                && std::env::var("MOEQ_CPU_BF16").map_or(true, |v| v.trim() != "0")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    })
}

/// Whether weight-only layers may widen codes into dequantised bf16 weights (see
/// `wo::bf16::BlockedWo::widens_dequantised`): each carries one bf16 rounding, as
/// compressed-tensors' own bf16 dequantisation (and vLLM's Marlin kernels) do. With activations
/// that share a large offset the gate and up values grow, and SiLU's flat negative side turns
/// their small absolute error into 1-2e-2 relative (a review's fuzzing, `randn + 8` inputs);
/// `MOEQ_CPU_BF16=exact` (read once) keeps the bf16 dot products on the exact weights.
pub fn bf16_dequantised_weights() -> bool {
    static ALLOWED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ALLOWED.get_or_init(|| std::env::var("MOEQ_CPU_BF16").map_or(true, |v| v.trim() != "exact"))
}

/// The name `MOEQ_CPU_ISA` and `cpu_features()` use for `isa`.
pub fn isa_name(isa: Isa) -> &'static str {
    match isa {
        Isa::Scalar => "scalar",
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => "avx2",
        #[cfg(target_arch = "x86_64")]
        Isa::AvxVnni => "avx_vnni",
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => "avx512",
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512Vnni => "avx512_vnni",
        #[cfg(target_arch = "x86_64")]
        Isa::AmxInt8 => "amx_int8",
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => "neon",
    }
}

/// `max |x|`, ignoring NaN (as `f32::max` does).
pub fn amax(x: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if isa().avx512() {
        // SAFETY: AVX-512F detected by `isa()`.
        return unsafe { x86::amax_avx512(x) };
    }
    #[cfg(target_arch = "x86_64")]
    if isa().avx2_fma() {
        // SAFETY: AVX2 detected by `isa()`.
        return unsafe { x86::amax_avx2(x) };
    }
    x.iter().fold(0f32, |m, v| m.max(v.abs()))
}

/// Whether `x` holds a NaN. One branch-free pass (an OR of the lanes' `x != x`, which the
/// compiler vectorises), not an early exit: rows are short and almost never hold one.
pub fn any_nan(x: &[f32]) -> bool {
    x.iter().fold(false, |seen, v| seen | v.is_nan())
}

/// `out[i] = (clamp(rne(x[i] / s), -128, 127) as i8) ^ 0x80`: int8 quantisation written as the
/// u8 operand of the VNNI kernels; NaN gives 0 and `s` not > 0 gives all zeros (u8 128), as in
/// [`super::linear::quantize_row_static`]. Returns whether `x / s` was NaN anywhere (found in
/// the same pass, so that callers need not read the row again): for a finite `s > 0`, whether
/// `x` holds a NaN; for `s` not > 0, whether `x` holds a NaN (the codes are all 128 then).
pub fn quantize_u8(x: &[f32], s: f32, out: &mut [u8]) -> bool {
    let n = x.len().min(out.len());
    let (x, out) = (&x[..n], &mut out[..n]);
    // Not `s <= 0.0`: a NaN scale quantises to zeros too.
    if s.partial_cmp(&0.0) != Some(std::cmp::Ordering::Greater) {
        out.fill(128);
        return any_nan(x);
    }
    #[cfg(target_arch = "x86_64")]
    if isa().avx512() {
        // SAFETY: AVX-512F and BW detected by `isa()`; both slices cut to the same length.
        return unsafe { x86::quantize_u8_avx512(x, s, out) };
    }
    #[cfg(target_arch = "x86_64")]
    if isa().avx2_fma() {
        // SAFETY: AVX2 detected by `isa()`; both slices cut to the same length.
        return unsafe { x86::quantize_u8_avx2(x, s, out) };
    }
    quantize_u8_scalar(x, s, out)
}

/// The scalar form of [`quantize_u8`] (for `s > 0`); returns whether `x / s` was NaN anywhere
/// (where `x` is NaN, and for `s = inf` also where `x` is infinite).
pub fn quantize_u8_scalar(x: &[f32], s: f32, out: &mut [u8]) -> bool {
    let mut nan = false;
    for (o, &v) in out.iter_mut().zip(x) {
        let q = v / s;
        nan |= q.is_nan();
        *o = (q.round_ties_even().clamp(-128.0, 127.0) as i8 as u8) ^ 0x80;
    }
    nan
}

/// `exp(x)` for the activation: Cody-Waite reduction `x = n ln2 + r` (`n` rounded to nearest
/// even with the 1.5 * 2^23 trick, `ln2` in two parts), a degree-6 polynomial in `r` (the
/// Cephes `expf` coefficients, about 1 ulp) and `2^n` built in the exponent bits. `x` is
/// clamped to `[-87, 88]` first so `2^n` is always a normal number; NaN passes through. Every
/// step is one IEEE multiply or add (no fused multiply-add, no rounding call: both would be
/// library calls on CPUs without FMA or SSE4.1), so the SIMD form equals this one bit for bit.
#[inline]
pub fn exp_act(x: f32) -> f32 {
    // Written with comparisons, not clamp(), so that NaN passes through as in the SIMD form.
    #[allow(clippy::manual_clamp)]
    let x = if x < EXP_LO {
        EXP_LO
    } else if x > EXP_HI {
        EXP_HI
    } else {
        x
    };
    // |x * log2(e)| < 2^22: adding and removing 1.5 * 2^23 rounds it to nearest even.
    let n = (x * std::f32::consts::LOG2_E + ROUND) - ROUND;
    let r = x - n * LN2_HI;
    let r = r - n * LN2_LO;
    let mut p = EXP_POLY[0];
    for &c in &EXP_POLY[1..] {
        p = p * r + c;
    }
    let y = (p * (r * r) + r) + 1.0;
    // n is an integer in [-126, 127] (or NaN, which gives a NaN y anyway).
    y * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

const EXP_LO: f32 = -87.0;
const EXP_HI: f32 = 88.0;
const ROUND: f32 = 12_582_912.0;
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
const EXP_POLY: [f32; 6] = [
    1.987_569_1e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    0.166_666_65,
    0.5,
];

/// `silu(a) = a / (1 + exp(-a))` with [`exp_act`]; below `-88` (where `exp(-a)` would be
/// clamped) `a * 0`: -0 for finite `a`, NaN for -inf, as torch gives.
#[inline]
pub fn silu_ref(a: f32) -> f32 {
    if a < -EXP_HI {
        a * 0.0
    } else {
        a / (1.0 + exp_act(-a))
    }
}

/// `up[i] = silu(gate[i]) * up[i]` (SwiGLU), or `up[i] = silu(up[i])` without a gate; the
/// SIMD form equals [`silu_ref`] bit for bit.
pub fn silu_mul(gate: Option<&[f32]>, up: &mut [f32]) {
    if let Some(g) = gate {
        let n = g.len().min(up.len());
        let up = &mut up[..n];
        #[cfg(target_arch = "x86_64")]
        if isa().avx512() {
            // SAFETY: AVX-512F detected by `isa()`; both slices have n values.
            unsafe { x86::silu_mul_avx512(Some(&g[..n]), up) };
            return;
        }
        #[cfg(target_arch = "x86_64")]
        if isa().avx2_fma() {
            // SAFETY: AVX2 detected by `isa()`; both slices have n values.
            unsafe { x86::silu_mul_avx2(Some(&g[..n]), up) };
            return;
        }
        for (u, &a) in up.iter_mut().zip(g) {
            *u *= silu_ref(a);
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if isa().avx512() {
        // SAFETY: AVX-512F detected by `isa()`.
        unsafe { x86::silu_mul_avx512(None, up) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if isa().avx2_fma() {
        // SAFETY: AVX2 detected by `isa()`.
        unsafe { x86::silu_mul_avx2(None, up) };
        return;
    }
    for u in up.iter_mut() {
        *u = silu_ref(*u);
    }
}

/// `dst[i] += w * src[i]`, the product rounded before the sum (no fused multiply-add); with
/// `first`, `dst[i] = 0 + w * src[i]` (the value adding to a zeroed `dst` gives) whatever
/// `dst` held, so the first term of a sum needs no zeroed buffer.
pub fn add_scaled(dst: &mut [f32], src: &[f32], w: f32, first: bool) {
    let n = dst.len().min(src.len());
    let (dst, src) = (&mut dst[..n], &src[..n]);
    #[cfg(target_arch = "x86_64")]
    if isa().avx512() {
        // SAFETY: AVX-512F detected by `isa()`; both slices have n values.
        unsafe { x86::add_scaled_avx512(dst, src, w, first) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if isa().avx2_fma() {
        // SAFETY: AVX2 detected by `isa()`; both slices have n values.
        unsafe { x86::add_scaled_avx2(dst, src, w, first) };
        return;
    }
    add_scaled_scalar(dst, src, w, first);
}

/// [`add_scaled`]'s scalar reference.
pub fn add_scaled_scalar(dst: &mut [f32], src: &[f32], w: f32, first: bool) {
    for (d, &v) in dst.iter_mut().zip(src) {
        let base = if first { 0.0 } else { *d };
        *d = base + w * v;
    }
}

/// bf16 bits (as torch stores `torch.bfloat16`) to f32: exact. Large inputs are converted
/// on the forward's threads (a prefill step's are millions of values).
pub fn bf16_bits_to_f32(bits: &[i16]) -> Vec<f32> {
    let mut out = super::spare::take(bits.len(), 0f32);
    convert_chunks(bits, &mut out, |b| {
        f32::from_bits(u32::from(b as u16) << 16)
    });
    out
}

/// The bf16 bits nearest to finite `v` (ties to even; a carry runs on into the exponent).
#[inline]
pub fn round_bf16(v: f32) -> u16 {
    let b = v.to_bits();
    (b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16) as u16
}

/// f32 to bf16 bits as torch's `.to(torch.bfloat16)` rounds finite values: to nearest, ties
/// to even, subnormals kept. NaN becomes the canonical quiet NaN (0x7fc0).
pub fn f32_to_bf16_bits(v: &[f32]) -> Vec<i16> {
    let mut out = vec![0i16; v.len()];
    convert_chunks(v, &mut out, |x| {
        (if x.is_nan() { 0x7fc0 } else { round_bf16(x) }) as i16
    });
    out
}

/// `out[i] = f(src[i])`, in parallel chunks on the forward's pool when long.
fn convert_chunks<A: Copy + Sync, B: Send>(src: &[A], out: &mut [B], f: impl Fn(A) -> B + Sync) {
    use rayon::prelude::*;
    const CHUNK: usize = 1 << 16;
    let run = |(o, s): (&mut [B], &[A])| {
        for (d, &v) in o.iter_mut().zip(s) {
            *d = f(v);
        }
    };
    if src.len() <= CHUNK {
        run((out, src));
    } else {
        super::in_pool(|| {
            out.par_chunks_mut(CHUNK)
                .zip(src.par_chunks(CHUNK))
                .for_each(run)
        });
    }
}

/// `Σ w[i] * x[i]` in f32, 16 lanes: lane `l` sums the rounded products `w[i] * x[i]` of
/// every `i ≡ l (mod 16)` below the last full chunk, in order (multiply, then add: no fused
/// operation, which the portable form would pay for without FMA hardware); then
/// `sum_lanes` and `tail_dot`. Every kernel gives these bits.
#[inline]
pub fn dot_f32(w: &[f32], x: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if isa().avx512() {
        let n = w.len().min(x.len());
        // SAFETY: AVX-512F detected by `isa()`; both slices hold at least n values.
        return unsafe { x86::dot_avx512(&w[..n], &x[..n]) };
    }
    dot_f32_lanes(w, x)
}

/// The portable form of [`dot_f32`], and its reference.
pub fn dot_f32_lanes(w: &[f32], x: &[f32]) -> f32 {
    // Over the common length, as the kernel (the remainders below must pair up).
    let n = w.len().min(x.len());
    let (w, x) = (&w[..n], &x[..n]);
    let mut lanes = [0f32; 16];
    let mut wc = w.chunks_exact(16);
    let mut xc = x.chunks_exact(16);
    for (ww, xx) in (&mut wc).zip(&mut xc) {
        for l in 0..16 {
            lanes[l] += ww[l] * xx[l];
        }
    }
    sum_lanes(&lanes) + tail_dot(wc.remainder(), xc.remainder())
}

/// The 16 lane sums of [`dot_f32`] added in lane order (one order for every kernel).
#[inline]
fn sum_lanes(lanes: &[f32; 16]) -> f32 {
    lanes.iter().fold(0.0, |a, &v| a + v)
}

/// The products of [`dot_f32`]'s last partial chunk added in order.
#[inline]
fn tail_dot(w: &[f32], x: &[f32]) -> f32 {
    w.iter().zip(x).fold(0.0, |a, (&p, &q)| a + p * q)
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// [`super::dot_f32`] on 16 lanes: the same rounded products, added lane by lane in the
    /// same order, then the same lane and tail sums.
    ///
    /// # Safety
    /// The CPU must support AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn dot_avx512(w: &[f32], x: &[f32]) -> f32 {
        let n = w.len().min(x.len());
        let mut acc = _mm512_setzero_ps();
        let mut i = 0;
        while i + 16 <= n {
            // SAFETY: i + 16 <= n <= both lengths.
            let (vw, vx) = unsafe {
                (
                    _mm512_loadu_ps(w.as_ptr().add(i)),
                    _mm512_loadu_ps(x.as_ptr().add(i)),
                )
            };
            acc = _mm512_add_ps(acc, _mm512_mul_ps(vw, vx));
            i += 16;
        }
        let mut lanes = [0f32; 16];
        // SAFETY: `lanes` holds 16 f32 values; the store is unaligned.
        unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), acc) };
        super::sum_lanes(&lanes) + super::tail_dot(&w[i..n], &x[i..n])
    }

    /// [`super::exp_act`] on 16 lanes, operation for operation.
    #[target_feature(enable = "avx512f")]
    fn exp_act_avx512(x: __m512) -> __m512 {
        // MAXPS/MINPS return their second operand when either is NaN: NaN passes through.
        let x = _mm512_max_ps(_mm512_set1_ps(super::EXP_LO), x);
        let x = _mm512_min_ps(_mm512_set1_ps(super::EXP_HI), x);
        let round = _mm512_set1_ps(super::ROUND);
        let t = _mm512_mul_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E));
        let n = _mm512_sub_ps(_mm512_add_ps(t, round), round);
        let r = _mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(super::LN2_HI)));
        let r = _mm512_sub_ps(r, _mm512_mul_ps(n, _mm512_set1_ps(super::LN2_LO)));
        let mut p = _mm512_set1_ps(super::EXP_POLY[0]);
        for &c in &super::EXP_POLY[1..] {
            p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(c));
        }
        let y = _mm512_add_ps(
            _mm512_add_ps(_mm512_mul_ps(p, _mm512_mul_ps(r, r)), r),
            _mm512_set1_ps(1.0),
        );
        let e = _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127));
        _mm512_mul_ps(y, _mm512_castsi512_ps(_mm512_slli_epi32::<23>(e)))
    }

    /// `silu(a) * u` on 16 lanes, as [`super::silu_ref`]; `u` absent means `silu(a)`.
    #[target_feature(enable = "avx512f")]
    fn silu_avx512(a: __m512, u: Option<__m512>) -> __m512 {
        let neg = _mm512_sub_ps(_mm512_setzero_ps(), a);
        let s = _mm512_div_ps(a, _mm512_add_ps(_mm512_set1_ps(1.0), exp_act_avx512(neg)));
        // Below -88, `a * 0` (see silu_ref); NaN compares false and keeps the quotient.
        let tiny = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(a, _mm512_set1_ps(-super::EXP_HI));
        let s = _mm512_mask_mov_ps(s, tiny, _mm512_mul_ps(a, _mm512_setzero_ps()));
        match u {
            Some(u) => _mm512_mul_ps(u, s),
            None => s,
        }
    }

    /// [`super::silu_mul`]'s loop.
    ///
    /// # Safety
    /// The CPU must support AVX-512F; `gate`, when given, is as long as `up`.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn silu_mul_avx512(gate: Option<&[f32]>, up: &mut [f32]) {
        let n = up.len();
        let mut i = 0;
        while i + 16 <= n {
            // SAFETY: i + 16 <= n = up.len() (= gate.len()): the loads and the store are in
            // bounds.
            unsafe {
                let p = up.as_mut_ptr().add(i);
                let v = match gate {
                    Some(g) => {
                        silu_avx512(_mm512_loadu_ps(g.as_ptr().add(i)), Some(_mm512_loadu_ps(p)))
                    }
                    None => silu_avx512(_mm512_loadu_ps(p), None),
                };
                _mm512_storeu_ps(p, v);
            }
            i += 16;
        }
        match gate {
            Some(g) => {
                for (u, &a) in up[i..].iter_mut().zip(&g[i..]) {
                    *u *= super::silu_ref(a);
                }
            }
            None => {
                for u in &mut up[i..] {
                    *u = super::silu_ref(*u);
                }
            }
        }
    }

    /// [`super::add_scaled`]'s loop.
    ///
    /// # Safety
    /// The CPU must support AVX-512F; `src` is at least as long as `dst`.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn add_scaled_avx512(dst: &mut [f32], src: &[f32], w: f32, first: bool) {
        let n = dst.len();
        let vw = _mm512_set1_ps(w);
        let mut i = 0;
        while i + 16 <= n {
            // SAFETY: i + 16 <= n <= src.len(): the loads and the store are in bounds.
            unsafe {
                let p = dst.as_mut_ptr().add(i);
                let base = if first {
                    _mm512_setzero_ps()
                } else {
                    _mm512_loadu_ps(p)
                };
                let v = _mm512_mul_ps(vw, _mm512_loadu_ps(src.as_ptr().add(i)));
                _mm512_storeu_ps(p, _mm512_add_ps(base, v));
            }
            i += 16;
        }
        super::add_scaled_scalar(&mut dst[i..], &src[i..], w, first);
    }

    /// # Safety
    /// The CPU must support AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn amax_avx512(x: &[f32]) -> f32 {
        let mut m = _mm512_setzero_ps();
        let mut i = 0;
        while i + 16 <= x.len() {
            // SAFETY: i + 16 <= x.len(): the 64-byte load is in bounds.
            let v = unsafe { _mm512_loadu_ps(x.as_ptr().add(i)) };
            // MAXPS returns its second operand when either is NaN, so NaN lanes keep `m`.
            m = _mm512_max_ps(_mm512_abs_ps(v), m);
            i += 16;
        }
        let mut best = _mm512_reduce_max_ps(m);
        for &v in &x[i..] {
            best = best.max(v.abs());
        }
        best
    }

    /// # Safety
    /// The CPU must support AVX-512F and BW; `x.len() == out.len()`; `s > 0`.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub unsafe fn quantize_u8_avx512(x: &[f32], s: f32, out: &mut [u8]) -> bool {
        let vs = _mm512_set1_ps(s);
        let (lo, hi) = (_mm512_set1_ps(-128.0), _mm512_set1_ps(127.0));
        let bias = _mm512_set1_epi32(128);
        let mut nans: __mmask16 = 0;
        let mut i = 0;
        while i + 16 <= x.len() {
            // SAFETY: i + 16 <= x.len() == out.len(): the 64-byte load and 16-byte store are in
            // bounds.
            unsafe {
                let q = _mm512_div_ps(_mm512_loadu_ps(x.as_ptr().add(i)), vs);
                let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(q, q);
                nans |= nan;
                // Clamping first keeps the conversion in range; clamp and round commute here
                // because the bounds are integers.
                let q = _mm512_min_ps(_mm512_max_ps(q, lo), hi);
                let q = _mm512_mask_mov_ps(q, nan, _mm512_setzero_ps());
                let qi = _mm512_cvt_roundps_epi32::<
                    { _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC },
                >(q);
                let u = _mm512_cvtepi32_epi8(_mm512_add_epi32(qi, bias));
                _mm_storeu_si128(out.as_mut_ptr().add(i).cast(), u);
            }
            i += 16;
        }
        super::quantize_u8_scalar(&x[i..], s, &mut out[i..]) | (nans != 0)
    }

    /// [`super::exp_act`] on 8 lanes, operation for operation (as [`exp_act_avx512`]).
    #[target_feature(enable = "avx2")]
    fn exp_act_avx2(x: __m256) -> __m256 {
        // MAXPS/MINPS return their second operand when either is NaN: NaN passes through.
        let x = _mm256_max_ps(_mm256_set1_ps(super::EXP_LO), x);
        let x = _mm256_min_ps(_mm256_set1_ps(super::EXP_HI), x);
        let round = _mm256_set1_ps(super::ROUND);
        let t = _mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E));
        let n = _mm256_sub_ps(_mm256_add_ps(t, round), round);
        let r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(super::LN2_HI)));
        let r = _mm256_sub_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(super::LN2_LO)));
        let mut p = _mm256_set1_ps(super::EXP_POLY[0]);
        for &c in &super::EXP_POLY[1..] {
            p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(c));
        }
        let y = _mm256_add_ps(
            _mm256_add_ps(_mm256_mul_ps(p, _mm256_mul_ps(r, r)), r),
            _mm256_set1_ps(1.0),
        );
        // n is integer-valued, so the conversion's rounding mode does not matter.
        let e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
        _mm256_mul_ps(y, _mm256_castsi256_ps(_mm256_slli_epi32::<23>(e)))
    }

    /// `silu(a) * u` on 8 lanes, as [`super::silu_ref`]; `u` absent means `silu(a)`.
    #[target_feature(enable = "avx2")]
    fn silu_avx2(a: __m256, u: Option<__m256>) -> __m256 {
        let neg = _mm256_sub_ps(_mm256_setzero_ps(), a);
        let s = _mm256_div_ps(a, _mm256_add_ps(_mm256_set1_ps(1.0), exp_act_avx2(neg)));
        // Below -88, `a * 0` (see silu_ref); NaN compares false and keeps the quotient.
        let tiny = _mm256_cmp_ps::<_CMP_LT_OQ>(a, _mm256_set1_ps(-super::EXP_HI));
        let s = _mm256_blendv_ps(s, _mm256_mul_ps(a, _mm256_setzero_ps()), tiny);
        match u {
            Some(u) => _mm256_mul_ps(u, s),
            None => s,
        }
    }

    /// [`super::silu_mul`]'s loop on 8 lanes.
    ///
    /// # Safety
    /// The CPU must support AVX2; `gate`, when given, is as long as `up`.
    #[target_feature(enable = "avx2")]
    pub unsafe fn silu_mul_avx2(gate: Option<&[f32]>, up: &mut [f32]) {
        let n = up.len();
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: i + 8 <= n = up.len() (= gate.len()): the loads and the store are in
            // bounds.
            unsafe {
                let p = up.as_mut_ptr().add(i);
                let v = match gate {
                    Some(g) => {
                        silu_avx2(_mm256_loadu_ps(g.as_ptr().add(i)), Some(_mm256_loadu_ps(p)))
                    }
                    None => silu_avx2(_mm256_loadu_ps(p), None),
                };
                _mm256_storeu_ps(p, v);
            }
            i += 8;
        }
        match gate {
            Some(g) => {
                for (u, &a) in up[i..].iter_mut().zip(&g[i..]) {
                    *u *= super::silu_ref(a);
                }
            }
            None => {
                for u in &mut up[i..] {
                    *u = super::silu_ref(*u);
                }
            }
        }
    }

    /// [`super::add_scaled`]'s loop on 8 lanes.
    ///
    /// # Safety
    /// The CPU must support AVX2; `src` is at least as long as `dst`.
    #[target_feature(enable = "avx2")]
    pub unsafe fn add_scaled_avx2(dst: &mut [f32], src: &[f32], w: f32, first: bool) {
        let n = dst.len();
        let vw = _mm256_set1_ps(w);
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: i + 8 <= n <= src.len(): the loads and the store are in bounds.
            unsafe {
                let p = dst.as_mut_ptr().add(i);
                let base = if first {
                    _mm256_setzero_ps()
                } else {
                    _mm256_loadu_ps(p)
                };
                let v = _mm256_mul_ps(vw, _mm256_loadu_ps(src.as_ptr().add(i)));
                _mm256_storeu_ps(p, _mm256_add_ps(base, v));
            }
            i += 8;
        }
        super::add_scaled_scalar(&mut dst[i..], &src[i..], w, first);
    }

    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    pub unsafe fn amax_avx2(x: &[f32]) -> f32 {
        let sign = _mm256_set1_ps(-0.0);
        let mut m = _mm256_setzero_ps();
        let mut i = 0;
        while i + 8 <= x.len() {
            // SAFETY: i + 8 <= x.len(): the 32-byte load is in bounds.
            let v = unsafe { _mm256_loadu_ps(x.as_ptr().add(i)) };
            // MAXPS returns its second operand when either is NaN, so NaN lanes keep `m`.
            m = _mm256_max_ps(_mm256_andnot_ps(sign, v), m);
            i += 8;
        }
        let mut lanes = [0f32; 8];
        // SAFETY: `lanes` is 32 bytes, one unaligned store.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), m) };
        let mut best = lanes.iter().fold(0f32, |a, &v| a.max(v));
        for &v in &x[i..] {
            best = best.max(v.abs());
        }
        best
    }

    /// # Safety
    /// The CPU must support AVX2; `x.len() == out.len()`; `s > 0`.
    #[target_feature(enable = "avx2")]
    pub unsafe fn quantize_u8_avx2(x: &[f32], s: f32, out: &mut [u8]) -> bool {
        let vs = _mm256_set1_ps(s);
        let (lo, hi) = (_mm256_set1_ps(-128.0), _mm256_set1_ps(127.0));
        let bias = _mm256_set1_epi32(128);
        // All ones in the lanes where a NaN was seen.
        let mut nans = _mm256_setzero_ps();
        // Eight values to i32 codes + 128 (0..=255), as quantize_u8_avx512 computes them.
        let mut codes = |v: __m256| {
            let q = _mm256_div_ps(v, vs);
            let nan = _mm256_cmp_ps::<_CMP_UNORD_Q>(q, q);
            nans = _mm256_or_ps(nans, nan);
            // Clamping first keeps the conversion in range; clamp and round commute here
            // because the bounds are integers.
            let q = _mm256_min_ps(_mm256_max_ps(q, lo), hi);
            let q = _mm256_blendv_ps(q, _mm256_setzero_ps(), nan);
            // Round to nearest even explicitly, then convert the integral value exactly.
            let q = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(q);
            _mm256_add_epi32(_mm256_cvttps_epi32(q), bias)
        };
        let mut i = 0;
        while i + 16 <= x.len() {
            // SAFETY: i + 16 <= x.len() == out.len(): two 32-byte loads and a 16-byte store
            // in bounds.
            unsafe {
                let a = codes(_mm256_loadu_ps(x.as_ptr().add(i)));
                let b = codes(_mm256_loadu_ps(x.as_ptr().add(i + 8)));
                // packus works per 128-bit lane: [a0-3 b0-3 | a4-7 b4-7]; put a before b.
                let w = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packus_epi32(a, b));
                let bytes =
                    _mm_packus_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256::<1>(w));
                _mm_storeu_si128(out.as_mut_ptr().add(i).cast(), bytes);
            }
            i += 16;
        }
        super::quantize_u8_scalar(&x[i..], s, &mut out[i..]) | (_mm256_movemask_ps(nans) != 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn isa_caps_name_a_kernel_or_none() {
        assert_eq!(isa_cap("scalar"), "scalar");
        assert_eq!(isa_cap(" Scalar\n"), "scalar");
        for unknown in ["", "bogus", "avx-512", "scalar2"] {
            assert_eq!(isa_cap(unknown), "", "{unknown:?}");
        }
        #[cfg(target_arch = "x86_64")]
        {
            assert_eq!(isa_cap("AVX2"), "avx2");
            assert_eq!(isa_cap(" amx_int8 "), "amx_int8");
            assert_eq!(isa_cap("neon"), "");
        }
        #[cfg(target_arch = "aarch64")]
        {
            assert_eq!(isa_cap("NEON"), "neon");
            assert_eq!(isa_cap("avx2"), "");
        }
    }

    #[test]
    fn add_scaled_equals_scalar() {
        let mut next = crate::cpu::xorshift(7);
        let mut val = || (next() % 20001) as f32 / 97.0 - 100.0;
        for n in [0usize, 5, 16, 37, 1000] {
            let mut src: Vec<f32> = (0..n).map(|_| val()).collect();
            let dst0: Vec<f32> = (0..n).map(|_| val()).collect();
            if n > 3 {
                src[1] = -0.0;
                src[2] = f32::NAN;
            }
            for first in [false, true] {
                let w = 0.3719;
                let (mut a, mut b) = (dst0.clone(), dst0.clone());
                add_scaled(&mut a, &src, w, first);
                add_scaled_scalar(&mut b, &src, w, first);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&a), bits(&b), "n={n} first={first}");
                for i in 0..n {
                    let want = if first {
                        0.0 + w * src[i]
                    } else {
                        dst0[i] + w * src[i]
                    };
                    assert!(want.to_bits() == b[i].to_bits() || want.is_nan() && b[i].is_nan());
                }
                if n > 3 && first {
                    // 0 + w * -0 is +0: what summing into a zeroed buffer gives.
                    assert_eq!(a[1].to_bits(), 0);
                }
            }
        }
    }

    /// The AVX2 forms (AVX2 CPUs without AVX-512) of the activation helpers equal their
    /// scalar references bit for bit: quantisation (ties, NaN, infinities, extreme scales),
    /// `max |x|`, SiLU (tails, NaN, below -88) and the scaled sum (-0, NaN, `first`).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_helpers_equal_scalar() {
        if !std::arch::is_x86_feature_detected!("avx2") {
            assert!(!isa().avx2_fma());
            return;
        }
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        let mut x: Vec<f32> = (0..1003)
            .map(|i| ((i * 7919) % 4001) as f32 / 20.0 - 100.0)
            .collect();
        x[3] = f32::NAN;
        x[4] = f32::INFINITY;
        x[5] = f32::NEG_INFINITY;
        x[6] = -1e30;
        x[7] = -0.0;
        x[40] = 0.5;
        x[41] = 1.5;
        x[42] = -2.5;
        x[43] = -88.5;
        for n in [0usize, 7, 8, 15, 16, 17, 1003] {
            let x = &x[..n];
            for s in [1.0f32, 0.37, 1e-30, 1e30] {
                let mut want = vec![0u8; n];
                let want_nan = quantize_u8_scalar(x, s, &mut want);
                let mut got = vec![7u8; n];
                // SAFETY: AVX2 detected above; equal lengths; s > 0.
                let got_nan = unsafe { x86::quantize_u8_avx2(x, s, &mut got) };
                assert_eq!(got, want, "n={n} s={s}");
                // The NaN at 3 is in the scalar tail below 16 values, in the first vector
                // from 16.
                assert_eq!((got_nan, want_nan), (n > 3, n > 3), "n={n} s={s}");
            }
            let reference = x.iter().fold(0f32, |m, v| m.max(v.abs()));
            // SAFETY: AVX2 detected above.
            assert_eq!(unsafe { x86::amax_avx2(x) }.to_bits(), reference.to_bits());
            let u0: Vec<f32> = (0..n)
                .map(|i| ((i * 13) % 17) as f32 * 0.25 - 2.0)
                .collect();
            let mut want = u0.clone();
            for (w, &a) in want.iter_mut().zip(x) {
                *w *= silu_ref(a);
            }
            let mut got = u0.clone();
            // SAFETY: AVX2 detected above; equal lengths.
            unsafe { x86::silu_mul_avx2(Some(x), &mut got) };
            assert_eq!(bits(&got), bits(&want), "silu_mul n={n}");
            let mut got = x.to_vec();
            // SAFETY: AVX2 detected above.
            unsafe { x86::silu_mul_avx2(None, &mut got) };
            let want: Vec<f32> = x.iter().map(|&a| silu_ref(a)).collect();
            assert_eq!(bits(&got), bits(&want), "silu n={n}");
            for first in [false, true] {
                let (mut a, mut b) = (u0.clone(), u0.clone());
                // SAFETY: AVX2 detected above; equal lengths.
                unsafe { x86::add_scaled_avx2(&mut a, x, 0.3719, first) };
                add_scaled_scalar(&mut b, x, 0.3719, first);
                assert_eq!(bits(&a), bits(&b), "add_scaled n={n} first={first}");
            }
        }
    }

    #[test]
    fn quantize_matches_reference() {
        let mut x: Vec<f32> = (0..1003)
            .map(|i| ((i * 7919) % 2001) as f32 / 7.0 - 140.0)
            .collect();
        x[5] = f32::NAN;
        x[17] = f32::INFINITY;
        x[18] = f32::NEG_INFINITY;
        x[40] = 0.5; // ties round to even
        x[41] = 1.5;
        x[42] = -2.5;
        for s in [1.0f32, 0.37, 1e-30, 1e30, 0.0, -1.0, f32::INFINITY] {
            let mut want = vec![0i8; x.len()];
            super::super::linear::quantize_row_static(&x, s, &mut want);
            let mut got = vec![0u8; x.len()];
            assert!(
                quantize_u8(&x, s, &mut got),
                "s = {s}: the NaN at 5 was not reported"
            );
            let want: Vec<u8> = want.iter().map(|&v| (v as u8) ^ 0x80).collect();
            assert_eq!(got, want, "s = {s}");
        }
        // The NaN report: none, one in a 16-value chunk or one in the tail, every path.
        let clean: Vec<f32> = x
            .iter()
            .map(|v| if v.is_nan() { 1.0 } else { *v })
            .collect();
        for at in [None, Some(0), Some(37), Some(992), Some(1000), Some(1002)] {
            let mut y = clean.clone();
            if let Some(i) = at {
                y[i] = f32::NAN;
            }
            let mut got = vec![0u8; y.len()];
            for s in [0.37f32, 0.0] {
                assert_eq!(quantize_u8(&y, s, &mut got), at.is_some(), "{at:?} s = {s}");
            }
            assert_eq!(
                quantize_u8_scalar(&y, 0.37, &mut got),
                at.is_some(),
                "scalar {at:?}"
            );
        }
        let reference = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        assert_eq!(amax(&x).to_bits(), reference.to_bits());
        assert_eq!(
            amax(&x[19..30]),
            x[19..30].iter().fold(0f32, |m, v| m.max(v.abs()))
        );
    }

    /// The activation's exp is within 2 ulp of f64's over the range that matters, and SiLU's
    /// SIMD form equals the scalar reference bit for bit (tails, extremes and NaN included).
    #[test]
    fn silu_simd_equals_reference_and_exp_is_accurate() {
        let mut worst = 0f64;
        let mut x = -87.0f32;
        while x < 88.0 {
            let want = f64::from(x).exp();
            let got = f64::from(exp_act(x));
            let ulp = f64::from(f32::EPSILON) * want;
            worst = worst.max((got - want).abs() / ulp);
            x += 0.0137;
        }
        assert!(worst <= 2.0, "exp error {worst} ulp");
        assert_eq!(exp_act(0.0), 1.0);
        assert!(exp_act(f32::NAN).is_nan());
        let mut g: Vec<f32> = (0..1003)
            .map(|i| ((i * 7919) % 4001) as f32 / 20.0 - 100.0)
            .collect();
        g[3] = f32::NAN;
        g[4] = f32::INFINITY;
        g[5] = -1e30;
        g[6] = 0.0;
        g[7] = -0.0;
        let u0: Vec<f32> = (0..1003)
            .map(|i| ((i * 13) % 17) as f32 * 0.25 - 2.0)
            .collect();
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        let mut want = u0.clone();
        for (w, &a) in want.iter_mut().zip(&g) {
            *w *= silu_ref(a);
        }
        let mut got = u0.clone();
        silu_mul(Some(&g), &mut got);
        assert_eq!(bits(&got), bits(&want));
        let mut got = g.clone();
        silu_mul(None, &mut got);
        let want: Vec<f32> = g.iter().map(|&a| silu_ref(a)).collect();
        assert_eq!(bits(&got), bits(&want));
        // The reference itself: silu(x) = x * sigmoid(x), checked in f64, extremes included
        // (below -88 the result is -0 where f64 gives a few 1e-37 or less).
        for &a in g[4..]
            .iter()
            .chain(&[-88.5, -87.9, -1e38, f32::MAX, -f32::MAX])
        {
            let exact = f64::from(a) / (1.0 + (-f64::from(a)).exp());
            let got = f64::from(silu_ref(a));
            if exact.is_finite() {
                let tol = 4.0 * f64::from(f32::EPSILON) * exact.abs() + 1e-35;
                assert!(
                    (got - exact).abs() <= tol,
                    "silu({a}) = {got}, want {exact}"
                );
            } else {
                assert_eq!(got, exact, "silu({a})");
            }
        }
        assert!(silu_ref(f32::NEG_INFINITY).is_nan());
    }

    /// bf16 bits round trip exactly, and rounding is to nearest even with carries into the
    /// exponent (checked against f64 arithmetic on the two neighbouring bf16 values).
    #[test]
    fn bf16_conversions() {
        let all: Vec<i16> = (0..=u16::MAX).map(|b| b as i16).collect();
        let f = bf16_bits_to_f32(&all);
        let back = f32_to_bf16_bits(&f);
        for (&b, (&x, &r)) in all.iter().zip(f.iter().zip(&back)) {
            if x.is_nan() {
                assert_eq!(r, 0x7fc0);
            } else {
                assert_eq!(r, b, "{x}");
            }
        }
        // Long inputs go through the parallel chunks: the same values.
        let long: Vec<i16> = (0..300_000u32)
            .map(|i| (i.wrapping_mul(40_503) >> 3) as i16)
            .collect();
        let wide = bf16_bits_to_f32(&long);
        for (&b, &x) in long.iter().zip(&wide) {
            assert_eq!(x.to_bits(), bf16_bits_to_f32(&[b])[0].to_bits());
        }
        let narrow = f32_to_bf16_bits(&wide);
        for (&x, &r) in wide.iter().zip(&narrow) {
            assert_eq!(r, f32_to_bf16_bits(&[x])[0]);
        }
        let mut next = crate::cpu::xorshift(0x0bad_5eed_u64);
        for _ in 0..200_000 {
            let s = next();
            let x = f32::from_bits(s as u32);
            if !x.is_finite() {
                continue;
            }
            let r = f32_to_bf16_bits(&[x])[0];
            let lo = f32::from_bits((s as u32) & 0xffff_0000);
            let hi_bits = ((s as u32) & 0xffff_0000).wrapping_add(0x1_0000);
            let hi = f32::from_bits(hi_bits);
            // Past the largest bf16 the next step is infinity, one ulp (2^120) further.
            let hi_at = if hi.is_infinite() {
                f64::from(lo) + f64::from(lo.signum()) * 2f64.powi(120)
            } else {
                f64::from(hi)
            };
            let (dl, dh) = (
                (f64::from(x) - f64::from(lo)).abs(),
                (hi_at - f64::from(x)).abs(),
            );
            let want = if dl < dh || (dl == dh && (lo.to_bits() >> 16) & 1 == 0) {
                lo
            } else {
                hi
            };
            assert_eq!(r as u16, (want.to_bits() >> 16) as u16, "{x}");
        }
    }

    #[test]
    fn float_dot_matches_reference() {
        let w: Vec<f32> = (0..1003).map(|i| ((i * 37) % 255) as f32 - 127.0).collect();
        let x: Vec<f32> = (0..1003)
            .map(|i| ((i * 13) % 17) as f32 * 0.25 - 2.0)
            .collect();
        let exact: f64 = w
            .iter()
            .zip(&x)
            .map(|(&a, &b)| f64::from(a) * f64::from(b))
            .sum();
        for got in [dot_f32(&w, &x), dot_f32_lanes(&w, &x)] {
            assert!(
                (f64::from(got) - exact).abs() <= 1e-4 * exact.abs().max(1.0),
                "{got} vs {exact}"
            );
        }
    }

    /// Values whose products and sums round: the kernel's bits equal the portable form's,
    /// at lengths with and without a partial last chunk (the AVX-512 form once summed with
    /// fused operations and another lane order, a few ulps off).
    #[test]
    fn float_dot_kernels_give_the_portable_bits() {
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        };
        let w: Vec<f32> = (0..2100).map(|_| next()).collect();
        let x: Vec<f32> = (0..2100).map(|_| next() * 3.7).collect();
        let mut rounded = 0;
        for n in [0, 1, 15, 16, 17, 100, 768, 1003, 2048, 2100] {
            let (w, x) = (&w[..n], &x[..n]);
            let got = dot_f32(w, x);
            assert_eq!(got.to_bits(), dot_f32_lanes(w, x).to_bits(), "n = {n}");
            let exact: f64 = w
                .iter()
                .zip(x)
                .map(|(&a, &b)| f64::from(a) * f64::from(b))
                .sum();
            assert!((f64::from(got) - exact).abs() <= 1e-5 * (n as f64).max(1.0));
            rounded += usize::from(f64::from(got) != exact);
        }
        assert!(
            rounded >= 5,
            "the values must round for the test to mean anything"
        );
        // Slices of different lengths: both forms take the common length.
        let short = dot_f32(&w[..40], &x[..20]);
        assert_eq!(short.to_bits(), dot_f32_lanes(&w[..40], &x[..20]).to_bits());
        assert_eq!(short.to_bits(), dot_f32_lanes(&w[..20], &x[..20]).to_bits());
    }
}
