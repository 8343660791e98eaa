//! Validation of a safetensors file's header, independent of how the bytes were obtained.
//!
//! The checks follow the format's rules and go beyond the reference implementation (see
//! `reference/style_anchors.md` §2.1): duplicate names and unknown entry fields are rejected, and
//! every tensor's absolute offset is checked against its dtype's alignment so that a typed view
//! of the mapped bytes is never a misaligned cast.

use std::collections::BTreeMap;
use std::fmt;

use serde::de::{self, Deserializer, MapAccess, Visitor};
use serde::Deserialize;
use smallvec::SmallVec;

use super::dtype::DType;

/// Largest header accepted (the same cap as the safetensors crate), checked before any allocation.
pub const MAX_HEADER_SIZE: u64 = 100_000_000;

/// The first bytes of a Git LFS pointer file.
pub const LFS_POINTER_PREFIX: &[u8] = b"version https://git-lfs";

/// A tensor shape; inline up to four dimensions (no allocation for the usual 1-D/2-D tensors).
pub type Shape = SmallVec<[usize; 4]>;

/// One tensor of a validated header. `start` is the absolute byte offset in the file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    pub dtype: DType,
    pub shape: Shape,
    pub start: usize,
    pub len: usize,
}

impl TensorInfo {
    pub fn numel(&self) -> usize {
        // Validated at parse time not to overflow.
        self.shape.iter().product()
    }
}

/// A validated header: tensors sorted by name, and the optional `__metadata__` map.
#[derive(Clone, Debug, Default)]
pub struct Header {
    pub tensors: Vec<TensorInfo>,
    pub metadata: BTreeMap<String, String>,
    /// Size of the length prefix plus the JSON header, i.e. where the data section starts.
    pub data_start: usize,
}

/// Why a header is invalid; the caller adds the file path. `tensor` is set when one tensor is at
/// fault.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeaderIssue {
    pub tensor: Option<String>,
    pub reason: String,
    pub lfs_pointer: bool,
}

impl HeaderIssue {
    fn file(reason: impl Into<String>) -> Self {
        HeaderIssue {
            tensor: None,
            reason: reason.into(),
            lfs_pointer: false,
        }
    }
    fn tensor(name: &str, reason: impl Into<String>) -> Self {
        HeaderIssue {
            tensor: Some(name.to_string()),
            reason: reason.into(),
            lfs_pointer: false,
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawEntry<'a> {
    #[serde(borrow)]
    dtype: std::borrow::Cow<'a, str>,
    shape: SmallVec<[u64; 4]>,
    data_offsets: (u64, u64),
}

/// The header object, read entry by entry so that duplicate keys are seen (a plain map would
/// silently keep the last one).
struct RawHeader<'a> {
    entries: Vec<(String, RawEntry<'a>)>,
    metadata: BTreeMap<String, String>,
    duplicate: Option<String>,
}

impl<'de> Deserialize<'de> for RawHeader<'de> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct HeaderVisitor;
        impl<'de> Visitor<'de> for HeaderVisitor {
            type Value = RawHeader<'de>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a JSON object mapping tensor names to {dtype, shape, data_offsets}")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<RawHeader<'de>, A::Error> {
                let mut out = RawHeader {
                    entries: Vec::new(),
                    metadata: BTreeMap::new(),
                    duplicate: None,
                };
                while let Some(key) = map.next_key::<String>()? {
                    if key == "__metadata__" {
                        if !out.metadata.is_empty() {
                            out.duplicate = Some(key.clone());
                        }
                        let meta: Option<BTreeMap<String, String>> = map.next_value()?;
                        out.metadata = meta.unwrap_or_default();
                    } else {
                        let entry: RawEntry = map
                            .next_value()
                            .map_err(|e| de::Error::custom(format!("tensor '{key}': {e}")))?;
                        out.entries.push((key, entry));
                    }
                }
                Ok(out)
            }
        }
        deserializer.deserialize_map(HeaderVisitor)
    }
}

/// Reads the 8-byte length prefix and returns the header length, checked against the cap and the
/// file size. `prefix` is at least the first 8 bytes of the file.
pub fn header_length(prefix: &[u8], file_len: u64) -> Result<usize, HeaderIssue> {
    if prefix.starts_with(LFS_POINTER_PREFIX) {
        return Err(HeaderIssue {
            tensor: None,
            reason: "Git LFS pointer".into(),
            lfs_pointer: true,
        });
    }
    let Some(len_bytes) = prefix.get(..8) else {
        return Err(HeaderIssue::file(format!(
            "file is {file_len} bytes, shorter than the 8-byte header length prefix (truncated?)"
        )));
    };
    let mut le = [0u8; 8];
    le.copy_from_slice(len_bytes);
    let n = u64::from_le_bytes(le);
    if n > MAX_HEADER_SIZE {
        return Err(HeaderIssue::file(format!(
            "header length {n} exceeds the {MAX_HEADER_SIZE}-byte limit"
        )));
    }
    let end = n.saturating_add(8);
    if end > file_len {
        return Err(HeaderIssue::file(format!(
            "header length {n} runs past the end of the {file_len}-byte file (truncated?)"
        )));
    }
    usize::try_from(n).map_err(|_| HeaderIssue::file("header length does not fit in memory"))
}

/// Validates a whole file image: `bytes` is the complete file content.
pub fn parse(bytes: &[u8]) -> Result<Header, HeaderIssue> {
    let file_len = bytes.len() as u64;
    let n = header_length(bytes, file_len)?;
    let data_start = 8 + n; // cannot overflow: n + 8 <= file_len
    let json = bytes
        .get(8..data_start)
        .ok_or_else(|| HeaderIssue::file("header runs past the end of the file"))?;
    parse_json(json, data_start, bytes.len())
}

/// Validates the JSON header given the data section's absolute start and the file length.
pub fn parse_json(json: &[u8], data_start: usize, file_len: usize) -> Result<Header, HeaderIssue> {
    let text = std::str::from_utf8(json)
        .map_err(|e| HeaderIssue::file(format!("header is not valid UTF-8 ({e})")))?;
    let raw: RawHeader = serde_json::from_str(text)
        .map_err(|e| HeaderIssue::file(format!("header is not valid JSON: {e}")))?;
    if let Some(dup) = raw.duplicate {
        return Err(HeaderIssue::tensor(
            &dup,
            "appears more than once in the header",
        ));
    }
    let data_len = file_len - data_start;

    let mut tensors = Vec::with_capacity(raw.entries.len());
    for (name, entry) in raw.entries {
        let dtype = DType::from_header(&entry.dtype).ok_or_else(|| {
            HeaderIssue::tensor(&name, format!("unknown dtype '{}'", entry.dtype))
        })?;
        let (begin, end) = entry.data_offsets;
        if end < begin {
            return Err(HeaderIssue::tensor(
                &name,
                format!("data_offsets [{begin}, {end}] end before they begin"),
            ));
        }
        let mut shape = Shape::new();
        let mut numel: usize = 1;
        for &d in &entry.shape {
            let d = usize::try_from(d)
                .map_err(|_| HeaderIssue::tensor(&name, format!("dimension {d} is too large")))?;
            numel = numel.checked_mul(d).ok_or_else(|| {
                HeaderIssue::tensor(&name, format!("shape {:?} overflows", entry.shape))
            })?;
            shape.push(d);
        }
        let bits = numel.checked_mul(dtype.bit_size()).ok_or_else(|| {
            HeaderIssue::tensor(&name, format!("shape {:?} overflows", entry.shape))
        })?;
        if bits % 8 != 0 {
            return Err(HeaderIssue::tensor(
                &name,
                format!("{numel} elements of {dtype} do not fill whole bytes"),
            ));
        }
        let nbytes = (bits / 8) as u64;
        if end - begin != nbytes {
            return Err(HeaderIssue::tensor(
                &name,
                format!(
                    "dtype {dtype} x shape {:?} is {nbytes} bytes but data_offsets [{begin}, {end}] span {} bytes",
                    shape,
                    end - begin
                ),
            ));
        }
        if end > data_len as u64 {
            return Err(HeaderIssue::tensor(
                &name,
                format!(
                    "data_offsets [{begin}, {end}] run past the end of the {data_len}-byte data section (truncated file?)"
                ),
            ));
        }
        // Both fit in usize: end <= data_len.
        let start = data_start + begin as usize;
        if !start.is_multiple_of(dtype.alignment()) {
            return Err(HeaderIssue::tensor(
                &name,
                format!(
                    "data at file offset {start} is not aligned to {} bytes for {dtype}; rewrite the file with a current safetensors writer",
                    dtype.alignment()
                ),
            ));
        }
        tensors.push(TensorInfo {
            name,
            dtype,
            shape,
            start,
            len: nbytes as usize,
        });
    }

    // Writers mostly emit names in order: a stable sort is near-linear on such runs.
    tensors.sort_by(|a, b| a.name.cmp(&b.name));
    // Duplicate names: adjacent after sorting (a JSON map would silently keep the last one).
    if let Some(pair) = tensors.windows(2).find(|p| p[0].name == p[1].name) {
        return Err(HeaderIssue::tensor(
            &pair[0].name,
            "appears more than once in the header",
        ));
    }

    // Offsets must tile the data section exactly: in order, contiguous, no overlaps, no holes.
    let mut order: Vec<usize> = (0..tensors.len()).collect();
    order.sort_by_key(|&i| (tensors[i].start, tensors[i].start + tensors[i].len));
    let mut expected = data_start;
    for &i in &order {
        let t = &tensors[i];
        if t.start != expected {
            let what = if t.start < expected {
                "overlaps the previous tensor"
            } else {
                "leaves a gap after the previous tensor"
            };
            return Err(HeaderIssue::tensor(
                &t.name,
                format!(
                    "data_offsets start at {} but the previous tensor ends at {}: {what}",
                    t.start - data_start,
                    expected - data_start
                ),
            ));
        }
        expected = t.start + t.len;
    }
    if expected != file_len {
        return Err(HeaderIssue::file(format!(
            "{} trailing bytes after the last tensor (the data section must end with the file)",
            file_len - expected
        )));
    }

    Ok(Header {
        tensors,
        metadata: raw.metadata,
        data_start,
    })
}
