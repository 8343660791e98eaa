//! One quantized linear layer on the CPU, in the numerics of DESIGN.md: weight-only schemes
//! compute in fp32 on the dequantised weights; W8A8 quantises activations to int8 (dynamic per
//! token or static per tensor), accumulates in int32 and rescales in fp32.
//!
//! These are the scalar reference kernels; SIMD kernels (a later step) must match them exactly on
//! the integer accumulators.

use std::borrow::Cow;

use rayon::prelude::*;

use super::kernels;
use super::packed::{PackedI8, BLOCK};
use super::spare::{self, LineBytes};
use super::wo::bf16::Bf16Rows;
use super::wo::fixed::{fixed_dot, FixedRows};
use super::wo::BlockedWo;

/// The arithmetic of weight-only layers. DESIGN.md: fp32 input means fp32 compute. For bf16
/// input the caller may ask for bf16 dot products (see [`super::wo::bf16`]); they are used
/// where the CPU has them and a layer sees enough rows ([`BlockedWo::bf16_min_rows`]:
/// [`super::wo::bf16::NIBBLE_MIN_ROWS`] for 4-bit codes, [`super::wo::bf16::BF16_MIN_ROWS`]
/// for int8), fp32 otherwise.
/// W8A8 layers quantise their input either way.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Compute {
    #[default]
    F32,
    Bf16,
}

/// A linear layer `y = x W^T` with `W` `[n, k]`.
#[derive(Clone, Debug)]
pub enum Linear {
    /// Unquantized weights in fp32.
    Dense { n: usize, k: usize, w: Vec<f32> },
    /// int4/int8 codes with per-(row, group) scales and optional zero points, in 16-feature
    /// blocks ([`BlockedWo`]). Columns are stored in `perm` order (act-order sorted) so every
    /// group is a contiguous run.
    WeightOnly {
        n: usize,
        k: usize,
        w: BlockedWo,
        perm: Option<Vec<u32>>,
    },
    /// int8 weights with per-channel scales, prepacked for the u8 x i8 dot-product kernels;
    /// activations quantised per token (dynamic) or with a static per-tensor `input_scale`.
    Int8 {
        n: usize,
        k: usize,
        w: PackedI8,
        scale: Vec<f32>,
        input_scale: Option<f32>,
    },
}

/// A layer's input in the form its kernels read: fp32 rows (act-order gathered) or int8 rows
/// as `x + 128` with their per-row scales.
pub enum Prepared<'a> {
    F32(Cow<'a, [f32]>),
    /// `xu` starts on a cache line, and so does every row when `k_pad` is a multiple of 64
    /// (AMX's A tiles; see [`LineBytes`]).
    U8 {
        xu: LineBytes,
        sx: Vec<f32>,
    },
    Bf16(Bf16Rows),
    Fixed(FixedRows),
}

impl Prepared<'_> {
    /// Hands the buffers to this thread's spares (see [`super::spare`]) once used.
    pub fn recycle(self) {
        match self {
            Prepared::F32(Cow::Owned(v)) => spare::give(v),
            Prepared::F32(Cow::Borrowed(_)) => {}
            Prepared::U8 { xu, sx } => {
                xu.give();
                spare::give(sx);
            }
            Prepared::Bf16(r) => {
                spare::give(r.x);
                spare::give(r.sums);
            }
            Prepared::Fixed(r) => {
                spare::give(r.planes);
                spare::give(r.comp);
                spare::give(r.unit);
                spare::give(r.sums);
            }
        }
    }

    /// The same input, owning its values.
    pub fn into_owned(self) -> Prepared<'static> {
        match self {
            Prepared::F32(x) => Prepared::F32(Cow::Owned(x.into_owned())),
            Prepared::U8 { xu, sx } => Prepared::U8 { xu, sx },
            Prepared::Bf16(x) => Prepared::Bf16(x),
            Prepared::Fixed(x) => Prepared::Fixed(x),
        }
    }

    /// Rows `rows` of an int8 input prepared for all tokens (see
    /// [`Linear::prepare_int8_all`]), exactly as [`Linear::prepare_rows`] would prepare
    /// them; `None` for other forms or rows out of range.
    pub fn gather(&self, rows: &[usize]) -> Option<Prepared<'static>> {
        let Prepared::U8 { xu, sx } = self else {
            return None;
        };
        let k_pad = xu.len().checked_div(sx.len())?;
        if rows.iter().any(|&t| t >= sx.len()) {
            return None;
        }
        let mut out = LineBytes::take_any(rows.len() * k_pad);
        let mut scales = spare::take_empty(rows.len());
        // (`t < sx.len()`, and `xu` holds `sx.len() * k_pad` bytes or more.)
        for (i, &t) in rows.iter().enumerate() {
            out[i * k_pad..(i + 1) * k_pad].copy_from_slice(&xu[t * k_pad..(t + 1) * k_pad]);
            scales.push(sx[t]);
        }
        Some(Prepared::U8 {
            xu: out,
            sx: scales,
        })
    }
}

/// One row of an int8 layer's input as the u8 operand of the kernels, with its scale: the
/// static `input_scale`, or dynamic per token (`max|x| / 127`).
///
/// A row holding NaN (or, with a dynamic scale, an infinity: `max|x|` is then infinite and
/// `inf / s` NaN) has NaN products in DESIGN.md's arithmetic, so every output of the row is
/// NaN there. The codes cannot carry that (NaN quantises to 0), so the returned scale does: NaN,
/// which the epilogue multiplies into every output of the row. Without it a NaN from an earlier
/// layer would come out as finite numbers, only on the W8A8 path.
fn quantize_row_u8(xr: &[f32], input_scale: Option<f32>, dst: &mut [u8]) -> f32 {
    let s = input_scale.unwrap_or_else(|| kernels::amax(xr) / 127.0);
    let nan = kernels::quantize_u8(xr, s, dst);
    if s.is_finite() && !nan {
        s
    } else {
        f32::NAN
    }
}

/// `q = clamp(rne(x / s), -128, 127)`; `s == 0` gives zeros.
pub fn quantize_row_static(x: &[f32], s: f32, q: &mut [i8]) {
    for (o, &v) in q.iter_mut().zip(x) {
        *o = if s > 0.0 {
            (v / s).round_ties_even().clamp(-128.0, 127.0) as i8
        } else {
            0
        };
    }
}

impl Linear {
    /// An int8 W8A8 layer from row-major `[n, k]` codes (packed here).
    pub fn int8(
        n: usize,
        k: usize,
        q: Vec<i8>,
        scale: Vec<f32>,
        input_scale: Option<f32>,
    ) -> Linear {
        Linear::Int8 {
            n,
            k,
            w: PackedI8::pack(&q, n, k),
            scale,
            input_scale,
        }
    }

    /// A weight-only layer from row-major `[n, k]` codes (columns in group order), `[n, groups]`
    /// scales and zero points, the first column of each group and the act-order column order.
    pub fn weight_only(
        n: usize,
        k: usize,
        q: &[i8],
        zp: Option<&[i8]>,
        scale: &[f32],
        group_starts: Vec<usize>,
        perm: Option<Vec<u32>>,
    ) -> Linear {
        Linear::WeightOnly {
            n,
            k,
            w: BlockedWo::new(n, k, q, scale, zp, group_starts),
            perm,
        }
    }

    pub fn out_features(&self) -> usize {
        match self {
            Linear::Dense { n, .. } | Linear::WeightOnly { n, .. } | Linear::Int8 { n, .. } => *n,
        }
    }
    pub fn in_features(&self) -> usize {
        match self {
            Linear::Dense { k, .. } | Linear::WeightOnly { k, .. } | Linear::Int8 { k, .. } => *k,
        }
    }

    /// Output features per unit of work: the register tile width of the packed int8 kernel,
    /// a few cache lines of rows otherwise.
    pub fn panel(&self) -> usize {
        match self {
            Linear::Int8 { .. } | Linear::WeightOnly { .. } => super::packed::TILE_BLOCKS * BLOCK,
            Linear::Dense { .. } => 16,
        }
    }

    /// `x[m, k]` (row-major f32) in the form [`Linear::forward_cols`] reads.
    pub fn prepare<'a>(&self, x: &'a [f32], m: usize, compute: Compute) -> Prepared<'a> {
        self.prepare_rows(x, m, None, compute)
    }

    /// As [`Linear::prepare`] for the rows `rows` of `x` (all `m` rows when `None`): experts
    /// read their tokens straight from the layer input, with no gathered copy.
    pub fn prepare_rows<'a>(
        &self,
        x: &'a [f32],
        m: usize,
        rows: Option<&[usize]>,
        compute: Compute,
    ) -> Prepared<'a> {
        let k = self.in_features();
        let row = |r: usize| {
            let t = rows.map_or(r, |rs| rs[r]);
            &x[t * k..(t + 1) * k]
        };
        if let Linear::WeightOnly { w, perm, .. } = self {
            // Few rows (decode): the codes on int8 dot products, inputs in fixed point.
            if compute == Compute::Bf16 && m <= w.fixed_max_rows() && fixed_dot() {
                if let Some(rows) = w.fixed_rows_from(m, row, perm.as_deref()) {
                    return Prepared::Fixed(rows);
                }
            }
            if compute == Compute::Bf16 && m >= w.bf16_min_rows() && kernels::bf16_dot() {
                return Prepared::Bf16(w.bf16_rows_from(m, |r| Some(row(r)), perm.as_deref()));
            }
        }
        let xs = match self {
            Linear::Dense { .. } | Linear::WeightOnly { perm: None, .. } => match rows {
                None => Cow::Borrowed(&x[..m * k]),
                Some(_) => {
                    let mut v = spare::take_empty(m * k);
                    for r in 0..m {
                        v.extend_from_slice(row(r));
                    }
                    Cow::Owned(v)
                }
            },
            // Act-order: gather x into the sorted column order once.
            Linear::WeightOnly { perm: Some(p), .. } => {
                let mut v = spare::take_empty(m * p.len());
                for r in 0..m {
                    let xr = row(r);
                    v.extend(p.iter().map(|&c| xr[c as usize]));
                }
                Cow::Owned(v)
            }
            Linear::Int8 { w, input_scale, .. } => {
                let mut xu = LineBytes::take(m * w.k_pad, 128);
                let mut sx = spare::take(m, 0f32);
                for (r, s) in sx.iter_mut().enumerate() {
                    let dst = &mut xu[r * w.k_pad..r * w.k_pad + k];
                    *s = quantize_row_u8(row(r), *input_scale, dst);
                }
                return Prepared::U8 { xu, sx };
            }
        };
        Prepared::F32(xs)
    }

    /// An int8 layer's input for all `m` rows of `x`, quantised in parallel: experts whose
    /// projections take the same input ([`Linear::same_input`]) then copy their tokens' rows
    /// ([`Prepared::gather`]) instead of quantising each token once per expert. `None` for
    /// other layers.
    pub fn prepare_int8_all(&self, x: &[f32], m: usize) -> Option<Prepared<'static>> {
        let Linear::Int8 {
            w, input_scale, k, ..
        } = self
        else {
            return None;
        };
        let (k, k_pad) = (*k, w.k_pad);
        if x.len() < m * k {
            return None;
        }
        let mut xu = LineBytes::take(m * k_pad, 128);
        let mut sx = spare::take(m, 0f32);
        xu.par_chunks_mut(k_pad.max(1))
            .zip(sx.par_iter_mut())
            .enumerate()
            .with_min_len(16)
            .for_each(|(r, (dst, s))| {
                *s = quantize_row_u8(&x[r * k..(r + 1) * k], *input_scale, &mut dst[..k]);
            });
        Some(Prepared::U8 { xu, sx })
    }

    /// Output features `first..first + count` for all `m` rows into a strided view:
    /// `out[r * rs + (j - first) * cs] = y[r, j]` (feature-major is `rs = 1, cs = m`, row-major
    /// `rs = n, cs = 1`). `first` is a multiple of [`Linear::panel`].
    #[allow(clippy::too_many_arguments)]
    pub fn forward_cols(
        &self,
        x: &Prepared<'_>,
        m: usize,
        first: usize,
        count: usize,
        out: &mut [f32],
        rs: usize,
        cs: usize,
    ) {
        if m == 0 {
            return;
        }
        let k = self.in_features();
        let at = |r: usize, j: usize| r * rs + (j - first) * cs;
        match (self, x) {
            (Linear::Dense { w, .. }, Prepared::F32(x)) => {
                for j in first..first + count {
                    let wr = &w[j * k..(j + 1) * k];
                    for r in 0..m {
                        out[at(r, j)] = kernels::dot_f32(wr, &x[r * k..(r + 1) * k]);
                    }
                }
            }
            (Linear::WeightOnly { w, .. }, Prepared::F32(xs)) => {
                let end = first + count;
                w.gemm(
                    xs,
                    m,
                    first / super::wo::BLOCK,
                    count.div_ceil(super::wo::BLOCK),
                    |r, b, lanes| emit_block(out, at, r, b, lanes, first, end, cs),
                );
            }
            (Linear::WeightOnly { w, .. }, Prepared::Bf16(xb)) => {
                let end = first + count;
                w.gemm_bf16(
                    xb,
                    m,
                    first / super::wo::BLOCK,
                    count.div_ceil(super::wo::BLOCK),
                    |r, b, lanes| emit_block(out, at, r, b, lanes, first, end, cs),
                );
            }
            (Linear::WeightOnly { w, .. }, Prepared::Fixed(xf)) if w.fixed_reads(xf) => {
                let end = first + count;
                w.gemm_fixed(
                    xf,
                    first / super::wo::BLOCK,
                    count.div_ceil(super::wo::BLOCK),
                    |r, b, lanes| emit_block(out, at, r, b, lanes, first, end, cs),
                );
            }
            (Linear::Int8 { w, scale, .. }, Prepared::U8 { xu, sx }) => {
                let end = first + count;
                // Whole blocks into rows: the epilogue writes `out` itself.
                if cs == 1
                    && first.is_multiple_of(BLOCK)
                    && count.is_multiple_of(BLOCK)
                    && w.gemm_scaled_rows(
                        (xu, m, sx),
                        scale,
                        first / BLOCK,
                        count / BLOCK,
                        (out, rs, first),
                    )
                {
                    return;
                }
                w.gemm_scaled(
                    xu,
                    m,
                    sx,
                    scale,
                    first / BLOCK,
                    count.div_ceil(BLOCK),
                    |r, b, lanes| emit_block(out, at, r, b, lanes, first, end, cs),
                );
            }
            // `prepare` of the same layer always gives the matching form.
            _ => out.fill(f32::NAN),
        }
    }

    /// `y[m, n]` for `x[m, k]` (row-major f32). Work is split over output features, so each
    /// weight byte is read once per call whatever the number of tokens; `parallel` uses the
    /// thread pool.
    pub fn forward(&self, x: &[f32], m: usize, parallel: bool) -> Vec<f32> {
        let n = self.out_features();
        let mut yt = vec![0f32; m * n];
        if m == 0 {
            return yt;
        }
        let prepared = self.prepare(x, m, Compute::F32);
        if !parallel {
            self.forward_cols(&prepared, m, 0, n, &mut yt, n, 1);
            return yt;
        }
        let panel = self.panel();
        let run = |(p, out): (usize, &mut [f32])| {
            let count = out.len() / m;
            self.forward_cols(&prepared, m, p * panel, count, out, 1, m)
        };
        yt.par_chunks_mut(panel * m).enumerate().for_each(run);
        transpose(&yt, n, m)
    }

    /// Whether `other` reads the same prepared input as `self` (gate and up share one).
    pub fn same_input(&self, other: &Linear) -> bool {
        self.in_features() == other.in_features()
            && match (self, other) {
                (Linear::Dense { .. }, Linear::Dense { .. }) => true,
                // bf16 rows are padded per group and carry group sums: same groups too, and the
                // same row count from which each takes them.
                (
                    Linear::WeightOnly { perm: a, w: wa, .. },
                    Linear::WeightOnly { perm: b, w: wb, .. },
                ) => {
                    a == b
                        && wa.group_starts() == wb.group_starts()
                        && wa.bf16_min_rows() == wb.bf16_min_rows()
                        // Same groups and layout give the same fixed-point row limit too.
                        && wa.fixed_layout() == wb.fixed_layout()
                }
                (Linear::Int8 { input_scale: a, .. }, Linear::Int8 { input_scale: b, .. }) => {
                    a.map(f32::to_bits) == b.map(f32::to_bits)
                }
                _ => false,
            }
    }
}

/// Writes a weight-only block's lanes for row `r` (features `first..end` only): a contiguous
/// copy when the output is row-major and the block lies inside.
#[allow(clippy::too_many_arguments)]
#[inline]
fn emit_block(
    out: &mut [f32],
    at: impl Fn(usize, usize) -> usize,
    r: usize,
    b: usize,
    lanes: &[f32; super::wo::BLOCK],
    first: usize,
    end: usize,
    cs: usize,
) {
    let j0 = b * super::wo::BLOCK;
    if cs == 1 && j0 >= first && j0 + super::wo::BLOCK <= end {
        let start = at(r, j0);
        out[start..start + super::wo::BLOCK].copy_from_slice(lanes);
        return;
    }
    for (l, &v) in lanes.iter().enumerate() {
        let j = j0 + l;
        if j >= first && j < end {
            out[at(r, j)] = v;
        }
    }
}

/// `[n, m]` -> `[m, n]`.
pub fn transpose(yt: &[f32], n: usize, m: usize) -> Vec<f32> {
    if m == 1 {
        return yt.to_vec();
    }
    let mut y = vec![0f32; m * n];
    transpose_into(yt, n, m, &mut y);
    y
}

/// Output rows per task of [`transpose_into`].
const TRANSPOSE_ROWS: usize = 8;

/// `yt` (`[n, m]`) transposed into `y` (`[m, n]`) in tasks of 8 output rows spread over the
/// pool: each source column gives 8 contiguous values, written to the 8 rows' lines, which stay
/// in L1. A plain element loop, run on the calling thread, was a third of Mixtral's T=1024
/// forward on 16 threads (66 of 221 ms for the output; the down projection's input another
/// large part), where fewer experts than threads take the panel path.
pub fn transpose_into(yt: &[f32], n: usize, m: usize, y: &mut [f32]) {
    let (yt, y) = (&yt[..n * m], &mut y[..n * m]);
    if n == 0 || m == 0 {
        return;
    }
    y.par_chunks_mut(n * TRANSPOSE_ROWS)
        .enumerate()
        .for_each(|(c, out)| {
            let r0 = c * TRANSPOSE_ROWS;
            let rows = out.len() / n;
            for j in 0..n {
                let src = &yt[j * m + r0..j * m + r0 + rows];
                for (rr, &v) in src.iter().enumerate() {
                    out[rr * n + j] = v;
                }
            }
        });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The blocked, parallel transpose equals the element loop on sizes off its blocks.
    #[test]
    fn transpose_equals_the_element_loop() {
        for (n, m) in [(1, 1), (3, 2), (65, 9), (130, 17), (64, 8), (7, 300)] {
            let yt: Vec<f32> = (0..n * m).map(|v| v as f32 * 0.5 - 3.0).collect();
            let mut want = vec![0f32; n * m];
            for j in 0..n {
                for r in 0..m {
                    want[r * n + j] = yt[j * m + r];
                }
            }
            let mut got = vec![f32::NAN; n * m];
            transpose_into(&yt, n, m, &mut got);
            assert_eq!(got, want, "n={n} m={m}");
            if m > 1 {
                assert_eq!(transpose(&yt, n, m), want);
            }
        }
    }

    /// Every int8 input form starts on a cache line, so with a reduction of whole 64-byte steps
    /// (AMX's) every row does; the padding past `k` is the zero code (128), and the gathered
    /// rows are the rows prepared per expert, bit for bit.
    #[test]
    fn int8_rows_start_on_cache_lines() {
        let (n, k, m) = (32, 190, 9);
        let q: Vec<i8> = (0..n * k).map(|i| (i * 37 % 251) as i8).collect();
        let lin = Linear::int8(n, k, q, vec![1e-3; n], None);
        let x: Vec<f32> = (0..m * k).map(|v| ((v * 7) % 23) as f32 - 11.0).collect();
        let rows = [7usize, 0, 3, 3];
        let on_lines = |p: &Prepared<'_>| -> (Vec<u8>, Vec<f32>) {
            let Prepared::U8 { xu, sx } = p else {
                panic!("an int8 layer prepares u8 rows");
            };
            let k_pad = xu.len() / sx.len();
            assert_eq!(k_pad, 192);
            assert!(xu
                .chunks(k_pad)
                .all(|r| (r.as_ptr() as usize).is_multiple_of(64) && r[k..] == [128, 128]));
            (xu.to_vec(), sx.clone())
        };
        let all = lin.prepare_int8_all(&x, m).expect("an int8 layer");
        let gathered = on_lines(&all.gather(&rows).expect("rows in range"));
        let direct = on_lines(&lin.prepare_rows(&x, rows.len(), Some(&rows), Compute::F32));
        assert_eq!(gathered, direct);
        on_lines(&all);
        assert!(all.gather(&[m]).is_none(), "a row past the input");
    }

    /// Weight-only layers with int8 and with 4-bit storage never share a prepared input: their
    /// fixed-point inputs differ in column order (and would be read wrongly); one handed to the
    /// other gives NaN, not numbers.
    #[test]
    fn int8_and_4bit_layers_do_not_share_inputs() {
        let (n, k) = (32, 256);
        let wide: Vec<i8> = (0..n * k).map(|i| (i * 37 % 251) as i8).collect();
        let narrow: Vec<i8> = (0..n * k).map(|i| (i * 5 % 16) as i8 - 8).collect();
        let scale = vec![0.01f32; n * 2];
        let make = |q: &[i8]| Linear::weight_only(n, k, q, None, &scale, vec![0, 128], None);
        let (a, b) = (make(&wide), make(&narrow));
        assert!(!a.same_input(&b) && !b.same_input(&a));
        assert!(a.same_input(&make(&wide)));
        let x: Vec<f32> = (0..k).map(|i| (i % 13) as f32 * 0.25 - 1.5).collect();
        let p = a.prepare(&x, 1, Compute::Bf16);
        if matches!(p, Prepared::Fixed(_)) {
            let mut out = vec![0f32; n];
            b.forward_cols(&p, 1, 0, n, &mut out, n, 1);
            assert!(out.iter().all(|v| v.is_nan()));
            let mut good = vec![f32::NAN; n];
            a.forward_cols(&p, 1, 0, n, &mut good, n, 1);
            let want = a.forward(&x, 1, false);
            for (g, w) in good.iter().zip(&want) {
                assert!((g - w).abs() <= 1e-2 * w.abs().max(1.0), "{g} {w}");
            }
        }
    }

    /// Gate and up share a prepared input when only their zero points differ: the input a
    /// symmetric layer prepares serves one with zero points exactly as its own does.
    #[test]
    fn a_shared_input_serves_layers_with_and_without_zero_points() {
        let (n, k) = (32, 256);
        let q: Vec<i8> = (0..n * k).map(|i| (i * 37 % 251) as i8).collect();
        let zp: Vec<i8> = (0..n * 2).map(|i| (i * 7 % 9) as i8 - 4).collect();
        let scale = vec![0.01f32; n * 2];
        let sym = Linear::weight_only(n, k, &q, None, &scale, vec![0, 128], None);
        let asym = Linear::weight_only(n, k, &q, Some(&zp), &scale, vec![0, 128], None);
        assert!(sym.same_input(&asym));
        let x: Vec<f32> = (0..2 * k).map(|i| (i % 13) as f32 * 0.25 - 1.5).collect();
        let (shared, own) = (
            sym.prepare(&x, 2, Compute::Bf16),
            asym.prepare(&x, 2, Compute::Bf16),
        );
        let mut a = vec![12345f32; 2 * n];
        let mut b = vec![-1f32; 2 * n];
        asym.forward_cols(&shared, 2, 0, n, &mut a, n, 1);
        asym.forward_cols(&own, 2, 0, n, &mut b, n, 1);
        assert_eq!(a, b);
        assert!(a.iter().all(|v| v.is_finite() && *v != 12345.0));
    }

    /// A row's scale carries NaN where DESIGN.md's arithmetic gives the row NaN products: a
    /// NaN anywhere, or an infinity under a dynamic scale (`inf / inf`); under a static scale an
    /// infinity clamps to 127 there and here.
    #[test]
    fn rows_with_nan_products_get_a_nan_scale() {
        let row = |v: [f32; 4], s: Option<f32>| {
            let mut codes = [0u8; 4];
            let scale = quantize_row_u8(&v, s, &mut codes);
            (scale, codes)
        };
        let (nan, inf) = (f32::NAN, f32::INFINITY);
        assert_eq!(row([1.0, -2.0, 0.5, 0.0], None).0, 2.0 / 127.0);
        assert_eq!(row([0.0; 4], None), (0.0, [128; 4]));
        assert!(row([1.0, nan, 0.5, 0.0], None).0.is_nan());
        assert!(row([1.0, inf, 0.5, 0.0], None).0.is_nan());
        assert!(row([1.0, -inf, 0.5, 0.0], None).0.is_nan());
        assert!(row([1.0, nan, 0.5, 0.0], Some(0.1)).0.is_nan());
        assert_eq!(
            row([1.0, inf, 0.5, -inf], Some(0.1)),
            (0.1, [138, 255, 133, 0])
        );
        for len in [1usize, 7, 16, 33, 100] {
            for at in 0..len {
                let mut v = vec![0.25f32; len];
                v[at] = nan;
                assert!(kernels::any_nan(&v), "len {len} at {at}");
                v[at] = inf;
                assert!(!kernels::any_nan(&v));
            }
        }
    }
}
