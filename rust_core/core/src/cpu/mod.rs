//! The CPU MoE path: routing, quantized linear layers and the fused forward.

pub mod arena;
pub mod build;
pub mod kernels;
pub mod linear;
pub mod load;
pub mod moe;
pub mod packed;
pub mod routing;
pub mod wo;

pub use moe::{CpuExpert, CpuMoe};
