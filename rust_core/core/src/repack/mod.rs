//! Repacking quantized weights into kernel layouts (Marlin for CUDA, VNNI blocks for the CPU).

pub mod checkpoint;
pub mod cpu;
pub mod marlin;
pub mod moe_layer;
mod out_lock;
pub mod simd;
pub mod tables;
