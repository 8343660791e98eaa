//! Launching compiled kernels on the caller's stream with raw device pointers (torch's memory
//! and stream: cudarc's owning wrappers would free or destroy them, so only its `result` layer
//! is used). Modules are loaded once per (device, variant) into the device's primary context,
//! the one torch uses.
//!
//! Not yet exercised on a GPU (this project's machines had none so far): `scripts/gpu_check.sh`
//! is the first run, and `mq.cuda.is_available()` stays False until it passes.

use std::collections::HashMap;
use std::ffi::{c_void, CString};
use std::sync::Mutex;

use cudarc::driver::{result, sys};

use super::{cache, err, kernels, nvrtc};
use crate::error::CudaError;

/// One kernel argument.
#[derive(Clone, Copy, Debug)]
pub enum Arg {
    /// A device pointer (e.g. `tensor.data_ptr()`).
    Ptr(u64),
    I32(i32),
    I64(i64),
    F32(f32),
}

/// A loaded module and its context (raw driver handles, used only under [`LOADED`]'s lock or
/// by value for a launch).
struct Loaded {
    ctx: sys::CUcontext,
    module: sys::CUmodule,
    functions: HashMap<String, usize>,
}

// SAFETY: CUcontext and CUmodule are driver handles valid on any thread once the context is
// made current there (every launch does so); this map only stores and hands them out.
unsafe impl Send for Loaded {}

static LOADED: Mutex<Option<HashMap<(i32, String), Loaded>>> = Mutex::new(None);

/// Whether a launch has found the CUDA driver loaded and initialised in this process.
static DRIVER_READY: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

fn driver(e: result::DriverError, what: &str) -> CudaError {
    err(what, format!("{e:?}"))
}

/// `sm_XY` of device `ordinal`.
pub fn device_arch(ordinal: i32) -> Result<String, CudaError> {
    if !super::driver_available() {
        return Err(err("cuda", "no CUDA driver or device"));
    }
    let dev = result::device::get(ordinal).map_err(|e| driver(e, "cuDeviceGet"))?;
    // SAFETY: `dev` is a valid device handle from cuDeviceGet.
    let (major, minor) = unsafe {
        (
            result::device::get_attribute(
                dev,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
            ),
            result::device::get_attribute(
                dev,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
            ),
        )
    };
    let (major, minor) = (
        major.map_err(|e| driver(e, "compute capability"))?,
        minor.map_err(|e| driver(e, "compute capability"))?,
    );
    Ok(format!("sm_{major}{minor}"))
}

/// The calling thread's current CUDA context when captured, made current again on drop.
struct RestoreContext(Option<sys::CUcontext>);

impl RestoreContext {
    fn capture() -> Result<Self, CudaError> {
        result::ctx::get_current()
            .map(Self)
            .map_err(|e| driver(e, "cuCtxGetCurrent"))
    }
}

impl Drop for RestoreContext {
    fn drop(&mut self) {
        let previous = self.0.unwrap_or(std::ptr::null_mut());
        // SAFETY: `previous` was current on this thread when captured (or null, which unbinds
        // the thread); a context torch or the caller made current stays alive across a launch.
        // A failure here cannot be reported from a destructor, and the launch's own result
        // is what the caller acts on.
        let _ = unsafe { result::ctx::set_current(previous) };
    }
}

/// Launches `entry` of kernel variant `variant` on device `ordinal`, stream `stream` (a
/// `cudaStream_t` as an integer; 0 is the legacy default stream).
///
/// # Safety
/// Every `Arg::Ptr` must be a device allocation on `ordinal` large enough for what the kernel
/// reads and writes given the other arguments, `stream` must be a live stream of that device,
/// and the argument list must match the kernel's parameters in number and type.
#[allow(clippy::too_many_arguments)]
pub unsafe fn launch(
    ordinal: i32,
    variant: &str,
    entry: &str,
    grid: (u32, u32, u32),
    block: (u32, u32, u32),
    shared_bytes: u32,
    stream: u64,
    args: &[Arg],
    nvrtc_dirs: &[std::path::PathBuf],
) -> Result<(), CudaError> {
    // Launching makes `ordinal`'s primary context current; the caller's is put back on
    // return, or torch (which reads its current device from the current context) would place
    // later allocations on this device.
    // The driver must be loaded and initialised before the current context can be read; once
    // it was, it stays so, and later launches skip the probe (a dlopen and two driver calls).
    if !DRIVER_READY.load(std::sync::atomic::Ordering::Relaxed) {
        if !super::driver_available() {
            return Err(err("cuda", "no CUDA driver or device"));
        }
        DRIVER_READY.store(true, std::sync::atomic::Ordering::Relaxed);
    }
    let _restore = RestoreContext::capture()?;
    let mut guard = LOADED
        .lock()
        .map_err(|_| err("cuda", "module cache lock poisoned"))?;
    let map = guard.get_or_insert_with(HashMap::new);
    let key = (ordinal, variant.to_string());
    if !map.contains_key(&key) {
        // First launch of this variant on this device: find, compile (or read the disk
        // cache) and load it. Later launches only look up the cached handles.
        let v = kernels::variants()
            .into_iter()
            .find(|v| v.name == variant)
            .ok_or_else(|| err(variant, "no such kernel variant"))?;
        if !v.entries.iter().any(|e| e == entry) {
            return Err(err(variant, format!("has no entry '{entry}'")));
        }
        let arch = device_arch(ordinal)?;
        let lib = nvrtc::load(nvrtc_dirs)?;
        let (cubin, _) = cache::cubin(&v, &arch, &lib)?;
        let dev = result::device::get(ordinal).map_err(|e| driver(e, "cuDeviceGet"))?;
        // SAFETY: `dev` is valid; retaining the primary context shares torch's context.
        let ctx = unsafe { result::primary_ctx::retain(dev) }
            .map_err(|e| driver(e, "cuDevicePrimaryCtxRetain"))?;
        // SAFETY: `ctx` was just retained.
        unsafe { result::ctx::set_current(ctx) }.map_err(|e| driver(e, "cuCtxSetCurrent"))?;
        // SAFETY: `cubin` is a complete ELF image (checked when compiled or read from disk)
        // and outlives the call; the driver copies it.
        let module = unsafe { result::module::load_data(cubin.as_ptr().cast()) }
            .map_err(|e| driver(e, "cuModuleLoadData"))?;
        map.insert(
            key.clone(),
            Loaded {
                ctx,
                module,
                functions: HashMap::new(),
            },
        );
    }
    let loaded = map
        .get_mut(&key)
        .ok_or_else(|| err(variant, "module vanished from the cache"))?;
    // SAFETY: the context is the retained primary context of `ordinal`.
    unsafe { result::ctx::set_current(loaded.ctx) }.map_err(|e| driver(e, "cuCtxSetCurrent"))?;
    let f = match loaded.functions.get(entry) {
        Some(&f) => f as sys::CUfunction,
        None => {
            let name = CString::new(entry).map_err(|_| err(entry, "name holds a NUL byte"))?;
            // SAFETY: `module` is a live module loaded above.
            let f = unsafe { result::module::get_function(loaded.module, name) }
                .map_err(|e| driver(e, "cuModuleGetFunction"))?;
            loaded.functions.insert(entry.to_string(), f as usize);
            f
        }
    };
    drop(guard);
    // Each parameter is passed as a pointer to its value; the values live in `slots` until the
    // launch call returns (the driver copies them).
    let mut slots: Vec<[u8; 8]> = args
        .iter()
        .map(|a| match *a {
            Arg::Ptr(p) => p.to_ne_bytes(),
            Arg::I64(v) => v.to_ne_bytes(),
            Arg::I32(v) => {
                let mut b = [0u8; 8];
                b[..4].copy_from_slice(&v.to_ne_bytes());
                b
            }
            Arg::F32(v) => {
                let mut b = [0u8; 8];
                b[..4].copy_from_slice(&v.to_ne_bytes());
                b
            }
        })
        .collect();
    let mut params: Vec<*mut c_void> = slots
        .iter_mut()
        .map(|s| s.as_mut_ptr().cast::<c_void>())
        .collect();
    // SAFETY: the caller guarantees the pointers, stream and argument list match the kernel;
    // `params` points at values alive for the whole call.
    unsafe {
        result::launch_kernel(
            f,
            grid,
            block,
            shared_bytes,
            stream as sys::CUstream,
            &mut params,
        )
    }
    .map_err(|e| driver(e, &format!("launch {variant}::{entry}")))
}
