//! Integer unpacking and dequantisation, bit-exact with compressed-tensors.

pub mod dequant;
pub mod pack;

pub use dequant::{dequant_value, dequantize, Dequantized};
pub use pack::PackVariant;
