//! Finding, loading and driving NVRTC.
//!
//! cudarc only `dlopen`s NVRTC by name, so a library that is not on the loader path is loaded
//! here first by absolute path (its `libnvrtc-builtins` too: the 13.0 wheel has no RUNPATH to
//! find it), after which cudarc's `dlopen("libnvrtc.so.13")` resolves to it by soname. Order:
//! `MOEQ_NVRTC_PATH` (the library file or its directory), the directories the caller passes (the
//! Python package passes the nvidia wheel's `lib` directories), then whatever is already loaded
//! or on the loader path.

use std::ffi::{c_char, c_int, CString};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Instant;

use cudarc::nvrtc::{result, sys};

use super::err;
use crate::error::CudaError;

/// The loaded NVRTC.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Nvrtc {
    pub major: i32,
    pub minor: i32,
    /// The file loaded by absolute path, when it was not already on the loader path.
    pub path: Option<PathBuf>,
}

/// `libnvrtc.so.<major>` (newest first) and its builtins in `dir`.
fn find_in(dir: &Path) -> Option<PathBuf> {
    ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"]
        .iter()
        .map(|n| dir.join(n))
        .find(|p| p.is_file())
}

fn preload(lib: &Path) -> Result<(), CudaError> {
    let dir = lib.parent().unwrap_or(Path::new("."));
    let mut builtins: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| {
                    p.file_name()
                        .and_then(|n| n.to_str())
                        .is_some_and(|n| n.starts_with("libnvrtc-builtins.so"))
                })
                .collect()
        })
        .unwrap_or_default();
    builtins.sort();
    for b in builtins.iter().chain(std::iter::once(&lib.to_path_buf())) {
        // SAFETY: loading NVRTC's own shared libraries runs only their initialisers, which have
        // no preconditions. The handle is leaked on purpose: the library must stay loaded for
        // the process, since cudarc resolves it by soname later.
        let lib = unsafe { libloading::Library::new(b) }
            .map_err(|e| err(&b.display().to_string(), format!("cannot be loaded: {e}")))?;
        std::mem::forget(lib);
    }
    Ok(())
}

/// Loads NVRTC (once per process; later calls return the first outcome) looking in `dirs` after
/// `MOEQ_NVRTC_PATH`.
pub fn load(dirs: &[PathBuf]) -> Result<Nvrtc, CudaError> {
    static LOADED: Mutex<Option<Nvrtc>> = Mutex::new(None);
    let mut guard = LOADED
        .lock()
        .map_err(|_| err("nvrtc", "loader lock poisoned"))?;
    if let Some(n) = guard.as_ref() {
        return Ok(n.clone());
    }
    let mut searched: Vec<String> = Vec::new();
    let mut chosen = None;
    if let Some(p) = std::env::var_os("MOEQ_NVRTC_PATH").map(PathBuf::from) {
        let lib = if p.is_dir() {
            find_in(&p)
        } else {
            Some(p.clone())
        };
        match lib.filter(|l| l.is_file()) {
            Some(l) => chosen = Some(l),
            None => {
                return Err(err(
                    "MOEQ_NVRTC_PATH",
                    format!(
                        "{} is not an NVRTC library or a directory holding one",
                        p.display()
                    ),
                ))
            }
        }
    }
    if chosen.is_none() {
        for d in dirs {
            searched.push(d.display().to_string());
            if let Some(l) = find_in(d) {
                chosen = Some(l);
                break;
            }
        }
    }
    if let Some(l) = &chosen {
        preload(l)?;
    }
    // SAFETY: only probes `dlopen` on cudarc's candidate names.
    if !unsafe { sys::is_culib_present() } {
        searched.push("the loader path (LD_LIBRARY_PATH, system libraries)".into());
        return Err(err(
            "nvrtc",
            format!(
                "libnvrtc not found (searched: {}); install torch's CUDA build or \
                 nvidia-cuda-nvrtc, or set MOEQ_NVRTC_PATH",
                searched.join(", ")
            ),
        ));
    }
    let (mut major, mut minor): (c_int, c_int) = (0, 0);
    // SAFETY: NVRTC is present (checked above), so cudarc's lazy symbol lookup succeeds; the
    // out-pointers are valid for the call.
    let status = unsafe { sys::nvrtcVersion(&mut major, &mut minor) };
    status
        .result()
        .map_err(|e| err("nvrtc", format!("nvrtcVersion failed: {e:?}")))?;
    if major < 12 {
        return Err(err(
            "nvrtc",
            format!("version {major}.{minor} is too old (need 12 or newer)"),
        ));
    }
    let n = Nvrtc {
        major,
        minor,
        path: chosen,
    };
    *guard = Some(n.clone());
    Ok(n)
}

/// The calling thread's locale, put back when dropped. NVRTC 12.x (seen with 12.1 and 12.4;
/// 13.2 does not) switches the calling thread to the "C" locale (`uselocale`) while compiling
/// and leaves it there: Python in the same process then reads and writes text files as ASCII.
struct ThreadLocale(libc::locale_t);

impl ThreadLocale {
    fn save() -> Self {
        // SAFETY: `uselocale(0)` only returns the thread's current locale (or
        // LC_GLOBAL_LOCALE), a handle that stays valid while no one frees it; we never do.
        ThreadLocale(unsafe { libc::uselocale(std::ptr::null_mut()) })
    }
}

impl Drop for ThreadLocale {
    fn drop(&mut self) {
        // SAFETY: the handle came from `uselocale` on this thread (the guard is a local of
        // `compile`, dropped where it was made) and was never freed.
        unsafe { libc::uselocale(self.0) };
    }
}

/// What ptxas reported for one entry function.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EntryStats {
    pub registers: u32,
    pub spill_stores: u32,
    pub spill_loads: u32,
    pub stack_frame: u32,
}

/// One compiled program.
#[derive(Clone, Debug)]
pub struct Compiled {
    pub cubin: Vec<u8>,
    pub log: String,
    /// Per entry function, from `--ptxas-options=-v`.
    pub entries: Vec<(String, EntryStats)>,
    pub seconds: f64,
}

/// The NVRTC options of every compile besides the architecture and the variant's defines; the
/// CUBIN cache key hashes them (see `cache::key`), so a change here cannot reuse a stale CUBIN.
pub const FIXED_OPTIONS: [&str; 2] = ["--std=c++17", "--ptxas-options=-v"];

/// Compiles `source` to CUBIN for `arch` (`sm_80`, `sm_90`, `sm_90a`, ...). NVRTC must have
/// been loaded with [`load`].
pub fn compile(
    name: &str,
    source: &str,
    arch: &str,
    defines: &[(String, String)],
) -> Result<Compiled, CudaError> {
    let ok_arch = arch.strip_prefix("sm_").is_some_and(|v| {
        !v.is_empty() && v.trim_end_matches('a').chars().all(|c| c.is_ascii_digit())
    });
    if !ok_arch {
        return Err(err(
            "arch",
            format!("'{arch}' is not a GPU architecture such as sm_80, sm_90 or sm_90a"),
        ));
    }
    let src = CString::new(source).map_err(|_| err(name, "source holds a NUL byte"))?;
    let cname = CString::new(name).map_err(|_| err(name, "name holds a NUL byte"))?;
    let mut opts = vec![format!("--gpu-architecture={arch}")];
    opts.extend(FIXED_OPTIONS.iter().map(|o| o.to_string()));
    for (k, v) in defines {
        opts.push(format!("-D{k}={v}"));
    }
    if opts.iter().any(|o| o.contains('\0')) {
        return Err(err(name, "a define holds a NUL byte"));
    }
    let t0 = Instant::now();
    let _locale = ThreadLocale::save();
    let prog = result::create_program(&src, Some(&cname))
        .map_err(|e| err(name, format!("nvrtcCreateProgram failed: {e:?}")))?;
    // SAFETY: `prog` was just created and is destroyed exactly once below; the options hold no
    // NUL byte (checked), so cudarc's CString conversion cannot fail.
    let compiled = unsafe { result::compile_program(prog, &opts) };
    // SAFETY: `prog` is live.
    let log = unsafe { result::get_program_log(prog) }
        .map(|raw| {
            let bytes: Vec<u8> = raw
                .iter()
                .take_while(|&&c| c != 0)
                // c_char is i8 on x86_64 and u8 on aarch64.
                .map(
                    #[allow(clippy::unnecessary_cast)]
                    |&c| c as u8,
                )
                .collect();
            String::from_utf8_lossy(&bytes).into_owned()
        })
        .unwrap_or_default();
    let cubin = compiled.map_err(|e| format!("{e:?}")).and_then(|()| {
        let mut size = 0usize;
        // SAFETY: `prog` compiled successfully; `size` is a valid out-pointer.
        unsafe { sys::nvrtcGetCUBINSize(prog, &mut size) }
            .result()
            .map_err(|e| format!("nvrtcGetCUBINSize: {e:?}"))?;
        let mut buf = vec![0u8; size];
        // SAFETY: `buf` holds exactly the `size` bytes NVRTC reported for this program.
        unsafe { sys::nvrtcGetCUBIN(prog, buf.as_mut_ptr().cast::<c_char>()) }
            .result()
            .map_err(|e| format!("nvrtcGetCUBIN: {e:?}"))?;
        Ok(buf)
    });
    // SAFETY: `prog` is live and not used after this.
    let _ = unsafe { result::destroy_program(prog) };
    let cubin =
        cubin.map_err(|e| err(name, format!("compilation for {arch} failed ({e}):\n{log}")))?;
    if cubin.len() < 4 || &cubin[..4] != b"\x7fELF" {
        return Err(err(
            name,
            format!("NVRTC gave no CUBIN for {arch} (is it a real sm_ target?)"),
        ));
    }
    Ok(Compiled {
        entries: parse_ptxas_log(&log),
        cubin,
        log,
        seconds: t0.elapsed().as_secs_f64(),
    })
}

/// The per-function figures of a `ptxas -v` log.
pub fn parse_ptxas_log(log: &str) -> Vec<(String, EntryStats)> {
    let mut out: Vec<(String, EntryStats)> = Vec::new();
    let number_before = |line: &str, what: &str| -> Option<u32> {
        let at = line.find(what)?;
        line[..at].split_whitespace().last()?.parse().ok()
    };
    for line in log.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            let name = rest.split('\'').next().unwrap_or("").to_string();
            out.push((name, EntryStats::default()));
        } else if let Some((_, s)) = out.last_mut() {
            if let Some(v) = number_before(line, "bytes spill stores") {
                s.spill_stores = v;
            }
            if let Some(v) = number_before(line, "bytes spill loads") {
                s.spill_loads = v;
            }
            if let Some(v) = number_before(line, "bytes stack frame") {
                s.stack_frame = v;
            }
            if let Some(v) = number_before(line, "registers") {
                s.registers = v;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ptxas_log_is_parsed_per_entry() {
        let log = "ptxas info    : 0 bytes gmem\n\
            ptxas info    : Compiling entry function 'moe_align' for 'sm_90'\n\
            ptxas info    : Function properties for moe_align\n\
            \x20   8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads\n\
            ptxas info    : Used 18 registers, used 1 barriers, 4096 bytes smem\n\
            ptxas info    : Compiling entry function 'silu_and_mul_bf16' for 'sm_90'\n\
            ptxas info    : Function properties for silu_and_mul_bf16\n\
            \x20   0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n\
            ptxas info    : Used 12 registers\n";
        let p = parse_ptxas_log(log);
        assert_eq!(p.len(), 2);
        assert_eq!(p[0].0, "moe_align");
        assert_eq!(
            p[0].1,
            EntryStats {
                registers: 18,
                spill_stores: 4,
                spill_loads: 4,
                stack_frame: 8
            }
        );
        assert_eq!(p[1].1.registers, 12);
        assert_eq!(p[1].1.spill_stores, 0);
    }
}
