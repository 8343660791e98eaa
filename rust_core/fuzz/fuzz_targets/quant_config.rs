#![no_main]
//! Arbitrary JSON as `quantization_config`: parsing and target resolution never panic.

use std::path::Path;

use libfuzzer_sys::fuzz_target;
use moeq_core::scheme::{ModuleClass, QuantizationConfig};

fuzz_target!(|data: &[u8]| {
    let Ok(qc) = serde_json::from_slice::<serde_json::Value>(data) else {
        return;
    };
    let config = serde_json::json!({ "quantization_config": qc });
    let file = Path::new("config.json");
    if let Ok(Some(q)) = QuantizationConfig::from_model_config(file, &config) {
        for m in [
            "model.layers.0.mlp.experts.0.gate_proj",
            "model.layers.1.block_sparse_moe.experts.3.w2",
            "lm_head",
        ] {
            let _ = q.resolve(file, m, ModuleClass::Linear);
            let _ = q.resolve(file, m, ModuleClass::Other);
        }
    }
});
