//! Reading a checkpoint directory: `config.json` plus one `model.safetensors` or shards listed in
//! `model.safetensors.index.json`. Every header and the index are validated when opening.

pub mod dtype;
pub mod file;
pub mod header;
pub mod writer;

use std::borrow::Cow;
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
    /// (file index, tensor index within that file's sorted list) of every tensor, sorted by
    /// name: lookups are binary searches, and no name is copied or hashed when opening.
    order: Vec<(u32, u32)>,
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
            let reason = not_a_file(&config_path).unwrap_or("config.json not found");
            return Err(CheckpointError::Io {
                path: config_path,
                source: std::io::Error::new(std::io::ErrorKind::NotFound, reason),
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
        let index_bytes = if index_path.is_file() {
            std::fs::read(&index_path).map_err(|e| io_err(&index_path, e))?
        } else {
            Vec::new()
        };
        let (files, weight_map) = if index_path.is_file() {
            // Shard names are known from the file names on disk; parse the index and every shard
            // header concurrently and cross-check afterwards.
            let shard_paths = shard_files(dir)?;
            let (index, files) = rayon::join(
                || read_index(&index_path, &index_bytes),
                || {
                    shard_paths
                        .par_iter()
                        .map(|p| SafetensorsFile::open(p).map_err(Error::from))
                        .collect::<Vec<_>>()
                },
            );
            let (shard_names, weight_map) = index?;
            let mut opened = Vec::with_capacity(shard_names.len());
            // Files the index does not name are not part of the checkpoint: their errors are
            // irrelevant, only the named shards' are reported.
            let mut files: Vec<Option<Result<SafetensorsFile>>> =
                files.into_iter().map(Some).collect();
            for n in &shard_names {
                let p = shard_path(dir, &index_path, n)?;
                let pos = shard_paths.iter().position(|q| *q == p);
                match pos.and_then(|i| files.get_mut(i)).and_then(Option::take) {
                    Some(f) => opened.push(f?),
                    None => {
                        return Err(CheckpointError::Index {
                            path: index_path.clone(),
                            // The scan opened regular `.safetensors` files only.
                            reason: match not_a_file(&p) {
                                // A regular file the scan skipped: its name is not a shard's.
                                Some(_) if p.is_file() => {
                                    format!("names shard '{n}', which is not a .safetensors file")
                                }
                                Some(what) => format!("names shard '{n}', which {what}"),
                                None => format!("names shard '{n}' which does not exist"),
                            },
                        }
                        .into());
                    }
                }
            }
            (opened, Some(weight_map))
        } else if single_path.is_file() {
            (vec![SafetensorsFile::open(&single_path)?], None)
        } else if let Some(what) = not_a_file(&index_path) {
            // There, but not a file to read: say so rather than "no weights found".
            return Err(CheckpointError::Io {
                path: index_path,
                source: std::io::Error::new(std::io::ErrorKind::InvalidInput, what),
            }
            .into());
        } else if let Some(what) = not_a_file(&single_path) {
            return Err(CheckpointError::Io {
                path: single_path,
                source: std::io::Error::new(std::io::ErrorKind::InvalidInput, what),
            }
            .into());
        } else {
            return Err(CheckpointError::NoWeights {
                dir: dir.to_path_buf(),
            }
            .into());
        };

        let order = sorted_order(&files)?;
        if let Some(weight_map) = weight_map {
            check_index(&index_path, weight_map, &files, &order)?;
        }

        Ok(Checkpoint {
            dir: dir.to_path_buf(),
            config,
            files,
            order,
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

    fn entry(&self, (fi, ti): (u32, u32)) -> Option<(&SafetensorsFile, &TensorInfo)> {
        let f = self.files.get(fi as usize)?;
        Some((f, f.tensors().get(ti as usize)?))
    }

    /// All tensor names, sorted.
    pub fn tensor_names(&self) -> impl ExactSizeIterator<Item = &str> + '_ {
        self.order
            .iter()
            .map(|&e| self.entry(e).map_or("", |(_, t)| t.name.as_str()))
    }

    /// Every tensor with its file, sorted by name.
    pub fn tensors(&self) -> impl Iterator<Item = (&SafetensorsFile, &TensorInfo)> + '_ {
        self.order.iter().filter_map(move |&e| self.entry(e))
    }

    pub fn contains(&self, name: &str) -> bool {
        self.locate(name).is_some()
    }

    /// The file and header entry of a tensor, if present.
    pub fn locate(&self, name: &str) -> Option<(&SafetensorsFile, &TensorInfo)> {
        let i = self
            .order
            .binary_search_by(|&e| self.entry(e).map_or("", |(_, t)| t.name.as_str()).cmp(name))
            .ok()?;
        self.entry(*self.order.get(i)?)
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

/// `weight_map` entries `(tensor, shard file)`, sorted by tensor name, borrowed from the index.
type WeightMap<'a> = Vec<(Cow<'a, str>, Cow<'a, str>)>;

/// `(file, tensor)` indices of every tensor sorted by name; a name stored twice is an error.
fn sorted_order(files: &[SafetensorsFile]) -> Result<Vec<(u32, u32)>> {
    let mut all: Vec<(&str, u32, u32)> =
        Vec::with_capacity(files.iter().map(|f| f.tensors().len()).sum());
    for (fi, f) in files.iter().enumerate() {
        all.extend(
            f.tensors()
                .iter()
                .enumerate()
                .map(|(ti, t)| (t.name.as_str(), fi as u32, ti as u32)),
        );
    }
    // Each file is already sorted: a stable sort merges the runs.
    all.sort_by(|a, b| a.0.cmp(b.0));
    if let Some(pair) = all.windows(2).find(|p| p[0].0 == p[1].0) {
        let path = |fi: u32| {
            files
                .get(fi as usize)
                .map(|f| f.path().to_path_buf())
                .unwrap_or_default()
        };
        return Err(CheckpointError::Tensor {
            path: path(pair[1].1),
            tensor: pair[1].0.to_string(),
            reason: format!("is also stored in {}", path(pair[0].1).display()),
        }
        .into());
    }
    Ok(all.into_iter().map(|(_, f, t)| (f, t)).collect())
}

#[derive(serde::Deserialize)]
struct IndexDoc<'a> {
    #[serde(borrow)]
    weight_map: Option<MapEntries<'a>>,
}

/// A JSON object read as its list of entries (keeps duplicates visible, borrows the strings).
struct MapEntries<'a>(Vec<(Cow<'a, str>, Cow<'a, str>)>);

impl<'de: 'a, 'a> serde::Deserialize<'de> for MapEntries<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct V<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> serde::de::Visitor<'de> for V<'a> {
            type Value = MapEntries<'a>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("an object of tensor name -> shard file name")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> std::result::Result<Self::Value, A::Error> {
                let mut out = Vec::with_capacity(map.size_hint().unwrap_or(0));
                while let Some(entry) = map.next_entry::<CowStr<'a>, CowStr<'a>>()? {
                    out.push((entry.0 .0, entry.1 .0));
                }
                Ok(MapEntries(out))
            }
        }
        d.deserialize_map(V(std::marker::PhantomData))
    }
}

/// A string that borrows from the input when it has no escapes.
struct CowStr<'a>(Cow<'a, str>);

impl<'de: 'a, 'a> serde::Deserialize<'de> for CowStr<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        #[derive(serde::Deserialize)]
        struct Wrap<'a>(#[serde(borrow)] Cow<'a, str>);
        Wrap::deserialize(d).map(|w| CowStr(w.0))
    }
}

fn read_index<'a>(index_path: &Path, bytes: &'a [u8]) -> Result<(Vec<String>, WeightMap<'a>)> {
    let index_err = |reason: String| -> Error {
        CheckpointError::Index {
            path: index_path.to_path_buf(),
            reason,
        }
        .into()
    };
    if bytes.starts_with(header::LFS_POINTER_PREFIX) {
        return Err(CheckpointError::LfsPointer {
            path: index_path.to_path_buf(),
        }
        .into());
    }
    // Typed, borrowing parse: an index of many thousand entries is read on every open.
    let doc: IndexDoc<'a> = serde_json::from_slice(bytes).map_err(|e| {
        index_err(format!(
            "not a valid index (expected {{\"weight_map\": {{tensor: shard file}}}}): {e}"
        ))
    })?;
    let mut entries = doc
        .weight_map
        .ok_or_else(|| index_err("weight_map: missing".into()))?
        .0;
    // Writers emit the map sorted; a stable sort is linear on sorted input.
    entries.sort_by(|a, b| a.0.cmp(&b.0));
    if let Some(pair) = entries.windows(2).find(|p| p[0].0 == p[1].0) {
        return Err(index_err(format!(
            "weight_map: tensor '{}' is listed twice",
            pair[0].0
        )));
    }
    // Sorted and deduplicated in n log n: an index naming a shard per tensor (a broken or
    // hostile one) must fail fast, not take minutes.
    let mut shards: Vec<String> = entries.iter().map(|(_, f)| f.to_string()).collect();
    shards.sort_unstable();
    shards.dedup();
    if shards.is_empty() {
        return Err(index_err("weight_map: is empty".into()));
    }
    Ok((shards, entries))
}

fn check_index(
    index_path: &Path,
    weight_map: WeightMap<'_>,
    files: &[SafetensorsFile],
    order: &[(u32, u32)],
) -> Result<()> {
    let err = |reason: String| -> Error {
        CheckpointError::Index {
            path: index_path.to_path_buf(),
            reason,
        }
        .into()
    };
    let file_names: Vec<String> = files
        .iter()
        .map(|f| {
            f.path()
                .file_name()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default()
        })
        .collect();
    let stored = |&(fi, ti): &(u32, u32)| -> (&str, &str) {
        let name = files
            .get(fi as usize)
            .and_then(|f| f.tensors().get(ti as usize))
            .map_or("", |t| t.name.as_str());
        (name, file_names.get(fi as usize).map_or("", String::as_str))
    };
    // Both lists are sorted by name: walk them together.
    let (mut i, mut j) = (0, 0);
    loop {
        match (weight_map.get(i), order.get(j).map(stored)) {
            (None, None) => return Ok(()),
            (Some((name, shard)), None) => {
                return Err(err(format!(
                    "names tensor '{name}' in shard '{shard}', but that shard does not contain it"
                )))
            }
            (None, Some((name, file))) => {
                return Err(err(format!(
                    "does not list tensor '{name}' stored in shard '{file}'"
                )))
            }
            (Some((name, shard)), Some((stored_name, file))) => {
                match name.as_ref().cmp(stored_name) {
                    std::cmp::Ordering::Less => {
                        return Err(err(format!(
                    "names tensor '{name}' in shard '{shard}', but that shard does not contain it"
                )))
                    }
                    std::cmp::Ordering::Greater => {
                        return Err(err(format!(
                            "does not list tensor '{stored_name}' stored in shard '{file}'"
                        )))
                    }
                    std::cmp::Ordering::Equal => {
                        if shard != file {
                            return Err(err(format!(
                            "maps tensor '{name}' to shard '{shard}', but it is stored in '{file}'"
                        )));
                        }
                        i += 1;
                        j += 1;
                    }
                }
            }
        }
    }
}

/// Why `path`, which is there but is not a readable regular file, cannot be read as one; None
/// when nothing is at `path`.
fn not_a_file(path: &Path) -> Option<&'static str> {
    let link = std::fs::symlink_metadata(path).ok()?;
    Some(match std::fs::metadata(path) {
        Ok(m) if m.is_dir() => "is a directory, not a file",
        Ok(_) => "is not a regular file",
        Err(e) if link.file_type().is_symlink() && links_loop(&e) => {
            "is a symbolic link that loops (too many levels of links)"
        }
        Err(_) if link.file_type().is_symlink() => {
            "is a broken symbolic link (its target does not exist)"
        }
        Err(_) => "cannot be read",
    })
}

/// Whether `e` says that symbolic links led back to themselves (ELOOP).
fn links_loop(e: &std::io::Error) -> bool {
    #[cfg(unix)]
    {
        e.raw_os_error() == Some(libc::ELOOP)
    }
    #[cfg(not(unix))]
    {
        let _ = e;
        false
    }
}

/// The `*.safetensors` files of a sharded checkpoint directory, sorted.
fn shard_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(|e| io_err(dir, e))? {
        let path = entry.map_err(|e| io_err(dir, e))?.path();
        if path.extension().is_some_and(|x| x == "safetensors") && path.is_file() {
            out.push(path);
        }
    }
    out.sort();
    Ok(out)
}
