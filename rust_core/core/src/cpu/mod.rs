//! The CPU MoE path: routing, quantized linear layers and the fused forward.

pub mod amx;
pub mod amx_bf16;
pub mod arena;
pub mod build;
pub mod kernels;
pub mod linear;
pub mod load;
pub mod moe;
pub mod omp;
pub mod packed;
pub mod peak;
pub mod routing;
pub mod spare;
pub mod wo;

pub use moe::{CpuExpert, CpuMoe};

/// The thread pool of the CPU forward for threads other than an adopted one: `MOEQ_NUM_THREADS`
/// threads (read once; unset, zero or unparsable means one per available CPU). A pool of our
/// own keeps the thread count ours to set, whatever else in the process uses rayon's global
/// pool. `None` only if the OS refused the threads; the work then runs on the calling thread
/// alone (`on_this_thread_only`).
///
/// One per process: a child forked after the pool started inherits it without its threads, and
/// work handed to it there would wait forever (a call from any thread but the adopted one), so
/// the child builds its own (the parent's stays allocated, unused). No lock: a fork while
/// another thread held one would leave the child a lock that nobody releases.
pub fn pool() -> Option<&'static rayon::ThreadPool> {
    use std::sync::atomic::Ordering;
    let pid = std::process::id();
    loop {
        let current = POOL.load(Ordering::Acquire);
        if let Some((owner, p)) = process_pool(current) {
            if owner == pid {
                return Some(p);
            }
        }
        let built = rayon::ThreadPoolBuilder::new()
            .num_threads(num_threads())
            .thread_name(|i| format!("moeq-cpu-{i}"))
            .build()
            .ok()?;
        let mine = Box::into_raw(Box::new((pid, built)));
        if POOL
            .compare_exchange(current, mine, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            // SAFETY: `mine` came from Box::into_raw just above; published, it is never freed.
            return Some(unsafe { &(*mine).1 });
        }
        // Another thread published first: ours was never shared, so it is dropped (its
        // threads exit) and the loop takes the published one.
        // SAFETY: `mine` came from Box::into_raw above and was not published.
        drop(unsafe { Box::from_raw(mine) });
    }
}

/// [`pool`] and the process that built it: published once per process, never freed.
static POOL: std::sync::atomic::AtomicPtr<(u32, rayon::ThreadPool)> =
    std::sync::atomic::AtomicPtr::new(std::ptr::null_mut());

/// The published [`POOL`] entry `p` (null for none).
fn process_pool(p: *mut (u32, rayon::ThreadPool)) -> Option<(u32, &'static rayon::ThreadPool)> {
    // SAFETY: a non-null `POOL` value was published by `pool` from Box::into_raw and is never
    // freed, so it stays valid for the rest of the process.
    unsafe { p.as_ref() }.map(|(owner, pool)| (*owner, pool))
}

/// The pool that a long-lived thread joined with [`adopt_calling_thread`] (in Python, the
/// main thread, when it first opens a checkpoint, repacks, builds a layer or runs a forward):
/// that thread is one of its `MOEQ_NUM_THREADS` threads.
static OWNER: std::sync::OnceLock<Option<rayon::ThreadPool>> = std::sync::OnceLock::new();

/// Makes the calling thread one of the forward's `MOEQ_NUM_THREADS` threads, so that a
/// forward called on it starts at once instead of handing the work to a sleeping worker and
/// waiting for it to wake (about 0.1 ms on small machines, a tenth of a decode step); the
/// other workers join as they wake. Other threads keep using [`pool`]. Meant for one
/// long-lived thread (the first caller wins; a thread that exits leaves its pool's workers
/// idle). Rayon's parallel iterators called on this thread then run on this pool. `false`
/// when another thread was adopted, or this one already works for another rayon pool.
pub fn adopt_calling_thread() -> bool {
    let mut adopted = false;
    OWNER.get_or_init(|| {
        let built = rayon::ThreadPoolBuilder::new()
            .num_threads(num_threads())
            .use_current_thread()
            .thread_name(|i| format!("moeq-cpu-main-{i}"))
            .build()
            .ok();
        adopted = built.is_some();
        // The initialiser runs on the calling thread: this marks the adopted one.
        IS_ADOPTED.set(adopted);
        OWNER_PROCESS.store(std::process::id(), std::sync::atomic::Ordering::Relaxed);
        built
    });
    adopted
}

/// Whether [`adopt_calling_thread`] has run in this process (whether or not it adopted): a
/// caller that adopts its main thread on first use (Python's `moeq_rs`) has then done so.
pub fn adoption_settled() -> bool {
    OWNER.get().is_some()
}

/// The process that adopted a thread into [`OWNER`] (a forked child has the pool without its
/// other threads).
static OWNER_PROCESS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// Frees the spare scratch buffers ([`spare`]) of every forward thread of this process and of
/// the calling thread; returns the bytes they held. Called on another thread than the adopted
/// one (Python's main thread), the adopted pool's threads keep theirs. The forward keeps up to 8 buffers of up to
/// 256 MiB per element type and thread, so that a prefill does not fault its scratch in again
/// each call: after a long prompt that is hundreds of MB (a Qwen3-shape layer, T = 8192: about
/// 850 MB), held until the next call reuses it. Pools inherited across a fork (whose other
/// threads do not exist) are skipped.
pub fn release_scratch() -> usize {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let here = || spare::release_here() + moe::release_gate_up_here();
    let freed = AtomicUsize::new(here());
    let pid = std::process::id();
    let each = |_: rayon::BroadcastContext<'_>| {
        freed.fetch_add(here(), Ordering::Relaxed);
    };
    // The adopted thread is one of its pool's workers, and only it runs its own share of a
    // broadcast: from any other thread this would wait until that thread next entered the
    // pool, maybe forever. So its pool is reached from that thread only.
    if let Some(Some(p)) = OWNER.get() {
        if IS_ADOPTED.get() && OWNER_PROCESS.load(Ordering::Relaxed) == pid {
            p.broadcast(each);
        }
    }
    if let Some((owner, p)) = process_pool(POOL.load(Ordering::Acquire)) {
        if owner == pid {
            p.broadcast(each);
        }
    }
    freed.into_inner()
}

thread_local! {
    /// Whether this thread is inside [`with_openmp_parked`], which has decided about parking.
    static OPENMP_DECIDED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    /// Whether this thread is the one [`adopt_calling_thread`] adopted.
    static IS_ADOPTED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// A xorshift64 stream: varied test inputs without a dependency.
#[cfg(test)]
pub(crate) fn xorshift(mut s: u64) -> impl FnMut() -> u64 {
    move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    }
}

/// The thread count `MOEQ_NUM_THREADS` asks for (default, and for a value that is not a
/// positive integer: the available CPUs), at most four per available CPU: more only
/// oversubscribes the CPUs, and each pool starts every thread up front (a value of 100000 spent
/// minutes starting threads; 2048 made `moeq inspect` of a 4 MB checkpoint take 7 s).
pub fn num_threads() -> usize {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    std::env::var("MOEQ_NUM_THREADS")
        .ok()
        .and_then(|v| requested_threads(&v))
        .map_or(cpus, |n| n.min(cpus.saturating_mul(4)))
}

/// The positive thread count a `MOEQ_NUM_THREADS` value asks for, or None. A count too large
/// for `usize` asks for the most (then capped), like any other large count, rather than
/// being read as no count at all.
fn requested_threads(value: &str) -> Option<usize> {
    match value.trim().parse::<usize>() {
        Ok(n) => (n > 0).then_some(n),
        Err(e) if *e.kind() == std::num::IntErrorKind::PosOverflow => Some(usize::MAX),
        Err(_) => None,
    }
}

/// Whether the forward's calls on this thread park its idle OpenMP threads ([`omp::parked`]):
/// only on the adopted thread (Python's main thread, where torch's operators run), with more
/// than one thread in its pool (with one there is nothing to gain, and waking the sleepers at
/// the end costs tens of microseconds). Other threads may have no OpenMP team yet, and a
/// first parallel region would create one.
fn parks_here() -> bool {
    IS_ADOPTED.get() && matches!(OWNER.get(), Some(Some(p)) if p.current_num_threads() > 1)
}

/// Whether a forward called now on this thread would park its idle OpenMP threads.
pub fn parks_openmp_here() -> bool {
    parks_here() && omp::would_park()
}

/// Runs `f` with this thread's idle OpenMP threads parked where [`parks_openmp_here`], else
/// as it is: for callers that make several forward calls in a row (one decision and one
/// region for all; the calls inside run as they are).
pub fn with_openmp_parked<R>(f: impl FnOnce() -> R) -> R {
    if !parks_here() || OPENMP_DECIDED.get() {
        return f();
    }
    OPENMP_DECIDED.set(true);
    // Reset on the way out, panic or not.
    struct Decided;
    impl Drop for Decided {
        fn drop(&mut self) {
            OPENMP_DECIDED.set(false);
        }
    }
    let _decided = Decided;
    omp::parked(f)
}

/// Runs `f` with `MOEQ_NUM_THREADS` threads: on the calling thread and the rest of its pool
/// when it was adopted (see [`adopt_calling_thread`]); else on [`pool`]. Nothing else: no
/// OpenMP region, so work that is not a forward (opening, repacking, packing) never creates
/// the caller's OpenMP team (which a process forked afterwards would inherit without its
/// threads). [`in_pool`] is the forward's form.
pub fn on_threads<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    if let Some(Some(p)) = OWNER.get() {
        if p.current_thread_index().is_some() {
            // This thread is a member: rayon's parallel iterators in `f` use its pool.
            return f();
        }
    }
    match pool() {
        Some(p) => p.install(f),
        None => on_this_thread_only(f),
    }
}

thread_local! {
    /// A pool of the calling thread alone, for when the OS refuses new threads (a container's
    /// pids limit, RLIMIT_NPROC): rayon's global pool would need threads too, and its parallel
    /// iterators panic when it cannot start them. Kept for the thread's life: the thread stays
    /// registered with the pool it joined.
    static ALONE: Option<rayon::ThreadPool> = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .use_current_thread()
        .build()
        .ok();
}

/// Runs `f` (whose parallel iterators then run serially) on the calling thread, as a pool of
/// one that starts no thread; where the thread already works for a rayon pool, on that one.
fn on_this_thread_only<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    if rayon::current_thread_index().is_some() {
        return f();
    }
    ALONE.with(|alone| match alone {
        Some(p) => p.install(f),
        // Not expected (a pool of one starts no thread); `f` may then meet the global pool.
        None => f(),
    })
}

/// The number of threads [`on_threads`] runs on, without starting a pool.
pub fn threads() -> usize {
    let other = process_pool(POOL.load(std::sync::atomic::Ordering::Acquire));
    match (OWNER.get(), other) {
        (Some(Some(p)), _) | (_, Some((_, p))) => p.current_num_threads(),
        _ => num_threads(),
    }
}

/// Runs `f` with `MOEQ_NUM_THREADS` threads: on the calling thread and the rest of its pool
/// when it was adopted (see [`adopt_calling_thread`]), with its idle OpenMP threads parked
/// ([`with_openmp_parked`]); else on [`pool`].
pub fn in_pool<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    // Parking applies only on the adopted thread, which `on_threads` runs `f` on as it is.
    on_threads(|| with_openmp_parked(f))
}

#[cfg(test)]
mod tests {
    use super::requested_threads;

    /// The fallback for a refused pool runs parallel iterators serially on the calling
    /// thread, starting no thread and never touching rayon's global pool.
    #[test]
    fn alone_runs_parallel_work_on_the_calling_thread() {
        use rayon::prelude::*;
        std::thread::spawn(|| {
            let me = std::thread::current().id();
            let (threads, ids, sum) = super::on_this_thread_only(|| {
                let ids: Vec<_> = (0..64)
                    .into_par_iter()
                    .map(|_| std::thread::current().id())
                    .collect();
                let sum: u64 = (0..1000u64).into_par_iter().sum();
                (rayon::current_num_threads(), ids, sum)
            });
            assert_eq!(threads, 1);
            assert!(ids.iter().all(|&id| id == me));
            assert_eq!(sum, 499_500);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn thread_counts_from_the_environment() {
        assert_eq!(requested_threads("3"), Some(3));
        assert_eq!(requested_threads(" 16\n"), Some(16));
        // Too large for usize: the most, which num_threads then caps.
        assert_eq!(requested_threads("99999999999999999999"), Some(usize::MAX));
        for not_a_count in ["0", "-1", "2.5", "abc", "", "-99999999999999999999"] {
            assert_eq!(requested_threads(not_a_count), None, "{not_a_count:?}");
        }
    }
}
