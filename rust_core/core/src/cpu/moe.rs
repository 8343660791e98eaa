//! The fused MoE forward on the CPU: tokens grouped by expert, GEMM1 (gate|up) with
//! SiLU(gate) * up, GEMM2 (down) with the top-k weights applied, shared experts.

use rayon::prelude::*;

use super::linear::Linear;
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
    /// `down(silu(gate(x)) * up(x))` for `x[m, hidden]`.
    pub fn forward(&self, x: &[f32], m: usize, parallel: bool) -> Vec<f32> {
        let u = self.up.forward(x, m, parallel);
        let h: Vec<f32> = match &self.gate {
            Some(g) => {
                let gv = g.forward(x, m, parallel);
                gv.iter()
                    .zip(&u)
                    .map(|(&a, &b)| a / (1.0 + (-a).exp()) * b)
                    .collect()
            }
            None => u.iter().map(|&a| a / (1.0 + (-a).exp())).collect(),
        };
        self.down.forward(&h, m, parallel)
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
}

fn bad(reason: String) -> crate::error::Error {
    LayoutError {
        subject: "moe forward".into(),
        reason,
    }
    .into()
}

impl CpuMoe {
    /// The weighted sum over the routed experts only: `out[t] = Σ_j w[t, j] * expert[ids[t, j]](x_t)`.
    pub fn forward_topk(&self, x: &[f32], tokens: usize, routed: &Routed) -> Result<Vec<f32>> {
        let h = self.hidden;
        if x.len() != tokens * h {
            return Err(bad(format!(
                "hidden_states has {} values, expected [{tokens}, {h}]",
                x.len()
            )));
        }
        let k = routed.top_k;
        if routed.ids.len() != tokens * k || routed.weights.len() != tokens * k {
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
            return Err(bad(format!(
                "topk_ids[{}, {}] = {bad_id} is not an expert (0..{e_count})",
                i / k.max(1),
                i % k.max(1)
            )));
        }
        // Group (token, slot) pairs by expert.
        let mut by_expert: Vec<Vec<(usize, f32)>> = vec![Vec::new(); e_count];
        for t in 0..tokens {
            for j in 0..k {
                let e = routed.ids[t * k + j] as usize;
                by_expert[e].push((t, routed.weights[t * k + j]));
            }
        }
        // Few experts busy (decode): parallelise inside each expert; many: across experts.
        let parallel_inside =
            by_expert.iter().filter(|r| !r.is_empty()).count() < rayon::current_num_threads() * 2;
        let partial: Vec<(usize, Vec<f32>)> = by_expert
            .par_iter()
            .enumerate()
            .filter(|(_, rows)| !rows.is_empty())
            .map(|(e, rows)| {
                let m = rows.len();
                let mut xe = Vec::with_capacity(m * h);
                for &(t, _) in rows {
                    xe.extend_from_slice(&x[t * h..(t + 1) * h]);
                }
                (e, self.experts[e].forward(&xe, m, parallel_inside))
            })
            .collect();
        // Accumulate in a fixed order (expert, then token) so results are deterministic.
        let mut out = vec![0f32; tokens * h];
        for (e, y) in partial {
            for (r, &(t, w)) in by_expert[e].iter().enumerate() {
                let dst = &mut out[t * h..(t + 1) * h];
                for (o, v) in dst.iter_mut().zip(&y[r * h..(r + 1) * h]) {
                    *o += w * v;
                }
            }
        }
        Ok(out)
    }

    /// Routes with the model's router logits, runs the routed experts (routed scaling included)
    /// and adds the shared experts.
    pub fn forward(&self, x: &[f32], tokens: usize, router_logits: &[f32]) -> Result<Vec<f32>> {
        let e = self.experts.len();
        if router_logits.len() != tokens * e {
            return Err(bad(format!(
                "router_logits has {} values, expected [{tokens}, {e}]",
                router_logits.len()
            )));
        }
        let routed = route(
            router_logits,
            e,
            &self.routing,
            self.top_k,
            self.correction_bias.as_deref(),
            true,
        );
        let mut out = self.forward_topk(x, tokens, &routed)?;
        if let Some(shared) = &self.shared {
            let s = shared.forward(x, tokens, true);
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
        Ok(out)
    }
}
