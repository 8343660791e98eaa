//! Keeps the calling thread's idle OpenMP threads off the CPUs while a forward runs.
//!
//! torch runs its CPU operators on OpenMP threads, and GNU OpenMP's idle threads spin for
//! milliseconds after each parallel region before they sleep. A forward that comes right after
//! a torch operator (every MoE layer: the router's linear layer comes first) finds those
//! threads on the CPUs its own workers need. Since Linux 6.6 a woken thread waits out the
//! running one's time slice (~1.5 ms on two CPUs) rather than preempting it, so at decode the
//! forward ran on the calling thread alone: Qwen3-30B-A3B's layer took ~1.2 ms from Python
//! against ~0.95 ms with the spinning switched off (`OMP_WAIT_POLICY=PASSIVE`, which slows
//! torch instead). [`parked`] runs the forward inside a parallel region of the caller's own
//! OpenMP team whose other threads only sleep until it is done, so their CPUs are free for
//! our workers; this is what any OpenMP code of the caller's would do, and it costs one
//! region's start and end (microseconds: the team is spinning, ready for work).

use std::cell::UnsafeCell;
use std::ffi::{c_int, c_uint, c_void};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::OnceLock;

type Body = unsafe extern "C" fn(*mut c_void);

/// The entry points of the process's OpenMP runtime (GNU ABI: libgomp, which torch's wheels
/// ship).
struct Runtime {
    parallel: unsafe extern "C" fn(Body, *mut c_void, c_uint, c_uint),
    thread_num: unsafe extern "C" fn() -> c_int,
    max_threads: unsafe extern "C" fn() -> c_int,
    in_parallel: unsafe extern "C" fn() -> c_int,
}

/// Whether [`parked`] parks (`MOEQ_PARK_OPENMP=0` at start-up, or [`set_parking`], turns it
/// off).
static PARKING: OnceLock<AtomicBool> = OnceLock::new();

fn parking() -> &'static AtomicBool {
    PARKING.get_or_init(|| {
        AtomicBool::new(std::env::var("MOEQ_PARK_OPENMP").map_or(true, |v| v.trim() != "0"))
    })
}

/// Turns parking on or off for later forwards (benchmarks compare the two in one process).
pub fn set_parking(on: bool) {
    parking().store(on, Ordering::Relaxed);
}

/// Whether a forward called now would park this thread's OpenMP threads: parking is on, an
/// OpenMP runtime is loaded, this thread is not inside a parallel region and its team has
/// more than one thread.
pub fn would_park() -> bool {
    team().is_some()
}

/// The runtime and the number of threads of this thread's team, when parking applies.
fn team() -> Option<(&'static Runtime, c_uint)> {
    if !parking().load(Ordering::Relaxed) {
        return None;
    }
    let rt = runtime()?;
    // SAFETY: OpenMP API calls without arguments, valid on any thread.
    let (threads, nested) = unsafe { ((rt.max_threads)(), (rt.in_parallel)() != 0) };
    (threads > 1 && !nested).then_some((rt, threads as c_uint))
}

/// The OpenMP runtime already loaded into this process (torch's), if any: looked up on first
/// use by its path in `/proc/self/maps`; never loaded by us.
fn runtime() -> Option<&'static Runtime> {
    static RUNTIME: OnceLock<Option<Runtime>> = OnceLock::new();
    RUNTIME.get_or_init(find_runtime).as_ref()
}

#[cfg(target_os = "linux")]
fn find_runtime() -> Option<Runtime> {
    use std::ffi::CString;
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    let path = maps.lines().find_map(|line| {
        let path = line.split_whitespace().nth(5)?;
        path.rsplit('/')
            .next()?
            .starts_with("libgomp")
            .then_some(path)
    })?;
    let c_path = CString::new(path).ok()?;
    // SAFETY: `c_path` is NUL-terminated. RTLD_NOLOAD returns a handle only for a library that
    // is loaded already; the handle is never closed, so it stays loaded.
    let handle = unsafe { libc::dlopen(c_path.as_ptr(), libc::RTLD_NOLOAD | libc::RTLD_NOW) };
    if handle.is_null() {
        return None;
    }
    let symbol = |name: &std::ffi::CStr| -> Option<*mut c_void> {
        // SAFETY: `handle` is a live dlopen handle and `name` is NUL-terminated.
        let p = unsafe { libc::dlsym(handle, name.as_ptr()) };
        (!p.is_null()).then_some(p)
    };
    let parallel = symbol(c"GOMP_parallel")?;
    let thread_num = symbol(c"omp_get_thread_num")?;
    let max_threads = symbol(c"omp_get_max_threads")?;
    let in_parallel = symbol(c"omp_in_parallel")?;
    type Query = unsafe extern "C" fn() -> c_int;
    // SAFETY: libgomp exports these functions with these C signatures: GOMP_parallel (the
    // entry point of `#pragma omp parallel` since GCC 4.9) and three OpenMP API functions.
    unsafe {
        Some(Runtime {
            parallel: std::mem::transmute::<
                *mut c_void,
                unsafe extern "C" fn(Body, *mut c_void, c_uint, c_uint),
            >(parallel),
            thread_num: std::mem::transmute::<*mut c_void, Query>(thread_num),
            max_threads: std::mem::transmute::<*mut c_void, Query>(max_threads),
            in_parallel: std::mem::transmute::<*mut c_void, Query>(in_parallel),
        })
    }
}

#[cfg(not(target_os = "linux"))]
fn find_runtime() -> Option<Runtime> {
    None
}

#[cfg(target_os = "linux")]
/// What the region's threads share: the work, run by thread 0 (the caller), its result, and
/// the word the other threads sleep on until the work is done.
struct Region<F, R> {
    work: UnsafeCell<Option<F>>,
    result: UnsafeCell<Option<std::thread::Result<R>>>,
    done: AtomicU32,
    thread_num: unsafe extern "C" fn() -> c_int,
}

#[cfg(target_os = "linux")]
/// The region's body: thread 0 runs the work, the others sleep on `done`.
unsafe extern "C" fn body<F: FnOnce() -> R, R>(data: *mut c_void) {
    // SAFETY: `data` is the `Region<F, R>` that `parked` passed to GOMP_parallel; it lives
    // until GOMP_parallel returns, after every thread of the region has left this body.
    let region = unsafe { &*(data as *const Region<F, R>) };
    // SAFETY: an OpenMP API call on a thread of the region.
    if unsafe { (region.thread_num)() } == 0 {
        // SAFETY: only thread 0 touches `work` and `result`; `parked` reads `result` after
        // GOMP_parallel has returned.
        let (work, result) = unsafe { (&mut *region.work.get(), &mut *region.result.get()) };
        if let Some(f) = work.take() {
            *result = Some(std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)));
        }
        region.done.store(1, Ordering::Release);
        futex(&region.done, libc::FUTEX_WAKE, i32::MAX as u32);
    } else {
        while region.done.load(Ordering::Acquire) == 0 {
            // Sleeps only while `done` is still 0, so a wake that came first is not missed.
            futex(&region.done, libc::FUTEX_WAIT, 0);
        }
    }
}

#[cfg(target_os = "linux")]
/// `futex(word, op | FUTEX_PRIVATE_FLAG, value)` without a timeout.
fn futex(word: &AtomicU32, op: c_int, value: u32) {
    // SAFETY: `word` is a live, aligned 32-bit word of this process; FUTEX_WAIT reads it and
    // sleeps while it equals `value`, FUTEX_WAKE wakes up to `value` sleepers on it. Neither
    // writes memory; a spurious or interrupted wait returns and the caller checks again.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            op | libc::FUTEX_PRIVATE_FLAG,
            value,
            std::ptr::null::<libc::timespec>(),
        );
    }
}

/// Runs `f` on the calling thread while the other threads of its OpenMP team, if the process
/// has an OpenMP runtime, sleep (see the module's doc). Runs `f` as it is where parking does
/// not apply ([`would_park`]). A panic in `f` resumes here, after the region has ended.
pub fn parked<F: FnOnce() -> R, R>(f: F) -> R {
    #[cfg(target_os = "linux")]
    if let Some((rt, threads)) = team() {
        return parked_in(rt, threads, f);
    }
    f()
}

#[cfg(target_os = "linux")]
fn parked_in<F: FnOnce() -> R, R>(rt: &Runtime, threads: c_uint, f: F) -> R {
    let region = Region {
        work: UnsafeCell::new(Some(f)),
        result: UnsafeCell::new(None),
        done: AtomicU32::new(0),
        thread_num: rt.thread_num,
    };
    // SAFETY: `body::<F, R>` reads `data` as the `Region<F, R>` it is, and GOMP_parallel
    // returns only after all the region's threads have finished `body`.
    unsafe {
        (rt.parallel)(
            body::<F, R>,
            &region as *const Region<F, R> as *mut c_void,
            threads,
            0,
        )
    };
    match region.result.into_inner() {
        Some(Ok(r)) => r,
        Some(Err(panic)) => std::panic::resume_unwind(panic),
        // OpenMP runs a region's body on its thread 0, the caller, whatever else happens.
        None => unreachable!("the OpenMP region did not run on its calling thread"),
    }
}
