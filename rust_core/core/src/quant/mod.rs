//! Integer unpacking and dequantisation, bit-exact with compressed-tensors.

pub mod dequant;
pub mod pack;

pub use dequant::{dequantize, Dequantized};
pub use pack::PackVariant;
