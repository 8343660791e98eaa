#![allow(clippy::unwrap_used, clippy::expect_used)]
//! quantization_config parsing, normalisation and target resolution.

use std::path::Path;

use moeq_core::scheme::{ActOrder, Format, MatchTier, ModuleClass, QuantizationConfig, Strategy};
use moeq_core::{Error, ErrorKind};
use serde_json::{json, Value};

fn parse(qc: Value) -> Result<QuantizationConfig, Error> {
    let cfg = json!({ "quantization_config": qc });
    QuantizationConfig::from_model_config(Path::new("config.json"), &cfg)
        .map(|q| q.expect("present"))
}

fn group(weights: Value) -> Value {
    json!({"config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}}, "format": "pack-quantized"})
}

fn weights(qc: &QuantizationConfig) -> moeq_core::scheme::QuantArgs {
    qc.groups[0].weights.clone().expect("weights")
}

#[test]
fn strategy_is_inferred_from_group_size() {
    let q = parse(group(json!({"num_bits": 4, "group_size": 128}))).unwrap();
    assert_eq!(weights(&q).strategy, Strategy::Group);
    assert_eq!(weights(&q).group_size, 128);
    let q = parse(group(json!({"num_bits": 8, "group_size": -1}))).unwrap();
    assert_eq!(weights(&q).strategy, Strategy::Channel);
    let q = parse(group(json!({"num_bits": 8}))).unwrap();
    assert_eq!(weights(&q).strategy, Strategy::Tensor);
}

#[test]
fn regression_44570_channel_with_null_group_size_is_minus_one() {
    let q = parse(group(
        json!({"num_bits": 8, "strategy": "channel", "group_size": null}),
    ))
    .unwrap();
    assert_eq!(weights(&q).strategy, Strategy::Channel);
    assert_eq!(weights(&q).group_size, -1);
}

#[test]
fn actorder_aliases() {
    for (v, expect) in [
        (json!(true), Some(ActOrder::Group)),
        (json!("dynamic"), Some(ActOrder::Group)),
        (json!("group"), Some(ActOrder::Group)),
        (json!("static"), Some(ActOrder::Weight)),
        (json!("weight"), Some(ActOrder::Weight)),
        (json!(false), None),
        (Value::Null, None),
    ] {
        let q = parse(group(
            json!({"num_bits": 4, "group_size": 128, "actorder": v}),
        ))
        .unwrap();
        assert_eq!(weights(&q).actorder, expect, "{v}");
    }
}

#[test]
fn actorder_needs_group_strategy() {
    let e = parse(group(
        json!({"num_bits": 8, "strategy": "channel", "actorder": "group"}),
    ))
    .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config);
    assert!(
        e.to_string()
            .contains("config_groups.group_0.weights.actorder"),
        "{e}"
    );
}

#[test]
fn wrong_type_names_the_key_path() {
    let e = parse(json!({"config_groups": {"group_1": {"targets": ["Linear"], "weights": {"num_bits": "4"}}}})).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config);
    let msg = e.to_string();
    assert!(
        msg.contains("quantization_config.config_groups.group_1.weights.num_bits"),
        "{msg}"
    );
    assert!(msg.contains("string \"4\""), "{msg}");
}

#[test]
fn unknown_keys_are_accepted() {
    let q = parse(json!({
        "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 4, "group_size": 32, "observer": "minmax", "future": 1}}},
        "format": "pack-quantized", "brand_new_key": {"x": 1}
    }))
    .unwrap();
    assert_eq!(weights(&q).group_size, 32);
}

#[test]
fn unknown_format_is_a_config_error() {
    let e = parse(json!({"format": "zip-quantized", "config_groups": {}})).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config);
    assert!(e.to_string().contains("quantization_config.format"));
}

#[test]
fn group_format_overrides_global() {
    let q = parse(json!({
        "format": "mixed-precision",
        "config_groups": {
            "a": {"targets": ["Linear"], "weights": {"num_bits": 8, "strategy": "channel"}, "input_activations": {"num_bits": 8, "strategy": "token", "dynamic": true}, "format": "int-quantized"},
            "b": {"targets": ["re:.*experts.*"], "weights": {"num_bits": 4, "group_size": 128}}
        }
    }))
    .unwrap();
    assert_eq!(q.groups[0].format, Format::IntQuantized);
    // No own format under a mixed-precision global: inferred like compressed-tensors does.
    assert_eq!(q.groups[1].format, Format::PackQuantized);
}

#[test]
fn preset_form_expands() {
    let q =
        parse(json!({"config_groups": {"W4A16": ["Linear"]}, "format": "pack-quantized"})).unwrap();
    let w = weights(&q);
    assert_eq!(
        (w.num_bits, w.strategy, w.group_size, w.symmetric),
        (4, Strategy::Group, 128, true)
    );
    let q = parse(json!({"config_groups": {"W8A8": ["Linear"]}})).unwrap();
    assert!(q.groups[0].input_activations.as_ref().unwrap().is_dynamic());
    assert_eq!(q.groups[0].format, Format::IntQuantized);
    let e = parse(json!({"config_groups": {"W5A5": ["Linear"]}})).unwrap_err();
    assert!(e.to_string().contains("W5A5"));
    for bad in ["W9A16", "W8A4", "W+4A16", "W4A16A", "WA16", "W4A32"] {
        let e = parse(json!({"config_groups": {bad: ["Linear"]}})).unwrap_err();
        assert!(e.to_string().contains("not a known preset"), "{bad}: {e}");
    }
}

/// compressed-tensors' `QuantizationScheme` requires `targets` (vLLM's parse fails without it
/// too); `[]` is a group that targets nothing.
#[test]
fn a_config_group_lists_its_targets() {
    let w = json!({"num_bits": 4, "group_size": 128});
    for group in [
        json!({"weights": w}),
        json!({"weights": w, "targets": null}),
    ] {
        let e = parse(json!({"config_groups": {"g": group}})).unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("config_groups.g.targets") && msg.contains("missing"),
            "{msg}"
        );
    }
    let q = parse(json!({"config_groups": {"g": {"weights": w, "targets": []}}})).unwrap();
    assert!(q.groups[0].targets.is_empty());
}

#[test]
fn presets_follow_the_compressed_tensors_release_that_wrote_them() {
    // W8A16 was channelwise int8 up to compressed-tensors 0.15 and is int8 group 128 from
    // 0.16.0 (read as channelwise always, a 0.16+ checkpoint's group scales were refused as
    // the wrong shape).
    let w8a16 = |version: Option<&str>| {
        let mut qc = json!({"config_groups": {"W8A16": ["Linear"]}, "format": "pack-quantized"});
        if let Some(v) = version {
            qc["version"] = json!(v);
        }
        let w = weights(&parse(qc).unwrap());
        (w.strategy, w.group_size)
    };
    let group = (Strategy::Group, 128);
    let channel = (Strategy::Channel, -1);
    assert_eq!(w8a16(None), group);
    assert_eq!(w8a16(Some("0.20.1")), group);
    assert_eq!(w8a16(Some("0.16.0")), group);
    assert_eq!(w8a16(Some("0.15.0")), channel);
    assert_eq!(w8a16(Some("0.9.5.dev12+g1234")), channel);
    assert_eq!(w8a16(Some("1.0")), group);
    // Looked up upper-cased, as CT does.
    let q = parse(json!({"config_groups": {"w4a16": ["Linear"]}})).unwrap();
    assert_eq!(weights(&q).num_bits, 4);
    // CT's _int_wnam family: group-128 weights, dynamic per-token activations below 16 bits.
    let q = parse(json!({"config_groups": {"W3A8": ["Linear"]}})).unwrap();
    let w = weights(&q);
    assert_eq!(
        (w.num_bits, w.strategy, w.group_size),
        (3, Strategy::Group, 128)
    );
    let a = q.groups[0].input_activations.as_ref().unwrap();
    assert!(a.is_dynamic() && a.num_bits == 8 && a.strategy == Strategy::Token);
    let q = parse(json!({"config_groups": {"W4A4": ["Linear"]}})).unwrap();
    assert_eq!(q.groups[0].input_activations.as_ref().unwrap().num_bits, 4);
}

fn laguna_like() -> QuantizationConfig {
    parse(json!({
        "format": "pack-quantized",
        "config_groups": {
            "group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "group_size": 128}},
            "group_1": {"targets": ["re:.*layers\\.1\\.mlp\\.experts\\.\\d+\\.(gate|up|down)_proj$"], "weights": {"num_bits": 4, "group_size": 128}},
            "group_2": {"targets": ["model.layers.2.mlp.experts.0.up_proj"], "weights": {"num_bits": 4, "group_size": 64}}
        },
        "ignore": ["lm_head", "re:.*mlp\\.gate$"]
    }))
    .unwrap()
}

#[test]
fn precedence_exact_over_regex_over_class() {
    let q = laguna_like();
    let f = Path::new("config.json");
    let r = |m: &str| {
        q.resolve(f, m, ModuleClass::Linear)
            .unwrap()
            .map(|(s, t)| (s.name.clone(), t))
    };
    assert_eq!(
        r("model.layers.1.mlp.experts.3.down_proj"),
        Some(("group_1".into(), MatchTier::Regex))
    );
    assert_eq!(
        r("model.layers.2.mlp.experts.3.down_proj"),
        Some(("group_0".into(), MatchTier::Class))
    );
    assert_eq!(
        r("model.layers.2.mlp.experts.0.up_proj"),
        Some(("group_2".into(), MatchTier::Name))
    );
    // re.match is anchored at the start only; "$" in the pattern anchors the end.
    assert_eq!(
        r("model.layers.1.mlp.experts.3.down_proj_extra"),
        Some(("group_0".into(), MatchTier::Class))
    );
    assert_eq!(r("lm_head"), None);
    assert_eq!(r("model.layers.1.mlp.gate"), None);
    assert_eq!(
        q.resolve(f, "model.embed_tokens", ModuleClass::Other)
            .unwrap()
            .map(|x| x.0.name.clone()),
        None
    );
}

#[test]
fn overlapping_regexes_with_different_schemes_are_ambiguous() {
    let q = parse(json!({
        "config_groups": {
            "a": {"targets": ["re:.*experts.*"], "weights": {"num_bits": 4, "group_size": 128}},
            "b": {"targets": ["re:.*down_proj"], "weights": {"num_bits": 8, "group_size": 128}}
        }
    }))
    .unwrap();
    let e = q
        .resolve(
            Path::new("config.json"),
            "x.experts.0.down_proj",
            ModuleClass::Linear,
        )
        .unwrap_err();
    assert!(e.to_string().contains("ambiguous"));
}

#[test]
fn every_matching_regex_of_a_group_counts() {
    // Keyed by its first matching regex only, group a ("mlp") lost that key to group b and its
    // "experts" regex was never weighed: the experts silently took b's W8A8, where CT (the
    // alphabetically first regex, "experts") gives them a's weight-only int8.
    let q = parse(json!({
        "config_groups": {
            "a": {"targets": ["re:.*mlp\\..*", "re:.*experts\\..*"],
                  "weights": {"num_bits": 8, "strategy": "channel"}},
            "b": {"targets": ["re:.*mlp\\..*", "re:.*self_attn\\..*"],
                  "weights": {"num_bits": 8, "strategy": "channel"},
                  "input_activations": {"num_bits": 8, "strategy": "token", "dynamic": true}}
        }
    }))
    .unwrap();
    let f = Path::new("config.json");
    let e = q
        .resolve(f, "m.layers.0.mlp.experts.0.gate_proj", ModuleClass::Linear)
        .unwrap_err();
    assert!(e.to_string().contains("ambiguous"), "{e}");
    // Where CT (alphabetically first regex) and vLLM (first listed) agree, no error: here
    // both take "experts", last listed by b.
    let agreed = parse(json!({
        "config_groups": {
            "a": {"targets": ["re:.*experts\\..*", "re:.*mlp\\..*"],
                  "weights": {"num_bits": 8, "strategy": "channel"}},
            "b": {"targets": ["re:.*experts\\..*", "re:.*self_attn\\..*"],
                  "weights": {"num_bits": 8, "group_size": 128}}
        }
    }))
    .unwrap();
    let (s, _) = agreed
        .resolve(f, "m.layers.0.mlp.experts.0.gate_proj", ModuleClass::Linear)
        .unwrap()
        .unwrap();
    assert_eq!(s.name, "b");
    // Where only the shared regex matches, the last group listing it wins, as before.
    let (s, tier) = q
        .resolve(f, "m.layers.0.mlp.gate_proj", ModuleClass::Linear)
        .unwrap()
        .unwrap();
    assert_eq!((s.name.as_str(), tier), ("b", MatchTier::Regex));
}

#[test]
fn a_target_given_by_several_groups_resolves_to_the_last() {
    // CT and vLLM key their target maps by the target string, so a repeated "Linear", name or
    // regex goes to the last group that gives it (a MiniMax hybrid: FP8 on "Linear", then
    // W4A16 on "Linear" plus the experts). It was refused as ambiguous.
    let q = parse(json!({
        "config_groups": {
            "fp8": {"targets": ["Linear", "re:.*down_proj"],
                    "weights": {"num_bits": 8, "type": "float", "strategy": "channel"}},
            "w4": {"targets": ["Linear", "re:.*down_proj", "x.q_proj"],
                   "weights": {"num_bits": 4, "group_size": 128}},
            "w8": {"targets": ["x.q_proj"], "weights": {"num_bits": 8, "group_size": 128}}
        }
    }))
    .unwrap();
    let f = Path::new("config.json");
    let r = |m: &str| {
        q.resolve(f, m, ModuleClass::Linear)
            .unwrap()
            .map(|(s, t)| (s.name.clone(), t))
    };
    assert_eq!(r("x.k_proj"), Some(("w4".into(), MatchTier::Class)));
    assert_eq!(r("x.down_proj"), Some(("w4".into(), MatchTier::Regex)));
    assert_eq!(r("x.q_proj"), Some(("w8".into(), MatchTier::Name)));
}

#[test]
fn unsupported_regex_is_a_config_error_naming_the_target() {
    let e = parse(
        json!({"config_groups": {"g": {"targets": ["re:(?<=x)y"], "weights": {"num_bits": 4}}}}),
    )
    .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config);
    assert!(e.to_string().contains("config_groups.g.targets[0]"), "{e}");
}

#[test]
fn online_transform_is_rejected() {
    let e = parse(json!({
        "config_groups": {},
        "transform_config": {"config_groups": {"u": {"type": "hadamard", "apply": [{"targets": ["Linear"], "location": "input"}]}}}
    }))
    .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::UnsupportedScheme);
    assert!(e.to_string().contains("online hadamard transform"), "{e}");
    // Transforms fused into the weights are fine.
    parse(json!({
        "config_groups": {},
        "transform_config": {"config_groups": {"u": {"type": "hadamard", "apply": [{"targets": ["Linear"], "location": "weight_input"}]}}}
    }))
    .unwrap();
}

#[test]
fn kv_cache_scheme_and_version_are_read() {
    let q = parse(json!({
        "config_groups": {}, "version": "0.18.0",
        "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": false, "symmetric": true}
    }))
    .unwrap();
    assert_eq!(q.version.as_deref(), Some("0.18.0"));
    assert_eq!(q.kv_cache_scheme.unwrap().num_bits, 8);
}

#[test]
fn token_activations_must_be_dynamic() {
    let e = parse(json!({"config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 8, "strategy": "channel"}, "input_activations": {"num_bits": 8, "strategy": "token", "dynamic": false}}}})).unwrap_err();
    assert!(e.to_string().contains("input_activations.dynamic"), "{e}");
}

#[test]
fn non_compressed_tensors_is_unsupported() {
    let e = parse(json!({"quant_method": "gptq"})).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::UnsupportedScheme);
}
