//! Reading a checkpoint directory: `config.json` plus one `model.safetensors` or shards listed in
//! `model.safetensors.index.json`. Every header and the index are validated when opening.

pub mod dtype;
pub mod file;
pub mod header;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use rayon::prelude::*;
use serde_json::Value;

pub use dtype::DType;
pub use file::{SafetensorsFile, TensorView};
pub use header::TensorInfo;

use crate::error::{CheckpointError, ConfigError, Error, Result};

pub const CONFIG_FILE: &str = "config.json";
pub const SINGLE_FILE: &str = "model.safetensors";
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// A checkpoint directory with validated headers; tensor data stays mapped and unread.
#[derive(Debug)]
pub struct Checkpoint {
    dir: PathBuf,
    config: Value,
    files: Vec<SafetensorsFile>,
    /// name -> (file index, tensor index within that file's sorted list)
    lookup: HashMap<String, (usize, usize)>,
    names: Vec<String>,
}

fn io_err(path: &Path, source: std::io::Error) -> Error {
    CheckpointError::Io {
        path: path.to_path_buf(),
        source,
    }
    .into()
}

/// Reads and parses a JSON file; syntax errors are `ConfigError`s naming the file.
pub fn read_json(path: &Path) -> Result<Value> {
    let bytes = std::fs::read(path).map_err(|e| io_err(path, e))?;
    if bytes.starts_with(header::LFS_POINTER_PREFIX) {
        return Err(CheckpointError::LfsPointer {
            path: path.to_path_buf(),
        }
        .into());
    }
    serde_json::from_slice(&bytes).map_err(|e| {
        ConfigError {
            file: path.to_path_buf(),
            key: "(document)".into(),
            reason: format!("not valid JSON: {e}"),
        }
        .into()
    })
}

/// A shard name from the index must be a plain file name inside the checkpoint directory.
fn shard_path(dir: &Path, index_path: &Path, name: &str) -> Result<PathBuf> {
    let plain = !name.is_empty()
        && !name.contains('/')
        && !name.contains('\\')
        && name != "."
        && name != "..";
    if !plain {
        return Err(CheckpointError::Index {
            path: index_path.to_path_buf(),
            reason: format!(
                "shard name '{name}' is not a plain file name in the checkpoint directory"
            ),
        }
        .into());
    }
    Ok(dir.join(name))
}

impl Checkpoint {
    /// Opens `dir`, reading `config.json` and validating every safetensors header (and the index).
    pub fn open(dir: &Path) -> Result<Checkpoint> {
        if !dir.is_dir() {
            let reason = if dir.exists() {
                "is not a directory (pass the checkpoint directory holding config.json)"
            } else {
                "does not exist"
            };
            return Err(CheckpointError::Io {
                path: dir.to_path_buf(),
                source: std::io::Error::new(std::io::ErrorKind::NotFound, reason),
            }
            .into());
        }
        let config_path = dir.join(CONFIG_FILE);
        if !config_path.is_file() {
            return Err(CheckpointError::Io {
                path: config_path,
                source: std::io::Error::new(std::io::ErrorKind::NotFound, "config.json not found"),
            }
            .into());
        }
        let config = read_json(&config_path)?;
        if !config.is_object() {
            return Err(ConfigError {
                file: config_path,
                key: "(document)".into(),
                reason: "expected a JSON object".into(),
            }
            .into());
        }

        let index_path = dir.join(INDEX_FILE);
        let single_path = dir.join(SINGLE_FILE);
        let (files, weight_map) = if index_path.is_file() {
            let (shard_names, weight_map) = read_index(&index_path)?;
            let paths = shard_names
                .iter()
                .map(|n| shard_path(dir, &index_path, n))
                .collect::<Result<Vec<_>>>()?;
            for p in &paths {
                if !p.is_file() {
                    return Err(CheckpointError::Index {
                        path: index_path.clone(),
                        reason: format!(
                            "names shard '{}' which does not exist",
                            p.file_name()
                                .map(|s| s.to_string_lossy())
                                .unwrap_or_default()
                        ),
                    }
                    .into());
                }
            }
            let files = paths
                .par_iter()
                .map(|p| SafetensorsFile::open(p).map_err(Error::from))
                .collect::<Result<Vec<_>>>()?;
            (files, Some(weight_map))
        } else if single_path.is_file() {
            (vec![SafetensorsFile::open(&single_path)?], None)
        } else {
            return Err(CheckpointError::NoWeights {
                dir: dir.to_path_buf(),
            }
            .into());
        };

        let total: usize = files.iter().map(|f| f.tensors().len()).sum();
        let mut lookup = HashMap::with_capacity(total);
        let mut names = Vec::with_capacity(total);
        for (fi, f) in files.iter().enumerate() {
            for (ti, t) in f.tensors().iter().enumerate() {
                if let Some((other, _)) = lookup.insert(t.name.clone(), (fi, ti)) {
                    let other_path: &Path = files
                        .get(other)
                        .map(|o: &SafetensorsFile| o.path())
                        .unwrap_or(f.path());
                    return Err(CheckpointError::Tensor {
                        path: f.path().to_path_buf(),
                        tensor: t.name.clone(),
                        reason: format!("is also stored in {}", other_path.display()),
                    }
                    .into());
                }
                names.push(t.name.clone());
            }
        }
        names.sort();

        if let Some(weight_map) = weight_map {
            check_index(&index_path, &weight_map, &files, &lookup)?;
        }

        Ok(Checkpoint {
            dir: dir.to_path_buf(),
            config,
            files,
            lookup,
            names,
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn config_path(&self) -> PathBuf {
        self.dir.join(CONFIG_FILE)
    }

    /// The parsed `config.json`.
    pub fn config(&self) -> &Value {
        &self.config
    }

    pub fn files(&self) -> &[SafetensorsFile] {
        &self.files
    }

    /// All tensor names, sorted.
    pub fn tensor_names(&self) -> &[String] {
        &self.names
    }

    pub fn contains(&self, name: &str) -> bool {
        self.lookup.contains_key(name)
    }

    /// The file and header entry of a tensor, if present.
    pub fn locate(&self, name: &str) -> Option<(&SafetensorsFile, &TensorInfo)> {
        let &(fi, ti) = self.lookup.get(name)?;
        let f = self.files.get(fi)?;
        let t = f.tensors().get(ti)?;
        Some((f, t))
    }

    pub fn info(&self, name: &str) -> Option<&TensorInfo> {
        self.locate(name).map(|(_, t)| t)
    }

    /// A zero-copy view of the named tensor, if present.
    pub fn get(&self, name: &str) -> Option<TensorView<'_>> {
        self.locate(name).map(|(f, t)| f.view(t))
    }

    /// A zero-copy view of the named tensor, or `CheckpointError::MissingTensor`.
    pub fn tensor(&self, name: &str) -> Result<TensorView<'_>> {
        self.get(name).ok_or_else(|| {
            CheckpointError::MissingTensor {
                name: name.to_string(),
            }
            .into()
        })
    }
}

type WeightMap = BTreeMap<String, String>;

fn read_index(index_path: &Path) -> Result<(Vec<String>, WeightMap)> {
    let doc = read_json(index_path)?;
    let cfg_err = |key: &str, reason: &str| -> Error {
        CheckpointError::Index {
            path: index_path.to_path_buf(),
            reason: format!("{key}: {reason}"),
        }
        .into()
    };
    let map = doc
        .get("weight_map")
        .ok_or_else(|| cfg_err("weight_map", "missing"))?
        .as_object()
        .ok_or_else(|| {
            cfg_err(
                "weight_map",
                "expected an object of tensor name -> shard file",
            )
        })?;
    let mut weight_map = WeightMap::new();
    let mut shards: Vec<String> = Vec::new();
    for (name, file) in map {
        let file = file
            .as_str()
            .ok_or_else(|| cfg_err(&format!("weight_map.{name}"), "expected a file name string"))?;
        if !shards.iter().any(|s| s == file) {
            shards.push(file.to_string());
        }
        weight_map.insert(name.clone(), file.to_string());
    }
    if shards.is_empty() {
        return Err(cfg_err("weight_map", "is empty"));
    }
    shards.sort();
    Ok((shards, weight_map))
}

fn check_index(
    index_path: &Path,
    weight_map: &WeightMap,
    files: &[SafetensorsFile],
    lookup: &HashMap<String, (usize, usize)>,
) -> Result<()> {
    let err = |reason: String| -> Error {
        CheckpointError::Index {
            path: index_path.to_path_buf(),
            reason,
        }
        .into()
    };
    let file_name = |f: &SafetensorsFile| {
        f.path()
            .file_name()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default()
    };
    for (name, shard) in weight_map {
        match lookup.get(name).and_then(|&(fi, _)| files.get(fi)) {
            None => {
                return Err(err(format!(
                    "names tensor '{name}' in shard '{shard}', but that shard does not contain it"
                )))
            }
            Some(f) if file_name(f) != *shard => {
                return Err(err(format!(
                    "maps tensor '{name}' to shard '{shard}', but it is stored in '{}'",
                    file_name(f)
                )))
            }
            Some(_) => {}
        }
    }
    for f in files {
        for t in f.tensors() {
            if !weight_map.contains_key(&t.name) {
                return Err(err(format!(
                    "does not list tensor '{}' stored in shard '{}'",
                    t.name,
                    file_name(f)
                )));
            }
        }
    }
    Ok(())
}
