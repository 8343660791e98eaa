//! The fused MoE forward on the CPU: tokens grouped by expert, GEMM1 (gate|up) with
//! SiLU(gate) * up, GEMM2 (down) with the top-k weights applied, shared experts.

use std::borrow::Cow;

use rayon::prelude::*;

use super::kernels;
use super::linear::{transpose, transpose_into, Compute, Linear, Prepared};
use super::routing::{route, Routed};
use crate::error::{LayoutError, Result};
use crate::moe::Routing;

/// One expert (or the shared expert): gate is absent for non-gated experts.
#[derive(Clone, Debug)]
pub struct CpuExpert {
    pub gate: Option<Linear>,
    pub up: Linear,
    pub down: Linear,
}

impl CpuExpert {
    /// `down(silu(gate(x)) * up(x))` for `x[m, hidden]`, row-major `[m, hidden]` out.
    pub fn forward(&self, x: &[f32], m: usize, parallel: bool, compute: Compute) -> Vec<f32> {
        let job = Job {
            ex: self,
            x,
            rows: None,
            m,
            compute,
            pre: None,
        };
        let mut y = vec![0f32; m * self.down.out_features()];
        if parallel {
            run_experts(&[job], true, &mut y);
        } else {
            job.forward_whole(&mut y, false);
        }
        y
    }
}

thread_local! {
    /// Per-thread gate/up buffers of [`Job::forward_whole`], kept between calls: a prefill
    /// step would otherwise fault in ~100 MB of fresh pages.
    static GATE_UP: std::cell::RefCell<(Vec<f32>, Vec<f32>)> =
        const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
}

/// Frees this thread's gate/up buffers ([`GATE_UP`]); returns the bytes they held.
pub(super) fn release_gate_up_here() -> usize {
    GATE_UP.with(|cell| {
        cell.try_borrow_mut().map_or(0, |mut b| {
            let bytes = (b.0.capacity() + b.1.capacity()) * std::mem::size_of::<f32>();
            *b = (Vec::new(), Vec::new());
            bytes
        })
    })
}

/// `v` with length `n`; old contents are kept (callers overwrite every value), or NaN under
/// `MOEQ_POISON_SCRATCH=1` ([`super::spare::poisoning`]).
fn sized(v: &mut Vec<f32>, n: usize) -> &mut [f32] {
    if super::spare::poisoning() {
        // Every row must be written by the experts (see `spare::poisoning`).
        v.clear();
        v.resize(n, f32::NAN);
    } else if v.len() < n {
        v.resize(n, 0.0);
    }
    &mut v[..n]
}

/// Runs `a` and `b`; with `offer`, `b` is offered to the pool's other threads when this
/// thread is one of its workers (`rayon::join`). Elsewhere both run here, rather than in
/// rayon's global pool.
fn offer_both(offer: bool, a: impl FnOnce() + Send, b: impl FnOnce() + Send) {
    if offer && rayon::current_thread_index().is_some() {
        rayon::join(a, b);
    } else {
        a();
        b();
    }
}

/// One expert's share of a call: rows `rows` of `x` (all `m` rows when `None`).
#[derive(Clone, Copy)]
struct Job<'a> {
    ex: &'a CpuExpert,
    x: &'a [f32],
    rows: Option<&'a [usize]>,
    m: usize,
    compute: Compute,
    /// The layer input prepared once for all tokens, when gate and up take it as it is.
    pre: Option<&'a Prepared<'a>>,
}

impl Job<'_> {
    /// The up projection's input: rows of the shared prepared input, or prepared here.
    fn up_input(&self) -> Prepared<'_> {
        let shared = match (self.pre, self.rows) {
            (Some(p), Some(rows)) => p.gather(rows),
            _ => None,
        };
        shared.unwrap_or_else(|| {
            self.ex
                .up
                .prepare_rows(self.x, self.m, self.rows, self.compute)
        })
    }

    /// The whole expert into `y` (`[m, hidden]`), every buffer row-major, led by this thread;
    /// with `offer`, parts of it are offered to the pool (see [`Job::down_input`]).
    fn forward_whole(&self, y: &mut [f32], offer: bool) {
        with_gate_up(|u, g| {
            let ph = self.down_input(u, g, offer);
            self.down_into(&ph, y, offer);
            ph.recycle();
        });
    }

    /// The down projection's input (SiLU(gate) * up, prepared), owning its values: what
    /// [`run_experts_summed`] keeps of each expert until its down pass.
    fn owned_down_input(&self, offer: bool) -> Prepared<'static> {
        with_gate_up(|u, g| {
            match self.down_input(u, g, offer) {
                // fp32 input as it is: copied into a spare buffer, so that the thread keeps
                // its gate/up buffer and the copy goes back to the spares once used.
                Prepared::F32(Cow::Borrowed(h)) => {
                    let mut owned = super::spare::take_any(h.len(), 0f32);
                    owned.copy_from_slice(h);
                    Prepared::F32(Cow::Owned(owned))
                }
                ph => ph.into_owned(),
            }
        })
    }

    /// Gate and up into `u` and `g` (sized here), `silu(gate) * up` into `u`, prepared for the
    /// down projection.
    fn down_input<'b>(&self, u: &'b mut Vec<f32>, g: &mut Vec<f32>, offer: bool) -> Prepared<'b> {
        let Job {
            ex,
            x,
            rows,
            m,
            compute,
            ..
        } = *self;
        // Up and gate (and for one row, the two halves of down) are offered to the pool with
        // `join`: while the other threads are busy with experts of their own, this thread runs
        // both sides itself at no cost; a thread that is idle (or just woke: a sleeping worker
        // starts ~0.1 ms after the call) takes one, so no expert waits whole for a late thread.
        let i = ex.up.out_features();
        let px = self.up_input();
        let hidden = sized(u, m * i);
        let up = |hidden: &mut [f32]| ex.up.forward_cols(&px, m, 0, i, hidden, i, 1);
        if let Some(gate) = &ex.gate {
            let gv = sized(g, m * i);
            offer_both(
                offer,
                || up(hidden),
                || {
                    if gate.same_input(&ex.up) {
                        gate.forward_cols(&px, m, 0, i, gv, i, 1);
                    } else {
                        let pg = gate.prepare_rows(x, m, rows, compute);
                        gate.forward_cols(&pg, m, 0, i, gv, i, 1);
                        pg.recycle();
                    }
                },
            );
            kernels::silu_mul(Some(gv), hidden);
        } else {
            up(hidden);
            kernels::silu_mul(None, hidden);
        }
        px.recycle();
        ex.down.prepare(hidden, m, compute)
    }

    /// The down projection of `ph` into `y` (`[m, hidden]`).
    fn down_into(&self, ph: &Prepared<'_>, y: &mut [f32], offer: bool) {
        let (ex, m) = (self.ex, self.m);
        let n = ex.down.out_features();
        let y = &mut y[..m * n];
        // One row is contiguous per feature range: split at a panel boundary.
        let half = (n / 2).next_multiple_of(ex.down.panel().max(1));
        if offer && m == 1 && half > 0 && half < n {
            let (a, b) = y.split_at_mut(half);
            offer_both(
                true,
                || ex.down.forward_cols(ph, 1, 0, half, a, half, 1),
                || ex.down.forward_cols(ph, 1, half, n - half, b, n - half, 1),
            );
        } else {
            ex.down.forward_cols(ph, m, 0, n, y, n, 1);
        }
    }
}

/// `f` on this thread's gate/up buffers ([`GATE_UP`]).
fn with_gate_up<R>(f: impl FnOnce(&mut Vec<f32>, &mut Vec<f32>) -> R) -> R {
    // The buffers leave the cell for the call: while this thread waits on an offered part it
    // may run another expert, which then finds the cell empty and sizes its own.
    let (mut u, mut g) = GATE_UP.with(|cell| {
        cell.try_borrow_mut()
            .map(|mut b| std::mem::take(&mut *b))
            .unwrap_or_default()
    });
    let r = f(&mut u, &mut g);
    // Not kept beyond the spares' size limit (one prefill expert of all tokens held hundreds
    // of MB per thread for the life of the process).
    let bytes = (u.capacity() + g.capacity()) * std::mem::size_of::<f32>();
    if bytes > super::spare::MAX_BYTES {
        return r;
    }
    GATE_UP.with(|cell| {
        if let Ok(mut b) = cell.try_borrow_mut() {
            // Keep the larger pair (a nested expert may have put its own back).
            if b.0.capacity() + b.1.capacity() < u.capacity() + g.capacity() {
                *b = (u, g);
            }
        }
    });
    r
}

/// Which projection a unit of work belongs to.
#[derive(Clone, Copy)]
enum Proj {
    Gate,
    Up,
}

/// Runs each job, writing its output (row-major `[m, hidden]`) into `out`, one after another.
///
/// At least one expert per thread: one task per expert, everything row-major, its parts
/// (gate beside up, one row's down halves) offered to the pool so the threads stay balanced
/// to the end. Fewer experts than threads: every projection is cut into panels of output
/// features and all experts' panels run as one parallel pass per GEMM, so the threads stream
/// different weight bytes and each byte is read once. (The whole-expert tasks took over from
/// one to four experts per thread, measured with 2 threads: DeepSeek-V2-Lite and Mixtral
/// W4A16 decode ~10% faster, W8A8 and W8A16 unchanged.)
fn run_experts(jobs: &[Job<'_>], parallel: bool, out: &mut [f32]) {
    let mut outs: Vec<&mut [f32]> = Vec::with_capacity(jobs.len());
    let mut rest = out;
    for j in jobs {
        let (head, tail) = std::mem::take(&mut rest).split_at_mut(j.m * j.ex.down.out_features());
        outs.push(head);
        rest = tail;
    }
    let threads = rayon::current_num_threads();
    if !parallel || jobs.len() >= threads {
        jobs.par_iter()
            .zip(outs.into_par_iter())
            .with_max_len(1)
            .for_each(|(j, y)| j.forward_whole(y, true));
        return;
    }
    // GEMM1: inputs prepared once per expert (gate and up share them when they can).
    let prepared: Vec<_> = jobs
        .par_iter()
        .map(|job| {
            let Job {
                ex,
                x,
                rows,
                m,
                compute,
                ..
            } = *job;
            let up = job.up_input();
            let gate = ex
                .gate
                .as_ref()
                .filter(|g| !g.same_input(&ex.up))
                .map(|g| g.prepare_rows(x, m, rows, compute));
            (up, gate)
        })
        .collect();
    let mut gu: Vec<(Vec<f32>, Vec<f32>)> = jobs
        .iter()
        .map(|&Job { ex, m, .. }| {
            let i = ex.up.out_features();
            let g = if ex.gate.is_some() { m * i } else { 0 };
            (vec![0f32; g], vec![0f32; m * i])
        })
        .collect();
    {
        let mut tasks: Vec<(usize, Proj, usize, &mut [f32])> = Vec::new();
        for (e, (g, u)) in gu.iter_mut().enumerate() {
            let Job { ex, m, .. } = jobs[e];
            if m == 0 {
                continue;
            }
            let panel = ex.up.panel();
            for (p, c) in u.chunks_mut(panel * m).enumerate() {
                tasks.push((e, Proj::Up, p * panel, c));
            }
            if let Some(gate) = &ex.gate {
                let panel = gate.panel();
                for (p, c) in g.chunks_mut(panel * m).enumerate() {
                    tasks.push((e, Proj::Gate, p * panel, c));
                }
            }
        }
        tasks.into_par_iter().for_each(|(e, which, first, out)| {
            let Job { ex, m, .. } = jobs[e];
            let (up_in, gate_in) = &prepared[e];
            let (lin, input) = match (which, &ex.gate) {
                (Proj::Gate, Some(g)) => (g, gate_in.as_ref().unwrap_or(up_in)),
                _ => (&ex.up, up_in),
            };
            lin.forward_cols(input, m, first, out.len() / m, out, 1, m);
        });
    }
    for (up, gate) in prepared {
        up.recycle();
        if let Some(g) = gate {
            g.recycle();
        }
    }
    // silu(gate) * up, row-major, then the down projection's input.
    let down_in: Vec<_> = jobs
        .par_iter()
        .zip(gu.par_iter_mut())
        .map(|(&Job { ex, m, compute, .. }, (g, u))| {
            let i = ex.up.out_features();
            let mut u = std::mem::take(u);
            kernels::silu_mul(ex.gate.as_ref().map(|_| g.as_slice()), &mut u);
            let h = if m == 1 { u } else { transpose(&u, i, m) };
            let p = ex.down.prepare(&h, m, compute);
            if matches!(p, Prepared::F32(Cow::Borrowed(_))) {
                // fp32 input as it is: keep `h` rather than copy it.
                drop(p);
                Prepared::F32(Cow::Owned(h))
            } else {
                p.into_owned()
            }
        })
        .collect();
    drop(gu);
    let mut ys: Vec<Vec<f32>> = jobs
        .iter()
        .map(|&Job { ex, m, .. }| vec![0f32; m * ex.down.out_features()])
        .collect();
    {
        let mut tasks: Vec<(usize, usize, &mut [f32])> = Vec::new();
        for (e, y) in ys.iter_mut().enumerate() {
            let Job { ex, m, .. } = jobs[e];
            if m == 0 {
                continue;
            }
            let panel = ex.down.panel();
            for (p, c) in y.chunks_mut(panel * m).enumerate() {
                tasks.push((e, p * panel, c));
            }
        }
        tasks.into_par_iter().for_each(|(e, first, out)| {
            let Job { ex, m, .. } = jobs[e];
            ex.down
                .forward_cols(&down_in[e], m, first, out.len() / m, out, 1, m);
        });
    }
    for d in down_in {
        d.recycle();
    }
    jobs.par_iter()
        .zip(ys.par_iter())
        .zip(outs.into_par_iter())
        .for_each(|((&Job { ex, m, .. }, yt), y)| {
            transpose_into(yt, ex.down.out_features(), m, y);
        });
}

/// Where an expert's output rows go in [`run_experts_summed`]: per row, its token and top-k
/// weight (the expert's routed `(token, weight)` pairs), and whether it is that token's first
/// term (which overwrites rather than adds).
struct Sink<'a> {
    terms: &'a [(usize, f32)],
    first: Vec<bool>,
}

/// Output features per task of [`run_experts_summed`]'s down pass for `jobs` (`rows` routed
/// rows in all), or `None` where the buffered path is taken (see [`summed_width`]).
fn summed_panel(jobs: &[Job<'_>], rows: usize, hidden: usize, threads: usize) -> Option<usize> {
    let first = jobs.first()?;
    let (down, inter) = (&first.ex.down, first.ex.up.out_features());
    let same_shape = jobs.iter().all(|j| {
        j.ex.down.out_features() == hidden
            && j.ex.up.out_features() == inter
            && j.ex.down.panel() == down.panel()
    });
    // Bytes per value of the down projection's prepared input.
    let value_bytes = match down {
        Linear::Int8 { .. } => 1,
        // bf16 rows where the CPU has bf16 dot products (else fp32 ones).
        Linear::WeightOnly { .. } if first.compute == Compute::Bf16 && kernels::bf16_dot() => 2,
        _ => 4,
    };
    let shape = (hidden, inter, value_bytes, down.panel());
    same_shape
        .then(|| summed_width(shape, rows, threads))
        .flatten()
}

/// The panel width of [`run_experts_summed`] for a down projection of `hidden` outputs from
/// `inter` inputs of `value_bytes` each (prepared), whose column ranges start at multiples of
/// `panel`, over `rows` routed rows on `threads` threads; `None` where the buffered path costs
/// less. The summed path reads every expert's down input once per task, so its tasks are few
/// (two per thread), and it is taken only where the buffer it saves outweighs those reads by
/// 3x: each routed row's output is written (after a read for ownership) and read again by the
/// weighted sum, `3 * 4 * hidden` bytes, against `tasks * inter * value_bytes`. Below
/// [`SUMMED_MIN_BYTES`] of routed outputs the buffer stays in cache.
///
/// Measured on the 2-core AMX VM, cold weights, random routing, the two paths alternated call
/// by call in one process (medians of 10-20 calls each): Qwen3-30B-A3B W8A8 T=1024 73-89 ms
/// against 76-98, DeepSeek-V2-Lite 78-96 against 105-123; from Python (bf16 inputs, torch's
/// flush) 89 against 100 and 102 against 121; Qwen3 W4A16 with bf16 inputs 249-253 against
/// 282-283, W8A16 185 and 305 against 198 and 350. At T=128 (6-8 MB of routed outputs) the
/// two were within the noise of each other; DeepSeek-V2-Lite W4A16 (bf16 inputs) and Qwen3
/// W8A16 (fp32 inputs), which the rule leaves buffered, gained nothing when forced onto the
/// panels.
fn summed_width(
    (hidden, inter, value_bytes, panel): (usize, usize, usize, usize),
    rows: usize,
    threads: usize,
) -> Option<usize> {
    let tasks = 2 * threads.max(1);
    let width = hidden.div_ceil(tasks).next_multiple_of(panel.max(1));
    let saved = 3 * 4 * hidden;
    let reread = hidden
        .div_ceil(width.max(1))
        .saturating_mul(inter)
        .saturating_mul(value_bytes);
    let buffer = rows.saturating_mul(hidden).saturating_mul(4);
    let pays = buffer >= SUMMED_MIN_BYTES && reread.saturating_mul(3) <= saved;
    (pays && width > 0 && width < hidden).then_some(width)
}

/// How [`CpuMoe::routed_sum_by`] sums the experts' rows (the same bits either way). Calls
/// take [`SumPath::Chosen`]; the tests name the paths to compare them.
#[derive(Clone, Copy, Debug)]
#[cfg_attr(not(test), allow(dead_code))]
enum SumPath {
    /// As [`summed_panel`] chooses.
    Chosen,
    /// Every routed row's output into one buffer, then the weighted sum per token.
    Buffered,
    /// [`run_experts_summed`] in panels of this many features (a multiple of the down
    /// projection's panel).
    Summed(usize),
}

/// The routed rows' output size from which [`run_experts_summed`] may run.
const SUMMED_MIN_BYTES: usize = 4 << 20;

/// [`run_experts`] and the weighted sum per token in one, for calls whose routed rows' outputs
/// would not stay in cache: every expert's gate, up and SiLU first (one task per expert), then
/// the down projections in column panels of `width` features, one task per panel, each running
/// every expert in order and adding its weighted rows into the panel's tokens at once. Each
/// token's terms are added in the same order as the buffered path adds them (expert, then
/// row), so the bits are the same, and the panel's sums stay in cache instead of a buffer of
/// `rows x hidden` floats going to memory and back. `out` is `[tokens, hidden]`;
/// `has_terms[t]` says whether token `t` has any row (the others come out zero).
fn run_experts_summed(
    jobs: &[Job<'_>],
    (sinks, has_terms): (&[Sink<'_>], &[bool]),
    (hidden, width): (usize, usize),
    out: &mut [f32],
) {
    // (`forward_cols` starts its column ranges at multiples of the projection's panel.)
    let panel = jobs.first().map_or(1, |j| j.ex.down.panel().max(1));
    debug_assert!(
        width > 0 && width.is_multiple_of(panel),
        "panel width {width} for a projection of panel {panel}"
    );
    let downs: Vec<Prepared<'static>> = jobs
        .par_iter()
        .with_max_len(1)
        .map(|j| j.owned_down_input(true))
        .collect();
    let tokens = out.len() / hidden.max(1);
    let most = jobs.iter().map(|j| j.m).max().unwrap_or(0);
    let starts: Vec<usize> = (0..hidden).step_by(width.max(1)).collect();
    // `[tokens, count]` per panel: every token with a term gets its first one as an
    // overwrite. Taken (and given back) here, so that the calling thread's spares serve the
    // next call.
    let mut panels: Vec<Vec<f32>> = starts
        .iter()
        .map(|&first| super::spare::take_any(tokens * width.min(hidden - first), 0f32))
        .collect();
    panels
        .par_iter_mut()
        .zip(&starts)
        .with_max_len(1)
        .for_each(|(sums, &first)| {
            let count = width.min(hidden - first);
            let mut y = super::spare::take_any(most * count, 0f32);
            for ((job, down), sink) in jobs.iter().zip(&downs).zip(sinks) {
                let m = job.m;
                let y = &mut y[..m * count];
                job.ex.down.forward_cols(down, m, first, count, y, count, 1);
                for (r, (&(t, w), &first)) in sink.terms.iter().zip(&sink.first).enumerate() {
                    let dst = &mut sums[t * count..(t + 1) * count];
                    let src = &y[r * count..(r + 1) * count];
                    kernels::add_scaled(dst, src, w, first);
                }
            }
            super::spare::give(y);
        });
    // Spread over the threads, as they were made (each thread's spares serve its next call).
    downs
        .into_par_iter()
        .with_max_len(1)
        .for_each(Prepared::recycle);
    out.par_chunks_mut(hidden.max(1))
        .enumerate()
        .for_each(|(t, row)| {
            if !has_terms.get(t).copied().unwrap_or(false) {
                row.fill(0.0);
                return;
            }
            for (&first, sums) in starts.iter().zip(&panels) {
                let count = width.min(hidden - first);
                row[first..first + count].copy_from_slice(&sums[t * count..(t + 1) * count]);
            }
        });
    for p in panels {
        super::spare::give(p);
    }
}

/// An MoE layer ready to run.
#[derive(Clone, Debug)]
pub struct CpuMoe {
    pub hidden: usize,
    pub experts: Vec<CpuExpert>,
    pub shared: Option<CpuExpert>,
    /// `[hidden]` weights of Qwen2-MoE's `shared_expert_gate` (sigmoid gate on the shared output).
    pub shared_gate: Option<Vec<f32>>,
    pub routing: Routing,
    pub top_k: usize,
    pub correction_bias: Option<Vec<f32>>,
    /// The widest routed intermediate, found once (a walk over every expert at each call
    /// touched hundreds of cold cache lines at decode).
    pub(crate) widest: std::sync::OnceLock<usize>,
}

/// Why slot `slot` of a `[tokens, top_k]` routing naming expert `id` of a layer of `experts`
/// is refused; the Python binding words ids outside `u32` the same way.
pub fn not_an_expert(slot: usize, top_k: usize, id: i64, experts: usize) -> String {
    format!(
        "topk_ids[{}, {}] = {id} is not an expert (the layer has {experts}, ids 0 to {})",
        slot / top_k.max(1),
        slot % top_k.max(1),
        experts.saturating_sub(1)
    )
}

fn bad(reason: String) -> crate::error::Error {
    LayoutError {
        subject: "moe forward".into(),
        reason,
    }
    .into()
}

impl CpuMoe {
    /// Moves every packed weight of the layer (int8 blocks, weight-only codes) that is not in
    /// an arena yet into one huge-page arena (see [`super::arena`]); call once after building
    /// the layer.
    pub fn consolidate(&mut self) {
        use super::arena::Arena;
        enum Slot<'a> {
            Int8(&'a mut super::packed::PackedI8),
            WeightOnly(&'a mut super::wo::BlockedWo),
        }
        let mut slots: Vec<Slot<'_>> = Vec::new();
        for ex in self.experts.iter_mut().chain(self.shared.iter_mut()) {
            for lin in ex.gate.iter_mut().chain([&mut ex.up, &mut ex.down]) {
                match lin {
                    Linear::Int8 { w, .. } if !w.is_shared() => slots.push(Slot::Int8(w)),
                    Linear::WeightOnly { w, .. } if !w.is_shared() => {
                        slots.push(Slot::WeightOnly(w))
                    }
                    _ => {}
                }
            }
        }
        if slots.is_empty() {
            return;
        }
        let (arena, offsets) = {
            let parts: Vec<&[i8]> = slots
                .iter()
                .map(|s| match s {
                    Slot::Int8(p) => p.bytes(),
                    Slot::WeightOnly(w) => {
                        let b = w.code_bytes();
                        // SAFETY: u8 and i8 have the same size, alignment and valid bit
                        // patterns; the slice covers the same memory.
                        unsafe { std::slice::from_raw_parts(b.as_ptr().cast(), b.len()) }
                    }
                })
                .collect();
            Arena::build(&parts)
        };
        for (s, at) in slots.into_iter().zip(offsets) {
            match s {
                Slot::Int8(p) => p.share(&arena, at),
                Slot::WeightOnly(w) => w.share(&arena, at),
            }
        }
    }

    /// int8 experts that all quantise their input alike (dynamic per token, or one static
    /// scale) get it quantised once per token here rather than once per (token, expert).
    fn shared_int8_input(&self, x: &[f32], tokens: usize, k: usize) -> Option<Prepared<'static>> {
        let first = &self.experts.first()?.up;
        let shared = self.experts.iter().all(|ex| {
            ex.up.same_input(first) && ex.gate.as_ref().is_none_or(|g| g.same_input(first))
        });
        // Worth it once tokens are routed to several experts each.
        if !shared || k < 2 {
            return None;
        }
        first.prepare_int8_all(x, tokens)
    }

    /// The weighted sum over the routed experts only: `out[t] = Σ_j w[t, j] * expert[ids[t, j]](x_t)`.
    /// `compute` is the weight-only arithmetic (see [`Compute`]).
    pub fn forward_topk(
        &self,
        x: &[f32],
        tokens: usize,
        routed: &Routed,
        compute: Compute,
    ) -> Result<Vec<f32>> {
        super::in_pool(|| self.forward_topk_in_pool(x, tokens, routed, compute))
    }

    fn forward_topk_in_pool(
        &self,
        x: &[f32],
        tokens: usize,
        routed: &Routed,
        compute: Compute,
    ) -> Result<Vec<f32>> {
        let h = self.hidden;
        self.check_hidden(x, tokens)?;
        let k = routed.top_k;
        let slots = tokens.checked_mul(k);
        if slots != Some(routed.ids.len()) || slots != Some(routed.weights.len()) {
            return Err(bad(format!(
                "topk_ids/topk_weights must be [{tokens}, {k}]"
            )));
        }
        let e_count = self.experts.len();
        if let Some((i, &bad_id)) = routed
            .ids
            .iter()
            .enumerate()
            .find(|(_, &id)| id as usize >= e_count)
        {
            return Err(bad(not_an_expert(i, k, i64::from(bad_id), e_count)));
        }
        let chunk = self.planned_chunk(tokens, k, || format!("topk_ids: {k} slots per token"))?;
        Ok(in_chunks(tokens, chunk, h, |at| {
            let x = &x[at.start * h..at.end * h];
            let ids = &routed.ids[at.start * k..at.end * k];
            let weights = &routed.weights[at.start * k..at.end * k];
            self.routed_sum(x, at.len(), ids, weights, k, compute)
        }))
    }

    fn check_hidden(&self, x: &[f32], tokens: usize) -> Result<()> {
        let h = self.hidden;
        // Checked product: a token count from outside must not wrap to a matching length.
        if tokens.checked_mul(h) != Some(x.len()) {
            return Err(bad(format!(
                "hidden_states has {} values, expected [{tokens}, {h}]",
                x.len()
            )));
        }
        Ok(())
    }

    /// [`Self::forward_topk`] of checked arguments (`ids` all experts of the layer), in one
    /// pass over the experts: each weight byte is read once.
    fn routed_sum(
        &self,
        x: &[f32],
        tokens: usize,
        ids: &[u32],
        weights: &[f32],
        k: usize,
        compute: Compute,
    ) -> Vec<f32> {
        self.routed_sum_by(x, tokens, (ids, weights, k), compute, SumPath::Chosen)
    }

    /// [`Self::routed_sum`] by the path `path` asks for.
    fn routed_sum_by(
        &self,
        x: &[f32],
        tokens: usize,
        (ids, weights, k): (&[u32], &[f32], usize),
        compute: Compute,
        path: SumPath,
    ) -> Vec<f32> {
        let h = self.hidden;
        let e_count = self.experts.len();
        // Group (token, slot) pairs by expert.
        let mut by_expert: Vec<Vec<(usize, f32)>> = vec![Vec::new(); e_count];
        for t in 0..tokens {
            for j in 0..k {
                let e = ids[t * k + j] as usize;
                by_expert[e].push((t, weights[t * k + j]));
            }
        }
        let active: Vec<usize> = (0..e_count).filter(|&e| !by_expert[e].is_empty()).collect();
        let pre = self.shared_int8_input(x, tokens, k);
        let token_rows: Vec<Vec<usize>> = active
            .iter()
            .map(|&e| by_expert[e].iter().map(|&(t, _)| t).collect())
            .collect();
        let jobs: Vec<Job<'_>> = active
            .iter()
            .zip(&token_rows)
            .map(|(&e, rows)| Job {
                ex: &self.experts[e],
                x,
                rows: Some(rows),
                m: rows.len(),
                compute,
                pre: pre.as_ref(),
            })
            .collect();
        let rows = tokens * k;
        let threads = rayon::current_num_threads();
        let width = match path {
            SumPath::Chosen if jobs.len() >= threads => summed_panel(&jobs, rows, h, threads),
            SumPath::Chosen | SumPath::Buffered => None,
            SumPath::Summed(width) => Some(width),
        };
        if let Some(width) = width {
            // Each (token, slot)'s place in the sum, as the buffered path below adds them.
            let mut seen = vec![false; tokens];
            let sinks: Vec<Sink<'_>> = active
                .iter()
                .map(|&e| Sink {
                    terms: &by_expert[e],
                    first: by_expert[e]
                        .iter()
                        .map(|&(t, _)| !std::mem::replace(&mut seen[t], true))
                        .collect(),
                })
                .collect();
            let mut out = super::spare::take_any(tokens * h, 0f32);
            // (`seen` now marks every token with a term.)
            run_experts_summed(&jobs, (&sinks, &seen), (h, width), &mut out);
            drop(jobs);
            if let Some(p) = pre {
                p.recycle();
            }
            return out;
        }
        // All experts' outputs in one reused buffer, expert after expert.
        let mut starts = Vec::with_capacity(jobs.len());
        let mut total = 0;
        for j in &jobs {
            starts.push(total);
            total += j.m * h;
        }
        // In this thread's spares, not the layer's: a layer kept its largest call's buffer
        // (tokens x top_k x hidden floats, 2.5 GB at T = 32768 for Qwen3's shape) for its
        // whole life, one per layer of the model, beyond the spares' size limit and out of
        // `release_scratch`'s reach. Long calls come here in chunks that fit those spares.
        let mut buf = super::spare::take_any(total, 0f32);
        run_experts(&jobs, true, sized(&mut buf, total));
        drop(jobs);
        if let Some(p) = pre {
            p.recycle();
        }
        // Where each (token, slot) landed: (index into `active`, row).
        let mut place = vec![(0usize, 0usize); tokens * k];
        let mut next = vec![0usize; tokens];
        for (a, &e) in active.iter().enumerate() {
            for (r, &(t, _)) in by_expert[e].iter().enumerate() {
                place[t * k + next[t]] = (a, r);
                next[t] += 1;
            }
        }
        // Sum per token in a fixed order (expert, then row), so results are deterministic.
        // The first term overwrites whatever the buffer held (as if added to zeros).
        let mut out = super::spare::take_any(tokens * h, 0f32);
        out.par_chunks_mut(h.max(1))
            .enumerate()
            .for_each(|(t, dst)| {
                let slots = &place[t * k..t * k + next[t]];
                if slots.is_empty() {
                    dst.fill(0.0);
                }
                for (i, &(a, r)) in slots.iter().enumerate() {
                    let w = by_expert[active[a]][r].1;
                    let at = starts[a] + r * h;
                    super::kernels::add_scaled(dst, &buf[at..at + h], w, i == 0);
                }
            });
        super::spare::give(buf);
        out
    }

    /// The widest intermediate (gate and up outputs) of the routed experts.
    fn widest_intermediate(&self) -> usize {
        *self.widest.get_or_init(|| {
            self.experts
                .iter()
                .map(|ex| ex.up.out_features())
                .max()
                .unwrap_or(0)
        })
    }

    /// Scratch bytes one token of a call with `k` slots may need, summed over the buffers the
    /// paths of the routed sum (`routed_sum_by`, `run_experts`) allocate: per routed row its output
    /// (`hidden` floats, twice where a buffered path stacks a copy), its prepared inputs (up's
    /// and, with act-order, gate's own: `hidden` floats at most), its gate and up outputs and
    /// down input (`inter` floats each at most) and its routing bookkeeping; the shared
    /// expert's rows likewise; the token's output row.
    pub fn token_scratch_bytes(&self, k: usize) -> usize {
        const F32: usize = std::mem::size_of::<f32>();
        // `by_expert`, `token_rows` and `place` entries of one slot.
        const BOOKKEEPING: usize = 48;
        let h = self.hidden;
        let row = |inter: usize| {
            h.saturating_add(inter)
                .saturating_mul(3)
                .saturating_mul(F32)
        };
        let shared = self.shared.as_ref().map_or(0, |s| row(s.up.out_features()));
        k.saturating_mul(row(self.widest_intermediate()).saturating_add(BOOKKEEPING))
            .saturating_add(shared)
            .saturating_add(h.saturating_mul(F32))
    }

    /// Tokens per chunk of a call of `tokens` tokens with `k` slots each ([`plan_chunk`]), or
    /// why it is refused (`subject`: what one token's need is said of, worded only then).
    fn planned_chunk(
        &self,
        tokens: usize,
        k: usize,
        subject: impl FnOnce() -> String,
    ) -> Result<usize> {
        let per_token = self.token_scratch_bytes(k);
        let default = default_chunk(k, self.hidden, self.experts.len());
        let requested = requested_chunk_env();
        let limit = memory_limit();
        plan_chunk(tokens, per_token, requested, default, limit).map_err(|need| {
            let why = match requested {
                Some(n) => format!(
                    "MOEQ_CHUNK_TOKENS={}: a chunk of {} tokens needs {} of scratch memory",
                    if n == usize::MAX { 0 } else { n },
                    n.min(tokens),
                    gib(need)
                ),
                None => format!(
                    "{} need {} of scratch memory for one token",
                    subject(),
                    gib(need)
                ),
            };
            bad(format!(
                "{why}, more than this process may use ({}: the least of the machine's \
                 memory, its cgroup's memory limit and what RLIMIT_AS leaves)",
                limit.map_or_else(|| "unknown".into(), gib)
            ))
        })
    }

    /// Routes with the model's router logits, runs the routed experts (routed scaling included)
    /// and adds the shared experts.
    /// `compute` is the weight-only arithmetic (see [`Compute`]).
    pub fn forward(
        &self,
        x: &[f32],
        tokens: usize,
        router_logits: &[f32],
        compute: Compute,
    ) -> Result<Vec<f32>> {
        super::in_pool(|| self.forward_in_pool(x, tokens, router_logits, compute))
    }

    fn forward_in_pool(
        &self,
        x: &[f32],
        tokens: usize,
        router_logits: &[f32],
        compute: Compute,
    ) -> Result<Vec<f32>> {
        let e = self.experts.len();
        if tokens.checked_mul(e) != Some(router_logits.len()) {
            return Err(bad(format!(
                "router_logits has {} values, expected [{tokens}, {e}]",
                router_logits.len()
            )));
        }
        self.check_hidden(x, tokens)?;
        let h = self.hidden;
        let chunk = self.planned_chunk(tokens, self.top_k, || {
            format!(
                "this layer's top_k {} slots (hidden {h}, intermediate up to {})",
                self.top_k,
                self.widest_intermediate()
            )
        })?;
        Ok(in_chunks(tokens, chunk, h, |at| {
            let x = &x[at.start * h..at.end * h];
            self.routed_and_shared(
                x,
                at.len(),
                &router_logits[at.start * e..at.end * e],
                compute,
            )
        }))
    }

    /// [`Self::forward`] of checked arguments.
    fn routed_and_shared(
        &self,
        x: &[f32],
        tokens: usize,
        router_logits: &[f32],
        compute: Compute,
    ) -> Vec<f32> {
        let routed = route(
            router_logits,
            self.experts.len(),
            &self.routing,
            self.top_k,
            self.correction_bias.as_deref(),
            true,
        );
        let mut out = self.routed_sum(
            x,
            tokens,
            &routed.ids,
            &routed.weights,
            routed.top_k,
            compute,
        );
        if let Some(shared) = &self.shared {
            let s = shared.forward(x, tokens, true, compute);
            let h = self.hidden;
            for t in 0..tokens {
                let gate = match &self.shared_gate {
                    Some(g) => {
                        let z: f32 = g
                            .iter()
                            .zip(&x[t * h..(t + 1) * h])
                            .map(|(a, b)| a * b)
                            .sum();
                        1.0 / (1.0 + (-z).exp())
                    }
                    None => 1.0,
                };
                for (o, v) in out[t * h..(t + 1) * h]
                    .iter_mut()
                    .zip(&s[t * h..(t + 1) * h])
                {
                    *o += gate * v;
                }
            }
        }
        out
    }
}

/// The chunk `MOEQ_CHUNK_TOKENS` asks for (read once): `Some(usize::MAX)` for 0 (never split),
/// `None` where it is unset or not a count (the default applies).
fn requested_chunk_env() -> Option<usize> {
    static SET: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    let set = *SET.get_or_init(|| {
        std::env::var("MOEQ_CHUNK_TOKENS")
            .ok()
            .and_then(|v| requested_chunk(&v))
    });
    set.map(|n| if n == 0 { usize::MAX } else { n })
}

/// Tokens per chunk of a call of `tokens` tokens that needs up to `per_token` bytes of scratch
/// each: `requested` (`MOEQ_CHUNK_TOKENS`) as asked, else `default` ([`default_chunk`]) but
/// never planning more than a quarter of `limit`, the memory the process may use
/// ([`memory_limit`]). `Err(bytes)`, before anything is allocated, where the chunk would need
/// more than `limit`: one token alone, or a requested chunk (an allocation that large would
/// abort the process rather than fail).
fn plan_chunk(
    tokens: usize,
    per_token: usize,
    requested: Option<usize>,
    default: usize,
    limit: Option<usize>,
) -> std::result::Result<usize, usize> {
    let per_token = per_token.max(1);
    let chunk = match (requested, limit) {
        (Some(n), _) => n.max(1),
        (None, Some(limit)) => {
            // Down to a multiple of 256 tokens where that leaves any: the chunking (which
            // weight-only outputs' last bits follow) then moves in few steps with the memory.
            let cap = limit / 4 / per_token;
            let cap = if cap >= 256 { cap - cap % 256 } else { cap };
            default.min(cap).max(1)
        }
        (None, None) => default.max(1),
    };
    let need = chunk.min(tokens).max(1).saturating_mul(per_token);
    match limit {
        Some(limit) if need > limit => Err(need),
        _ => Ok(chunk),
    }
}

/// `bytes` in words: GiB or MiB.
fn gib(bytes: usize) -> String {
    if bytes >= 1 << 30 {
        format!("{:.1} GiB", bytes as f64 / f64::from(1u32 << 30))
    } else {
        format!("{:.1} MiB", bytes as f64 / f64::from(1u32 << 20))
    }
}

/// The memory this process may use, read once: the least of the machine's physical memory,
/// its cgroup's limit (`cgroup_memory_limit`) and what the address-space limit (`RLIMIT_AS`)
/// leaves beside the process's present size; `None` where none is known.
fn memory_limit() -> Option<usize> {
    static LIMIT: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    *LIMIT.get_or_init(read_memory_limit)
}

#[cfg(target_os = "linux")]
fn read_memory_limit() -> Option<usize> {
    // SAFETY: sysconf reads a system value and touches no memory of ours.
    let (pages, page) = unsafe {
        (
            libc::sysconf(libc::_SC_PHYS_PAGES),
            libc::sysconf(libc::_SC_PAGESIZE),
        )
    };
    let physical = usize::try_from(pages)
        .ok()
        .zip(usize::try_from(page).ok())
        .map(|(n, p)| n.saturating_mul(p))
        .filter(|&b| b > 0);
    let cgroup = cgroup_memory_limit();
    let mut rl = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit into `rl`, which lives for the call.
    let got = unsafe { libc::getrlimit(libc::RLIMIT_AS, &mut rl) } == 0;
    let address_space = (got && rl.rlim_cur != libc::RLIM_INFINITY)
        .then(|| usize::try_from(rl.rlim_cur).ok())
        .flatten()
        .map(|cap| {
            // /proc/self/statm: the process's size in pages, first.
            let used = std::fs::read_to_string("/proc/self/statm")
                .ok()
                .and_then(|v| v.split_whitespace().next()?.parse::<usize>().ok())
                .zip(usize::try_from(page).ok())
                .map_or(0, |(n, p)| n.saturating_mul(p));
            cap.saturating_sub(used)
        });
    [physical, cgroup, address_space]
        .into_iter()
        .flatten()
        .min()
}

/// The least memory limit of this process's cgroup and its ancestors: cgroup v2's
/// `memory.max` along the path `/proc/self/cgroup` gives (`0::<path>`), or v1's
/// `memory.limit_in_bytes` of its memory controller; `None` where none is set or readable.
#[cfg(target_os = "linux")]
fn cgroup_memory_limit() -> Option<usize> {
    let own = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let read = |file: std::path::PathBuf| {
        std::fs::read_to_string(file)
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
    };
    let mut least: Option<usize> = None;
    for line in own.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        let (root, file) = match controllers {
            "" => ("/sys/fs/cgroup", "memory.max"),
            c if c.split(',').any(|c| c == "memory") => {
                ("/sys/fs/cgroup/memory", "memory.limit_in_bytes")
            }
            _ => continue,
        };
        // The cgroup and each ancestor up to the root (a limit above binds as well); a path
        // outside this namespace's view ("/..") reads nothing.
        let mut dir = std::path::PathBuf::from(root).join(path.trim_start_matches('/'));
        loop {
            if let Some(v) = read(dir.join(file)) {
                least = Some(least.map_or(v, |l| l.min(v)));
            }
            if dir.as_os_str().len() <= root.len() || !dir.pop() {
                break;
            }
        }
    }
    least
}

#[cfg(not(target_os = "linux"))]
fn read_memory_limit() -> Option<usize> {
    None
}

/// The rows per expert a default chunk gives at least, on average.
const ROWS_PER_EXPERT: usize = 256;

/// Tokens per chunk of a long forward unless `MOEQ_CHUNK_TOKENS` says otherwise: as many as
/// keep a chunk's routed output rows (`top_k x hidden` floats per token) within the spares'
/// size limit, but at least `ROWS_PER_EXPERT` rows per expert on average (4096 tokens at
/// Qwen3-30B-A3B's shape, 8192 at DeepSeek-V3's). A chunk reads every weight it touches once,
/// so a call of several chunks reads them again per chunk: with that many rows per expert each
/// weight byte feeds as many multiply-adds, well above what a many-core CPU's memory can
/// supply per byte, and memory stays bounded instead of growing with the prompt.
/// [`plan_chunk`] then keeps the whole scratch of a chunk within the process's memory.
fn default_chunk(top_k: usize, hidden: usize, experts: usize) -> usize {
    let k = top_k.max(1);
    let row_bytes = k.saturating_mul(hidden.max(1)).saturating_mul(4);
    let by_memory = super::spare::MAX_BYTES / row_bytes;
    let by_reuse = ROWS_PER_EXPERT.saturating_mul(experts) / k;
    by_memory.max(by_reuse).max(1)
}

/// The chunk a `MOEQ_CHUNK_TOKENS` value asks for (0: none), or None for a value that is not a
/// count (then the default applies, as for `MOEQ_NUM_THREADS`); a count too large for `usize`
/// asks for no splitting.
fn requested_chunk(value: &str) -> Option<usize> {
    match value.trim().parse::<usize>() {
        Ok(n) => Some(n),
        Err(e) if *e.kind() == std::num::IntErrorKind::PosOverflow => Some(0),
        Err(_) => None,
    }
}

/// `f` over `tokens` in ranges of `chunk`, its `[len, h]` results stacked into one `[tokens, h]`
/// output; a call of one chunk returns `f`'s result as it is.
fn in_chunks(
    tokens: usize,
    chunk: usize,
    h: usize,
    mut f: impl FnMut(std::ops::Range<usize>) -> Vec<f32>,
) -> Vec<f32> {
    let chunk = chunk.max(1);
    if tokens <= chunk {
        return f(0..tokens);
    }
    let mut out = super::spare::take_any(tokens * h, 0f32);
    let mut start = 0;
    while start < tokens {
        let end = tokens.min(start.saturating_add(chunk));
        let part = f(start..end);
        out[start * h..end * h].copy_from_slice(&part);
        super::spare::give(part);
        start = end;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::build::{from_raw, RawProj, RawScheme, SampleCodes};

    /// A layer of `e` experts with sample codes and scales (group 64 where `group > 0`).
    fn sample_layer(
        scheme: RawScheme,
        e: usize,
        h: usize,
        i: usize,
        group: i64,
        k: usize,
    ) -> CpuMoe {
        sample_layer_with(scheme, (e, h, i), group, k, false)
    }

    /// [`sample_layer`], its scales rounded to bf16 values where `bf16_scales` (as a
    /// checkpoint's are: weight-only layers then widen into dequantised bf16 weights).
    fn sample_layer_with(
        scheme: RawScheme,
        (e, h, i): (usize, usize, usize),
        group: i64,
        k: usize,
        bf16_scales: bool,
    ) -> CpuMoe {
        let g13 = if group > 0 { h / 64 } else { 1 };
        let g2 = if group > 0 { i / 64 } else { 1 };
        let round = |v: f32| {
            if bf16_scales {
                f32::from_bits(v.to_bits() & 0xffff_0000)
            } else {
                v
            }
        };
        let s13: Vec<f32> = (0..e * 2 * i * g13)
            .map(|v| round(1e-3 * (1 + v % 5) as f32))
            .collect();
        let s2: Vec<f32> = (0..e * h * g2)
            .map(|v| round(1e-3 * (1 + v % 7) as f32))
            .collect();
        let codes = SampleCodes::new(scheme == RawScheme::W4a16, e, h, i);
        let (a, b) = codes.raw();
        let proj = |w, s| RawProj {
            weights: w,
            scales: s,
            zero_points: None,
            act_scales: None,
        };
        from_raw(scheme, e, h, i, group, proj(a, &s13), proj(b, &s2), k, true)
            .expect("a valid layer")
    }

    /// One-row experts run whole with their parts offered to the pool (gate beside up, down
    /// split at a panel boundary that leaves unequal halves): equal, bit for bit, to each
    /// projection run on its own; and one token routed to all of them equals those outputs
    /// summed in expert order.
    #[test]
    fn one_row_experts_equal_their_projections() {
        let (e, h, i, k) = (48usize, 192usize, 128usize, 40usize);
        for scheme in [RawScheme::W8a8Dynamic, RawScheme::W4a16] {
            let group = if scheme == RawScheme::W4a16 { 64 } else { -1 };
            let moe = sample_layer(scheme, e, h, i, group, k);
            let x: Vec<f32> = (0..h)
                .map(|v| ((v * 37) % 101) as f32 / 25.0 - 2.0)
                .collect();
            // Experts in a shuffled order, weights all different.
            let ids: Vec<u32> = (0..k).map(|j| ((j * 7 + 3) % e) as u32).collect();
            let weights: Vec<f32> = (0..k).map(|j| 0.01 + j as f32 / 100.0).collect();
            let routed = Routed {
                top_k: k,
                ids: ids.clone(),
                weights: weights.clone(),
            };
            let got = moe
                .forward_topk(&x, 1, &routed, Compute::F32)
                .expect("a valid call");
            let mut order: Vec<usize> = (0..k).collect();
            order.sort_by_key(|&j| ids[j]);
            let mut want = vec![0f32; h];
            for j in order {
                let ex = &moe.experts[ids[j] as usize];
                let gate = ex.gate.as_ref().expect("gated experts");
                let mut hid = ex.up.forward(&x, 1, false);
                kernels::silu_mul(Some(&gate.forward(&x, 1, false)), &mut hid);
                let y = ex.down.forward(&hid, 1, false);
                // The expert alone, whole, its parts offered to the pool.
                let job = Job {
                    ex,
                    x: &x,
                    rows: None,
                    m: 1,
                    compute: Compute::F32,
                    pre: None,
                };
                let mut whole = vec![f32::NAN; h];
                crate::cpu::in_pool(|| job.forward_whole(&mut whole, true));
                assert_eq!(
                    whole.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    y.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    "{scheme:?} expert {}",
                    ids[j]
                );
                for (o, v) in want.iter_mut().zip(&y) {
                    *o += weights[j] * v;
                }
            }
            assert!(want.iter().any(|v| *v != 0.0));
            assert_eq!(
                got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "{scheme:?}"
            );
        }
    }

    /// A long call split into chunks equals the call whole, bit for bit, for dynamic W8A8
    /// (each token's activations are quantised on their own, and each token's sum runs over
    /// its experts in the same order whatever the chunk); every row is written.
    #[test]
    fn chunked_calls_equal_the_call_whole() {
        let (e, h, i, k, tokens) = (6usize, 64usize, 32usize, 2usize, 23usize);
        let moe = sample_layer(RawScheme::W8a8Dynamic, e, h, i, -1, k);
        let x: Vec<f32> = (0..tokens * h)
            .map(|v| ((v * 37) % 101) as f32 / 25.0 - 2.0)
            .collect();
        let ids: Vec<u32> = (0..tokens * k)
            .map(|j| ((j * 5 + j / 3) % e) as u32)
            .collect();
        let weights: Vec<f32> = (0..tokens * k)
            .map(|j| 0.1 + (j % 9) as f32 / 10.0)
            .collect();
        let sum = |at: std::ops::Range<usize>| {
            moe.routed_sum(
                &x[at.start * h..at.end * h],
                at.len(),
                &ids[at.start * k..at.end * k],
                &weights[at.start * k..at.end * k],
                k,
                Compute::F32,
            )
        };
        let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        let whole = crate::cpu::in_pool(|| in_chunks(tokens, tokens, h, sum));
        assert_eq!(whole.len(), tokens * h);
        assert!(whole.iter().all(|v| v.is_finite()) && whole.iter().any(|v| *v != 0.0));
        for chunk in [1, 3, 7, 22] {
            let mut calls = 0;
            let got = crate::cpu::in_pool(|| {
                in_chunks(tokens, chunk, h, |at| {
                    calls += 1;
                    sum(at)
                })
            });
            assert_eq!(calls, tokens.div_ceil(chunk), "chunk {chunk}");
            assert_eq!(bits(&got), bits(&whole), "chunk {chunk}");
        }
    }

    /// The summed path (down projections in column panels, each token's terms added as its
    /// experts come) equals the buffered path bit for bit: dynamic W8A8, W8A16 and W4A16
    /// (channelwise with 336 outputs, 21 blocks, so a last panel of one block; grouped with
    /// 320), fp32 and bf16 inputs, bf16-valued scales, panels that divide the outputs and
    /// ones that do not. The routing is uneven: one expert takes 60 rows (the AMX tiles and,
    /// for bf16 inputs, the dequantised bf16 weights, from 32), one a single row, one six
    /// (the fixed-point rows), one none; a token goes to one expert twice, and every other
    /// token names its experts in falling order. Stale NaN values wait in the calling
    /// thread's spares before each call (the full poisoning, `MOEQ_POISON_SCRATCH=1`, is
    /// the Python tests').
    #[test]
    fn summed_path_equals_the_buffered_path() {
        let (e, k, tokens) = (8usize, 3usize, 90usize);
        let mut ids: Vec<u32> = Vec::with_capacity(tokens * k);
        for t in 0..tokens {
            let a = if t < 60 { 0 } else { 3 + (t % 2) as u32 };
            let b = match t {
                0 => 1,
                1..=5 => 2,
                _ => 5,
            };
            let c = if t == 1 { 2 } else { 6 };
            if t % 2 == 0 {
                ids.extend([c, b, a]);
            } else {
                ids.extend([a, b, c]);
            }
        }
        let weights: Vec<f32> = (0..tokens * k)
            .map(|j| 0.1 + (j % 9) as f32 / 10.0)
            .collect();
        let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        for (scheme, group, h) in [
            (RawScheme::W8a8Dynamic, -1, 336usize),
            (RawScheme::W8a16, -1, 336),
            (RawScheme::W4a16, -1, 336),
            (RawScheme::W8a16, 64, 320),
            (RawScheme::W4a16, 64, 320),
        ] {
            let moe = sample_layer_with(scheme, (e, h, 128), group, k, true);
            // bf16 values, so that both input kinds read the same numbers.
            let x: Vec<f32> = (0..tokens * h)
                .map(|v| ((v * 37) % 41) as f32 / 8.0 - 2.5)
                .collect();
            for compute in [Compute::F32, Compute::Bf16] {
                let run = |path: SumPath| {
                    crate::cpu::in_pool(|| {
                        crate::cpu::spare::give(vec![f32::NAN; tokens * h]);
                        moe.routed_sum_by(&x, tokens, (&ids, &weights, k), compute, path)
                    })
                };
                let want = run(SumPath::Buffered);
                assert_eq!(want.len(), tokens * h);
                assert!(want.iter().all(|v| v.is_finite()) && want.iter().any(|v| *v != 0.0));
                for width in [64, 128, 192, 320] {
                    let got = run(SumPath::Summed(width));
                    let case = format!("{scheme:?} group {group} {compute:?} width {width}");
                    assert_eq!(bits(&got), bits(&want), "{case}");
                }
            }
        }
    }

    /// Which calls [`summed_width`] sums in panels: the prefill shapes whose routed outputs
    /// leave the cache and whose down inputs are small beside them.
    #[test]
    fn summed_widths() {
        // (hidden, inter, value bytes, panel); rows = T x top_k at T = 1024.
        let qwen3 = |bytes| (2048, 768, bytes, 64);
        let dsv2 = |bytes| (2048, 1408, bytes, 64);
        assert_eq!(summed_width(qwen3(1), 8192, 2), Some(512));
        assert_eq!(summed_width(dsv2(1), 6144, 2), Some(512));
        assert_eq!(summed_width(qwen3(2), 8192, 2), Some(512));
        // Mixtral (its down inputs as large as the buffer), wider inputs, more tasks, a
        // buffer that stays in cache (T = 32), one panel: buffered.
        assert_eq!(summed_width((4096, 14336, 1, 64), 2048, 2), None);
        assert_eq!(summed_width(dsv2(2), 6144, 2), None);
        assert_eq!(summed_width(qwen3(4), 8192, 2), None);
        assert_eq!(summed_width(qwen3(1), 8192, 16), None);
        assert_eq!(summed_width(qwen3(1), 256, 2), None);
        assert_eq!(summed_width((64, 8, 1, 64), 1 << 20, 2), None);
    }

    #[test]
    fn default_chunks() {
        // Qwen3-30B-A3B, DeepSeek-V2-Lite, Mixtral: the 256 MiB bound; DeepSeek-V3: 256 rows
        // per expert.
        assert_eq!(default_chunk(8, 2048, 128), 4096);
        assert_eq!(default_chunk(6, 2048, 64), 5461);
        assert_eq!(default_chunk(2, 4096, 8), 8192);
        assert_eq!(default_chunk(8, 7168, 256), 8192);
        assert_eq!(default_chunk(0, 0, 0), (256 << 20) / 4);
        assert_eq!(default_chunk(usize::MAX, usize::MAX, usize::MAX), 1);
    }

    #[test]
    fn chunks_keep_their_scratch_within_the_memory_limit() {
        let gib = 1usize << 30;
        // No limit known: the default as it is.
        assert_eq!(plan_chunk(10_000, 1 << 20, None, 4096, None), Ok(4096));
        // A default chunk whose scratch would pass a quarter of the limit is cut to it.
        assert_eq!(
            plan_chunk(10_000, 1 << 20, None, 4096, Some(4 * gib)),
            Ok(1024)
        );
        assert_eq!(
            plan_chunk(10_000, 1 << 10, None, 4096, Some(4 * gib)),
            Ok(4096)
        );
        // A cap is taken down to a multiple of 256 tokens (1000 -> 768), unless below 256.
        assert_eq!(
            plan_chunk(10_000, 1 << 20, None, 4096, Some(4000 << 20)),
            Ok(768)
        );
        assert_eq!(
            plan_chunk(10_000, 1 << 20, None, 4096, Some(800 << 20)),
            Ok(200)
        );
        // Between a quarter of the limit and all of it for one token: a token per chunk.
        assert_eq!(plan_chunk(3, 2 * gib, None, 4096, Some(4 * gib)), Ok(1));
        // One token needing more than the limit: refused with what it needs.
        assert_eq!(
            plan_chunk(1, 5 * gib, None, 4096, Some(4 * gib)),
            Err(5 * gib)
        );
        assert_eq!(
            plan_chunk(0, 5 * gib, None, 4096, Some(4 * gib)),
            Err(5 * gib)
        );
        // A requested chunk is kept, unless the call's chunk would pass the limit.
        let asked = |tokens, n| plan_chunk(tokens, 1 << 20, Some(n), 4096, Some(4 * gib));
        assert_eq!(asked(10_000, 2048), Ok(2048));
        assert_eq!(asked(100, usize::MAX), Ok(usize::MAX));
        assert_eq!(asked(10_000, usize::MAX), Err(10_000 << 20));
        assert_eq!(asked(10_000, 8192), Err(8192 << 20));
        // Sizes that overflow saturate into a refusal, not a wrap.
        assert_eq!(
            plan_chunk(usize::MAX, usize::MAX, None, 4096, Some(gib)),
            Err(usize::MAX)
        );
    }

    #[test]
    fn chunk_sizes_from_the_environment() {
        assert_eq!(requested_chunk("4096"), Some(4096));
        assert_eq!(requested_chunk(" 0\n"), Some(0));
        assert_eq!(requested_chunk("99999999999999999999"), Some(0));
        for not_a_count in ["-1", "2.5", "abc", ""] {
            assert_eq!(requested_chunk(not_a_count), None, "{not_a_count:?}");
        }
    }
}
