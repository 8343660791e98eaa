//! moeq-core: reading, checking and dequantising compressed-tensors MoE checkpoints.
//!
//! The pipeline is one-directional: [`checkpoint`] (validated safetensors + `config.json`) ->
//! [`scheme`] (quantization config, target resolution, per-module cross-checks) -> [`moe`]
//! (layers, experts, routers) -> [`quant`] (bit-exact dequantisation). [`model::Model`] ties them
//! together. No pyo3 here: the Python bindings live in `rust_core/python`.

pub mod checkpoint;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod error;
pub mod model;
pub mod moe;
pub mod oracle;
pub mod quant;
pub mod repack;
pub mod scheme;

pub use error::{Error, ErrorKind, Result};
pub use model::Model;
