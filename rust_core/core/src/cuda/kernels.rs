//! The kernel registry: every program (a source file with its defines) and the entry functions
//! it must contain.

/// `cuda/common.cuh`, prepended to every program (NVRTC is given no include path).
pub const COMMON: &str = include_str!("../../../../cuda/common.cuh");

/// One program NVRTC compiles.
#[derive(Clone, Debug)]
pub struct Variant {
    /// e.g. `moe_act_bf16`
    pub name: String,
    /// e.g. `moe_act.cu`
    pub file: &'static str,
    source: &'static str,
    pub defines: Vec<(String, String)>,
    /// Unmangled entry points the CUBIN must hold.
    pub entries: Vec<String>,
}

impl Variant {
    /// The full source NVRTC compiles.
    pub fn source(&self) -> String {
        format!("{COMMON}\n#line 1 \"{}\"\n{}", self.file, self.source)
    }
}

const DTYPES: [(&str, &str); 3] = [("f32", "0"), ("f16", "1"), ("bf16", "2")];

/// Every kernel variant, in a fixed order.
pub fn variants() -> Vec<Variant> {
    let plain = |file: &'static str, source: &'static str, entries: &[&str]| Variant {
        name: file.trim_end_matches(".cu").to_string(),
        file,
        source,
        defines: vec![("DTYPE".into(), "0".into())],
        entries: entries.iter().map(|e| e.to_string()).collect(),
    };
    let mut out = vec![
        plain(
            "moe_routing.cu",
            include_str!("../../../../cuda/moe_routing.cu"),
            &["moe_softmax_topk"],
        ),
        plain(
            "moe_align.cu",
            include_str!("../../../../cuda/moe_align.cu"),
            &["moe_align"],
        ),
    ];
    let per_dtype: [(&'static str, &'static str, &[&str]); 4] = [
        (
            "moe_act.cu",
            include_str!("../../../../cuda/moe_act.cu"),
            &["silu_and_mul", "moe_combine"],
        ),
        (
            "quant_int8.cu",
            include_str!("../../../../cuda/quant_int8.cu"),
            &["quant_int8_per_token", "quant_int8_static"],
        ),
        (
            "w8a8_gemm.cu",
            include_str!("../../../../cuda/w8a8_gemm.cu"),
            &["w8a8_grouped_gemm"],
        ),
        (
            "w8a8_imma.cu",
            include_str!("../../../../cuda/w8a8_imma.cu"),
            &["w8a8_imma_gemm"],
        ),
    ];
    // Tensor-core kernels: 16-bit activations only.
    let half_only: [(&'static str, &'static str, &[&str]); 1] = [(
        "wna16_gemm.cu",
        include_str!("../../../../cuda/wna16_gemm.cu"),
        &["wna16_moe_gemm"],
    )];
    let all = per_dtype.iter().map(|p| (p, &DTYPES[..]));
    let half = half_only.iter().map(|p| (p, &DTYPES[1..]));
    for (&(file, source, entries), dtypes) in all.chain(half) {
        for &(suffix, code) in dtypes {
            out.push(Variant {
                name: format!("{}_{suffix}", file.trim_end_matches(".cu")),
                file,
                source,
                defines: vec![("DTYPE".into(), code.into())],
                entries: entries.iter().map(|e| format!("{e}_{suffix}")).collect(),
            });
        }
    }
    out
}
