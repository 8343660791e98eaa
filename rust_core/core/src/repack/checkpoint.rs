//! `moeq repack`: a whole checkpoint to the Marlin layout, one MoE layer at a time, written
//! through a temporary directory beside the output that is renamed at the end.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Instant;

use serde_json::{json, Value};

use super::moe_layer::{convert_layer, dequantize_marlin, geometry, FetchedTensor, MarlinGeometry};
use crate::checkpoint::writer::{Plan, ShardWriter};
use crate::checkpoint::{Checkpoint, SafetensorsFile, TensorInfo, CONFIG_FILE, INDEX_FILE};
use crate::error::{CheckpointError, Error, LayoutError, Result};
use crate::model::Model;
use crate::moe::ExpertModules;
use crate::scheme::module::MODULE_TENSOR_SUFFIXES;

/// Layout version recorded in `config.json` (`"moeq": {"layout_version": ...}`).
pub const LAYOUT_VERSION: u64 = 1;

#[derive(Clone, Debug)]
pub struct RepackOptions {
    pub force: bool,
    pub max_shard_size: u64,
    pub verify: bool,
}

/// Reported to the progress callback after every unit of work.
#[derive(Clone, Debug)]
pub struct Progress {
    pub stage: &'static str,
    pub done: usize,
    pub total: usize,
    pub bytes_written: u64,
    pub bytes_total: u64,
}

#[derive(Clone, Debug)]
pub struct RepackReport {
    pub out_dir: PathBuf,
    pub layers: usize,
    pub tensors: usize,
    pub bytes_written: u64,
    pub seconds: f64,
    pub verified_modules: usize,
}

fn output_error(path: &Path, reason: impl Into<String>) -> Error {
    CheckpointError::Output {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
    .into()
}

fn io(path: &Path, e: std::io::Error) -> Error {
    CheckpointError::Io {
        path: path.to_path_buf(),
        source: e,
    }
    .into()
}

/// Removes the temporary directory unless the repack was committed.
struct TempDir {
    path: PathBuf,
    committed: bool,
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if !self.committed {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

/// The geometry JSON recorded per layer in `config.json`.
fn geometry_json(layer: usize, g: &MarlinGeometry, weights: &Value) -> Value {
    json!({
        "layer": layer,
        "prefix": g.prefix,
        "num_experts": g.experts,
        "hidden_size": g.hidden,
        "intermediate_size": g.intermediate,
        "intermediate_size_padded": g.intermediate_padded,
        "num_bits": g.bits,
        "group_size": g.group_size,
        "symmetric": g.symmetric,
        "act_order": g.act_order,
        "scale_dtype": g.scale_dtype.name(),
        "weights": weights,
        "format": "pack-quantized",
    })
}

/// Repacks `model` into `out_dir` in the Marlin layout.
pub fn repack_marlin(
    model: &Model,
    out_dir: &Path,
    opts: &RepackOptions,
    progress: &mut dyn FnMut(&Progress) -> Result<()>,
) -> Result<RepackReport> {
    let t0 = Instant::now();
    let ckpt = model.checkpoint();
    if model.layout().is_some() {
        return Err(output_error(ckpt.dir(), "is already a repacked checkpoint"));
    }
    let name = out_dir
        .file_name()
        .ok_or_else(|| output_error(out_dir, "is not a usable directory name"))?
        .to_string_lossy()
        .into_owned();
    let parent = match out_dir.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    if !parent.is_dir() {
        return Err(output_error(
            out_dir,
            format!("the parent directory {} does not exist", parent.display()),
        ));
    }
    if out_dir.exists() || out_dir.is_symlink() {
        if !opts.force {
            return Err(output_error(
                out_dir,
                "already exists (pass --force to replace it)",
            ));
        }
        if let (Ok(a), Ok(b)) = (out_dir.canonicalize(), ckpt.dir().canonicalize()) {
            if a == b {
                return Err(output_error(
                    out_dir,
                    "is the source checkpoint; write elsewhere",
                ));
            }
        }
    }
    if opts.max_shard_size == 0 {
        return Err(output_error(out_dir, "max shard size must be positive"));
    }

    // Decide everything before writing anything.
    let mut layers = Vec::new();
    for l in model.moe_layers() {
        layers.push((l, geometry(l)?));
    }
    let mut replaced: BTreeSet<&str> = BTreeSet::new();
    for (l, _) in &layers {
        for e in &l.experts {
            replaced.extend(expert_tensors(ckpt, e).map(|(_, t)| t.name.as_str()));
        }
    }
    let mut specs = Vec::new();
    for (_, t) in ckpt.tensors() {
        if !replaced.contains(t.name.as_str()) {
            specs.push((t.name.clone(), t.dtype, t.shape.to_vec()));
        }
    }
    let copied: Vec<String> = specs.iter().map(|s| s.0.clone()).collect();
    for (_, g) in &layers {
        specs.extend(g.specs());
    }
    for (name, ..) in &specs {
        if copied.iter().filter(|c| *c == name).count() > 1
            || ckpt.contains(name) && !copied.contains(name)
        {
            return Err(output_error(
                out_dir,
                format!("tensor name '{name}' would be written twice"),
            ));
        }
    }
    let plan = Plan::new(specs, opts.max_shard_size);
    let bytes_total: u64 = plan.shards.iter().map(|s| s.size).sum();

    let tmp_path = parent.join(format!(".{name}.moeq-tmp-{}", std::process::id()));
    if tmp_path.exists() {
        std::fs::remove_dir_all(&tmp_path).map_err(|e| io(&tmp_path, e))?;
    }
    std::fs::create_dir(&tmp_path).map_err(|e| io(&tmp_path, e))?;
    let mut tmp = TempDir {
        path: tmp_path.clone(),
        committed: false,
    };

    let writer = ShardWriter::create(&tmp.path, plan)?;
    let total_units = copied.len() + layers.len();
    let mut done = 0usize;
    let mut written = 0u64;
    let mut report = |stage: &'static str, done: usize, written: u64| {
        progress(&Progress {
            stage,
            done,
            total: total_units,
            bytes_written: written,
            bytes_total,
        })
    };
    report("copy", 0, 0)?;
    let mut since = 0u64;
    for name in &copied {
        let (f, t) = ckpt
            .locate(name)
            .ok_or_else(|| output_error(out_dir, format!("source tensor '{name}' vanished")))?;
        writer.write(name, f.view(t).bytes)?;
        f.release(t);
        done += 1;
        written += t.len as u64;
        since += t.len as u64;
        if since >= 64 << 20 {
            since = 0;
            report("copy", done, written)?;
        }
    }
    report("copy", done, written)?;
    let version = model.quantization_config().and_then(|q| q.version.clone());
    let mut layer_meta = Vec::new();
    for (l, g) in &layers {
        let mut sink = |e: usize, name: &str, data: &[u8]| -> Result<()> {
            writer.write_part(name, (e * data.len()) as u64, data)?;
            written += data.len() as u64;
            Ok(())
        };
        // The source pages of an expert are dropped as soon as it is converted.
        let mut release = |e: usize| {
            if let Some(x) = l.experts.get(e) {
                for (f, t) in expert_tensors(ckpt, x) {
                    f.release(t);
                }
            }
        };
        convert_layer(ckpt, l, g, version.as_deref(), &mut sink, &mut release)?;
        let weights = l
            .experts
            .first()
            .and_then(|e| e.up.weights())
            .map_or(Value::Null, |w| {
                let mut v = w.weight_json();
                if let Some(o) = v.as_object_mut() {
                    o.insert("dynamic".into(), json!(false));
                }
                v
            });
        layer_meta.push(geometry_json(l.layer, g, &weights));
        done += 1;
        report("layers", done, written)?;
    }
    let index = writer.plan().index_json();
    let shard_names: Vec<String> = writer
        .plan()
        .shards
        .iter()
        .map(|s| s.file_name.clone())
        .collect();
    let out_tensors = writer.plan().slots.len();
    writer.finish()?;
    if let Some(index) = index {
        write_json(&tmp.path.join(INDEX_FILE), &index)?;
    }
    let mut config = ckpt.config().clone();
    if let Some(obj) = config.as_object_mut() {
        obj.insert(
            "moeq".into(),
            json!({
                "layout": "marlin",
                "layout_version": LAYOUT_VERSION,
                "source": ckpt.dir().display().to_string(),
                "reference": "vLLM main @7cfb97e33791 (process_weights_after_loading, Marlin MoE)",
                "layers": layer_meta,
            }),
        );
    }
    write_json(&tmp.path.join(CONFIG_FILE), &config)?;
    copy_side_files(ckpt.dir(), &tmp.path)?;

    let mut verified = 0;
    if opts.verify {
        verified = verify(model, &layers, &copied, &tmp.path, &shard_names)?;
        report("verify", done, written)?;
    }

    // Commit: move the finished directory into place.
    if out_dir.exists() || out_dir.is_symlink() {
        let old = parent.join(format!(".{name}.moeq-old-{}", std::process::id()));
        std::fs::rename(out_dir, &old).map_err(|e| io(out_dir, e))?;
        if let Err(e) = std::fs::rename(&tmp.path, out_dir) {
            let _ = std::fs::rename(&old, out_dir);
            return Err(io(out_dir, e));
        }
        tmp.committed = true;
        if old.is_dir() && !old.is_symlink() {
            let _ = std::fs::remove_dir_all(&old);
        } else {
            let _ = std::fs::remove_file(&old);
        }
    } else {
        std::fs::rename(&tmp.path, out_dir).map_err(|e| io(out_dir, e))?;
        tmp.committed = true;
    }
    Ok(RepackReport {
        out_dir: out_dir.to_path_buf(),
        layers: layers.len(),
        tensors: out_tensors,
        bytes_written: written,
        seconds: t0.elapsed().as_secs_f64(),
        verified_modules: verified,
    })
}

/// Every stored tensor of an expert's projections (`weight_packed`, `weight_scale`, ...).
fn expert_tensors<'a>(
    ckpt: &'a Checkpoint,
    e: &'a ExpertModules,
) -> impl Iterator<Item = (&'a SafetensorsFile, &'a TensorInfo)> + 'a {
    e.modules().flat_map(move |(_, m)| {
        MODULE_TENSOR_SUFFIXES
            .iter()
            .filter_map(move |s| ckpt.locate(&format!("{}.{s}", m.name)))
    })
}

fn write_json(path: &Path, v: &Value) -> Result<()> {
    let text = serde_json::to_string_pretty(v).map_err(|e| output_error(path, e.to_string()))?;
    std::fs::write(path, text + "\n").map_err(|e| io(path, e))
}

/// Copies the other top-level files of the source (tokenizer, generation config, ...).
fn copy_side_files(src: &Path, dst: &Path) -> Result<()> {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(src)
        .map_err(|e| io(src, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file())
        .collect();
    entries.sort();
    for p in entries {
        let Some(file) = p.file_name().map(|f| f.to_string_lossy().into_owned()) else {
            continue;
        };
        if file == CONFIG_FILE
            || file == INDEX_FILE
            || file.ends_with(".safetensors")
            || file.starts_with('.')
        {
            continue;
        }
        std::fs::copy(&p, dst.join(&file)).map_err(|e| io(&p, e))?;
    }
    Ok(())
}

/// Reads the written shards back and checks every expert projection dequantises to the same bits
/// as the source, and every copied tensor is byte-identical. Returns the modules checked.
fn verify(
    model: &Model,
    layers: &[(&crate::moe::MoeLayer, MarlinGeometry)],
    copied: &[String],
    dir: &Path,
    shards: &[String],
) -> Result<usize> {
    let files: Vec<SafetensorsFile> = shards
        .iter()
        .map(|s| SafetensorsFile::open(&dir.join(s)).map_err(Error::from))
        .collect::<Result<_>>()?;
    let find = |name: &str| -> Option<FetchedTensor> {
        files.iter().find_map(|f| {
            f.find(name)
                .map(|t| (t.dtype, t.shape.to_vec(), f.view(t).bytes.to_vec()))
        })
    };
    let mismatch = |what: &str| -> Error {
        LayoutError {
            subject: "verify".into(),
            reason: format!("{what} differs between the source and the repacked checkpoint"),
        }
        .into()
    };
    let ckpt = model.checkpoint();
    for name in copied {
        let src = ckpt.get(name).map(|v| v.bytes);
        let out = files
            .iter()
            .find_map(|f| f.find(name).map(|t| f.view(t).bytes));
        if src != out {
            return Err(mismatch(name));
        }
    }
    let mut checked = 0;
    for (l, g) in layers {
        // Fetch each stacked tensor once per layer.
        let cache: Vec<(String, Option<FetchedTensor>)> = g
            .specs()
            .into_iter()
            .map(|(n, ..)| {
                let v = find(&n);
                (n, v)
            })
            .collect();
        let lookup = |name: &str| {
            cache
                .iter()
                .find(|(n, _)| n == name)
                .and_then(|(_, v)| v.clone())
        };
        for (e, x) in l.experts.iter().enumerate() {
            for (role, m) in x.modules() {
                let want = model.dequantize(&m.name)?;
                let got = dequantize_marlin(&lookup, g, e, role.name())?;
                if got.data != want.data || got.shape != want.shape || got.dtype != want.dtype {
                    return Err(mismatch(&m.name));
                }
                checked += 1;
            }
        }
    }
    Ok(checked)
}
