//! Repacking quantized weights into kernel layouts (Marlin for CUDA).

pub mod checkpoint;
pub mod marlin;
pub mod moe_layer;
pub mod simd;
pub mod tables;
