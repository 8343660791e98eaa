//! The exact support matrix of each moeq_rs backend.

use super::types::{Backend, ExpertKind, LayerShape, Options, Platform};

/// Minimum CUDA compute capability of our kernels (`mma.sync` bf16/int8 tiles: Ampere).
pub const CUDA_MIN_SM: u32 = 80;
/// Group sizes every weight-only backend accepts (`-1` = channelwise).
pub const WNA16_GROUP_SIZES: [i64; 4] = [-1, 32, 64, 128];
/// K blocking of the CPU kernels and of the CUDA int8 GEMM.
pub const K_BLOCK: usize = 32;
/// Marlin tile constraints.
pub const MARLIN_HIDDEN_MULTIPLE: usize = 128;
pub const MARLIN_MIN_THREAD_N: usize = 64;

/// The CUDA kernels (and the Marlin w13 layout) take gate and up rows: `silu(gate) * up`.
/// vLLM's Marlin has a mode without the gate; ours does not.
fn check_gated(shape: LayerShape) -> Result<(), String> {
    if shape.gated {
        return Ok(());
    }
    Err(
        "non-gated experts (no gate_proj): the CUDA kernels and the Marlin w13 layout take gate \
         and up rows (silu(gate) * up)"
            .into(),
    )
}

/// Why `backend` cannot run `kind` on this layer, or `Ok` when it can.
pub fn check(
    backend: Backend,
    kind: ExpertKind,
    shape: LayerShape,
    platform: Platform,
    opts: Options,
) -> Result<(), String> {
    if kind == ExpertKind::Unquantized {
        return Err("unquantized experts are not an int scheme".into());
    }
    let tp = opts.tp_size.max(1);
    match backend {
        Backend::CpuSimd => {
            if !matches!(platform, Platform::Cpu(_)) {
                return Err("runs on the cpu platform only".into());
            }
            if tp != 1 {
                return Err(format!(
                    "tensor parallelism is not supported (tp_size={tp})"
                ));
            }
            match kind {
                ExpertKind::Wna16 {
                    bits,
                    symmetric,
                    group_size,
                    ..
                } => {
                    if bits == 8 && !symmetric {
                        return Err("asymmetric int8 weights are not supported".into());
                    }
                    check_group(group_size)?;
                    check_k_groups(shape.hidden, shape.intermediate, group_size)?;
                }
                ExpertKind::W8a8 { .. } => {}
                ExpertKind::Unquantized => {}
            }
            check_multiple(
                "hidden",
                shape.hidden,
                K_BLOCK,
                "cpu_simd processes K in blocks of 32",
            )?;
            check_multiple(
                "intermediate",
                shape.intermediate,
                K_BLOCK,
                "cpu_simd processes K in blocks of 32",
            )?;
            Ok(())
        }
        Backend::CudaMarlinWna16 => {
            check_cuda(platform)?;
            check_gated(shape)?;
            let ExpertKind::Wna16 {
                bits,
                group_size,
                symmetric,
                act_order,
            } = kind
            else {
                return Err("weight-only backend: it does not quantize activations (W8A8)".into());
            };
            if bits == 8 && !symmetric {
                return Err(
                    "asymmetric int8 weights are not supported (Marlin has uint8b128 only)".into(),
                );
            }
            check_group(group_size)?;
            let i_pp = per_partition(shape.intermediate, tp)?;
            check_multiple(
                "hidden",
                shape.hidden,
                MARLIN_HIDDEN_MULTIPLE,
                "Marlin never pads hidden",
            )?;
            if group_size > 0 {
                let g = group_size as usize;
                check_multiple(
                    "hidden",
                    shape.hidden,
                    g,
                    "groups run along K = hidden for w13",
                )?;
                if act_order {
                    let need = g.max(MARLIN_MIN_THREAD_N);
                    if i_pp % need != 0 {
                        return Err(format!(
                            "act-order cannot be padded: intermediate per partition {i_pp} must be a multiple of max(64, group_size {g}) = {need}"
                        ));
                    }
                    for (what, k) in [
                        ("hidden", shape.hidden),
                        ("intermediate per partition", i_pp),
                    ] {
                        if k / g < 2 {
                            return Err(format!(
                                "act-order with a single group along K ({what} {k}, group_size {g}): Marlin needs more than one group"
                            ));
                        }
                    }
                } else if i_pp % g != 0 {
                    return Err(format!(
                        "intermediate per partition {i_pp} is not a multiple of group_size {g} (use a tensor-parallel size that keeps whole groups)"
                    ));
                }
            }
            Ok(())
        }
        Backend::CudaInt8W8a8 => {
            check_cuda(platform)?;
            check_gated(shape)?;
            if !matches!(kind, ExpertKind::W8a8 { .. }) {
                return Err("int8 activation backend: it does not run weight-only schemes".into());
            }
            let i_pp = per_partition(shape.intermediate, tp)?;
            check_multiple(
                "hidden",
                shape.hidden,
                K_BLOCK,
                "the int8 MMA runs K in steps of 32",
            )?;
            check_multiple(
                "intermediate per partition",
                i_pp,
                K_BLOCK,
                "the int8 MMA runs K in steps of 32",
            )?;
            Ok(())
        }
    }
}

fn check_cuda(platform: Platform) -> Result<(), String> {
    match platform {
        Platform::Cuda { sm } if sm >= CUDA_MIN_SM => Ok(()),
        Platform::Cuda { sm } => Err(format!(
            "needs compute capability >= {CUDA_MIN_SM}, found sm {sm}"
        )),
        Platform::Cpu(_) => Err("runs on the cuda platform only".into()),
    }
}

fn check_group(group_size: i64) -> Result<(), String> {
    if WNA16_GROUP_SIZES.contains(&group_size) {
        Ok(())
    } else {
        Err(format!(
            "group_size {group_size} is not supported (supported: -1, 32, 64, 128)"
        ))
    }
}

fn check_k_groups(hidden: usize, intermediate: usize, group_size: i64) -> Result<(), String> {
    if group_size > 0 {
        let g = group_size as usize;
        check_multiple("hidden", hidden, g, "groups run along K = hidden for w13")?;
        check_multiple(
            "intermediate",
            intermediate,
            g,
            "groups run along K = intermediate for w2",
        )?;
    }
    Ok(())
}

fn check_multiple(what: &str, value: usize, multiple: usize, why: &str) -> Result<(), String> {
    if multiple == 0 || value.is_multiple_of(multiple) {
        Ok(())
    } else {
        Err(format!(
            "{what}={value} is not a multiple of {multiple} ({why})"
        ))
    }
}

fn per_partition(intermediate: usize, tp: usize) -> Result<usize, String> {
    if !intermediate.is_multiple_of(tp) {
        return Err(format!(
            "intermediate={intermediate} does not split evenly over tp_size={tp}"
        ));
    }
    Ok(intermediate / tp)
}

/// vLLM's `check_moe_marlin_supports_layer` rule set on plain sizes (newer-main semantics:
/// tile padding of the intermediate size when there is no act-order).
pub fn marlin_support_reason(
    hidden: usize,
    intermediate_per_partition: usize,
    group_size: i64,
    allow_tile_padding: bool,
) -> Option<String> {
    if !WNA16_GROUP_SIZES.contains(&group_size) {
        return Some(format!(
            "group_size {group_size} is not one of -1, 32, 64, 128"
        ));
    }
    if !hidden.is_multiple_of(MARLIN_HIDDEN_MULTIPLE) {
        return Some(format!("hidden_size={hidden} is not a multiple of 128"));
    }
    if allow_tile_padding {
        if group_size > 0 && !intermediate_per_partition.is_multiple_of(group_size as usize) {
            return Some(format!(
                "intermediate_size_per_partition={intermediate_per_partition} is not a multiple of group_size {group_size}"
            ));
        }
    } else {
        let need = (group_size.max(0) as usize).max(MARLIN_MIN_THREAD_N);
        if !intermediate_per_partition.is_multiple_of(need) {
            return Some(format!(
                "intermediate_size_per_partition={intermediate_per_partition} is not a multiple of max(64, group_size) = {need}"
            ));
        }
    }
    None
}

/// The backends tried for a kind on a platform, best first.
pub fn priority(platform: Platform, kind: ExpertKind) -> &'static [Backend] {
    match (platform, kind) {
        (Platform::Cpu(_), _) => &[Backend::CpuSimd],
        (Platform::Cuda { .. }, ExpertKind::W8a8 { .. }) => &[Backend::CudaInt8W8a8],
        (Platform::Cuda { .. }, _) => &[Backend::CudaMarlinWna16],
    }
}
