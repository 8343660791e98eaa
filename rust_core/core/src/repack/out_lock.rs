//! One repack at a time per OUT_DIR, across processes: `.<name>.moeq-lock` beside OUT_DIR,
//! held (`flock`) while a repack writes there and removed when it is done.
//!
//! Without it, two `--force` repacks to one OUT_DIR both succeeded: the later commit moved
//! the other's finished output aside and deleted it, and both said they had written OUT_DIR.
//! Two without `--force` both did all the work before one of them found OUT_DIR taken.
//!
//! The file is removed while still locked, so a process that opened it just before may lock a
//! file that no longer has the name; it checks, after locking, that the name still leads to
//! the file it locked, and starts again if not. A holder killed outright (SIGKILL) leaves the
//! file unlocked behind it: the next repack takes it over and removes it.
//!
//! Best effort where locking is impossible (a file system without `flock`, a directory that
//! cannot be written, a symlink planted at the name, a lock file another user's killed repack
//! left that this user cannot write): the repack goes on unlocked, as before, and the staging
//! directory's own checks report an unwritable parent.

use std::fs::{File, OpenOptions, TryLockError};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

/// How often a lock file removed under us is looked for again before giving up as if busy.
const ATTEMPTS: usize = 16;

/// The lock file of a repack to `parent/name`.
pub(super) fn lock_path(parent: &Path, name: &str) -> PathBuf {
    parent.join(format!(".{name}.moeq-lock"))
}

/// Another repack holds the lock.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Busy {
    /// The pid that holder wrote into the file, where it could be read.
    pub pid: Option<u32>,
}

impl std::fmt::Display for Busy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let who = match self.pid {
            Some(pid) => format!("another repack (process {pid})"),
            None => "another repack".into(),
        };
        write!(
            f,
            "{who} is writing it; wait for that one to finish, or write elsewhere"
        )
    }
}

/// The held lock; dropping it removes the file and releases the lock.
#[derive(Debug)]
pub(super) struct OutDirLock {
    path: PathBuf,
    file: File,
}

/// Takes the lock at `path` without waiting: `Ok(None)` where locking is impossible (see the
/// module docs), `Err` where another process (or another open of this one) holds it.
pub(super) fn acquire(path: &Path) -> Result<Option<OutDirLock>, Busy> {
    for _ in 0..ATTEMPTS {
        let Ok((mut file, created)) = open(path) else {
            return Ok(None);
        };
        match file.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => {
                return Err(Busy {
                    pid: holder(&mut file),
                })
            }
            Err(TryLockError::Error(_)) => {
                // No locking on this file system: leave nothing behind that was not there.
                if created {
                    let _ = std::fs::remove_file(path);
                }
                return Ok(None);
            }
        }
        if !names(path, &file) {
            // Its holder removed it between our open and our lock: look again.
            continue;
        }
        // Our pid, for the message another repack gives; the lock holds without it.
        let _ = file
            .set_len(0)
            .and_then(|()| file.write_all(format!("{}\n", std::process::id()).as_bytes()));
        return Ok(Some(OutDirLock {
            path: path.to_path_buf(),
            file,
        }));
    }
    Err(Busy { pid: None })
}

/// The lock file, and whether this call created it.
fn open(path: &Path) -> std::io::Result<(File, bool)> {
    let with = |create_new: bool| {
        let mut opts = OpenOptions::new();
        opts.read(true).write(true);
        if create_new {
            opts.create_new(true);
        }
        #[cfg(unix)]
        {
            use std::os::unix::fs::OpenOptionsExt;
            // Never through a symlink: the pid written after locking would land in its target.
            opts.custom_flags(libc::O_NOFOLLOW);
        }
        opts.open(path)
    };
    match with(true) {
        Ok(f) => Ok((f, true)),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => with(false).map(|f| (f, false)),
        Err(e) => Err(e),
    }
}

/// The pid a holder wrote, if the file holds one.
fn holder(file: &mut File) -> Option<u32> {
    let mut text = String::new();
    file.take(32).read_to_string(&mut text).ok()?;
    text.trim().parse().ok()
}

/// Whether `path` still names `file` (and not a newer lock file, or nothing).
fn names(path: &Path, file: &File) -> bool {
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        match (std::fs::symlink_metadata(path), file.metadata()) {
            (Ok(p), Ok(f)) => p.dev() == f.dev() && p.ino() == f.ino(),
            _ => false,
        }
    }
    #[cfg(not(unix))]
    {
        let _ = (path, file);
        true
    }
}

impl Drop for OutDirLock {
    fn drop(&mut self) {
        // Removed before the lock is released (when `file` closes after this): a process
        // that opened it meanwhile finds it nameless and looks again. (Elsewhere than Unix an
        // open file cannot be removed; it stays, unlocked, for the next repack to take.)
        #[cfg(unix)]
        if names(&self.path, &self.file) {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_holder_at_a_time_and_the_file_goes_with_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = lock_path(dir.path(), "out");
        let first = acquire(&path)
            .unwrap()
            .expect("a lock on a local file system");
        // Another open (as another process's would be) is refused and told who holds it.
        let busy = acquire(&path).unwrap_err();
        assert_eq!(
            busy,
            Busy {
                pid: Some(std::process::id())
            }
        );
        assert!(busy.to_string().starts_with(&format!(
            "another repack (process {}) is writing it",
            std::process::id()
        )));
        drop(first);
        assert!(!path.exists());
        let again = acquire(&path).unwrap().expect("free again");
        drop(again);
        assert!(!path.exists());
    }

    #[test]
    fn a_stale_file_is_taken_over() {
        // What a repack killed outright leaves: the file, unlocked, with a pid in it.
        let dir = tempfile::tempdir().unwrap();
        let path = lock_path(dir.path(), "out");
        std::fs::write(&path, "999999999\ngarbage").unwrap();
        let lock = acquire(&path).unwrap().expect("an unlocked file is free");
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            format!("{}\n", std::process::id())
        );
        drop(lock);
        assert!(!path.exists());
    }

    #[test]
    fn a_holder_without_a_pid_is_still_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = lock_path(dir.path(), "out");
        let other = File::create(&path).unwrap();
        other.lock().unwrap();
        let busy = acquire(&path).unwrap_err();
        assert_eq!(busy, Busy { pid: None });
        assert!(busy.to_string().starts_with("another repack is writing it"));
        // Not removed by the refused attempt.
        assert!(path.exists());
    }

    #[cfg(unix)]
    #[test]
    fn a_symlink_at_the_name_is_not_followed() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("precious");
        std::fs::write(&target, "data").unwrap();
        let path = lock_path(dir.path(), "out");
        std::os::unix::fs::symlink(&target, &path).unwrap();
        assert!(acquire(&path).unwrap().is_none());
        assert_eq!(std::fs::read_to_string(&target).unwrap(), "data");
        assert!(path.is_symlink());
    }
}
