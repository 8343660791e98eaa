#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Opening whole checkpoint directories written with the `safetensors` crate: shards and index,
//! naming schemes, non-gated experts, per-layer expert counts, dense layers, cross-checks.

use std::collections::BTreeMap;
use std::path::Path;

use moeq_core::{ErrorKind, Model};
use safetensors::tensor::{serialize_to_file, Dtype, TensorView};
use serde_json::{json, Value};

struct Tensor {
    dtype: Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

fn int4_module(
    out: &mut BTreeMap<String, Tensor>,
    name: &str,
    rows: usize,
    cols: usize,
    group: usize,
) {
    out.insert(
        format!("{name}.weight_packed"),
        Tensor {
            dtype: Dtype::I32,
            shape: vec![rows, cols / 8],
            data: vec![0x88; rows * cols / 2],
        },
    );
    out.insert(
        format!("{name}.weight_scale"),
        Tensor {
            dtype: Dtype::BF16,
            shape: vec![rows, cols / group],
            data: vec![0x3c; rows * cols / group * 2],
        },
    );
    let mut shape = Vec::new();
    shape.extend_from_slice(&(rows as i64).to_le_bytes());
    shape.extend_from_slice(&(cols as i64).to_le_bytes());
    out.insert(
        format!("{name}.weight_shape"),
        Tensor {
            dtype: Dtype::I64,
            shape: vec![2],
            data: shape,
        },
    );
}

fn write(dir: &Path, config: Value, tensors: &BTreeMap<String, Tensor>, shards: usize) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let names: Vec<&String> = tensors.keys().collect();
    let mut weight_map = serde_json::Map::new();
    for s in 0..shards {
        let file = if shards == 1 {
            "model.safetensors".to_string()
        } else {
            format!("model-{:05}-of-{:05}.safetensors", s + 1, shards)
        };
        let views: Vec<(String, TensorView<'_>)> = names
            .iter()
            .skip(s)
            .step_by(shards)
            .map(|n| {
                let t = &tensors[*n];
                weight_map.insert((*n).clone(), json!(file));
                (
                    (*n).clone(),
                    TensorView::new(t.dtype, t.shape.clone(), &t.data).unwrap(),
                )
            })
            .collect();
        serialize_to_file(views, None, &dir.join(&file)).unwrap();
    }
    if shards > 1 {
        std::fs::write(
            dir.join("model.safetensors.index.json"),
            json!({"metadata": {}, "weight_map": weight_map}).to_string(),
        )
        .unwrap();
    }
}

fn qc() -> Value {
    json!({"quant_method": "compressed-tensors", "format": "pack-quantized",
           "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 4, "group_size": 32}}},
           "ignore": ["re:.*gate$"]})
}

#[test]
fn sharded_mixtral_with_per_layer_expert_counts_and_dense_layer() {
    let dir = tempfile::tempdir().unwrap();
    let mut t = BTreeMap::new();
    // Layer 0: dense MLP. Layers 1 and 2: Mixtral-named experts, 4 then 3 (pruned).
    for p in ["gate_proj", "up_proj", "down_proj"] {
        let (r, c) = if p == "down_proj" { (64, 96) } else { (96, 64) };
        int4_module(&mut t, &format!("model.layers.0.mlp.{p}"), r, c, 32);
    }
    for (layer, experts) in [(1, 4), (2, 3)] {
        for e in 0..experts {
            for (p, (r, c)) in [("w1", (32, 64)), ("w3", (32, 64)), ("w2", (64, 32))] {
                int4_module(
                    &mut t,
                    &format!("model.layers.{layer}.block_sparse_moe.experts.{e}.{p}"),
                    r,
                    c,
                    32,
                );
            }
        }
        t.insert(
            format!("model.layers.{layer}.block_sparse_moe.gate.weight"),
            Tensor {
                dtype: Dtype::BF16,
                shape: vec![experts, 64],
                data: vec![0; experts * 128],
            },
        );
    }
    let mut q = qc();
    q["moe_sparsity_config"] = json!({"method": "prune", "num_experts": [null, 4, 3]});
    let config = json!({"model_type": "mixtral", "hidden_size": 64, "num_local_experts": 4, "num_experts_per_tok": 2, "quantization_config": q});
    write(dir.path(), config, &t, 3);
    let m = Model::open(dir.path()).unwrap();
    assert_eq!(m.checkpoint().files().len(), 3);
    assert_eq!(m.dense_layers(), &[0]);
    let layers = m.moe_layers();
    assert_eq!(
        layers
            .iter()
            .map(|l| (l.layer, l.experts.len()))
            .collect::<Vec<_>>(),
        vec![(1, 4), (2, 3)]
    );
    assert_eq!(layers[0].prefix, "model.layers.1.block_sparse_moe");
    assert!(layers[0].gated);
    assert_eq!(
        (layers[0].hidden_size, layers[0].intermediate_size),
        (64, 32)
    );
    assert_eq!(
        layers[1].router.as_ref().unwrap().module,
        "model.layers.2.block_sparse_moe.gate"
    );
    assert!(m.routing().renormalize, "Mixtral always renormalises");
    // A dequantised all-0x88 int4 weight is (8 - 8) * scale = 0.
    let d = m
        .dequantize("model.layers.2.block_sparse_moe.experts.2.w2")
        .unwrap();
    assert_eq!(d.shape, [64, 32]);
    assert!(d.data.iter().all(|&b| b == 0));
}

#[test]
fn expert_count_must_match_the_config() {
    let dir = tempfile::tempdir().unwrap();
    let mut t = BTreeMap::new();
    for e in 0..3 {
        for (p, (r, c)) in [
            ("gate_proj", (32, 64)),
            ("up_proj", (32, 64)),
            ("down_proj", (64, 32)),
        ] {
            int4_module(
                &mut t,
                &format!("model.layers.0.mlp.experts.{e}.{p}"),
                r,
                c,
                32,
            );
        }
    }
    write(
        dir.path(),
        json!({"num_experts": 4, "quantization_config": qc()}),
        &t,
        1,
    );
    let e = Model::open(dir.path()).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Checkpoint);
    assert!(
        e.to_string()
            .contains("holds 3 experts but the config declares 4"),
        "{e}"
    );
}

#[test]
fn non_gated_experts_and_shared_experts() {
    let dir = tempfile::tempdir().unwrap();
    let mut t = BTreeMap::new();
    for e in 0..2 {
        for (p, (r, c)) in [("up_proj", (32, 64)), ("down_proj", (64, 32))] {
            int4_module(
                &mut t,
                &format!("model.layers.5.mlp.experts.{e}.{p}"),
                r,
                c,
                32,
            );
        }
    }
    for (p, (r, c)) in [
        ("gate_proj", (64, 64)),
        ("up_proj", (64, 64)),
        ("down_proj", (64, 64)),
    ] {
        int4_module(
            &mut t,
            &format!("model.layers.5.mlp.shared_experts.{p}"),
            r,
            c,
            32,
        );
    }
    write(dir.path(), json!({"quantization_config": qc()}), &t, 1);
    let m = Model::open(dir.path()).unwrap();
    let l = &m.moe_layers()[0];
    assert_eq!((l.layer, l.gated, l.experts.len()), (5, false, 2));
    assert_eq!(l.shared_experts.as_ref().unwrap().up.out_features, 64);
}

#[test]
fn gate_and_up_shapes_must_agree() {
    let dir = tempfile::tempdir().unwrap();
    let mut t = BTreeMap::new();
    for (p, (r, c)) in [
        ("gate_proj", (32, 64)),
        ("up_proj", (64, 64)),
        ("down_proj", (64, 32)),
    ] {
        int4_module(
            &mut t,
            &format!("model.layers.0.mlp.experts.0.{p}"),
            r,
            c,
            32,
        );
    }
    write(dir.path(), json!({"quantization_config": qc()}), &t, 1);
    let e = Model::open(dir.path()).unwrap_err();
    assert!(
        e.to_string()
            .contains("gate is [32, 64] but up is [64, 64]"),
        "{e}"
    );
}

#[test]
fn symmetric_scheme_with_zero_points_is_rejected() {
    let dir = tempfile::tempdir().unwrap();
    let mut t = BTreeMap::new();
    int4_module(&mut t, "model.layers.0.mlp.experts.0.up_proj", 32, 64, 32);
    int4_module(&mut t, "model.layers.0.mlp.experts.0.down_proj", 64, 32, 32);
    t.insert(
        "model.layers.0.mlp.experts.0.up_proj.weight_zero_point".into(),
        Tensor {
            dtype: Dtype::I32,
            shape: vec![4, 2],
            data: vec![0; 32],
        },
    );
    write(dir.path(), json!({"quantization_config": qc()}), &t, 1);
    let e = Model::open(dir.path()).unwrap_err();
    assert!(
        e.to_string()
            .contains("up_proj': has weight_zero_point but the scheme is symmetric"),
        "{e}"
    );
}
