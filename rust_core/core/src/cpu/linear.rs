//! One quantized linear layer on the CPU, in the numerics of DESIGN.md: weight-only schemes
//! compute in fp32 on the dequantised weights; W8A8 quantises activations to int8 (dynamic per
//! token or static per tensor), accumulates in int32 and rescales in fp32.
//!
//! These are the scalar reference kernels; SIMD kernels (a later step) must match them exactly on
//! the integer accumulators.

use rayon::prelude::*;

use super::kernels;

/// A linear layer `y = x W^T` with `W` `[n, k]`.
#[derive(Clone, Debug)]
pub enum Linear {
    /// Unquantized weights in fp32.
    Dense { n: usize, k: usize, w: Vec<f32> },
    /// int4/int8 codes with per-(row, group) scales and optional zero points. Columns are stored
    /// in `perm` order (act-order sorted) so every group is a contiguous run `group_starts`.
    WeightOnly {
        n: usize,
        k: usize,
        q: Vec<i8>,
        zp: Option<Vec<i8>>,
        scale: Vec<f32>,
        group_starts: Vec<usize>,
        perm: Option<Vec<u32>>,
    },
    /// int8 weights with per-channel scales; activations quantised per token (dynamic) or with a
    /// static per-tensor `input_scale`.
    Int8 {
        n: usize,
        k: usize,
        q: Vec<i8>,
        scale: Vec<f32>,
        input_scale: Option<f32>,
        /// Σ of each weight row: the compensation term of the u8 x i8 VNNI kernels.
        wsum: Vec<i32>,
    },
}

/// Dynamic per-token int8 quantisation: `s = max|x| / 127`, `q = clamp(rne(x / s))`; a zero row
/// gives `q = 0` (and `s = 0`).
pub fn quantize_row_dynamic(x: &[f32], q: &mut [i8]) -> f32 {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let s = amax / 127.0;
    quantize_row_static(x, s, q);
    s
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

/// `Σ a[i] * b[i]` in int32.
pub fn dot_i8(a: &[i8], b: &[i8]) -> i32 {
    a.iter()
        .zip(b)
        .map(|(&x, &y)| i32::from(x) * i32::from(y))
        .sum()
}

impl Linear {
    /// An int8 W8A8 layer; computes the per-row weight sums.
    pub fn int8(
        n: usize,
        k: usize,
        q: Vec<i8>,
        scale: Vec<f32>,
        input_scale: Option<f32>,
    ) -> Linear {
        let wsum = q
            .chunks(k.max(1))
            .take(n)
            .map(|r| r.iter().map(|&v| i32::from(v)).sum())
            .collect();
        Linear::Int8 {
            n,
            k,
            q,
            scale,
            input_scale,
            wsum,
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

    /// `y[m, n]` for `x[m, k]` (row-major f32). Work is split over output features, so each
    /// weight row is read once per call whatever the number of tokens; `parallel` uses the
    /// thread pool.
    pub fn forward(&self, x: &[f32], m: usize, parallel: bool) -> Vec<f32> {
        let (n, k) = (self.out_features(), self.in_features());
        let mut yt = vec![0f32; m * n]; // [n, m]: one contiguous run per output feature
        match self {
            Linear::Dense { w, .. } => {
                for_features(&mut yt, m, parallel, |j, out| {
                    let wr = &w[j * k..(j + 1) * k];
                    for (r, o) in out.iter_mut().enumerate() {
                        *o = kernels::dot_f32(wr, &x[r * k..(r + 1) * k]);
                    }
                });
            }
            Linear::WeightOnly {
                q,
                zp,
                scale,
                group_starts,
                perm,
                ..
            } => {
                let groups = group_starts.len();
                // Act-order: gather x into the sorted column order once; otherwise use x as it is.
                let xs: std::borrow::Cow<'_, [f32]> = match perm {
                    Some(p) => (0..m)
                        .flat_map(|r| p.iter().map(move |&c| x[r * k + c as usize]))
                        .collect::<Vec<f32>>()
                        .into(),
                    None => std::borrow::Cow::Borrowed(&x[..m * k]),
                };
                for_features(&mut yt, m, parallel, |j, out| {
                    let qr = &q[j * k..(j + 1) * k];
                    for (r, o) in out.iter_mut().enumerate() {
                        let xr = &xs[r * k..(r + 1) * k];
                        let mut acc = 0f32;
                        for g in 0..groups {
                            let (a, b) = (
                                group_starts[g],
                                group_starts.get(g + 1).copied().unwrap_or(k),
                            );
                            let z = zp.as_ref().map_or(0f32, |z| f32::from(z[j * groups + g]));
                            acc +=
                                kernels::dot_q_f32(&qr[a..b], &xr[a..b], z) * scale[j * groups + g];
                        }
                        *o = acc;
                    }
                });
            }
            Linear::Int8 {
                q,
                scale,
                input_scale,
                wsum,
                ..
            } => {
                let mut qx = vec![0i8; m * k];
                let mut sx = vec![0f32; m];
                for r in 0..m {
                    let xr = &x[r * k..(r + 1) * k];
                    let qr = &mut qx[r * k..(r + 1) * k];
                    sx[r] = match input_scale {
                        Some(s) => {
                            quantize_row_static(xr, *s, qr);
                            *s
                        }
                        None => quantize_row_dynamic(xr, qr),
                    };
                }
                let qxu: Vec<u8> = qx.iter().map(|&v| (v as u8) ^ 0x80).collect();
                // Four output features at a time: a 4 x 4 (features x tokens) register tile
                // when the CPU has VNNI, so each loaded vector feeds four dot products.
                let quads = n / 4;
                let (head, tail) = yt.split_at_mut(quads * 4 * m);
                let quad = |jq: usize, out: &mut [f32]| {
                    let j0 = 4 * jq;
                    let mut acc: smallvec::SmallVec<[i32; 256]> = smallvec::smallvec![0; 4 * m];
                    kernels::dot_rows4(
                        &qx,
                        &qxu,
                        m,
                        k,
                        &q[j0 * k..(j0 + 4) * k],
                        &wsum[j0..j0 + 4],
                        &mut acc,
                    );
                    for f in 0..4 {
                        for r in 0..m {
                            out[f * m + r] = acc[f * m + r] as f32 * sx[r] * scale[j0 + f];
                        }
                    }
                };
                if parallel {
                    head.par_chunks_mut(4 * m)
                        .with_min_len(4)
                        .enumerate()
                        .for_each(|(jq, out)| quad(jq, out));
                } else {
                    head.chunks_mut(4 * m)
                        .enumerate()
                        .for_each(|(jq, out)| quad(jq, out));
                }
                for (f, out) in tail.chunks_mut(m).enumerate() {
                    let j = quads * 4 + f;
                    let mut acc: smallvec::SmallVec<[i32; 64]> = smallvec::smallvec![0; m];
                    kernels::dot_rows(&qx, &qxu, m, k, &q[j * k..(j + 1) * k], wsum[j], &mut acc);
                    for (r, o) in out.iter_mut().enumerate() {
                        *o = acc[r] as f32 * sx[r] * scale[j];
                    }
                }
            }
        }
        // [n, m] -> [m, n]
        if m == 1 {
            return yt;
        }
        let mut y = vec![0f32; m * n];
        for j in 0..n {
            for r in 0..m {
                y[r * n + j] = yt[j * m + r];
            }
        }
        y
    }
}

/// Calls `f(feature, out)` for each output feature with its `m` outputs, in parallel chunks.
fn for_features(yt: &mut [f32], m: usize, parallel: bool, f: impl Fn(usize, &mut [f32]) + Sync) {
    if m == 0 {
        return;
    }
    if parallel {
        yt.par_chunks_mut(m)
            .with_min_len(16)
            .enumerate()
            .for_each(|(j, out)| f(j, out));
    } else {
        yt.chunks_mut(m).enumerate().for_each(|(j, out)| f(j, out));
    }
}
