//! The CPU MoE path: routing, quantized linear layers and the fused forward.

pub mod arena;
pub mod build;
pub mod kernels;
pub mod linear;
pub mod load;
pub mod moe;
pub mod packed;
pub mod routing;
pub mod spare;
pub mod wo;

pub use moe::{CpuExpert, CpuMoe};

/// The thread pool of the CPU forward for threads other than its owner: `MOEQ_NUM_THREADS`
/// threads (read once; unset, zero or unparsable means one per available CPU). A pool of our
/// own keeps the thread count ours to set, whatever else in the process uses rayon's global
/// pool. `None` only if the OS refused the threads; the work then runs on rayon's global pool.
pub fn pool() -> Option<&'static rayon::ThreadPool> {
    static POOL: std::sync::OnceLock<Option<rayon::ThreadPool>> = std::sync::OnceLock::new();
    POOL.get_or_init(|| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(num_threads())
            .thread_name(|i| format!("moeq-cpu-{i}"))
            .build()
            .ok()
    })
    .as_ref()
}

/// The pool of the first thread that runs a forward (in Python, normally the main thread): that
/// thread is one of its `MOEQ_NUM_THREADS` threads. A forward called there starts at once on
/// the calling thread instead of handing the work to a sleeping worker and waiting for it to
/// wake (about 0.1 ms on small machines, a tenth of a decode step); the other workers join as
/// they wake. Other threads use [`pool`].
fn owner_pool() -> Option<&'static rayon::ThreadPool> {
    static POOL: std::sync::OnceLock<Option<rayon::ThreadPool>> = std::sync::OnceLock::new();
    POOL.get_or_init(|| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(num_threads())
            .use_current_thread()
            .thread_name(|i| format!("moeq-cpu-owner-{i}"))
            .build()
            .ok()
    })
    .as_ref()
}

/// The thread count `MOEQ_NUM_THREADS` asks for (default: the available CPUs).
pub fn num_threads() -> usize {
    std::env::var("MOEQ_NUM_THREADS")
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .filter(|&n| n > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// Runs `f` with `MOEQ_NUM_THREADS` threads: on the calling thread and the rest of its pool
/// when it owns one (see [`owner_pool`]), else on [`pool`].
pub fn in_pool<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    if let Some(p) = owner_pool() {
        if p.current_thread_index().is_some() {
            // This thread is a member: rayon's parallel iterators in `f` use its pool.
            return f();
        }
    }
    match pool() {
        Some(p) => p.install(f),
        None => f(),
    }
}
