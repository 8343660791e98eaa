//! One memory-mapped, validated safetensors file and zero-copy views of its tensors.

use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::{Mmap, MmapOptions};

use super::dtype::DType;
use super::header::{self, Header, HeaderIssue, TensorInfo};
use crate::error::CheckpointError;

/// A safetensors file whose header has been validated; tensor bytes stay in the page cache until
/// touched.
#[derive(Debug)]
pub struct SafetensorsFile {
    path: PathBuf,
    mmap: Arc<Mmap>,
    header: Header,
}

fn io_err(path: &Path, source: std::io::Error) -> CheckpointError {
    CheckpointError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn issue_to_error(path: &Path, issue: HeaderIssue) -> CheckpointError {
    if issue.lfs_pointer {
        return CheckpointError::LfsPointer {
            path: path.to_path_buf(),
        };
    }
    match issue.tensor {
        Some(tensor) => CheckpointError::Tensor {
            path: path.to_path_buf(),
            tensor,
            reason: issue.reason,
        },
        None => CheckpointError::Header {
            path: path.to_path_buf(),
            reason: issue.reason,
        },
    }
}

impl SafetensorsFile {
    /// Opens, maps and validates `path`. Only the header is read; tensor data is not touched.
    pub fn open(path: &Path) -> Result<Self, CheckpointError> {
        let mut file = File::open(path).map_err(|e| io_err(path, e))?;
        let file_len = file.metadata().map_err(|e| io_err(path, e))?.len();
        // Read the prefix with plain I/O first: an empty file cannot be mapped, and an LFS pointer
        // or a short file deserves its own message.
        let mut prefix = [0u8; 32];
        let mut got = 0;
        while got < prefix.len() {
            match file.read(&mut prefix[got..]) {
                Ok(0) => break,
                Ok(k) => got += k,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(io_err(path, e)),
            }
        }
        header::header_length(&prefix[..got], file_len).map_err(|i| issue_to_error(path, i))?;
        let file_len_usize = usize::try_from(file_len).map_err(|_| CheckpointError::Header {
            path: path.to_path_buf(),
            reason: "file too large for this platform".into(),
        })?;
        // SAFETY: the mapping is private and read-only; it stays valid as long as the Arc lives.
        // Concurrent truncation of the file by another process is outside our control (as with
        // every mmap-based reader) and is documented in the Python API.
        let mmap = unsafe {
            MmapOptions::new()
                .len(file_len_usize)
                .map_copy_read_only(&file)
        }
        .map_err(|e| io_err(path, e))?;
        let header = header::parse(&mmap).map_err(|i| issue_to_error(path, i))?;
        Ok(SafetensorsFile {
            path: path.to_path_buf(),
            mmap: Arc::new(mmap),
            header,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn header(&self) -> &Header {
        &self.header
    }

    pub fn tensors(&self) -> &[TensorInfo] {
        &self.header.tensors
    }

    /// The shared mapping, for callers (the Python layer) that hand out views outliving `self`.
    pub fn mmap(&self) -> &Arc<Mmap> {
        &self.mmap
    }

    pub fn find(&self, name: &str) -> Option<&TensorInfo> {
        self.header
            .tensors
            .binary_search_by(|t| t.name.as_str().cmp(name))
            .ok()
            .and_then(|i| self.header.tensors.get(i))
    }

    /// Drops the page-cache pages of a tensor from this process's mapping (they are re-read from
    /// the file if touched again), so streaming through a large checkpoint keeps RSS flat.
    pub fn release(&self, info: &TensorInfo) {
        const PAGE: usize = 4096;
        let start = info.start.div_ceil(PAGE) * PAGE;
        let end = (info.start + info.len) / PAGE * PAGE;
        if end > start {
            // SAFETY: the mapping is private and never written through (it is mapped read-only),
            // so MADV_DONTNEED only discards clean copies of file pages; later reads fault them
            // back in from the file. The range lies inside the mapping (validated offsets).
            let _ = unsafe {
                self.mmap.unchecked_advise_range(
                    memmap2::UncheckedAdvice::DontNeed,
                    start,
                    end - start,
                )
            };
        }
    }

    /// A zero-copy view of a tensor of this file.
    pub fn view<'a>(&'a self, info: &'a TensorInfo) -> TensorView<'a> {
        // Offsets were validated against the mapping length in `header::parse`.
        let bytes = self
            .mmap
            .get(info.start..info.start + info.len)
            .unwrap_or(&[]);
        TensorView {
            info,
            path: &self.path,
            bytes,
        }
    }
}

/// A borrowed, validated tensor: dtype, shape and its bytes in the mapped file.
#[derive(Clone, Copy, Debug)]
pub struct TensorView<'a> {
    pub info: &'a TensorInfo,
    pub path: &'a Path,
    pub bytes: &'a [u8],
}

/// Plain element types a [`TensorView`] can be viewed as.
pub trait Element: Copy + 'static {
    const DTYPES: &'static [DType];
}
macro_rules! element {
    ($t:ty, $($d:expr),+) => {
        impl Element for $t {
            const DTYPES: &'static [DType] = &[$($d),+];
        }
    };
}
element!(
    u8,
    DType::U8,
    DType::Bool,
    DType::F8E4M3,
    DType::F8E5M2,
    DType::F8E8M0
);
element!(i8, DType::I8);
element!(u16, DType::U16, DType::BF16, DType::F16);
element!(i16, DType::I16);
element!(i32, DType::I32);
element!(u32, DType::U32, DType::I32, DType::F32);
element!(f32, DType::F32);
element!(i64, DType::I64);
element!(u64, DType::U64);
element!(f64, DType::F64);

#[cfg(not(target_endian = "little"))]
compile_error!(
    "moeq-core reads little-endian safetensors data in place and needs a little-endian target"
);

impl<'a> TensorView<'a> {
    pub fn name(&self) -> &'a str {
        &self.info.name
    }
    pub fn dtype(&self) -> DType {
        self.info.dtype
    }
    pub fn shape(&self) -> &'a [usize] {
        &self.info.shape
    }

    /// The data as a typed slice, without copying. Fails (never casts) when the dtype does not
    /// match or the bytes are not aligned for `T`.
    pub fn typed<T: Element>(&self) -> Result<&'a [T], CheckpointError> {
        let err = |reason: String| CheckpointError::Tensor {
            path: self.path.to_path_buf(),
            tensor: self.info.name.clone(),
            reason,
        };
        if !T::DTYPES.contains(&self.info.dtype) {
            return Err(err(format!(
                "has dtype {}, cannot be read as {}",
                self.info.dtype,
                std::any::type_name::<T>()
            )));
        }
        let size = std::mem::size_of::<T>();
        if !self.bytes.len().is_multiple_of(size) {
            return Err(err(format!(
                "{} bytes is not a whole number of {size}-byte elements",
                self.bytes.len()
            )));
        }
        if !(self.bytes.as_ptr() as usize).is_multiple_of(std::mem::align_of::<T>()) {
            return Err(err(format!(
                "data is not aligned to {} bytes",
                std::mem::align_of::<T>()
            )));
        }
        // SAFETY: `T` is one of the plain integer/float types listed by `Element` (every bit
        // pattern is valid), the pointer is aligned for `T` (checked above), the length is a whole
        // number of elements (checked above), the bytes are little-endian like the target
        // (compile-time check above), and the slice borrows `self.bytes` for 'a, so the mapping
        // outlives it.
        Ok(unsafe {
            std::slice::from_raw_parts(self.bytes.as_ptr().cast::<T>(), self.bytes.len() / size)
        })
    }

    /// Integer values of a small integer tensor (any integer dtype), widened to i64.
    pub fn to_i64_vec(&self) -> Result<Vec<i64>, CheckpointError> {
        let b = self.bytes;
        Ok(match self.info.dtype {
            DType::I64 => b
                .chunks_exact(8)
                .map(|c| i64::from_le_bytes(le8(c)))
                .collect(),
            DType::U64 => b
                .chunks_exact(8)
                .map(|c| i64::try_from(u64::from_le_bytes(le8(c))).unwrap_or(i64::MAX))
                .collect(),
            DType::I32 => b
                .chunks_exact(4)
                .map(|c| i64::from(i32::from_le_bytes(le4(c))))
                .collect(),
            DType::U32 => b
                .chunks_exact(4)
                .map(|c| i64::from(u32::from_le_bytes(le4(c))))
                .collect(),
            DType::I16 => b
                .chunks_exact(2)
                .map(|c| i64::from(i16::from_le_bytes([c[0], c[1]])))
                .collect(),
            DType::U16 => b
                .chunks_exact(2)
                .map(|c| i64::from(u16::from_le_bytes([c[0], c[1]])))
                .collect(),
            DType::I8 => b.iter().map(|&x| i64::from(x as i8)).collect(),
            DType::U8 => b.iter().map(|&x| i64::from(x)).collect(),
            other => {
                return Err(CheckpointError::Tensor {
                    path: self.path.to_path_buf(),
                    tensor: self.info.name.clone(),
                    reason: format!("has dtype {other}, expected an integer dtype"),
                })
            }
        })
    }

    /// [`Self::to_i64_vec`] of integer codes or zero points of a `bits`-bit integer scheme,
    /// every value within its signed range (`-2^(bits-1)..=2^(bits-1)-1`), the range
    /// compressed-tensors' quantiser clamps to: a value beyond it (an 8-bit code of 300, a U8
    /// one of 200) only comes from a damaged checkpoint, and was dequantised as it stood by one
    /// reader, wrapped or clamped by others, or refused by the CPU loader alone.
    pub fn signed_codes(&self, bits: u32) -> Result<Vec<i64>, CheckpointError> {
        let values = self.to_i64_vec()?;
        let (lo, hi) = signed_range(bits);
        match values.iter().position(|v| !(lo..=hi).contains(v)) {
            None => Ok(values),
            Some(i) => Err(CheckpointError::Tensor {
                path: self.path.to_path_buf(),
                tensor: self.info.name.clone(),
                reason: format!(
                    "element {i} is {} ({} storage); {bits}-bit integer codes lie in {lo}..={hi}",
                    values[i], self.info.dtype
                ),
            }),
        }
    }
}

/// The signed range of `bits`-bit integer codes (`-2^(bits-1)..=2^(bits-1)-1`).
pub fn signed_range(bits: u32) -> (i64, i64) {
    let half = 1i64 << bits.clamp(1, 63).saturating_sub(1);
    (-half, half - 1)
}

fn le8(c: &[u8]) -> [u8; 8] {
    let mut a = [0u8; 8];
    a.copy_from_slice(c);
    a
}

fn le4(c: &[u8]) -> [u8; 4] {
    let mut a = [0u8; 4];
    a.copy_from_slice(c);
    a
}
