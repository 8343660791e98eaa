//! Integer unpacking and dequantisation, bit-exact with compressed-tensors.

pub mod dequant;
pub mod pack;

pub use dequant::{dequant_value, dequantize, dequantize_with, Dequantized};
pub use pack::PackVariant;
