//! The CUDA path: kernels in `cuda/` (header-free CUDA C++) compiled by NVRTC to CUBIN for the
//! device's exact architecture, cached in memory and on disk, launched through cudarc on the
//! caller's stream.
//!
//! Everything here works without a GPU except launching: NVRTC comes from the nvidia pip wheel
//! (torch's CUDA build ships it), so CPU-only machines compile and check every kernel variant.
//! cudarc panics when a library is missing, so every entry point checks presence first and
//! returns [`CudaError`] instead.

pub mod cache;
pub mod kernels;
pub mod launch;
pub mod nvrtc;

use crate::error::CudaError;

fn err(subject: &str, reason: impl Into<String>) -> CudaError {
    CudaError {
        subject: subject.to_string(),
        reason: reason.into(),
    }
}

/// Whether a CUDA driver with at least one device is present. Never panics: the driver library
/// is looked for before any cudarc call, and a panic inside cudarc is caught.
pub fn driver_available() -> bool {
    // SAFETY: only probes `dlopen` on cudarc's candidate names; no driver call is made.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return false;
    }
    std::panic::catch_unwind(|| {
        cudarc::driver::result::init().is_ok()
            && cudarc::driver::result::device::get_count().is_ok_and(|n| n > 0)
    })
    .unwrap_or(false)
}

/// What compiling one variant gave.
#[derive(Clone, Debug)]
pub struct VariantReport {
    pub name: String,
    pub cubin_bytes: usize,
    /// The most registers any entry function uses.
    pub registers: u32,
    /// Spill-store bytes summed over the entry functions (0 is required).
    pub spill_stores: u32,
    pub seconds: f64,
    pub entries: Vec<(String, nvrtc::EntryStats)>,
}

/// Compiles every kernel variant for `arch` with NVRTC (found as [`nvrtc::load`] describes,
/// `dirs` after `MOEQ_NVRTC_PATH`), checks each CUBIN holds its entry functions, stores it in
/// the disk cache and reports the ptxas figures. Needs no GPU.
pub fn compile_all(
    arch: &str,
    dirs: &[std::path::PathBuf],
) -> Result<Vec<VariantReport>, CudaError> {
    let lib = nvrtc::load(dirs)?;
    let mut out = Vec::new();
    for v in kernels::variants() {
        let c = nvrtc::compile(&v.name, &v.source(), arch, &v.defines)?;
        for e in &v.entries {
            if !c.entries.iter().any(|(n, _)| n == e) {
                return Err(err(
                    &v.name,
                    format!("the compiled program has no entry function '{e}'"),
                ));
            }
        }
        if let Some(d) = cache::dir() {
            cache::store(
                &d.join(format!("{}.cubin", cache::key(&v, arch, &lib))),
                &c.cubin,
            );
        }
        out.push(VariantReport {
            name: v.name.clone(),
            cubin_bytes: c.cubin.len(),
            registers: c
                .entries
                .iter()
                .map(|(_, s)| s.registers)
                .max()
                .unwrap_or(0),
            spill_stores: c.entries.iter().map(|(_, s)| s.spill_stores).sum(),
            seconds: c.seconds,
            entries: c.entries,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Where the test run finds NVRTC: `MOEQ_NVRTC_PATH`, or the nvidia wheel of the project's
    /// virtual environment.
    fn wheel_dirs() -> Vec<std::path::PathBuf> {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.venv/lib");
        let mut dirs = Vec::new();
        if let Ok(rd) = std::fs::read_dir(&root) {
            for py in rd.filter_map(|e| e.ok()) {
                for sub in ["cu13/lib", "cu12/lib", "cuda_nvrtc/lib"] {
                    dirs.push(py.path().join("site-packages/nvidia").join(sub));
                }
            }
        }
        dirs
    }

    /// Every variant compiles to CUBIN for sm_80 and sm_90 with its entry functions and no
    /// register spills. Skips (saying so) only when no NVRTC exists and MOEQ_REQUIRE_NVRTC is
    /// unset.
    #[test]
    fn every_variant_compiles_without_spills() {
        if let Err(e) = nvrtc::load(&wheel_dirs()) {
            assert!(
                std::env::var_os("MOEQ_REQUIRE_NVRTC").is_none(),
                "MOEQ_REQUIRE_NVRTC is set but NVRTC is missing: {e}"
            );
            eprintln!("skipped: {e}");
            return;
        }
        for arch in ["sm_80", "sm_90"] {
            let reports = compile_all(arch, &wheel_dirs()).unwrap();
            assert!(reports.len() >= 4);
            for r in &reports {
                assert!(r.cubin_bytes > 0, "{}", r.name);
                assert_eq!(r.spill_stores, 0, "{} spills on {arch}", r.name);
                assert!(r.registers > 0 && r.registers <= 255, "{}", r.name);
            }
        }
        assert!(nvrtc::compile("bad", "this is not CUDA", "sm_90", &[]).is_err());
        assert!(nvrtc::compile("bad", "", "compute_90", &[]).is_err());
    }

    #[test]
    fn no_driver_is_false_not_a_panic() {
        // Without libcuda (CPU machines) the answer must be false, and reaching it must not
        // panic; with a driver it is whatever the device count says.
        // SAFETY: only probes `dlopen` on cudarc's candidate names.
        let present = unsafe { cudarc::driver::sys::is_culib_present() };
        let available = driver_available();
        if !present {
            assert!(!available);
        }
    }
}
