//! `moeq repack`: a whole checkpoint to the Marlin layout (or the CPU layout), one MoE layer at
//! a time, written through a temporary directory beside the output that is renamed at the end.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Instant;

use rayon::prelude::*;
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
    /// What the repack wrote or moved and could not remove (the earlier output that `--force`
    /// replaced, moved aside), with the reason: the output itself is complete.
    pub leftover: Option<String>,
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

/// The longest file name (bytes) of the file systems a checkpoint lives on (ext4, xfs, btrfs,
/// tmpfs, NFS).
const NAME_MAX: usize = 255;
/// The most digits of a pid (Linux's pid_max is at most 2^22).
const PID_DIGITS: usize = 7;

/// Removes the temporary directory unless the repack was committed.
struct TempDir {
    path: PathBuf,
    committed: bool,
}

impl TempDir {
    /// Removes the uncommitted directory now; why it could not be, if so.
    fn discard(&mut self) -> Option<String> {
        if self.committed {
            return None;
        }
        // Not again on drop, whatever happens here.
        self.committed = true;
        match std::fs::remove_dir_all(&self.path) {
            Ok(()) => None,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => Some(format!(
                "the temporary directory {} could not be removed ({e}); remove it by hand",
                self.path.display()
            )),
        }
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        // Nothing to report from a drop; `discard` is a no-op once committed.
        let _ = self.discard();
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

/// The layout `moeq repack` writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    Marlin,
    Cpu,
}

impl Target {
    pub fn name(self) -> &'static str {
        match self {
            Target::Marlin => "marlin",
            Target::Cpu => "cpu",
        }
    }
}

/// One MoE layer to convert, with its target geometry.
enum Job<'a> {
    Marlin(&'a crate::moe::MoeLayer, MarlinGeometry),
    Cpu(&'a crate::moe::MoeLayer, super::cpu::CpuGeometry),
}

impl Job<'_> {
    fn layer(&self) -> &crate::moe::MoeLayer {
        match self {
            Job::Marlin(l, _) | Job::Cpu(l, _) => l,
        }
    }
    fn specs(&self) -> Vec<(String, crate::checkpoint::dtype::DType, Vec<usize>)> {
        match self {
            Job::Marlin(_, g) => g.specs(),
            Job::Cpu(_, g) => g.specs(),
        }
    }
}

/// Repacks `model` into `out_dir` in the Marlin layout.
pub fn repack_marlin(
    model: &Model,
    out_dir: &Path,
    opts: &RepackOptions,
    progress: &mut dyn FnMut(&Progress) -> Result<()>,
) -> Result<RepackReport> {
    repack(model, out_dir, Target::Marlin, opts, progress)
}

/// Removes what a repack to `parent/name` killed before it could clean up (SIGKILL, a power
/// loss) left behind: `.<name>.moeq-tmp-<pid>` and `.<name>.moeq-old-<pid>` of processes that
/// no longer exist (hundreds of MB each, hidden, and never reused: the next run has another
/// pid). A live process's are left alone: it may be repacking there now; and so is anything
/// written in the last ten minutes, since a pid names a process only on this machine and in
/// this PID namespace (another container or host may be writing to a shared volume); and so
/// is any that is, or holds, one of `sources` ([`source_paths`]): a source checkpoint that
/// happens to carry such a name (or a symlink to one) is read, never removed.
fn remove_abandoned(parent: &Path, name: &str, sources: &[PathBuf]) {
    let Ok(entries) = std::fs::read_dir(parent) else {
        return;
    };
    let prefixes = [staged_prefix(name, TMP), staged_prefix(name, OLD)];
    for entry in entries.flatten() {
        let file = entry.file_name();
        let pid = file.to_str().and_then(|f| {
            prefixes
                .iter()
                .find_map(|p| f.strip_prefix(p.as_str()))
                .and_then(|p| p.parse::<u32>().ok())
        });
        if let Some(pid) = pid {
            let holds_source = || {
                entry
                    .path()
                    .canonicalize()
                    .map_or(true, |c| sources.iter().any(|s| s.starts_with(&c)))
            };
            if pid != std::process::id()
                && !process_exists(pid)
                && untouched_for(&entry.path(), 600)
                && !holds_source()
            {
                let _ = remove_entry(&entry.path());
            }
        }
    }
}

/// The kinds of directory a repack keeps beside OUT_DIR: the output being written, and an
/// earlier output moved aside by `--force`.
const TMP: &str = "tmp";
const OLD: &str = "old";

/// `.<name>.moeq-<kind>-`, which the pid of the repack completes: the names a repack to
/// `name` works under beside it.
fn staged_prefix(name: &str, kind: &str) -> String {
    format!(".{name}.moeq-{kind}-")
}

/// Where this process keeps its `kind` of directory beside `parent/name`.
fn staged_path(parent: &Path, name: &str, kind: &str) -> PathBuf {
    parent.join(format!(
        "{}{}",
        staged_prefix(name, kind),
        std::process::id()
    ))
}

/// The staging directories this process's repacks are writing. Their names carry the pid only,
/// so two repacks to one OUT_DIR from two threads shared one: the second removed the first's
/// files, and one of them could commit a mix of both.
static STAGING: std::sync::Mutex<Vec<PathBuf>> = std::sync::Mutex::new(Vec::new());

/// This process's claim on a staging directory, released when dropped.
struct StagingClaim(PathBuf);

impl StagingClaim {
    /// Claims `staged` (beside `out_dir`), or says that another repack of this process is
    /// writing `out_dir`.
    fn new(staged: &Path, out_dir: &Path) -> Result<StagingClaim> {
        // The same directory however it was spelled (relative, through a symlinked parent).
        let key = match (staged.parent(), staged.file_name()) {
            (Some(dir), Some(file)) => std::fs::canonicalize(dir)
                .map(|d| d.join(file))
                .unwrap_or_else(|_| staged.to_path_buf()),
            _ => staged.to_path_buf(),
        };
        let mut held = STAGING
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if held.contains(&key) {
            return Err(output_error(
                out_dir,
                "another repack in this process is writing it; wait for that one to finish",
            ));
        }
        held.push(key.clone());
        Ok(StagingClaim(key))
    }
}

impl Drop for StagingClaim {
    fn drop(&mut self) {
        STAGING
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .retain(|p| *p != self.0);
    }
}

/// Removes a directory tree, or the file or symlink `path` names (never what a link points to).
fn remove_entry(path: &Path) -> std::io::Result<()> {
    if path.is_dir() && !path.is_symlink() {
        std::fs::remove_dir_all(path)
    } else {
        std::fs::remove_file(path)
    }
}

/// What went wrong with the earlier output `--force` moved aside to `old`.
fn moved_aside(old: &Path, failure: &str) -> String {
    format!(
        "the earlier output, moved aside to {}, could not be {failure}",
        old.display()
    )
}

/// Why `--force` must not replace the existing `out_dir`, or None where it may: a symlink (the
/// link is replaced, not what it points to), an empty directory, or an earlier `moeq repack`
/// output (its `config.json` has a `"moeq"` object, and it holds files only, as a repack
/// writes). Anything else may be someone's data: a mistyped OUT_DIR would have deleted a
/// directory of models. A mount point cannot be replaced at all.
fn not_replaceable(out_dir: &Path) -> Option<String> {
    if out_dir.is_symlink() {
        return None;
    }
    if !out_dir.is_dir() {
        return Some("is a file, not a directory".into());
    }
    if is_mount_point(out_dir) {
        // rename(2) cannot move a mount point (EBUSY); refused up front (see `MOUNT_POINT`).
        return Some("is a mount point, which a rename cannot replace".into());
    }
    let entries: Vec<std::fs::DirEntry> = match std::fs::read_dir(out_dir) {
        Ok(entries) => match entries.collect() {
            Ok(v) => v,
            Err(e) => return Some(format!("cannot be listed ({e})")),
        },
        Err(e) => return Some(format!("cannot be listed ({e})")),
    };
    if entries.is_empty() {
        return None;
    }
    // A repack writes files only (shards, config, index, the source's top-level side files).
    if let Some(e) = entries
        .iter()
        .find(|e| !e.file_type().is_ok_and(|t| t.is_file()))
    {
        return Some(format!(
            "holds {}, which is not a file a repack writes",
            e.path().display()
        ));
    }
    let config = out_dir.join(CONFIG_FILE);
    // (A config.json too large to be one is not ours; it is not read.)
    let written_by_us = std::fs::metadata(&config)
        .is_ok_and(|m| m.len() <= 1 << 24)
        .then(|| std::fs::read(&config).ok())
        .flatten()
        .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
        .is_some_and(|v| v.get("moeq").is_some_and(|m| m.is_object()));
    if !written_by_us {
        return Some(
            "is neither empty nor a checkpoint written by moeq repack (no \"moeq\" entry in its \
             config.json)"
                .into(),
        );
    }
    // Its files are removed after the commit: without the permission, the earlier output
    // would be left moved aside, hidden, once the new one is in place.
    if let Err(e) = may_remove_entries(out_dir, &entries) {
        return Some(format!("holds files this user may not remove ({e})"));
    }
    None
}

/// Why a repack does not replace what came to be at OUT_DIR after its checks.
const APPEARED: &str =
    "appeared while the repack ran; not replaced (remove it, or run again with --force to \
     replace it)";

/// The error of the rename that commits the output: something that took OUT_DIR in the
/// meantime is named as such, not as the OS's "Directory not empty".
fn commit_error(out_dir: &Path, e: std::io::Error) -> Error {
    // EEXIST is `AlreadyExists`; a plain rename onto a non-empty directory says ENOTEMPTY.
    let taken =
        e.kind() == std::io::ErrorKind::AlreadyExists || e.raw_os_error() == Some(libc::ENOTEMPTY);
    if taken {
        output_error(out_dir, APPEARED)
    } else {
        io(out_dir, e)
    }
}

/// Renames `from` to `to` unless something is at `to`: then `AlreadyExists`, where a plain
/// rename would silently replace an empty directory that appeared there. Linux's
/// `renameat2(RENAME_NOREPLACE)` makes the check and the rename one step; where it is missing
/// (another OS, an old kernel, a file system without the flag) the check comes just before.
fn rename_no_replace(from: &Path, to: &Path) -> std::io::Result<()> {
    #[cfg(any(target_os = "linux", target_os = "android"))]
    {
        use std::os::unix::ffi::OsStrExt;
        let cstr = |p: &Path| {
            std::ffi::CString::new(p.as_os_str().as_bytes())
                .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))
        };
        let (a, b) = (cstr(from)?, cstr(to)?);
        // SAFETY: both paths are NUL-terminated strings that outlive the call, which only
        // reads them; the syscall (as opposed to glibc's wrapper, 2.28+) works on any glibc.
        let r = unsafe {
            libc::syscall(
                libc::SYS_renameat2,
                libc::AT_FDCWD,
                a.as_ptr(),
                libc::AT_FDCWD,
                b.as_ptr(),
                libc::RENAME_NOREPLACE,
            )
        };
        if r == 0 {
            return Ok(());
        }
        let e = std::io::Error::last_os_error();
        if !matches!(e.raw_os_error(), Some(libc::ENOSYS | libc::EINVAL)) {
            return Err(e);
        }
    }
    if to.exists() || to.is_symlink() {
        return Err(std::io::ErrorKind::AlreadyExists.into());
    }
    std::fs::rename(from, to)
}

/// Whether this process may remove the entries of `dir`: write and search permission on it
/// (`access(2)`, for this process's user; a read-only mount fails too), and on Linux no
/// immutable or append-only flag on it or on any of its files, which stop even root.
#[cfg(unix)]
fn may_remove_entries(dir: &Path, entries: &[std::fs::DirEntry]) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(dir.as_os_str().as_bytes())
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    // SAFETY: `path` is a NUL-terminated string that outlives the call; access only reads it.
    if unsafe { libc::access(path.as_ptr(), libc::W_OK | libc::X_OK) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    #[cfg(any(target_os = "linux", target_os = "android"))]
    for p in std::iter::once(dir.to_path_buf()).chain(entries.iter().map(|e| e.path())) {
        if pinned(&p) {
            return Err(std::io::Error::new(
                std::io::ErrorKind::PermissionDenied,
                format!("{} is immutable or append-only (chattr)", p.display()),
            ));
        }
    }
    #[cfg(not(any(target_os = "linux", target_os = "android")))]
    let _ = entries;
    Ok(())
}

/// Whether `path` carries the immutable or append-only inode flag (`chattr +i` / `+a`), read
/// with FS_IOC_GETFLAGS; false where it cannot be read (a file system without such flags).
#[cfg(any(target_os = "linux", target_os = "android"))]
fn pinned(path: &Path) -> bool {
    use std::os::unix::fs::OpenOptionsExt;
    use std::os::unix::io::AsRawFd;
    const FS_IMMUTABLE_FL: libc::c_int = 0x10;
    const FS_APPEND_FL: libc::c_int = 0x20;
    let Ok(f) = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOFOLLOW)
        .open(path)
    else {
        return false;
    };
    let mut flags: libc::c_int = 0;
    // SAFETY: `f` is an open descriptor for the call's duration, and FS_IOC_GETFLAGS writes
    // one int (the kernel's size for it, whatever the ioctl number says) into `flags`.
    let r = unsafe { libc::ioctl(f.as_raw_fd(), libc::FS_IOC_GETFLAGS, &mut flags) };
    r == 0 && flags & (FS_IMMUTABLE_FL | FS_APPEND_FL) != 0
}

#[cfg(not(unix))]
fn may_remove_entries(_dir: &Path, _entries: &[std::fs::DirEntry]) -> std::io::Result<()> {
    Ok(())
}

/// Why an OUT_DIR that is a mount point is refused, before any work: rename(2) cannot replace
/// it (EBUSY), which the commit found out only after the whole repack.
const MOUNT_POINT: &str = "is a mount point (a volume or bind mount), which a rename cannot \
                           replace; write to a new directory inside it";

/// Whether `dir` is a mount point: on another file system than its parent, or (a bind mount
/// of the same file system) listed in `/proc/self/mountinfo`.
#[cfg(unix)]
fn is_mount_point(dir: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    let parent = dir.join("..");
    let other_fs = match (std::fs::metadata(dir), std::fs::metadata(parent)) {
        (Ok(d), Ok(p)) => d.dev() != p.dev() || d.ino() == p.ino(),
        _ => false,
    };
    other_fs || listed_mount_point(dir)
}

/// Whether `/proc/self/mountinfo` (Linux; absent elsewhere) lists `dir` as a mount point.
#[cfg(unix)]
fn listed_mount_point(dir: &Path) -> bool {
    use std::os::unix::ffi::OsStrExt;
    let (Ok(dir), Ok(info)) = (dir.canonicalize(), std::fs::read("/proc/self/mountinfo")) else {
        return false;
    };
    // The fifth field of each line, with space, tab, newline and backslash as octal escapes.
    info.split(|&b| b == b'\n')
        .filter_map(|line| line.split(|&b| b == b' ').nth(4))
        .any(|field| {
            let mut path = Vec::with_capacity(field.len());
            let mut i = 0;
            while i < field.len() {
                let octal = field
                    .get(i + 1..i + 4)
                    .filter(|d| field[i] == b'\\' && d.iter().all(|c| (b'0'..=b'7').contains(c)));
                match octal {
                    Some(d) => {
                        path.push(d.iter().fold(0u8, |v, c| v.wrapping_mul(8) + (c - b'0')));
                        i += 4;
                    }
                    None => {
                        path.push(field[i]);
                        i += 1;
                    }
                }
            }
            Path::new(std::ffi::OsStr::from_bytes(&path)) == dir
        })
}

#[cfg(not(unix))]
fn is_mount_point(_dir: &Path) -> bool {
    false
}

/// Whether nothing in `path` (it, or an entry directly inside it) was modified in the last
/// `seconds` seconds. Unreadable times count as recent.
fn untouched_for(path: &Path, seconds: u64) -> bool {
    let recent = |m: std::io::Result<std::fs::Metadata>| {
        m.and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.elapsed().ok())
            .is_none_or(|age| age.as_secs() < seconds)
    };
    if recent(std::fs::symlink_metadata(path)) {
        return false;
    }
    match std::fs::read_dir(path) {
        Ok(entries) => !entries.flatten().any(|e| recent(e.metadata())),
        Err(_) => true,
    }
}

/// Whether process `pid` exists (on other systems than Unix: assumed to, so nothing is removed).
fn process_exists(pid: u32) -> bool {
    #[cfg(unix)]
    {
        let Ok(pid) = libc::pid_t::try_from(pid) else {
            return true;
        };
        // SAFETY: signal 0 sends nothing; kill only checks that the process exists (ESRCH when
        // it does not; EPERM when it exists but is another user's).
        let r = unsafe { libc::kill(pid, 0) };
        r == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
    }
    #[cfg(not(unix))]
    {
        let _ = pid;
        true
    }
}

/// Why the oracle refuses a layer's scheme on every platform (its method is `unsupported`),
/// or `None`.
fn unsupported_scheme(l: &crate::moe::MoeLayer) -> Option<String> {
    use crate::oracle::{CpuFeatures, Method, Options, Platform};
    let plan = crate::oracle::plan_layer(
        &Model::layer_input(l),
        Platform::Cpu(CpuFeatures::detect()),
        Options::default(),
    );
    (plan.method == Method::Unsupported).then(|| {
        plan.error
            .unwrap_or_else(|| "the scheme is not supported".into())
    })
}

/// Repacks `model` into `out_dir` in the `target` layout. The CPU layout prepacks the W8A8
/// layers and copies every other tensor unchanged.
pub fn repack(
    model: &Model,
    out_dir: &Path,
    target: Target,
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
        let why = if parent.exists() {
            "is not a directory"
        } else {
            "does not exist"
        };
        return Err(output_error(
            out_dir,
            format!("the parent directory {} {why}", parent.display()),
        ));
    }
    // The repack writes through `.<name>.moeq-tmp-<pid>` beside OUT_DIR (and moves an earlier
    // output aside as `.<name>.moeq-old-<pid>`), which must fit a file name's 255 bytes too.
    // Counted with the widest pid (7 digits, Linux's pid_max limit), so that a name accepted
    // once is accepted on every run.
    let staged_len = staged_prefix(&name, TMP).len() + PID_DIGITS;
    if staged_len > NAME_MAX {
        return Err(output_error(
            out_dir,
            format!(
                "its name is {} bytes, too long for the temporary directory the repack writes \
                 beside it (.<name>.moeq-tmp-<pid>, up to {staged_len} bytes; a file name holds \
                 {NAME_MAX}): use a name of at most {} bytes",
                name.len(),
                name.len() - (staged_len - NAME_MAX)
            ),
        ));
    }
    if opts.max_shard_size == 0 {
        return Err(output_error(out_dir, "max shard size must be positive"));
    }
    // A copy of a model without MoE layers is not a repacked checkpoint anyone wants, and
    // once marked as one it could never be repacked again. (A MoE whose layers the layout
    // leaves in source form, mixed per-expert schemes say, still loads from the output.)
    if model.moe_layers().is_empty() {
        return Err(crate::error::UnsupportedSchemeError {
            subject: ckpt.dir().display().to_string(),
            reason: "has no MoE layers: there is nothing to repack".into(),
        }
        .into());
    }

    let tmp_path = staged_path(&parent, &name, TMP);
    // Held to the end, the commit and the removal of a moved-aside earlier output included.
    let _claim = StagingClaim::new(&tmp_path, out_dir)?;
    // And across processes (see `out_lock`): from here on, no other repack writes OUT_DIR.
    // Taken before OUT_DIR is looked at, so that what the checks below see (whether it exists,
    // what --force would replace) cannot be changed by a repack that commits while this one
    // plans: that change would only show at this one's commit, after all its work.
    let _lock = super::out_lock::acquire(&super::out_lock::lock_path(&parent, &name))
        .map_err(|busy| output_error(out_dir, busy.to_string()))?;
    // The directory entry OUT_DIR names, which the checks look at and the commit replaces:
    // `out/.` would rename `.` (EBUSY), and `link/` follows a symlink that `link` replaces.
    let entry = parent.join(out_dir.file_name().unwrap_or_default());
    // What the commit may replace: only an OUT_DIR that --force was given for.
    let existed = entry.exists() || entry.is_symlink();
    if existed {
        if !opts.force {
            return Err(output_error(
                out_dir,
                "already exists (pass --force, or force=True in Python, to replace it)",
            ));
        }
        // The entry that the commit replaces: a symlink OUT_DIR is replaced, not followed.
        let resolved = parent.canonicalize().map(|p| p.join(&name));
        if let (Ok(a), Ok(b)) = (resolved, ckpt.dir().canonicalize()) {
            if a == b || entry.canonicalize().is_ok_and(|t| t == b) {
                return Err(output_error(
                    out_dir,
                    "is the source checkpoint; write elsewhere",
                ));
            }
            // Replacing OUT_DIR deletes it: it must hold none of the files being read (an
            // ancestor of the source directory, one of its shards, or a side file that a
            // source file links to, was deleted before).
            for source in source_paths(ckpt) {
                if source.starts_with(&a) {
                    return Err(output_error(
                        out_dir,
                        format!(
                            "holds {} of the source checkpoint, which --force would delete; \
                             write elsewhere",
                            source.display()
                        ),
                    ));
                }
            }
        }
        if !entry.is_symlink() && is_mount_point(&entry) {
            return Err(output_error(out_dir, MOUNT_POINT));
        }
        if let Some(why) = not_replaceable(&entry) {
            return Err(output_error(
                out_dir,
                format!(
                    "{why}, so --force will not delete it; remove it yourself or write elsewhere"
                ),
            ));
        }
    }

    // Decide everything before writing anything.
    let mut layers = Vec::new();
    for l in model.moe_layers() {
        // A layer whose scheme the oracle refuses (dynamic weight quantization, say) stays as
        // it is: converted, it would plan and load as a scheme it is not. Marlin refuses it;
        // the CPU layout leaves it in its source form, which the plan and the loader refuse.
        if let Some(why) = unsupported_scheme(l) {
            match target {
                Target::Marlin => {
                    return Err(crate::error::UnsupportedSchemeError {
                        subject: format!("{} (layer {})", l.prefix, l.layer),
                        reason: why,
                    }
                    .into())
                }
                Target::Cpu => continue,
            }
        }
        // A layer with a part no kernel computes (projection biases): Marlin refuses it; the CPU
        // layout leaves it in its source form, which the CPU loader refuses.
        match (target, model.unsupported_part(&l.prefix)) {
            (Target::Marlin, Some(part)) => return Err(part.error().into()),
            (Target::Cpu, Some(_)) => {}
            (Target::Marlin, None) => layers.push(Job::Marlin(l, geometry(l)?)),
            (Target::Cpu, None) => {
                if let Some(g) = super::cpu::geometry(l) {
                    layers.push(Job::Cpu(l, g));
                }
            }
        }
    }
    let mut replaced: BTreeSet<&str> = BTreeSet::new();
    for job in &layers {
        for e in &job.layer().experts {
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
    for job in &layers {
        specs.extend(job.specs());
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
    // Tensor bytes only, as `written` counts them (the shard sizes include their headers, so
    // the progress never reached its total).
    let bytes_total: u64 = plan.slots.values().map(|s| s.nbytes).sum();

    remove_abandoned(&parent, &name, &source_paths(ckpt));
    if tmp_path.exists() {
        std::fs::remove_dir_all(&tmp_path).map_err(|e| io(&tmp_path, e))?;
    }
    // (The error names OUT_DIR, which the user typed, rather than the hidden directory.)
    std::fs::create_dir(&tmp_path).map_err(|e| {
        output_error(
            out_dir,
            format!("cannot write in {}: {e}", parent.display()),
        )
    })?;
    let mut tmp = TempDir {
        path: tmp_path.clone(),
        committed: false,
    };

    // Everything from here writes into the temporary directory; on failure it is removed, and
    // a removal that fails is added to the error (hundreds of MB would stay behind unsaid).
    let result = (|| -> Result<RepackReport> {
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
        // What the copies and then each layer wrote: verify's progress, in the same bytes.
        let mut written_by = vec![written];
        for job in &layers {
            let l = job.layer();
            // The source pages of an expert are dropped as soon as it is converted.
            let mut release = |e: usize| {
                if let Some(x) = l.experts.get(e) {
                    for (f, t) in expert_tensors(ckpt, x) {
                        f.release(t);
                    }
                }
            };
            match job {
                Job::Marlin(_, g) => {
                    let mut sink = |e: usize, name: &str, data: &[u8]| -> Result<()> {
                        writer.write_part(name, (e * data.len()) as u64, data)?;
                        written += data.len() as u64;
                        Ok(())
                    };
                    convert_layer(ckpt, l, g, version.as_deref(), &mut sink, &mut release)?;
                    let weights =
                        l.experts
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
                }
                Job::Cpu(_, g) => {
                    let mut sink = |name: &str, offset: u64, data: &[u8]| -> Result<()> {
                        writer.write_part(name, offset, data)?;
                        written += data.len() as u64;
                        Ok(())
                    };
                    super::cpu::convert_layer(
                        ckpt,
                        l,
                        g,
                        version.as_deref(),
                        &mut sink,
                        &mut release,
                    )?;
                    layer_meta.push(g.to_json());
                }
            }
            done += 1;
            written_by.push(written);
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
            let mut moeq = json!({
                "layout": target.name(),
                "layout_version": LAYOUT_VERSION,
                "source": ckpt.dir().display().to_string(),
                "layers": layer_meta,
            });
            if target == Target::Marlin {
                moeq["reference"] =
                    json!("vLLM main @7cfb97e33791 (process_weights_after_loading, Marlin MoE)");
            }
            obj.insert("moeq".into(), moeq);
        }
        write_json(&tmp.path.join(CONFIG_FILE), &config)?;
        copy_side_files(ckpt.dir(), &tmp.path)?;

        let mut verified = 0;
        if opts.verify {
            verified = verify(
                model,
                &layers,
                &copied,
                &tmp.path,
                &shard_names,
                // Before layer `j`: the copies and `j` layers checked.
                &mut |j| {
                    let bytes = written_by.get(j).copied().unwrap_or(written);
                    report("verify", copied.len() + j, bytes)
                },
            )?;
            report("verify", done, written)?;
        }

        // Every file in it is synced; its entries too, before the rename exposes them.
        sync_dir(&tmp.path)?;
        // A last chance to stop (Ctrl-C) before the output appears: after this, it is complete.
        report("commit", done, written)?;
        // Commit: move the finished directory into place.
        let mut leftover = None;
        if entry.exists() || entry.is_symlink() {
            // Something appeared at OUT_DIR while we wrote (another repack, say): --force was
            // given for what was there at the start, if anything, not for this.
            if !existed {
                return Err(output_error(out_dir, APPEARED));
            }
            // What was there may have changed since the checks at the start.
            if let Some(why) = not_replaceable(&entry) {
                return Err(output_error(
                    out_dir,
                    format!("changed while the repack ran and {why}; not replaced"),
                ));
            }
            let old = staged_path(&parent, &name, OLD);
            std::fs::rename(&entry, &old).map_err(|e| {
                if e.kind() == std::io::ErrorKind::ResourceBusy {
                    // A mount point the checks could not see.
                    output_error(out_dir, format!("{MOUNT_POINT} ({e})"))
                } else {
                    io(out_dir, e)
                }
            })?;
            if let Err(e) = rename_no_replace(&tmp.path, &entry) {
                let err = commit_error(out_dir, e);
                // Back, unless something took OUT_DIR meanwhile (then the note says where).
                return Err(match rename_no_replace(&old, &entry) {
                    Ok(()) => err,
                    // Said, not hidden: the next runs would remove it as abandoned.
                    Err(back) => err.noted(moved_aside(&old, &format!("moved back ({back})"))),
                });
            }
            tmp.committed = true;
            // The output is complete; what could not be removed is reported, not hidden (the
            // next runs leave a live-looking old directory alone only for ten minutes, and
            // cannot remove it either).
            leftover = remove_entry(&old)
                .err()
                .map(|e| moved_aside(&old, &format!("removed ({e}); remove it by hand")));
        } else {
            rename_no_replace(&tmp.path, &entry).map_err(|e| commit_error(out_dir, e))?;
            tmp.committed = true;
        }
        // The rename to disk, so that a crash now keeps the output. Best effort: the output is
        // in place and complete whatever this says, and reporting a failure as the repack's
        // would be false.
        let _ = sync_dir(&parent);
        Ok(RepackReport {
            out_dir: out_dir.to_path_buf(),
            layers: layers.len(),
            tensors: out_tensors,
            bytes_written: written,
            seconds: t0.elapsed().as_secs_f64(),
            verified_modules: verified,
            leftover,
        })
    })();
    result.map_err(|e| {
        let e = named_by_out_dir(e, &tmp.path, out_dir);
        match tmp.discard() {
            Some(note) => e.noted(note),
            None => e,
        }
    })
}

/// An I/O error on a file of the staging directory (a full disk, say), named by OUT_DIR and
/// the file's name in it: the staging directory is hidden, and gone once the error is read.
fn named_by_out_dir(e: Error, staging: &Path, out_dir: &Path) -> Error {
    match e {
        Error::Checkpoint(CheckpointError::Io { path, source }) if path.starts_with(staging) => {
            let name = path.strip_prefix(staging).unwrap_or(&path);
            output_error(
                out_dir,
                format!(
                    "writing {}: {source} (nothing was written to OUT_DIR)",
                    name.display()
                ),
            )
        }
        e => e,
    }
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

/// One converted tensor: name, dtype, shape and bytes.
pub type LayerTensor = (String, crate::checkpoint::dtype::DType, Vec<usize>, Vec<u8>);

/// Decoder layer `layer`'s MoE tensors in the Marlin layout, in memory: exactly what
/// [`repack`] writes for it (in [`MarlinGeometry::specs`] order), with its geometry. For
/// loading one layer onto a GPU without writing a checkpoint.
pub fn marlin_layer(model: &Model, layer: usize) -> Result<(MarlinGeometry, Vec<LayerTensor>)> {
    let ckpt = model.checkpoint();
    if let Some(layout) = model.layout() {
        // A repacked checkpoint's layers are not MoE layers in source form: one in the Marlin
        // layout is what this returns, stored (checked against its record at open); one in the
        // CPU layout cannot be converted back.
        if let Some(r) = layout.layers.iter().find(|r| r.layer == layer) {
            let tensors = r
                .geometry
                .specs()
                .into_iter()
                .map(|(name, dtype, shape)| {
                    let bytes = ckpt.tensor(&name)?.bytes.to_vec();
                    Ok((name, dtype, shape, bytes))
                })
                .collect::<Result<Vec<_>>>()?;
            return Ok((r.geometry.clone(), tensors));
        }
        if layout.cpu_layers.iter().any(|g| g.layer == layer) {
            return Err(LayoutError {
                subject: format!("layer {layer}"),
                reason: "is stored in moeq's CPU layout (moeq repack --target cpu), which is not \
                         converted to Marlin's: repack the source checkpoint with --target marlin"
                    .into(),
            }
            .into());
        }
    }
    let l = model
        .moe_layers()
        .iter()
        .find(|l| l.layer == layer)
        .ok_or_else(|| {
            Error::from(LayoutError {
                subject: format!("layer {layer}"),
                reason: "this decoder layer has no MoE block".into(),
            })
        })?;
    if let Some(part) = model.unsupported_part(&l.prefix) {
        return Err(part.error().into());
    }
    let g = geometry(l)?;
    let specs = g.specs();
    let mut bufs: Vec<Vec<u8>> = specs
        .iter()
        .map(|(_, d, shape)| vec![0u8; shape.iter().product::<usize>() * d.bit_size() / 8])
        .collect();
    let version = model.quantization_config().and_then(|q| q.version.clone());
    let mut sink = |e: usize, name: &str, data: &[u8]| -> Result<()> {
        let slot = specs
            .iter()
            .position(|s| s.0 == name)
            .and_then(|i| bufs.get_mut(i))
            .and_then(|b| b.get_mut(e * data.len()..(e + 1) * data.len()));
        match slot {
            Some(dst) => {
                dst.copy_from_slice(data);
                Ok(())
            }
            None => Err(LayoutError {
                subject: name.into(),
                reason: format!(
                    "expert {e}'s {} bytes do not fit the stacked tensor",
                    data.len()
                ),
            }
            .into()),
        }
    };
    convert_layer(ckpt, l, &g, version.as_deref(), &mut sink, &mut |_| {})?;
    let tensors = specs
        .into_iter()
        .zip(bufs)
        .map(|((name, dtype, shape), bytes)| (name, dtype, shape, bytes))
        .collect();
    Ok((g, tensors))
}

/// Writes `v` to a new file at `path`, on disk before it returns (as the shards are): the
/// rename that commits the output must not expose a config or index still in the page cache
/// only, which a crash would leave empty.
fn write_json(path: &Path, v: &Value) -> Result<()> {
    use std::io::Write;
    let text = serde_json::to_string_pretty(v).map_err(|e| output_error(path, e.to_string()))?;
    let mut f = std::fs::File::create(path).map_err(|e| io(path, e))?;
    f.write_all((text + "\n").as_bytes())
        .and_then(|()| f.sync_all())
        .map_err(|e| io(path, e))
}

/// Copies `src` to a new file `dst`, synced: a read error names `src`, a write error (a full
/// disk, a file-size limit) names `dst`. `std::fs::copy` reports both against one path.
fn copy_file(src: &Path, dst: &Path) -> Result<()> {
    use std::io::{Read, Write};
    let mut from = std::fs::File::open(src).map_err(|e| io(src, e))?;
    let mut to = std::fs::File::create(dst).map_err(|e| io(dst, e))?;
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(io(src, e)),
        };
        to.write_all(&buf[..n]).map_err(|e| io(dst, e))?;
    }
    // As `std::fs::copy` did: the permission bits (a script stays executable, a private
    // file private).
    if let Ok(meta) = from.metadata() {
        to.set_permissions(meta.permissions())
            .map_err(|e| io(dst, e))?;
    }
    to.sync_all().map_err(|e| io(dst, e))
}

/// Flushes a directory's entries (the files created in it, or a rename) to disk. Some file
/// systems refuse fsync on a directory (EINVAL, EBADF): there is nothing to flush that way.
fn sync_dir(dir: &Path) -> Result<()> {
    #[cfg(unix)]
    match std::fs::File::open(dir).and_then(|d| d.sync_all()) {
        Err(e) if !matches!(e.raw_os_error(), Some(libc::EINVAL | libc::EBADF)) => {
            return Err(io(dir, e))
        }
        _ => {}
    }
    #[cfg(not(unix))]
    let _ = dir;
    Ok(())
}

/// Weights in formats other than safetensors: the source's unconverted weights, which a loader
/// could pick up beside the repacked shards (and often as large as the checkpoint).
fn other_weight_format(file: &str) -> bool {
    (file.starts_with("pytorch_model")
        && (file.ends_with(".bin") || file.ends_with(".bin.index.json")))
        || [".pt", ".pth", ".ckpt", ".gguf", ".onnx"]
            .iter()
            .any(|ext| file.ends_with(ext))
        || ["tf_model", "flax_model"]
            .iter()
            .any(|p| file.starts_with(p))
}

/// Every path a repack of `ckpt` reads, resolved through its symlinks: the source directory,
/// its shards, index and config, and the side files it copies ([`side_files`]). What neither
/// the clean-up nor `--force` may delete. (Not the directory's other entries: an OUT_DIR
/// inside the source, or a subdirectory linking elsewhere, is not read.)
fn source_paths(ckpt: &crate::checkpoint::Checkpoint) -> Vec<PathBuf> {
    let dir = ckpt.dir();
    std::iter::once(dir.to_path_buf())
        .chain(side_files(dir).unwrap_or_default())
        .chain(ckpt.files().iter().map(|f| f.path().to_path_buf()))
        .chain(std::iter::once(dir.join(INDEX_FILE)))
        .chain(std::iter::once(ckpt.config_path().to_path_buf()))
        .filter_map(|p| p.canonicalize().ok())
        .collect()
}

/// The other top-level files of the source (tokenizer, generation config, ...) that a repack
/// copies, sorted: not subdirectories, hidden files, the weights and their index, nor weights
/// in other formats ([`other_weight_format`]).
fn side_files(src: &Path) -> Result<Vec<PathBuf>> {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(src)
        .map_err(|e| io(src, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file())
        .filter(|p| {
            // (Tested in lossy form; copied under the exact name: a lossy one merged names
            // that are not UTF-8 into one file, the others lost.)
            p.file_name().is_some_and(|name| {
                let file = name.to_string_lossy();
                !(file == CONFIG_FILE
                    || file == INDEX_FILE
                    || file.ends_with(".safetensors")
                    || file.starts_with('.')
                    || other_weight_format(&file))
            })
        })
        .collect();
    entries.sort();
    Ok(entries)
}

/// Copies [`side_files`] of `src` into `dst`.
fn copy_side_files(src: &Path, dst: &Path) -> Result<()> {
    for p in side_files(src)? {
        if let Some(name) = p.file_name() {
            copy_file(&p, &dst.join(name))?;
        }
    }
    Ok(())
}

/// A tensor of the written shards, read where it is stored.
fn find_stored<'f>(files: &'f [SafetensorsFile], name: &str) -> Option<FetchedTensor<'f>> {
    files.iter().find_map(|f| {
        f.find(name)
            .map(|t| (t.dtype, t.shape.to_vec(), f.view(t).bytes))
    })
}

/// Reads the written shards back and checks every expert projection dequantises to the same bits
/// as the source, and every copied tensor is byte-identical. Returns the modules checked.
/// `tick` runs before each layer and each batch of a layer's experts (a Ctrl-C check and
/// progress: verifying a large checkpoint takes tens of seconds).
fn verify(
    model: &Model,
    layers: &[Job<'_>],
    copied: &[String],
    dir: &Path,
    shards: &[String],
    tick: &mut dyn FnMut(usize) -> Result<()>,
) -> Result<usize> {
    let files: Vec<SafetensorsFile> = shards
        .iter()
        .map(|s| SafetensorsFile::open(&dir.join(s)).map_err(Error::from))
        .collect::<Result<_>>()?;
    let find = |name: &str| find_stored(&files, name);
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
    let threads = rayon::current_num_threads().max(1);
    for (j, job) in layers.iter().enumerate() {
        tick(j)?;
        let (l, g) = match job {
            Job::Marlin(l, g) => (l, g),
            Job::Cpu(l, g) if g.activation.is_none() => {
                checked += verify_cpu_weight_only(model, l, g, dir)?;
                continue;
            }
            Job::Cpu(l, g) => {
                checked += verify_cpu(model, l, g, &find)?;
                continue;
            }
        };
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
        // A thread's worth of experts at a time, their projections in parallel; between
        // batches, a chance to stop (Ctrl-C).
        let experts: Vec<_> = l.experts.iter().enumerate().collect();
        for batch in experts.chunks(threads) {
            tick(j)?;
            let modules: Vec<_> = batch
                .iter()
                .flat_map(|&(e, x)| x.modules().map(move |(role, m)| (e, role, m)))
                .collect();
            modules.par_iter().try_for_each(|&(e, role, m)| {
                let want = model.dequantize(&m.name)?;
                let got = dequantize_marlin(&lookup, g, e, role.name())?;
                if got.data != want.data || got.shape != want.shape || got.dtype != want.dtype {
                    return Err(mismatch(&m.name));
                }
                Ok(())
            })?;
            checked += modules.len();
        }
    }
    Ok(checked)
}

/// The CPU layout of one layer against the source: every feature's unpacked codes equal the
/// source int8 row, its code sum and scale equal the source's. Returns the modules checked.
fn verify_cpu<'f>(
    model: &Model,
    l: &crate::moe::MoeLayer,
    g: &super::cpu::CpuGeometry,
    find: &dyn Fn(&str) -> Option<FetchedTensor<'f>>,
) -> Result<usize> {
    use crate::cpu::packed::PackedI8;
    let ckpt = model.checkpoint();
    let fail = |what: String| -> Error {
        LayoutError {
            subject: "verify".into(),
            reason: format!("{what} differs between the source and the CPU layout"),
        }
        .into()
    };
    let fetch = |suffix: &str| {
        let name = format!("{}.{suffix}", g.prefix);
        find(&name).ok_or_else(|| fail(name))
    };
    let (w13, w2) = (fetch("w13_weight_packed")?, fetch("w2_weight_packed")?);
    let (s13, s2) = (fetch("w13_weight_sum")?, fetch("w2_weight_sum")?);
    let (c13, c2) = (fetch("w13_weight_scale")?, fetch("w2_weight_scale")?);
    let ints = |b: &[u8]| -> Vec<i32> {
        b.chunks_exact(4)
            .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    };
    let floats = |b: &[u8]| -> Vec<f32> {
        b.chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    };
    let (s13, s2, c13, c2) = (ints(s13.2), ints(s2.2), floats(c13.2), floats(c2.2));
    // Static activation scales: one per expert and projection input.
    let (a13, a2) = if g.static_act {
        (
            floats(fetch("w13_input_scale")?.2),
            floats(fetch("w2_input_scale")?.2),
        )
    } else {
        (Vec::new(), Vec::new())
    };
    let (h, i) = (g.hidden, g.intermediate);
    let e_count = g.experts.max(1);
    let (w13_len, w2_len) = (w13.2.len() / e_count, w2.2.len() / e_count);
    let (n13, n2) = (s13.len() / e_count, s2.len() / e_count);
    let mut checked = 0;
    for (e, x) in l.experts.iter().enumerate() {
        for (role, m) in x.modules() {
            let (n, k, bytes, sums, scales) = match role.name() {
                "gate" | "up" => {
                    let half = w13_len / 2;
                    let at = e * w13_len + if role.name() == "up" { half } else { 0 };
                    let sat = e * n13 + if role.name() == "up" { n13 / 2 } else { 0 };
                    let cat = e * 2 * i + if role.name() == "up" { i } else { 0 };
                    (
                        i,
                        h,
                        w13.2.get(at..at + half),
                        s13.get(sat..sat + n13 / 2),
                        c13.get(cat..cat + i),
                    )
                }
                _ => (
                    h,
                    i,
                    w2.2.get(e * w2_len..(e + 1) * w2_len),
                    s2.get(e * n2..(e + 1) * n2),
                    c2.get(e * h..(e + 1) * h),
                ),
            };
            let (Some(bytes), Some(sums), Some(scales)) = (bytes, sums, scales) else {
                return Err(fail(m.name.clone()));
            };
            let packed = PackedI8::from_parts(
                n,
                k,
                bytes.iter().map(|&b| b as i8).collect(),
                sums.to_vec(),
            )
            .ok_or_else(|| fail(m.name.clone()))?;
            let src = crate::cpu::load::int8_codes(ckpt, &m.weight_tensor)?;
            let want_scale = crate::cpu::load::floats(ckpt, &format!("{}.weight_scale", m.name))?;
            if src.len() != n * k || want_scale.as_slice() != scales {
                return Err(fail(m.name.clone()));
            }
            if g.static_act {
                let stored = if role.name() == "down" { &a2 } else { &a13 }.get(e);
                let input = format!("{}.input_scale", m.name);
                let want = crate::cpu::load::input_scales(ckpt, &input)?;
                if stored.map(|v| v.to_bits()) != want.first().map(|v| v.to_bits()) {
                    return Err(fail(input));
                }
            }
            for j in 0..n {
                let row = &src[j * k..(j + 1) * k];
                let sum: i32 = row.iter().map(|&v| i32::from(v)).sum();
                if packed.row(j) != row || packed.wsum[j] != sum {
                    return Err(fail(format!("{} row {j}", m.name)));
                }
            }
            checked += 1;
        }
    }
    Ok(checked)
}

/// A weight-only layer of the CPU layout, read back through the loader, dequantises (in the
/// scale dtype, original column order) to exactly the source's dequantisation.
fn verify_cpu_weight_only(
    model: &Model,
    l: &crate::moe::MoeLayer,
    g: &super::cpu::CpuGeometry,
    dir: &Path,
) -> Result<usize> {
    use crate::checkpoint::dtype::DType;
    use crate::cpu::linear::Linear;
    let out = Checkpoint::open(dir)?;
    let experts = super::cpu::load_experts(&out, g)?;
    let mut pairs = Vec::new();
    for (x, ex) in l.experts.iter().zip(&experts) {
        let lins = [ex.gate.as_ref(), Some(&ex.up), Some(&ex.down)];
        pairs.extend(x.modules().map(|(_, m)| m).zip(lins.into_iter().flatten()));
    }
    pairs.par_iter().try_for_each(|&(m, lin)| -> Result<()> {
        let fail = || -> Error {
            LayoutError {
                subject: "verify".into(),
                reason: format!("{} differs between the source and the CPU layout", m.name),
            }
            .into()
        };
        let Linear::WeightOnly { n, k, w, perm } = lin else {
            return Err(fail());
        };
        let (n, k) = (*n, *k);
        let want = model.dequantize(&m.name)?;
        let width = want.dtype.bit_size() / 8;
        if want.shape != [n, k] || want.data.len() != n * k * width {
            return Err(fail());
        }
        let group_starts = w.group_starts();
        let mut enc = [0u8; 4];
        for j in 0..n {
            let (q, scale, zp) = w.row(j);
            let mut gi = 0;
            for c in 0..k {
                while gi + 1 < group_starts.len() && group_starts[gi + 1] <= c {
                    gi += 1;
                }
                let z = zp.as_ref().map_or(0f32, |z| f32::from(z[gi]));
                let v = (f32::from(q[c]) - z) * scale[gi];
                let bytes: &[u8] = match want.dtype {
                    DType::BF16 => {
                        enc[..2].copy_from_slice(&half::bf16::from_f32(v).to_le_bytes());
                        &enc[..2]
                    }
                    DType::F16 => {
                        enc[..2].copy_from_slice(&half::f16::from_f32(v).to_le_bytes());
                        &enc[..2]
                    }
                    _ => {
                        enc = v.to_le_bytes();
                        &enc
                    }
                };
                let orig = perm.as_ref().map_or(c, |p| p[c] as usize);
                let at = (j * k + orig) * width;
                if want.data.get(at..at + width) != Some(bytes) {
                    return Err(fail());
                }
            }
        }
        Ok(())
    })?;
    let checked = pairs.len();
    Ok(checked)
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    #[test]
    fn the_commit_rename_never_replaces_what_appeared() {
        let dir = tempfile::tempdir().unwrap();
        let (staged, out) = (dir.path().join("staged"), dir.path().join("out"));
        std::fs::create_dir(&staged).unwrap();
        std::fs::write(staged.join("model.safetensors"), b"ours").unwrap();
        // An empty directory, which a plain rename(2) silently replaces, and a file.
        std::fs::create_dir(&out).unwrap();
        let e = rename_no_replace(&staged, &out).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::AlreadyExists, "{e}");
        let msg = commit_error(&out, e).to_string();
        assert!(
            msg.contains("appeared while the repack ran; not replaced"),
            "{msg}"
        );
        assert!(out.read_dir().unwrap().next().is_none() && staged.exists());
        std::fs::remove_dir(&out).unwrap();
        std::fs::write(&out, b"theirs").unwrap();
        assert!(rename_no_replace(&staged, &out).is_err());
        assert_eq!(std::fs::read(&out).unwrap(), b"theirs");
        std::fs::remove_file(&out).unwrap();
        rename_no_replace(&staged, &out).unwrap();
        assert_eq!(
            std::fs::read(out.join("model.safetensors")).unwrap(),
            b"ours"
        );
    }

    #[test]
    fn a_staging_directory_is_claimed_by_one_repack_at_a_time() {
        let dir = std::env::temp_dir().join(format!("moeq-claim-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let staged = staged_path(&dir, "out", TMP);
        let out = dir.join("out");
        let first = StagingClaim::new(&staged, &out).unwrap();
        // The same directory spelled through `..` is the same claim.
        let other_spelling = dir.join("..").join(dir.file_name().unwrap());
        for path in [staged.clone(), staged_path(&other_spelling, "out", TMP)] {
            let e = StagingClaim::new(&path, &out).err().unwrap().to_string();
            assert!(e.contains("another repack in this process"), "{e}");
        }
        // Another OUT_DIR beside it is free; the first is once its claim is dropped.
        drop(StagingClaim::new(&staged_path(&dir, "other", TMP), &out).unwrap());
        drop(first);
        drop(StagingClaim::new(&staged, &out).unwrap());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn mount_points_are_found_in_mountinfo_and_by_device() {
        // /proc is its own file system, listed in mountinfo; a fresh directory is neither.
        assert!(listed_mount_point(Path::new("/proc")) && is_mount_point(Path::new("/proc")));
        let dir = std::env::temp_dir().join(format!("moeq-mount-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let found = (listed_mount_point(&dir), is_mount_point(&dir));
        std::fs::remove_dir(&dir).unwrap();
        assert_eq!(found, (false, false));
        assert!(not_replaceable(Path::new("/proc")).is_some_and(|w| w.contains("mount point")));
    }
}
