//! Error types, one enum per concern, each variant carrying the file, tensor, module or key that
//! went wrong. [`Error`] is what public entry points return; its [`ErrorKind`] decides the Python
//! exception class (`CheckpointError`, `ConfigError`, `UnsupportedSchemeError`, `LayoutError`).

use std::path::PathBuf;

/// A checkpoint file or directory that cannot be read as a valid safetensors checkpoint.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: this is a Git LFS pointer file, not safetensors data (fetch the real file with `git lfs pull`)")]
    LfsPointer { path: PathBuf },
    #[error("{path}: invalid safetensors header: {reason}")]
    Header { path: PathBuf, reason: String },
    #[error("{path}: tensor '{tensor}': {reason}")]
    Tensor {
        path: PathBuf,
        tensor: String,
        reason: String,
    },
    #[error("{path}: {reason}")]
    Index { path: PathBuf, reason: String },
    #[error(
        "{dir}: no weights found (expected model.safetensors or model.safetensors.index.json)"
    )]
    NoWeights { dir: PathBuf },
    #[error("tensor '{name}' is not in the checkpoint")]
    MissingTensor { name: String },
    #[error("module '{module}': {reason}")]
    Module { module: String, reason: String },
    #[error("{path}: {reason}")]
    Output { path: PathBuf, reason: String },
}

/// A `config.json` / `quantization_config` that is malformed. `key` is the dotted path of the
/// offending field, e.g. `quantization_config.config_groups.group_1.weights.num_bits`.
#[derive(Debug, thiserror::Error)]
#[error("{file}: {key}: {reason}")]
pub struct ConfigError {
    pub file: PathBuf,
    pub key: String,
    pub reason: String,
}

/// A well-formed scheme that moeq_rs cannot honour (online transforms, sparse formats, ...).
#[derive(Debug, thiserror::Error)]
#[error("{subject}: {reason}")]
pub struct UnsupportedSchemeError {
    pub subject: String,
    pub reason: String,
}

/// A tensor layout rule broken (shapes, tiles, padding).
#[derive(Debug, thiserror::Error)]
#[error("{subject}: {reason}")]
pub struct LayoutError {
    pub subject: String,
    pub reason: String,
}

/// The CUDA path cannot run here (no driver, no NVRTC) or a kernel failed to compile.
#[derive(Debug, thiserror::Error)]
#[error("{subject}: {reason}")]
pub struct CudaError {
    pub subject: String,
    pub reason: String,
}

/// The error every public entry point returns.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Unsupported(#[from] UnsupportedSchemeError),
    #[error(transparent)]
    Layout(#[from] LayoutError),
    #[error(transparent)]
    Cuda(#[from] CudaError),
    /// Another error, with what also went wrong while cleaning up after it (its kind is the
    /// other error's).
    #[error("{inner}; and {note}")]
    Noted { inner: Box<Error>, note: String },
}

/// Which family an [`Error`] belongs to; the Python layer maps each onto one exception class.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    Checkpoint,
    Config,
    UnsupportedScheme,
    Layout,
    Cuda,
}

impl ErrorKind {
    /// The name of the matching Python exception class in `moeq_rs.errors`.
    pub fn python_class(self) -> &'static str {
        match self {
            ErrorKind::Checkpoint => "CheckpointError",
            ErrorKind::Config => "ConfigError",
            ErrorKind::UnsupportedScheme => "UnsupportedSchemeError",
            ErrorKind::Layout => "LayoutError",
            ErrorKind::Cuda => "CudaUnavailableError",
        }
    }
}

impl Error {
    /// The same error (and kind) with `note` added to its message: what also went wrong while
    /// cleaning up after it.
    pub fn noted(self, note: impl Into<String>) -> Error {
        Error::Noted {
            inner: Box::new(self),
            note: note.into(),
        }
    }

    /// What went wrong while cleaning up after this error (see [`Error::noted`]), if anything.
    pub fn cleanup_note(&self) -> Option<&str> {
        match self {
            Error::Noted { note, .. } => Some(note),
            _ => None,
        }
    }

    pub fn kind(&self) -> ErrorKind {
        match self {
            Error::Checkpoint(_) => ErrorKind::Checkpoint,
            Error::Config(_) => ErrorKind::Config,
            Error::Unsupported(_) => ErrorKind::UnsupportedScheme,
            Error::Layout(_) => ErrorKind::Layout,
            Error::Cuda(_) => ErrorKind::Cuda,
            Error::Noted { inner, .. } => inner.kind(),
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Shorthand used by the module cross-checks.
pub(crate) fn module_error(module: &str, reason: impl Into<String>) -> Error {
    Error::Checkpoint(CheckpointError::Module {
        module: module.to_string(),
        reason: reason.into(),
    })
}
