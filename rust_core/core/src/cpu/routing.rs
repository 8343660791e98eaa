//! Top-k routing: softmax (Qwen-MoE, Mixtral; with expert groups, DeepSeek-V2) and sigmoid
//! with score-correction bias, expert groups and routed scaling (DeepSeek-V3, Laguna).

use std::borrow::Cow;

use rayon::prelude::*;

use crate::moe::{Routing, Scoring};

/// Routing of `t` tokens: `ids[t * k + j]`, `weights[t * k + j]`.
#[derive(Clone, Debug, PartialEq)]
pub struct Routed {
    pub top_k: usize,
    pub ids: Vec<u32>,
    pub weights: Vec<f32>,
}

/// Indices of the `k` largest values, largest first; ties keep the lower index (like
/// `torch.topk` on CPU for distinct values; ties are measure-zero with real logits). NaN ranks
/// above every number, as in `torch.topk` (and so in vLLM's and transformers' routers): a NaN
/// score is chosen, and its NaN weight makes the token's output NaN rather than vanishing. An
/// insertion into a sorted list of `k`: routing picks a few of many.
fn top_k_indices(values: &[f32], k: usize) -> Vec<usize> {
    // `a` ranks strictly above `b`; the scan goes in index order, so an equal value (or a
    // second NaN) found later never passes an earlier one.
    let above = |a: f32, b: f32| !b.is_nan() && (a.is_nan() || a > b);
    let mut best: Vec<usize> = Vec::with_capacity(k + 1);
    for (i, &v) in values.iter().enumerate() {
        if best.len() == k && best.last().is_none_or(|&l| !above(v, values[l])) {
            continue;
        }
        let at = best
            .iter()
            .position(|&j| above(v, values[j]))
            .unwrap_or(best.len());
        best.insert(at, i);
        best.truncate(k);
    }
    best
}

/// Routes `logits` (`[tokens, experts]`, f32) with the model's routing parameters.
/// `correction_bias` is `[experts]` when the router has one. `apply_scaling` multiplies the
/// weights by the routed scaling factor (what `forward` does; `forward_topk` does not).
pub fn route(
    logits: &[f32],
    experts: usize,
    routing: &Routing,
    top_k: usize,
    correction_bias: Option<&[f32]>,
    apply_scaling: bool,
) -> Routed {
    let tokens = logits.len().checked_div(experts).unwrap_or(0);
    let k = top_k.min(experts);
    let rows: Vec<(Vec<usize>, Vec<f32>)> = logits
        .par_chunks_exact(experts.max(1))
        .take(tokens)
        .map(|row| route_row(row, experts, routing, k, correction_bias, apply_scaling))
        .collect();
    let mut ids = Vec::with_capacity(tokens * k);
    let mut weights = Vec::with_capacity(tokens * k);
    for (chosen, w) in rows {
        ids.extend(chosen.iter().map(|&i| i as u32));
        weights.extend(w);
    }
    Routed {
        top_k: k,
        ids,
        weights,
    }
}

/// One token's experts and weights.
fn route_row(
    row: &[f32],
    experts: usize,
    routing: &Routing,
    k: usize,
    correction_bias: Option<&[f32]>,
    apply_scaling: bool,
) -> (Vec<usize>, Vec<f32>) {
    let capped: Vec<f32> = match routing.logit_softcapping {
        Some(c) if c > 0.0 => row
            .iter()
            .map(|&x| ((x as f64 / c).tanh() * c) as f32)
            .collect(),
        _ => row.to_vec(),
    };
    let scores: Vec<f32> = match routing.scoring {
        Scoring::Softmax => {
            let max = capped.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let exps: Vec<f32> = capped.iter().map(|&x| (x - max).exp()).collect();
            let sum: f32 = exps.iter().sum();
            exps.iter().map(|&e| e / sum).collect()
        }
        Scoring::Sigmoid => capped.iter().map(|&x| 1.0 / (1.0 + (-x).exp())).collect(),
    };
    // Experts are chosen on the scores plus the correction bias, weighted by the scores.
    let bias = correction_bias.filter(|b| b.len() == scores.len());
    let choice: Cow<'_, [f32]> = match bias {
        Some(b) => scores.iter().zip(b).map(|(s, b)| s + b).collect(),
        None => Cow::Borrowed(&scores),
    };
    // Group-limited selection (DeepSeek-V2 softmax, DeepSeek-V3 sigmoid), as vLLM's
    // `grouped_topk`: only the `topk_group` best groups of experts compete, a group scored by
    // its two best biased scores when the router has a bias, else by its best score.
    let masked: Cow<'_, [f32]> = match (routing.n_group, routing.topk_group) {
        (Some(groups), Some(keep)) if groups > 1 && experts.is_multiple_of(groups) => {
            let per = experts / groups;
            let gscore: Vec<f32> = (0..groups)
                .map(|g| {
                    let members = &choice[g * per..(g + 1) * per];
                    let best = top_k_indices(members, if bias.is_some() { 2.min(per) } else { 1 });
                    best.iter().map(|&i| members[i]).sum()
                })
                .collect();
            let kept = top_k_indices(&gscore, keep.min(groups));
            choice
                .iter()
                .enumerate()
                .map(|(e, &c)| {
                    if kept.contains(&(e / per)) {
                        c
                    } else {
                        f32::NEG_INFINITY
                    }
                })
                .collect()
        }
        _ => choice,
    };
    let chosen = top_k_indices(&masked, k);
    let mut w: Vec<f32> = chosen.iter().map(|&i| scores[i]).collect();
    if routing.renormalize {
        let sum: f32 = w.iter().sum();
        let denom = if routing.scoring == Scoring::Sigmoid {
            sum + 1e-20
        } else {
            sum
        };
        if denom > 0.0 {
            for x in &mut w {
                *x /= denom;
            }
        }
    }
    if apply_scaling && routing.routed_scaling_factor != 1.0 {
        for x in &mut w {
            *x *= routing.routed_scaling_factor as f32;
        }
    }
    (chosen, w)
}

#[cfg(test)]
mod tests {
    use super::top_k_indices;

    /// The insertion selection equals a full sort (value descending, then index), ties and
    /// repeated values included; NaN ranks first, as in `torch.topk`.
    #[test]
    fn top_k_equals_full_sort() {
        let mut next = crate::cpu::xorshift(0x1234_5678_u64);
        for case in 0..300 {
            let n = 1 + case % 70;
            let values: Vec<f32> = (0..n)
                .map(|_| match next() % 9 {
                    // Some NaN in every fourth case.
                    8 if case % 4 == 0 => f32::NAN,
                    // Few distinct values, so ties are common.
                    v => (v as f32 - 4.0) * if case % 3 == 0 { 0.5 } else { 1.7 },
                })
                .collect();
            // NaN first, then the numbers descending (none is -0.0), then the index.
            let key = |v: f32| (!v.is_nan(), if v.is_nan() { 0.0 } else { -v });
            for k in [0, 1, 2, 6, 8, n, n + 3] {
                let mut want: Vec<usize> = (0..n).collect();
                want.sort_by(|&a, &b| {
                    let (ka, kb) = (key(values[a]), key(values[b]));
                    ka.0.cmp(&kb.0).then(ka.1.total_cmp(&kb.1)).then(a.cmp(&b))
                });
                want.truncate(k);
                assert_eq!(top_k_indices(&values, k), want, "{values:?} k={k}");
            }
        }
        assert_eq!(
            top_k_indices(&[f32::NAN, 1.0, f32::NEG_INFINITY, 3.0], 3),
            vec![0, 3, 1]
        );
        // torch.topk([1, nan, 2, nan, 5], 3).indices
        assert_eq!(
            top_k_indices(&[1.0, f32::NAN, 2.0, f32::NAN, 5.0], 3),
            vec![1, 3, 4]
        );
    }
}
