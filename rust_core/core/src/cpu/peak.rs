//! The machine's compute limit for the products the dispatched kernels issue: multiply-adds per
//! second of that instruction on `threads` threads, each running independent accumulators on
//! operands held in registers (no memory traffic). Benchmarks divide a layer's rate by it
//! ("% of peak"): the compute-side counterpart of the read-bandwidth bound, measured in the
//! same run rather than taken from a datasheet (clocks under load differ per machine).

use std::time::Instant;

#[cfg(target_arch = "x86_64")]
use super::kernels::{bf16_dot, isa};

/// The kind of product a layer's kernels compute.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dot {
    /// int8 x int8 into int32 (W8A8).
    Int8,
    /// bf16 pairs into fp32 (weight-only layers with bf16 inputs, where [`bf16_dot`]).
    Bf16,
    /// fp32 fused multiply-add (weight-only layers otherwise).
    F32,
}

/// Independent accumulators per thread: enough chains to cover any of these instructions'
/// latency (4-6 cycles) at two issues per cycle.
const CHAINS: usize = 12;

/// The instruction the kernels use for `dot` under the current dispatch (`isa()`, capped by
/// `MOEQ_CPU_ISA`, and `bf16_dot()`) and the multiply-adds one issue performs; `None` where
/// this probe has no loop for it: the scalar and NEON paths.
pub fn instruction(dot: Dot) -> Option<(&'static str, usize)> {
    #[cfg(target_arch = "x86_64")]
    {
        let isa = isa();
        match dot {
            #[cfg(target_os = "linux")]
            Dot::Int8 if isa.amx() => {
                Some(("tdpbusd (AMX tiles)", super::amx::PEAK_MACS_PER_ISSUE))
            }
            #[cfg(not(target_os = "linux"))]
            Dot::Int8 if isa.amx() => None,
            Dot::Int8 if isa.vnni() => Some(("vpdpbusd zmm", 64)),
            Dot::Int8 if isa.avx_vnni() => Some(("vpdpbusd ymm (AVX-VNNI)", 32)),
            Dot::Int8 if isa.avx2_int8() => Some(("vpmaddwd + vpaddd ymm", 16)),
            // Weight-only prefill's instruction where the AMX-BF16 tiles run it.
            #[cfg(target_os = "linux")]
            Dot::Bf16 if super::amx_bf16::enabled() => Some((
                "tdpbf16ps (AMX tiles)",
                super::amx_bf16::PEAK_MACS_PER_ISSUE,
            )),
            Dot::Bf16 if bf16_dot() => Some(("vdpbf16ps zmm", 32)),
            Dot::F32 if isa.avx512() => Some(("vfmadd zmm", 16)),
            Dot::F32 if isa.avx2_fma() => Some(("vfmadd ymm", 8)),
            _ => None,
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = dot;
        None
    }
}

/// GMAC/s of [`instruction`]`(dot)` on `threads` threads at once, with the instruction's
/// name: the best run of ~10 ms, once three runs in a row have not beaten it by 2% (at most
/// 30 runs, after a ~30 ms warm-up); `None` where [`instruction`] is, or where the OS refused
/// a thread.
pub fn measure(dot: Dot, threads: usize) -> Option<(&'static str, f64)> {
    let (name, macs) = instruction(dot)?;
    let threads = threads.max(1);
    // Issues per thread and run: ~10 ms at 2 issues per cycle and 2 GHz; a tile product
    // (16,384 multiply-adds) issues about once per 16 cycles, so ~1 ms of those.
    let rounds = if macs > 1024 {
        40_000_000 / CHAINS / 256
    } else {
        40_000_000 / CHAINS
    };
    // Runs in the first ~0.1 s of a Python process came out at half the rate of the later
    // ones on this machine's VM (the other CPU still busy after the imports): hence a warm-up
    // and runs until the best settles, not a fixed few.
    // Seconds for `rounds` on every thread; `None` if a thread could not be started.
    let all = |rounds: usize| {
        let t0 = Instant::now();
        let started = std::thread::scope(|s| {
            (0..threads).all(|_| {
                std::thread::Builder::new()
                    .spawn_scoped(s, || std::hint::black_box(run(dot, rounds)))
                    .is_ok()
            })
        });
        started.then(|| t0.elapsed().as_secs_f64())
    };
    all(3 * rounds)?;
    let total = (threads * rounds * CHAINS * macs) as f64;
    let (mut best, mut since) = (0f64, 0);
    for _ in 0..30 {
        let rate = total / all(rounds)? / 1e9;
        since = if rate > best * 1.02 { 0 } else { since + 1 };
        best = best.max(rate);
        if since == 3 {
            break;
        }
    }
    Some((name, best))
}

/// `rounds` rounds of [`CHAINS`] issues of `dot`'s instruction; the folded accumulators (so
/// that nothing is optimised away).
fn run(dot: Dot, rounds: usize) -> f64 {
    #[cfg(target_arch = "x86_64")]
    {
        let isa = isa();
        // SAFETY: each arm runs only where the dispatch found its instruction's features on
        // this CPU (the tests the kernels themselves dispatch on); `isa()` reports AMX only
        // once `amx::usable()` found the tiles granted and self-tested, and
        // `amx_bf16::enabled()` holds only on top of that with AMX-BF16 self-tested.
        unsafe {
            match dot {
                // CHAINS issues per round, four per pass of the tile loop.
                #[cfg(target_os = "linux")]
                Dot::Int8 if isa.amx() => {
                    super::amx::peak_loop(rounds * CHAINS / 4);
                    return 0.0;
                }
                Dot::Int8 if isa.vnni() => return x86::vnni512(rounds),
                Dot::Int8 if isa.avx_vnni() => return x86::vnni256(rounds),
                Dot::Int8 if isa.avx2_int8() => return x86::madd256(rounds),
                #[cfg(target_os = "linux")]
                Dot::Bf16 if super::amx_bf16::enabled() => {
                    super::amx_bf16::peak_loop(rounds * CHAINS / 4);
                    return 0.0;
                }
                Dot::Bf16 if bf16_dot() => return x86::bf16_512(rounds),
                Dot::F32 if isa.avx512() => return x86::fma512(rounds),
                Dot::F32 if isa.avx2_fma() => return x86::fma256(rounds),
                _ => {}
            }
        }
    }
    let _ = (dot, rounds);
    0.0
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::CHAINS;
    use std::arch::x86_64::*;

    /// The body of a probe for an instruction that reads its accumulator (`op(acc, a, b)`,
    /// the operands a pair `ops`): [`CHAINS`] accumulators (in registers: 12 of 16 or 32)
    /// each updated `rounds` times, then summed with `add` and one lane returned by `lane`.
    /// The operands come through `black_box`, so the compiler cannot fold the chains into
    /// closed forms. Expanded inside each probe, so that the intrinsics compile with that
    /// probe's target features.
    macro_rules! chains {
        ($rounds:expr, $zero:expr, $ops:expr, $op:path, $add:path, $lane:expr) => {{
            let (a, b) = std::hint::black_box($ops);
            let mut acc = [$zero; CHAINS];
            for _ in 0..$rounds {
                for v in acc.iter_mut() {
                    *v = $op(*v, a, b);
                }
            }
            $lane(acc.iter().fold($zero, |s, &v| $add(s, v)))
        }};
    }

    /// # Safety
    /// AVX-512F, BW and VNNI.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub unsafe fn vnni512(rounds: usize) -> f64 {
        let ops = (_mm512_set1_epi8(1), _mm512_set1_epi8(-1));
        chains!(
            rounds,
            _mm512_setzero_si512(),
            ops,
            _mm512_dpbusd_epi32,
            _mm512_add_epi32,
            |s| { f64::from(_mm512_reduce_add_epi32(s)) }
        )
    }

    /// # Safety
    /// AVX2 and AVX-VNNI.
    #[target_feature(enable = "avx2,avxvnni")]
    pub unsafe fn vnni256(rounds: usize) -> f64 {
        let ops = (_mm256_set1_epi8(1), _mm256_set1_epi8(-1));
        let zero = _mm256_setzero_si256();
        chains!(
            rounds,
            zero,
            ops,
            _mm256_dpbusd_avx_epi32,
            _mm256_add_epi32,
            |s| { f64::from(_mm256_extract_epi32::<0>(s)) }
        )
    }

    /// The AVX2 int8 tile's step: widened codes times an activation pair, `madd` then `add`.
    /// Unlike the fused instructions, `madd(a, b)` does not read the accumulator, so with
    /// loop-invariant operands the compiler would compute it once: each chain has its own `b`
    /// and `a` passes through `black_box` every round.
    ///
    /// # Safety
    /// AVX2.
    #[target_feature(enable = "avx2")]
    pub unsafe fn madd256(rounds: usize) -> f64 {
        const N: usize = CHAINS / 2;
        let a = _mm256_set1_epi16(3);
        let b: [__m256i; N] = std::array::from_fn(|i| _mm256_set1_epi16(-(i as i16) - 1));
        let mut acc = [_mm256_setzero_si256(); N];
        // Twice the rounds of N chains: the same issues as the other loops' CHAINS. Each
        // round reads `a` afresh (a load, independent of the other rounds; passing the value
        // from round to round through `black_box` chained them and halved the rate).
        for _ in 0..2 * rounds {
            let a = std::hint::black_box(a);
            for (v, b) in acc.iter_mut().zip(&b) {
                *v = _mm256_add_epi32(*v, _mm256_madd_epi16(a, *b));
            }
        }
        let s = acc
            .iter()
            .fold(_mm256_setzero_si256(), |s, &v| _mm256_add_epi32(s, v));
        f64::from(_mm256_extract_epi32::<0>(s))
    }

    /// # Safety
    /// AVX-512F and AVX512-BF16.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub unsafe fn bf16_512(rounds: usize) -> f64 {
        // SAFETY: __m512i and __m512bh are both 64 bytes of plain bits (bf16 1.0 in each half).
        let one = unsafe { std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi16(0x3f80)) };
        chains!(
            rounds,
            _mm512_setzero_ps(),
            (one, one),
            _mm512_dpbf16_ps,
            _mm512_add_ps,
            |s| { f64::from(_mm512_reduce_add_ps(s)) }
        )
    }

    /// # Safety
    /// AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn fma512(rounds: usize) -> f64 {
        let ops = (_mm512_set1_ps(0.5), _mm512_set1_ps(0.25));
        chains!(
            rounds,
            _mm512_setzero_ps(),
            ops,
            _mm512_fmadd_ps,
            _mm512_add_ps,
            |s| { f64::from(_mm512_reduce_add_ps(s)) }
        )
    }

    /// # Safety
    /// AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn fma256(rounds: usize) -> f64 {
        let ops = (_mm256_set1_ps(0.5), _mm256_set1_ps(0.25));
        chains!(
            rounds,
            _mm256_setzero_ps(),
            ops,
            _mm256_fmadd_ps,
            _mm256_add_ps,
            |s| { f64::from(_mm256_cvtss_f32(s)) }
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each kind this CPU has gives a positive rate, and the loops compute what they say
    /// (one round of int8 `1 * -1` over 4 bytes per lane is -4 per lane).
    #[test]
    fn peaks_are_measured_where_the_dispatch_has_the_instruction() {
        for dot in [Dot::Int8, Dot::Bf16, Dot::F32] {
            match (instruction(dot), measure(dot, 2)) {
                (Some((name, macs)), Some((same, rate))) => {
                    assert_eq!(name, same);
                    // Two threads, at most 4 issues per cycle each at 5 GHz: a loop whose
                    // multiplies the compiler hoisted out reported ~3x that.
                    let most = (2 * macs * 4 * 5) as f64;
                    assert!(macs >= 8 && rate > 0.0 && rate < most, "{name}: {rate}");
                }
                (None, None) => {}
                other => panic!("{dot:?}: {other:?}"),
            }
        }
        #[cfg(target_arch = "x86_64")]
        if isa().avx2_int8() || isa().vnni() {
            // SAFETY: AVX2 (every x86 family above scalar has it).
            let v = unsafe { x86::madd256(1) };
            // Two rounds; chain i adds 2 * 3 * -(i + 1) per lane pair, over 8 lanes.
            let want: i32 = (0..CHAINS as i32 / 2).map(|i| 2 * 2 * 3 * -(i + 1)).sum();
            assert_eq!(v, f64::from(want));
        }
        #[cfg(target_arch = "x86_64")]
        if isa().vnni() {
            // SAFETY: AVX-512 VNNI (the dispatch found it).
            let v = unsafe { x86::vnni512(1) };
            assert_eq!(v, (CHAINS * 16) as f64 * -4.0);
        }
    }
}
