//! Inputs and outputs of the oracle: plain data, no I/O.

use crate::scheme::{Format, QuantArgs};

/// The backends moeq_rs runs MoE layers on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Backend {
    /// Our CPU kernels (scalar reference + runtime-dispatched SIMD).
    CpuSimd,
    /// Our CUDA weight-only GEMM over the Marlin layout (int4/int8 weights, 16-bit activations).
    CudaMarlinWna16,
    /// Our CUDA int8 x int8 GEMM (per-channel weights, per-token or per-tensor activations).
    CudaInt8W8a8,
}

impl Backend {
    pub const ALL: [Backend; 3] = [
        Backend::CpuSimd,
        Backend::CudaMarlinWna16,
        Backend::CudaInt8W8a8,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Backend::CpuSimd => "cpu_simd",
            Backend::CudaMarlinWna16 => "cuda_marlin_wna16",
            Backend::CudaInt8W8a8 => "cuda_int8_w8a8",
        }
    }

    pub fn parse(s: &str) -> Option<Backend> {
        Backend::ALL.into_iter().find(|b| b.name() == s)
    }
}

/// CPU features that select kernels (never whether a layer can run: the scalar path always can).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CpuFeatures {
    pub avx2: bool,
    pub avx_vnni: bool,
    pub avx512_vnni: bool,
    pub amx_int8: bool,
    pub neon: bool,
}

/// AMX-INT8 as CPUID reports it (leaf 7, EDX bit 25). `is_x86_feature_detected!("amx-int8")` is
/// not stable yet. Whether the OS grants tile state is decided later, by the kernels' own
/// `arch_prctl` request, which falls back cleanly when refused.
#[cfg(target_arch = "x86_64")]
fn cpuid_amx_int8() -> bool {
    use std::arch::x86_64::__cpuid_count;
    // Leaf 0 reports the highest leaf; leaf 7 is only queried when it exists.
    let max_leaf = __cpuid_count(0, 0).eax;
    if max_leaf < 7 {
        return false;
    }
    let leaf7 = __cpuid_count(7, 0);
    leaf7.edx & (1 << 25) != 0
}

impl CpuFeatures {
    /// Features of the machine we run on.
    pub fn detect() -> CpuFeatures {
        #[cfg(target_arch = "x86_64")]
        {
            CpuFeatures {
                avx2: std::arch::is_x86_feature_detected!("avx2"),
                avx_vnni: std::arch::is_x86_feature_detected!("avxvnni"),
                avx512_vnni: std::arch::is_x86_feature_detected!("avx512vnni")
                    && std::arch::is_x86_feature_detected!("avx512bw"),
                amx_int8: cpuid_amx_int8(),
                neon: false,
            }
        }
        #[cfg(target_arch = "aarch64")]
        {
            CpuFeatures {
                neon: std::arch::is_aarch64_feature_detected!("neon"),
                ..CpuFeatures::default()
            }
        }
        #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
        {
            CpuFeatures::default()
        }
    }

    /// The int8 SIMD features present. What the CPU forward dispatches to also depends on
    /// `MOEQ_CPU_ISA` and, for AMX, on the OS granting tile state: `cpu::kernels::isa()`.
    pub fn names(&self) -> Vec<&'static str> {
        [
            (self.avx2, "avx2"),
            (self.avx_vnni, "avx_vnni"),
            (self.avx512_vnni, "avx512_vnni"),
            (self.amx_int8, "amx_int8"),
            (self.neon, "neon"),
        ]
        .into_iter()
        .filter_map(|(on, n)| on.then_some(n))
        .collect()
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Platform {
    Cpu(CpuFeatures),
    /// `sm` = major * 10 + minor (90 for H100/H200).
    Cuda {
        sm: u32,
    },
}

impl Platform {
    pub fn name(&self) -> &'static str {
        match self {
            Platform::Cpu(_) => "cpu",
            Platform::Cuda { .. } => "cuda",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Options {
    /// An explicit backend: used or the layer fails with the reason; never a silent fallback.
    pub backend: Option<Backend>,
    pub tp_size: usize,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            backend: None,
            tp_size: 1,
        }
    }
}

/// Sizes of one MoE layer (full, before tensor parallelism).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerShape {
    pub hidden: usize,
    pub intermediate: usize,
    pub num_experts: usize,
    /// Whether the experts have a gate projection (`silu(gate) * up`); without one they compute
    /// `silu(up)`, which the CPU forward runs and the CUDA kernels do not.
    pub gated: bool,
}

/// The scheme of one projection as the checkpoint stores it.
#[derive(Clone, Debug, PartialEq)]
pub struct ProjScheme {
    pub weights: Option<QuantArgs>,
    pub activation: Option<QuantArgs>,
    pub format: Format,
    /// The format vLLM reads where it differs from `format` (see
    /// [`crate::scheme::config::Scheme::vllm_format`]), for the `--compat vllm` verdict.
    pub vllm_format: Option<Option<Format>>,
}

/// The projections of one expert (`gate` is absent for non-gated experts).
#[derive(Clone, Debug, PartialEq)]
pub struct ExpertSchemes {
    pub gate: Option<ProjScheme>,
    pub up: ProjScheme,
    pub down: ProjScheme,
}

#[derive(Clone, Debug)]
pub struct LayerInput {
    pub layer: usize,
    pub shape: LayerShape,
    pub experts: Vec<ExpertSchemes>,
}

/// What a layer (or one expert of a mixed layer) runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Method {
    Wna16,
    W8a8Int8,
    Unquantized,
    Unsupported,
    Mixed,
}

impl Method {
    pub fn name(self) -> &'static str {
        match self {
            Method::Wna16 => "wna16",
            Method::W8a8Int8 => "w8a8_int8",
            Method::Unquantized => "unquantized",
            Method::Unsupported => "unsupported",
            Method::Mixed => "mixed",
        }
    }
}

/// vLLM's `FusedMoEQuantConfig` kinds we produce.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuantKind {
    Int4W4a16,
    Int8W8a16,
    Int8W8a8,
}

impl QuantKind {
    pub fn name(self) -> &'static str {
        match self {
            QuantKind::Int4W4a16 => "int4_w4a16",
            QuantKind::Int8W8a16 => "int8_w8a16",
            QuantKind::Int8W8a8 => "int8_w8a8",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QuantConfig {
    pub kind: QuantKind,
    pub per_act_token_quant: bool,
    /// `-1` for channelwise.
    pub group_size: i64,
    pub static_act_scales: bool,
}

/// The normalised scheme of an expert, once classified as runnable in principle.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ExpertKind {
    Unquantized,
    Wna16 {
        bits: u32,
        group_size: i64,
        symmetric: bool,
        act_order: bool,
    },
    W8a8 {
        static_act: bool,
    },
}

/// The plan of one expert inside a `"mixed"` layer.
#[derive(Clone, Debug, PartialEq)]
pub struct ExpertPlan {
    pub expert: usize,
    pub scheme: ExpertSchemes,
    pub method: Method,
    pub scale_kind: Option<&'static str>,
    pub quant_config: Option<QuantConfig>,
    pub backend: Option<Backend>,
    pub error: Option<String>,
}

/// What the oracle decided for one MoE layer.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerPlan {
    pub layer: usize,
    pub method: Method,
    /// The scheme shared by every projection (absent for `"mixed"`).
    pub scheme: Option<ProjScheme>,
    pub scale_kind: Option<&'static str>,
    pub quant_config: Option<QuantConfig>,
    pub backend: Option<Backend>,
    pub rejected: Vec<(Backend, String)>,
    pub error: Option<String>,
    pub experts: Option<Vec<ExpertPlan>>,
}
