//! Repacking quantized weights into kernel layouts (Marlin for CUDA).

pub mod marlin;
pub mod tables;
