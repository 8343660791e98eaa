//! Building a [`CpuMoe`] from raw stacked tensors (`MoELayer.from_tensors`).

use super::linear::Linear;
use super::load::first_non_finite;
use super::moe::{CpuExpert, CpuMoe};
use crate::error::{LayoutError, Result};
use crate::moe::{Routing, Scoring};

/// Weight storage of `from_tensors`, per scheme.
pub enum RawWeights<'a> {
    /// int8 codes `[E, N, K]` (w8a8_dynamic, w8a8_static, w8a16).
    Int8(&'a [i8]),
    /// int4 codes as compressed-tensors packs them: int32 words `[E, N, K/8]`, each value + 8.
    Int4Packed(&'a [u32]),
}

/// Zero points of `from_tensors` (w4a16 asymmetric).
pub enum RawZeroPoints<'a> {
    /// signed int8 `[E, N, G]`
    Int8(&'a [i8]),
    /// compressed-tensors packing `[E, N/8, G]` int32, each value + 8
    Int4Packed(&'a [u32]),
}

/// Deterministic, varied codes for `e` experts' `[2i, h]` (gate rows, then up) and `[h, i]`
/// projections, int8 or 4-bit packed as compressed-tensors packs them: a layer for examples
/// and tests without a checkpoint.
#[doc(hidden)]
pub enum SampleCodes {
    Int8(Vec<i8>, Vec<i8>),
    Int4Packed(Vec<u32>, Vec<u32>),
}

impl SampleCodes {
    pub fn new(int4: bool, e: usize, h: usize, i: usize) -> SampleCodes {
        let (n13, n2) = (e * 2 * i * h, e * h * i);
        if int4 {
            let words = |n: usize, m: u32| (0..n / 8).map(|v| (v as u32).wrapping_mul(m)).collect();
            SampleCodes::Int4Packed(words(n13, 2654435761), words(n2, 40503))
        } else {
            let codes = |n: usize, m: usize| (0..n).map(|v| (v * m % 251) as i8).collect();
            SampleCodes::Int8(codes(n13, 7919), codes(n2, 104729))
        }
    }

    /// The w13 and w2 codes as `from_raw` takes them.
    pub fn raw(&self) -> (RawWeights<'_>, RawWeights<'_>) {
        match self {
            SampleCodes::Int8(a, b) => (RawWeights::Int8(a), RawWeights::Int8(b)),
            SampleCodes::Int4Packed(a, b) => (RawWeights::Int4Packed(a), RawWeights::Int4Packed(b)),
        }
    }
}

pub struct RawProj<'a> {
    pub weights: RawWeights<'a>,
    /// `[E, N, G]` f32
    pub scales: &'a [f32],
    pub zero_points: Option<RawZeroPoints<'a>>,
    /// static activation scale per expert `[E]` (w8a8_static)
    pub act_scales: Option<&'a [f32]>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RawScheme {
    W8a8Dynamic,
    W8a8Static,
    W8a16,
    W4a16,
}

fn err(arg: &str, reason: String) -> crate::error::Error {
    LayoutError {
        subject: arg.to_string(),
        reason,
    }
    .into()
}

/// The Python name of a projection's static activation scales: `a13_scale` for `w13`.
fn act_arg(arg: &str) -> String {
    format!("a{}_scale", arg.trim_start_matches('w'))
}

/// One expert's projection `[n, k]` from the stacked raw tensors.
#[allow(clippy::too_many_arguments)]
fn proj(
    arg: &str,
    p: &RawProj<'_>,
    scheme: RawScheme,
    experts: usize,
    e: usize,
    rows: std::ops::Range<usize>,
    n_total: usize,
    k: usize,
    group_size: i64,
) -> Result<Linear> {
    let n = rows.len();
    let groups = if group_size > 0 {
        k / group_size as usize
    } else {
        1
    };
    let scale_row = |r: usize| -> &[f32] {
        p.scales
            .get((e * n_total + r) * groups..(e * n_total + r + 1) * groups)
            .unwrap_or(&[])
    };
    let scale: Vec<f32> = rows
        .clone()
        .flat_map(|r| scale_row(r).iter().copied())
        .collect();
    if scale.len() != n * groups {
        return Err(err(
            &format!("{arg}_scale"),
            format!("expected [E={experts}, {n_total}, {groups}] scales"),
        ));
    }
    if let Some((i, x)) = first_non_finite(&scale) {
        return Err(err(
            &format!("{arg}_scale"),
            format!(
                "expert {e}, row {}, group {} is {x}; scales must be finite",
                rows.start + i / groups,
                i % groups
            ),
        ));
    }
    let codes: Vec<i8> = match p.weights {
        RawWeights::Int8(q) => {
            let at = (e * n_total + rows.start) * k;
            q.get(at..at + n * k)
                .ok_or_else(|| err(arg, format!("expected [E={experts}, {n_total}, {k}] int8")))?
                .to_vec()
        }
        RawWeights::Int4Packed(w) => {
            let kw = k / 8;
            let at = (e * n_total + rows.start) * kw;
            let words = w.get(at..at + n * kw).ok_or_else(|| {
                err(
                    arg,
                    format!("expected [E={experts}, {n_total}, {kw}] int32"),
                )
            })?;
            let mut out = Vec::with_capacity(n * k);
            for word in words {
                for j in 0..8 {
                    out.push(((word >> (4 * j)) & 15) as i8 - 8);
                }
            }
            out
        }
    };
    match scheme {
        RawScheme::W8a8Dynamic | RawScheme::W8a8Static => {
            if groups != 1 {
                return Err(err(
                    &format!("{arg}_scale"),
                    "W8A8 needs per-channel scales (group_size=-1)".into(),
                ));
            }
            let input_scale = match (scheme, p.act_scales) {
                (RawScheme::W8a8Static, Some(a)) => {
                    let s = *a.get(e).ok_or_else(|| {
                        err(
                            &act_arg(arg),
                            format!("static activation scales must be [E={experts}]"),
                        )
                    })?;
                    if !s.is_finite() {
                        return Err(err(
                            &act_arg(arg),
                            format!("expert {e} is {s}; scales must be finite"),
                        ));
                    }
                    // Zero has no codes to give and a negative scale flips the expert's input:
                    // refused, as the checkpoint loader does.
                    if s <= 0.0 {
                        return Err(err(
                            &act_arg(arg),
                            format!("expert {e} is {s}; static activation scales must be positive"),
                        ));
                    }
                    Some(s)
                }
                (RawScheme::W8a8Static, None) => {
                    return Err(err(
                        &act_arg(arg),
                        "w8a8_static needs activation scales".into(),
                    ))
                }
                _ => None,
            };
            Ok(Linear::int8(n, k, codes, scale, input_scale))
        }
        RawScheme::W8a16 | RawScheme::W4a16 => {
            let zp = match &p.zero_points {
                None => None,
                Some(RawZeroPoints::Int8(z)) => {
                    let mut out = Vec::with_capacity(n * groups);
                    for r in rows.clone() {
                        let at = (e * n_total + r) * groups;
                        out.extend_from_slice(z.get(at..at + groups).ok_or_else(|| {
                            err(
                                &format!("{arg}_zero_point"),
                                format!("expected [E={experts}, {n_total}, {groups}] int8"),
                            )
                        })?);
                    }
                    Some(out)
                }
                Some(RawZeroPoints::Int4Packed(w)) => {
                    let nw = n_total.div_ceil(8);
                    if w.len() != experts * nw * groups {
                        return Err(err(
                            &format!("{arg}_zero_point"),
                            format!("expected [E={experts}, {nw}, {groups}] int32"),
                        ));
                    }
                    let mut out = Vec::with_capacity(n * groups);
                    for r in rows.clone() {
                        for g in 0..groups {
                            let word = w[(e * nw + r / 8) * groups + g];
                            out.push(((word >> (4 * (r % 8))) & 15) as i8 - 8);
                        }
                    }
                    Some(out)
                }
            };
            let group_starts: Vec<usize> = (0..groups).map(|g| g * (k / groups)).collect();
            Ok(Linear::weight_only(
                n,
                k,
                &codes,
                zp.as_deref(),
                &scale,
                group_starts,
                None,
            ))
        }
    }
}

/// Builds the layer; `hidden`/`intermediate` are H and I (w13 is `[E, 2I, H]`, w2 `[E, H, I]`).
#[allow(clippy::too_many_arguments)]
pub fn from_raw(
    scheme: RawScheme,
    experts: usize,
    hidden: usize,
    intermediate: usize,
    group_size: i64,
    w13: RawProj<'_>,
    w2: RawProj<'_>,
    top_k: usize,
    renormalize: bool,
) -> Result<CpuMoe> {
    if experts == 0 || hidden == 0 || intermediate == 0 {
        return Err(err(
            "w13",
            "experts, hidden and intermediate sizes must be positive".into(),
        ));
    }
    if top_k == 0 || top_k > experts {
        return Err(err(
            "top_k",
            format!("must be between 1 and the number of experts ({experts})"),
        ));
    }
    if group_size != -1
        && (group_size <= 0
            || !hidden.is_multiple_of(group_size as usize)
            || !intermediate.is_multiple_of(group_size as usize))
    {
        return Err(err(
            "group_size",
            format!(
                "{group_size} must be -1 or divide hidden={hidden} and intermediate={intermediate}"
            ),
        ));
    }
    if matches!(scheme, RawScheme::W4a16)
        && (!hidden.is_multiple_of(8) || !intermediate.is_multiple_of(8))
    {
        return Err(err(
            "w13",
            "int4 packing needs hidden and intermediate multiples of 8".into(),
        ));
    }
    // The stored values must be what the sizes say, checked before any loop runs over the
    // sizes: the sizes of a direct native call need not come from the arrays (2^62 rows
    // looped for hours, `2 * intermediate` wrapped).
    let stored = |w: &RawWeights<'_>| match w {
        RawWeights::Int8(q) => Some(q.len()),
        RawWeights::Int4Packed(p) => p.len().checked_mul(8),
    };
    for (arg, w, n, k) in [
        ("w13", &w13.weights, intermediate.checked_mul(2), hidden),
        ("w2", &w2.weights, Some(hidden), intermediate),
    ] {
        let want = n
            .and_then(|n| n.checked_mul(experts))
            .and_then(|v| v.checked_mul(k));
        let have = stored(w);
        if want.is_none() || want != have {
            return Err(err(
                arg,
                format!(
                    "holds {} values, not the {} that E={experts}, H={hidden}, I={intermediate} \
                     make",
                    have.map_or("too many".into(), |v| v.to_string()),
                    want.map_or("(overflowing)".into(), |v| v.to_string()),
                ),
            ));
        }
    }
    let mut list = Vec::with_capacity(experts);
    for e in 0..experts {
        let gate = proj(
            "w13",
            &w13,
            scheme,
            experts,
            e,
            0..intermediate,
            2 * intermediate,
            hidden,
            group_size,
        )?;
        let up = proj(
            "w13",
            &w13,
            scheme,
            experts,
            e,
            intermediate..2 * intermediate,
            2 * intermediate,
            hidden,
            group_size,
        )?;
        let down = proj(
            "w2",
            &w2,
            scheme,
            experts,
            e,
            0..hidden,
            hidden,
            intermediate,
            group_size,
        )?;
        list.push(CpuExpert {
            gate: Some(gate),
            up,
            down,
        });
    }
    let mut moe = CpuMoe {
        hidden,
        experts: list,
        shared: None,
        shared_gate: None,
        routing: Routing {
            top_k: Some(top_k),
            renormalize,
            scoring: Scoring::Softmax,
            unsupported_scoring: None,
            unsupported_model: None,
            n_group: None,
            topk_group: None,
            routed_scaling_factor: 1.0,
            routed_scaling_key: "routed_scaling_factor",
            logit_softcapping: None,
            weight_on_input: false,
            // from_tensors: the caller chose the routing.
            family_checked: true,
            family_defaults: Vec::new(),
        },
        top_k,
        correction_bias: None,
        widest: Default::default(),
    };
    moe.consolidate();
    Ok(moe)
}
