#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The CPU forward's scratch stays within the bound its chunks are planned by
//! (`CpuMoe::token_scratch_bytes`): an allocator that counts every byte live measures the
//! peak of each call above what was live before it, on every path the forward takes (experts
//! run whole or in panels, the buffered and the summed weighted sums, int8 and weight-only
//! layers, fp32 and bf16 inputs). One test in its own binary, so that no other test's
//! allocations land in the count.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

use moeq_core::cpu::build::{from_raw, RawProj, RawScheme, SampleCodes};
use moeq_core::cpu::linear::Compute;
use moeq_core::cpu::routing::Routed;

/// The system allocator, counting the bytes live and their peak.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

fn grew(by: usize) {
    let now = LIVE.fetch_add(by, Relaxed) + by;
    PEAK.fetch_max(now, Relaxed);
}

// SAFETY: every request goes to the system allocator unchanged and its answer comes back
// unchanged; only the counters are updated beside it.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract for `alloc` is the system allocator's.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as for `alloc`.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from this allocator (so from the system one) with `layout`.
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: `ptr` came from this allocator with `layout`; the caller's contract for
        // `realloc` is the system allocator's.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            if new_size > layout.size() {
                grew(new_size - layout.size());
            } else {
                LIVE.fetch_sub(layout.size() - new_size, Relaxed);
            }
        }
        p
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// A layer of sample codes and scales (groups of 64 where the scheme has groups).
fn layer(scheme: RawScheme, e: usize, h: usize, i: usize, k: usize) -> moeq_core::cpu::moe::CpuMoe {
    let grouped = matches!(scheme, RawScheme::W8a16 | RawScheme::W4a16);
    let (g13, g2, group) = if grouped {
        (h / 64, i / 64, 64)
    } else {
        (1, 1, -1)
    };
    // bf16 values, as a checkpoint's scales are (weight-only layers then widen into
    // dequantised bf16 weights from 32 rows, a path of its own).
    let s13 = vec![f32::from_bits(0x3a83_0000); e * 2 * i * g13];
    let s2 = vec![f32::from_bits(0x3a03_0000); e * h * g2];
    let codes = SampleCodes::new(scheme == RawScheme::W4a16, e, h, i);
    let (a, b) = codes.raw();
    let proj = |weights, scales| RawProj {
        weights,
        scales,
        zero_points: None,
        act_scales: None,
    };
    from_raw(scheme, e, h, i, group, proj(a, &s13), proj(b, &s2), k, true).expect("a layer")
}

#[test]
fn a_forward_allocates_within_its_planned_scratch() {
    let mut seed = 0x2545_f491u32;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 17;
        seed ^= seed << 5;
        seed
    };
    // (scheme, experts, hidden, intermediate, top_k, tokens, inputs)
    let cases = [
        // Experts run whole, the weighted sum buffered.
        (RawScheme::W8a8Dynamic, 16, 256, 128, 2, 64, Compute::F32),
        // 8192 routed rows of int8 down inputs: the summed path, in column panels.
        (RawScheme::W8a8Dynamic, 16, 256, 128, 4, 2048, Compute::F32),
        // One expert: fewer than the threads, so projections in panels (where there are 2+).
        (RawScheme::W4a16, 1, 256, 128, 1, 256, Compute::F32),
        (RawScheme::W8a16, 3, 128, 192, 2, 100, Compute::F32),
        // bf16 inputs: from 32 rows per expert the dequantised bf16 weights (and AMX-BF16).
        (RawScheme::W4a16, 4, 256, 128, 2, 128, Compute::Bf16),
        (RawScheme::W8a16, 8, 128, 64, 2, 7, Compute::Bf16),
    ];
    for (scheme, e, h, i, k, tokens, compute) in cases {
        let moe = layer(scheme, e, h, i, k);
        let routed = Routed {
            top_k: k,
            ids: (0..tokens * k).map(|_| next() % e as u32).collect(),
            weights: (0..tokens * k).map(|_| 1.0 / k as f32).collect(),
        };
        let x: Vec<f32> = (0..tokens * h)
            .map(|_| (next() % 2001) as f32 / 1000.0 - 1.0)
            .collect();
        // Every spare buffer freed, so that the call allocates all it uses.
        moeq_core::cpu::release_scratch();
        let before = LIVE.load(Relaxed);
        PEAK.store(before, Relaxed);
        let out = moe
            .forward_topk(&x, tokens, &routed, compute)
            .expect("a forward");
        let used = PEAK.load(Relaxed) - before;
        let bound = tokens * moe.token_scratch_bytes(k);
        let case = format!("{scheme:?} E={e} H={h} I={i} k={k} T={tokens} {compute:?}");
        // The count works: the output alone is in it.
        assert!(used >= out.len() * 4, "{case}: {used} bytes counted");
        assert!(
            used <= bound,
            "{case}: {used} bytes of scratch, bound {bound}"
        );
        drop(out);
    }
}
