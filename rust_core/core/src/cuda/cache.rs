//! The CUBIN cache: in memory per process and on disk, keyed by everything that changes the
//! binary (source with its defines, options, architecture, NVRTC version, crate version).
//! Disk: `$MOEQ_CACHE_DIR`, else `$XDG_CACHE_HOME/moeq_rs/cubin`, else `~/.cache/moeq_rs/cubin`;
//! files are written to a temporary name and renamed, so a reader never sees half a file.
//! `MOEQ_NO_DISK_CACHE=1` turns the disk level off.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use super::kernels::Variant;
use super::nvrtc::{compile, Compiled, Nvrtc};
use crate::error::CudaError;

/// FNV-1a, 64 bit: a stable hash (std's is not stable across releases).
fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in parts {
        for &b in *p {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        h ^= 0xff;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// The cache key of `v` compiled for `arch` by `nvrtc`.
pub fn key(v: &Variant, arch: &str, nvrtc: &Nvrtc) -> String {
    let defines: String = v
        .defines
        .iter()
        .map(|(k, d)| format!("-D{k}={d};"))
        .collect();
    let version = format!("{}.{}", nvrtc.major, nvrtc.minor);
    let options = super::nvrtc::FIXED_OPTIONS.join(" ");
    let h = fnv1a(&[
        v.source().as_bytes(),
        defines.as_bytes(),
        arch.as_bytes(),
        version.as_bytes(),
        env!("CARGO_PKG_VERSION").as_bytes(),
        options.as_bytes(),
    ]);
    format!("{}-{arch}-{h:016x}", v.name)
}

/// The disk cache directory, unless turned off.
pub fn dir() -> Option<PathBuf> {
    if std::env::var_os("MOEQ_NO_DISK_CACHE").is_some_and(|v| v != "0") {
        return None;
    }
    if let Some(d) = std::env::var_os("MOEQ_CACHE_DIR") {
        return Some(PathBuf::from(d));
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("moeq_rs").join("cubin"))
}

/// A CUBIN from the cache, compiling (and storing) it on a miss. Returns the binary and whether
/// it was a hit.
pub fn cubin(v: &Variant, arch: &str, nvrtc: &Nvrtc) -> Result<(Arc<Vec<u8>>, bool), CudaError> {
    static MEMORY: Mutex<Option<HashMap<String, Arc<Vec<u8>>>>> = Mutex::new(None);
    let k = key(v, arch, nvrtc);
    if let Ok(guard) = MEMORY.lock() {
        if let Some(c) = guard.as_ref().and_then(|m| m.get(&k)) {
            return Ok((Arc::clone(c), true));
        }
    }
    let disk = dir().map(|d| d.join(format!("{k}.cubin")));
    let from_disk = disk
        .as_ref()
        .and_then(|p| std::fs::read(p).ok())
        .filter(|b| b.starts_with(b"\x7fELF"));
    let (bytes, hit) = match from_disk {
        Some(b) => (b, true),
        None => {
            let Compiled { cubin, .. } = compile(&v.name, &v.source(), arch, &v.defines)?;
            if let Some(p) = &disk {
                store(p, &cubin);
            }
            (cubin, false)
        }
    };
    let bytes = Arc::new(bytes);
    if let Ok(mut guard) = MEMORY.lock() {
        guard
            .get_or_insert_with(HashMap::new)
            .insert(k, Arc::clone(&bytes));
    }
    Ok((bytes, hit))
}

/// Writes `bytes` to `path` through a temporary file and a rename; a failure only loses the
/// cache entry.
pub(crate) fn store(path: &std::path::Path, bytes: &[u8]) {
    let Some(parent) = path.parent() else {
        return;
    };
    if std::fs::create_dir_all(parent).is_err() {
        return;
    }
    let tmp = parent.join(format!(
        ".{}.{}.tmp",
        path.file_name().and_then(|n| n.to_str()).unwrap_or("cubin"),
        std::process::id()
    ));
    if std::fs::write(&tmp, bytes).is_ok() && std::fs::rename(&tmp, path).is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_change_with_every_input() {
        let n = Nvrtc {
            major: 13,
            minor: 2,
            path: None,
        };
        let vs = super::super::kernels::variants();
        let a = key(&vs[0], "sm_90", &n);
        assert_eq!(a, key(&vs[0], "sm_90", &n));
        assert_ne!(a, key(&vs[0], "sm_80", &n));
        assert_ne!(a, key(&vs[1], "sm_90", &n));
        let older = Nvrtc {
            minor: 0,
            ..n.clone()
        };
        assert_ne!(a, key(&vs[0], "sm_90", &older));
        let names: std::collections::BTreeSet<_> = vs.iter().map(|v| v.name.clone()).collect();
        assert_eq!(names.len(), vs.len(), "variant names are unique");
    }
}
