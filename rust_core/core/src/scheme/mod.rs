//! Quantization schemes: `QuantizationArgs`, the `quantization_config` object, and module
//! target/ignore resolution.

pub mod args;
pub mod config;
pub mod json;
pub mod module;

pub use args::{ActOrder, ArgsRole, Dynamic, QuantArgs, QuantType, Strategy};
pub use config::{Format, MatchTier, ModuleClass, QuantizationConfig, Scheme, Target};
