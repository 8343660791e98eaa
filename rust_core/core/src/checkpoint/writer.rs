//! Writing safetensors shards whose layout is planned before any tensor exists: headers first,
//! then each tensor's bytes at its final offset, in any order. This is what lets the repacker
//! stream one layer at a time. Output is deterministic (fixed order, space-padded headers) and
//! every tensor is aligned to its dtype.

use std::collections::BTreeMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use serde_json::{json, Map, Value};

use super::DType;
use crate::error::{CheckpointError, Result};

/// Where one planned tensor goes.
#[derive(Clone, Debug)]
pub struct Slot {
    pub shard: usize,
    /// Absolute byte offset in the shard file.
    pub offset: u64,
    pub nbytes: u64,
    pub dtype: DType,
    pub shape: Vec<usize>,
}

#[derive(Clone, Debug)]
pub struct ShardPlan {
    pub file_name: String,
    pub header: Vec<u8>,
    pub size: u64,
    pub tensors: Vec<String>,
}

/// The planned files of a checkpoint.
#[derive(Clone, Debug)]
pub struct Plan {
    pub shards: Vec<ShardPlan>,
    pub slots: BTreeMap<String, Slot>,
}

fn io(path: &Path, e: std::io::Error) -> crate::error::Error {
    CheckpointError::Io {
        path: path.to_path_buf(),
        source: e,
    }
    .into()
}

impl Plan {
    /// Assigns tensors (name, dtype, shape) to shards of at most `max_shard_size` bytes (a tensor
    /// larger than that gets a shard of its own), in name order.
    pub fn new(mut tensors: Vec<(String, DType, Vec<usize>)>, max_shard_size: u64) -> Plan {
        tensors.sort_by(|a, b| a.0.cmp(&b.0));
        let mut groups: Vec<Vec<(String, DType, Vec<usize>)>> = vec![Vec::new()];
        let mut current = 0u64;
        for t in tensors {
            let nbytes = (t.2.iter().product::<usize>() * t.1.bit_size() / 8) as u64;
            if current > 0 && current + nbytes > max_shard_size {
                groups.push(Vec::new());
                current = 0;
            }
            current += nbytes;
            if let Some(g) = groups.last_mut() {
                g.push(t);
            }
        }
        let n = groups.len();
        let mut shards = Vec::with_capacity(n);
        let mut slots = BTreeMap::new();
        for (si, mut group) in groups.into_iter().enumerate() {
            let file_name = if n == 1 {
                "model.safetensors".to_string()
            } else {
                format!("model-{:05}-of-{:05}.safetensors", si + 1, n)
            };
            // Data order: widest alignment first, so every tensor starts aligned.
            group.sort_by(|a, b| {
                b.1.alignment()
                    .cmp(&a.1.alignment())
                    .then_with(|| a.0.cmp(&b.0))
            });
            let mut entries: Vec<(String, Value)> = Vec::with_capacity(group.len());
            let mut offset = 0u64;
            let mut local = Vec::with_capacity(group.len());
            for (name, dtype, shape) in &group {
                let nbytes = (shape.iter().product::<usize>() * dtype.bit_size() / 8) as u64;
                entries.push((
                    name.clone(),
                    json!({"dtype": dtype.name(), "shape": shape, "data_offsets": [offset, offset + nbytes]}),
                ));
                local.push((name.clone(), *dtype, shape.clone(), offset, nbytes));
                offset += nbytes;
            }
            entries.sort_by(|a, b| a.0.cmp(&b.0));
            let mut obj = Map::new();
            obj.insert("__metadata__".into(), json!({"format": "pt"}));
            for (k, v) in entries {
                obj.insert(k, v);
            }
            let mut text = Value::Object(obj).to_string().into_bytes();
            while !(8 + text.len()).is_multiple_of(8) {
                text.push(b' ');
            }
            let data_start = 8 + text.len() as u64;
            let mut header = (text.len() as u64).to_le_bytes().to_vec();
            header.extend_from_slice(&text);
            for (name, dtype, shape, off, nbytes) in local {
                slots.insert(
                    name,
                    Slot {
                        shard: si,
                        offset: data_start + off,
                        nbytes,
                        dtype,
                        shape,
                    },
                );
            }
            shards.push(ShardPlan {
                file_name,
                header,
                size: data_start + offset,
                tensors: group.into_iter().map(|t| t.0).collect(),
            });
        }
        Plan { shards, slots }
    }

    /// `model.safetensors.index.json` for a multi-shard plan.
    pub fn index_json(&self) -> Option<Value> {
        if self.shards.len() < 2 {
            return None;
        }
        let total: u64 = self.slots.values().map(|s| s.nbytes).sum();
        let mut map = Map::new();
        for (name, slot) in &self.slots {
            if let Some(s) = self.shards.get(slot.shard) {
                map.insert(name.clone(), json!(s.file_name));
            }
        }
        Some(json!({"metadata": {"total_size": total}, "weight_map": map}))
    }
}

/// Shard files a writer keeps open for its whole life. Beyond this many, each write opens its
/// shard: a plan of more shards than the process may hold open (1,024 is a common default
/// limit; a 700 GB model in 500 MB shards has 1,400) must still be writable.
const KEEP_OPEN: usize = 64;

/// The shard files of a plan, headers written, data filled in by [`ShardWriter::write`].
pub struct ShardWriter {
    plan: Plan,
    /// Each shard's path and, for plans of at most [`KEEP_OPEN`] shards, its open file.
    files: Vec<(PathBuf, Option<File>)>,
}

impl ShardWriter {
    pub fn create(dir: &Path, plan: Plan) -> Result<ShardWriter> {
        let keep = plan.shards.len() <= KEEP_OPEN;
        let mut files = Vec::with_capacity(plan.shards.len());
        for s in &plan.shards {
            let path = dir.join(&s.file_name);
            let f = File::create(&path).map_err(|e| io(&path, e))?;
            f.set_len(s.size).map_err(|e| io(&path, e))?;
            f.write_all_at(&s.header, 0).map_err(|e| io(&path, e))?;
            files.push((path, keep.then_some(f)));
        }
        Ok(ShardWriter { plan, files })
    }

    /// Runs `f` on shard `path`'s file: the kept one, or the file opened for this call.
    fn with_file<T>(
        path: &Path,
        kept: Option<&File>,
        f: impl FnOnce(&File) -> std::io::Result<T>,
    ) -> Result<T> {
        match kept {
            Some(file) => f(file),
            None => std::fs::OpenOptions::new()
                .write(true)
                .open(path)
                .and_then(|file| f(&file)),
        }
        .map_err(|e| io(path, e))
    }

    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// Writes one planned tensor's bytes.
    pub fn write(&self, name: &str, data: &[u8]) -> Result<()> {
        // A whole tensor must fill its slot exactly; write_part checks the rest.
        if let Some(slot) = self.plan.slots.get(name) {
            if data.len() as u64 != slot.nbytes {
                return Err(CheckpointError::Output {
                    path: PathBuf::from(name),
                    reason: format!("{} bytes given, {} planned", data.len(), slot.nbytes),
                }
                .into());
            }
        }
        self.write_part(name, 0, data)
    }

    /// Writes `data` at byte `offset` inside a planned tensor (a slice of a stacked tensor).
    pub fn write_part(&self, name: &str, offset: u64, data: &[u8]) -> Result<()> {
        let slot = self
            .plan
            .slots
            .get(name)
            .ok_or_else(|| CheckpointError::Output {
                path: PathBuf::from(name),
                reason: "tensor was not planned".into(),
            })?;
        if offset + data.len() as u64 > slot.nbytes {
            return Err(CheckpointError::Output {
                path: PathBuf::from(name),
                reason: format!(
                    "bytes {offset}..{} fall outside the {} planned",
                    offset + data.len() as u64,
                    slot.nbytes
                ),
            }
            .into());
        }
        let (path, f) = self
            .files
            .get(slot.shard)
            .ok_or_else(|| CheckpointError::Output {
                path: PathBuf::from(name),
                reason: "shard missing".into(),
            })?;
        Self::with_file(path, f.as_ref(), |file| {
            file.write_all_at(data, slot.offset + offset)
        })
    }

    /// Flushes every shard to disk.
    pub fn finish(self) -> Result<()> {
        for (path, f) in &self.files {
            Self::with_file(path, f.as_ref(), File::sync_all)?;
        }
        Ok(())
    }
}
