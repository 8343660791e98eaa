//! The config oracle: for each MoE layer, which method, scale kind, quant config and backend, or
//! why not. Pure: plain data in, plain data out, no I/O, no panics.

pub mod backends;
pub mod classify;
pub mod types;
pub mod vllm;

pub use classify::{int8_moe_quant_kind, wna16_scale_kind};
pub use types::*;

/// Plans one MoE layer.
pub fn plan_layer(input: &LayerInput, platform: Platform, opts: Options) -> LayerPlan {
    let mut plan = LayerPlan {
        layer: input.layer,
        method: Method::Unsupported,
        scheme: None,
        scale_kind: None,
        quant_config: None,
        backend: None,
        rejected: Vec::new(),
        error: None,
        experts: None,
    };
    if input.experts.is_empty() {
        plan.error = Some("the layer has no experts".into());
        return plan;
    }
    // One scheme per expert (gate, up and down agree), then one per layer unless mixed.
    let mut schemes = Vec::with_capacity(input.experts.len());
    for (e, x) in input.experts.iter().enumerate() {
        match classify::expert_scheme(x) {
            Ok(s) => schemes.push(s),
            Err(reason) => {
                plan.error = Some(format!("expert {e}: {reason}"));
                return plan;
            }
        }
    }
    let first = schemes.first().copied();
    let uniform = schemes.iter().all(|s| Some(*s) == first);
    if uniform {
        if let Some(s) = first {
            plan.scheme = Some(s.clone());
            plan_uniform(&mut plan, s, input.shape, platform, opts);
        }
        return plan;
    }
    plan_mixed(&mut plan, input, &schemes, platform, opts);
    plan
}

fn method_of(kind: ExpertKind) -> Method {
    match kind {
        ExpertKind::Unquantized => Method::Unquantized,
        ExpertKind::Wna16 { .. } => Method::Wna16,
        ExpertKind::W8a8 { .. } => Method::W8a8Int8,
    }
}

/// Picks a backend for `kind`: the explicit one (or an error naming why it cannot), else the
/// first of the platform's priority list that accepts it. Every other backend is listed with
/// its reason.
fn choose(
    kind: ExpertKind,
    shape: LayerShape,
    platform: Platform,
    opts: Options,
) -> (Option<Backend>, Vec<(Backend, String)>, Option<String>) {
    let mut rejected = Vec::new();
    let mut chosen = None;
    if let Some(b) = opts.backend {
        match backends::check(b, kind, shape, platform, opts) {
            Ok(()) => chosen = Some(b),
            Err(reason) => rejected.push((b, reason)),
        }
    } else {
        for &b in backends::priority(platform, kind) {
            match backends::check(b, kind, shape, platform, opts) {
                Ok(()) if chosen.is_none() => chosen = Some(b),
                Ok(()) => {}
                Err(reason) => rejected.push((b, reason)),
            }
        }
    }
    for b in Backend::ALL {
        if Some(b) != chosen && !rejected.iter().any(|(r, _)| *r == b) {
            let reason = match backends::check(b, kind, shape, platform, opts) {
                Err(reason) => reason,
                Ok(()) => "not selected (another backend was requested or ranks first)".into(),
            };
            rejected.push((b, reason));
        }
    }
    let error = match (chosen, opts.backend) {
        (Some(_), _) => None,
        (None, Some(b)) => {
            let why = rejected
                .iter()
                .find(|(r, _)| *r == b)
                .map_or_else(String::new, |(_, w)| w.clone());
            Some(format!(
                "backend {} was requested but cannot run this layer: {why}",
                b.name()
            ))
        }
        (None, None) => {
            let why: Vec<String> = backends::priority(platform, kind)
                .iter()
                .filter_map(|b| rejected.iter().find(|(r, _)| r == b))
                .map(|(b, w)| format!("{}: {w}", b.name()))
                .collect();
            Some(format!(
                "no {} backend can run this layer ({})",
                platform.name(),
                why.join("; ")
            ))
        }
    };
    (chosen, rejected, error)
}

fn plan_uniform(
    plan: &mut LayerPlan,
    scheme: &ProjScheme,
    shape: LayerShape,
    platform: Platform,
    opts: Options,
) {
    let kind = match classify::classify(scheme) {
        Ok(k) => k,
        Err(reason) => {
            plan.method = Method::Unsupported;
            plan.error = Some(reason);
            return;
        }
    };
    plan.method = method_of(kind);
    let (scale_kind, quant_config) = classify::scale_and_config(kind);
    plan.scale_kind = scale_kind;
    plan.quant_config = quant_config;
    if kind == ExpertKind::Unquantized {
        if let Some(b) = opts.backend {
            plan.error = Some(format!(
                "backend {} was requested but the layer is not quantized",
                b.name()
            ));
        }
        return;
    }
    let (backend, rejected, error) = choose(kind, shape, platform, opts);
    plan.backend = backend;
    plan.rejected = rejected;
    plan.error = error;
}

/// Experts with different schemes in one layer: each expert gets its own plan; the layer runs
/// only on a backend that takes per-expert kernels (cpu_simd).
fn plan_mixed(
    plan: &mut LayerPlan,
    input: &LayerInput,
    schemes: &[&ProjScheme],
    platform: Platform,
    opts: Options,
) {
    plan.method = Method::Mixed;
    let mut experts = Vec::with_capacity(schemes.len());
    for (e, s) in schemes.iter().enumerate() {
        let mut ep = ExpertPlan {
            expert: e,
            scheme: input
                .experts
                .get(e)
                .cloned()
                .unwrap_or_else(|| ExpertSchemes {
                    gate: None,
                    up: (*s).clone(),
                    down: (*s).clone(),
                }),
            method: Method::Unsupported,
            scale_kind: None,
            quant_config: None,
            backend: None,
            error: None,
        };
        match classify::classify(s) {
            Err(reason) => ep.error = Some(reason),
            Ok(ExpertKind::Unquantized) => {
                ep.method = Method::Unquantized;
                ep.error =
                    Some("an unquantized expert among quantized ones is not supported".into());
            }
            Ok(kind) => {
                ep.method = method_of(kind);
                let (sk, qc) = classify::scale_and_config(kind);
                ep.scale_kind = sk;
                ep.quant_config = qc;
                let (b, _, err) = choose(kind, input.shape, platform, opts);
                ep.backend = b;
                ep.error = err;
            }
        }
        experts.push(ep);
    }
    let failing: Vec<usize> = experts
        .iter()
        .filter(|e| e.error.is_some())
        .map(|e| e.expert)
        .collect();
    let all_cpu = experts.iter().all(|e| e.backend == Some(Backend::CpuSimd));
    if let Some(&e) = failing.first() {
        let reason = experts
            .get(e)
            .and_then(|x| x.error.clone())
            .unwrap_or_default();
        plan.error = Some(format!(
            "per-expert mixed precision: expert {e} cannot run ({reason}){}",
            if failing.len() > 1 {
                format!(" and {} more", failing.len() - 1)
            } else {
                String::new()
            }
        ));
    } else if all_cpu {
        plan.backend = Some(Backend::CpuSimd);
    } else {
        plan.error = Some(
            "per-expert mixed precision runs on cpu_simd only (the CUDA backends take one scheme per layer)"
                .into(),
        );
    }
    for b in Backend::ALL {
        if plan.backend != Some(b) {
            let reason = match b {
                Backend::CpuSimd => match platform {
                    Platform::Cpu(_) => "some experts cannot run on it".to_string(),
                    Platform::Cuda { .. } => "runs on the cpu platform only".to_string(),
                },
                _ => "takes one scheme per layer; per-expert mixed precision needs cpu_simd"
                    .to_string(),
            };
            plan.rejected.push((b, reason));
        }
    }
    plan.experts = Some(experts);
}
