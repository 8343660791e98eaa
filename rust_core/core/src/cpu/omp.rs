//! Keeps the calling thread's idle OpenMP threads off the CPUs while a forward runs.
//!
//! torch runs its CPU operators on OpenMP threads, and GNU OpenMP's idle threads spin for
//! 5-10 ms after each parallel region before they sleep. A forward that comes right after a
//! torch operator (every MoE layer in a model: the router's linear layer comes first) finds
//! those threads on the CPUs its own workers need. Since Linux 6.6 a woken thread waits out
//! the running one's time slice (~1.5 ms on two CPUs) rather than preempting it, so the
//! forward ran on fewer threads than it was split for. [`parked`] runs the forward inside a
//! parallel region of the calling thread's own OpenMP team whose other threads sleep on a
//! futex until it is done, as any OpenMP code of the caller's could. The cost: the region's
//! start (microseconds while the team spins, a futex wake per thread once it sleeps) and its
//! end, where the caller wakes the sleepers and waits for them at the team's barrier (tens of
//! microseconds, more when their CPUs have gone idle).
//!
//! A team that has gone to sleep (no parallel region in the last few milliseconds) takes no
//! CPU, and waking it only to park it cost ~50 us at decode, so a team whose threads are known
//! (up to four of them, from an earlier region) is parked only when one of them is spinning:
//! its CPU clock moves across a 3 us window, or it is waiting for a CPU. A region of ours
//! leaves the team spinning as any other does, so forwards back to back park each time. Before
//! the team is known, the first park waits until some other thread of the process is seen on a
//! CPU or waiting for one: a region where torch has made no team yet would create one, and a
//! child forked afterwards would hang in torch's own parallel operators.
//!
//! Only GNU OpenMP (libgomp, which torch's PyPI wheels ship) is recognised, only a copy the
//! process has loaded already (looked up once, at the first forward that could park), and
//! never in a process forked after this library was loaded: a forked child inherits the
//! parent's team record but not its threads, and a region there would wait for them forever.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::OnceLock;

/// Whether [`parked`] parks (`MOEQ_PARK_OPENMP=0`, read at first use, or [`set_parking`], turns
/// it off).
fn parking() -> &'static AtomicBool {
    static PARKING: OnceLock<AtomicBool> = OnceLock::new();
    PARKING.get_or_init(|| {
        AtomicBool::new(std::env::var("MOEQ_PARK_OPENMP").map_or(true, |v| v.trim() != "0"))
    })
}

/// `MOEQ_PARK_OPENMP=always` (read once): park every time, never backing off after costly
/// parks ([`Backoff`]); for measuring parking itself.
fn always_park() -> bool {
    static ALWAYS: OnceLock<bool> = OnceLock::new();
    *ALWAYS.get_or_init(|| std::env::var("MOEQ_PARK_OPENMP").is_ok_and(|v| v.trim() == "always"))
}

/// Bumped by [`set_parking`]: a thread's [`Backoff`] from before counts for nothing.
static PARKING_EPOCH: AtomicU32 = AtomicU32::new(0);

/// Turns parking on or off for later forwards (benchmarks compare the two in one process); any
/// backing off after costly parks starts afresh.
pub fn set_parking(on: bool) {
    parking().store(on, Ordering::Relaxed);
    PARKING_EPOCH.fetch_add(1, Ordering::Relaxed);
}

/// The process this library was loaded into (0 before then).
static PROCESS: AtomicU32 = AtomicU32::new(0);

/// Notes the current process as the one whose OpenMP runtime may be used, if none is noted
/// yet. Runs when the library is loaded, so that a child forked later never parks.
#[cfg_attr(not(target_os = "linux"), allow(dead_code))]
fn note_process() {
    let _ = PROCESS.compare_exchange(0, std::process::id(), Ordering::Relaxed, Ordering::Relaxed);
}

#[cfg(target_os = "linux")]
extern "C" fn note_process_at_load() {
    note_process();
}

/// Runs [`note_process`] when the library is loaded, before any code of the process can fork.
#[cfg(target_os = "linux")]
#[used]
#[link_section = ".init_array"]
static NOTE_PROCESS_AT_LOAD: extern "C" fn() = note_process_at_load;

#[cfg_attr(not(target_os = "linux"), allow(dead_code))]
fn same_process() -> bool {
    PROCESS.load(Ordering::Relaxed) == std::process::id()
}

/// Whether a forward called now on this thread may park its OpenMP threads, given that our
/// side would (see `cpu::in_pool`): parking is on, this is the process the library was loaded
/// into, an OpenMP runtime is loaded, this thread is not inside a parallel region and its team
/// has more than one thread. It then parks them if they are spinning (see the module's doc).
pub fn would_park() -> bool {
    imp::team().is_some()
}

/// Runs `f` on the calling thread while the other threads of its OpenMP team, if the process
/// has a GNU OpenMP runtime and they are spinning, sleep (see the module's doc). Runs `f` as
/// it is where that does not apply ([`would_park`]) or the team sleeps already. A panic in
/// `f` resumes here, after the region has ended.
pub fn parked<F: FnOnce() -> R, R>(f: F) -> R {
    imp::parked(f)
}

/// How many forwards have run parked in this process.
pub fn parked_regions() -> u64 {
    imp::REGIONS.load(Ordering::Relaxed)
}

/// Parking's record on a thread. The region ends at the team's barrier, which waits until
/// every team thread has been scheduled, seen the work done and arrived: tens of microseconds
/// on an idle machine, but on one whose CPUs other processes keep busy each of those threads
/// waits for a time slice first, and parking then cost milliseconds per forward (a 0.1 ms
/// forward took 7-20 ms, a 1.9 ms decode step 3.3-4.2 ms). A park whose region outlasted its
/// work by more than [`Backoff::COSTLY`] (or a quarter of the work) is costly; after
/// [`Backoff::STRIKES`] costly parks in a row, forwards run unparked, 16 and then twice as
/// many after each further costly park (at most 1024); a park that cost little resets that.
/// One costly park alone does not back off: a VM's scheduling hiccup makes one now and then on
/// an idle machine, and backing off on it ran the next 16-1024 forwards unparked, 1.7x slower
/// after a torch operator (a benchmark's Mixtral W4A16 decode steps took 9.4-18 ms against
/// 6.5-7.3 ms parked). `MOEQ_PARK_OPENMP=always` never backs off.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(not(target_os = "linux"), allow(dead_code))]
struct Backoff {
    /// Forwards still to run unparked.
    skip: u32,
    /// Forwards to skip after the next costly park, halved (0: none yet).
    last: u32,
    /// Costly parks in a row so far (counted up to [`Backoff::STRIKES`]).
    strikes: u32,
}

#[cfg_attr(not(target_os = "linux"), allow(dead_code))]
impl Backoff {
    const NONE: Backoff = Backoff {
        skip: 0,
        last: 0,
        strikes: 0,
    };
    /// The region's own cost (beyond its work) that counts as costly.
    const COSTLY: std::time::Duration = std::time::Duration::from_micros(200);
    /// Costly parks in a row before the first back-off.
    const STRIKES: u32 = 3;
    const FIRST: u32 = 16;
    const MOST: u32 = 1024;

    /// The record after a park whose work took `worked` within a region of `total`.
    fn after(self, worked: std::time::Duration, total: std::time::Duration) -> Backoff {
        let cost = total.saturating_sub(worked);
        if cost <= Self::COSTLY.max(worked / 4) {
            return Self::NONE;
        }
        let strikes = (self.strikes + 1).min(Self::STRIKES);
        if strikes < Self::STRIKES {
            return Backoff {
                strikes,
                ..Self::NONE
            };
        }
        let skip = if self.last == 0 {
            Self::FIRST
        } else {
            self.last.saturating_mul(2).min(Self::MOST)
        };
        Backoff {
            skip,
            last: skip,
            strikes,
        }
    }
}

/// The wait before the next scan for a spinning team after a quiet one, given the wait before
/// that one (`None`: it was the first): 100 ms, doubling up to 6.4 s.
#[cfg_attr(not(target_os = "linux"), allow(dead_code))]
fn quiet_scan_wait(last: Option<std::time::Duration>) -> std::time::Duration {
    const FIRST: std::time::Duration = std::time::Duration::from_millis(100);
    const LONGEST: std::time::Duration = std::time::Duration::from_millis(6400);
    last.map_or(FIRST, |w| w.saturating_mul(2).min(LONGEST))
}

#[cfg(test)]
mod tests {
    use super::Backoff;
    use std::time::Duration;

    #[test]
    fn quiet_scans_back_off_to_six_seconds() {
        let mut wait = None;
        let mut seen = Vec::new();
        for _ in 0..9 {
            let w = super::quiet_scan_wait(wait);
            seen.push(w.as_millis());
            wait = Some(w);
        }
        assert_eq!(seen, [100, 200, 400, 800, 1600, 3200, 6400, 6400, 6400]);
    }

    #[test]
    fn costly_parks_back_off_and_cheap_ones_reset() {
        let us = Duration::from_micros;
        // Cheap: the region's own cost within 200 us, or within a quarter of the work.
        assert_eq!(Backoff::NONE.after(us(100), us(250)), Backoff::NONE);
        assert_eq!(Backoff::NONE.after(us(4000), us(4900)), Backoff::NONE);
        // Costly: nothing skipped for the first two in a row, then 16 unparked forwards, then
        // twice as many after each further costly park.
        let costly = |b: Backoff| b.after(us(100), us(6800));
        let b = costly(Backoff::NONE);
        assert_eq!((b.skip, b.strikes), (0, 1));
        let b = costly(b);
        assert_eq!((b.skip, b.strikes), (0, 2));
        let mut b = costly(b);
        assert_eq!(b.skip, 16);
        let mut seen = vec![b.skip];
        for _ in 0..8 {
            b = b.after(us(1900), us(3300));
            seen.push(b.skip);
        }
        assert_eq!(seen, [16, 32, 64, 128, 256, 512, 1024, 1024, 1024]);
        // One cheap park and the next costly ones count from the first strike again.
        let b = b.after(us(1900), us(1950));
        assert_eq!(b, Backoff::NONE);
        assert_eq!(costly(costly(b)).skip, 0);
        assert_eq!(costly(costly(costly(b))).skip, 16);
        // A costly park between cheap ones (a scheduling hiccup) never backs off.
        let mut b = Backoff::NONE;
        for i in 0..10 {
            b = if i % 2 == 0 {
                costly(b)
            } else {
                b.after(us(10), us(20))
            };
            assert_eq!(b.skip, 0);
        }
    }
}

#[cfg(not(target_os = "linux"))]
mod imp {
    pub(super) static REGIONS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

    pub(super) fn team() -> Option<()> {
        None
    }

    pub(super) fn parked<F: FnOnce() -> R, R>(f: F) -> R {
        f()
    }
}

#[cfg(target_os = "linux")]
mod imp {
    use std::cell::UnsafeCell;
    use std::ffi::{c_int, c_uint, c_void, CStr, CString};
    use std::sync::atomic::{AtomicI32, AtomicU32, AtomicU64, Ordering};
    use std::sync::OnceLock;

    pub(super) static REGIONS: AtomicU64 = AtomicU64::new(0);

    /// How many of a team's other threads are remembered and watched.
    const WATCHED: usize = 4;

    /// A remembered thread of the team: its id and its open `/proc/self/task/<tid>/stat`.
    struct Watched {
        tid: libc::pid_t,
        stat: Option<std::fs::File>,
    }

    thread_local! {
        /// The other threads of this thread's team (each OpenMP master thread has its own),
        /// from its last parked region.
        static TEAM: std::cell::RefCell<Vec<Watched>> = const { std::cell::RefCell::new(Vec::new()) };
    }

    /// The CPU time used so far by thread `tid` of this process (Linux's per-thread
    /// scheduler clock, as `pthread_getcpuclockid` makes it), or `None` if it is gone.
    fn cpu_time(tid: libc::pid_t) -> Option<std::time::Duration> {
        // MAKE_THREAD_CPUCLOCK(tid, CPUCLOCK_SCHED): per-thread (4) scheduler clock (2).
        let clock = ((!(tid as u32)) << 3 | 6) as libc::clockid_t;
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: `ts` is a writable timespec; for a thread that has exited, or is not in
        // this process, the call fails with EINVAL and writes nothing.
        let got = unsafe { libc::clock_gettime(clock, &mut ts) };
        (got == 0).then(|| std::time::Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32))
    }

    /// Whether the thread is runnable ('R' in its stat line): a spinner waiting for a CPU uses
    /// no CPU time while it waits, but will take a CPU back.
    fn runnable(stat: &std::fs::File) -> bool {
        use std::os::unix::fs::FileExt;
        let mut line = [0u8; 512];
        stat.read_at(&mut line, 0)
            .ok()
            .and_then(|n| name_and_state(&line[..n]))
            .is_some_and(|(_, state)| state == b'R')
    }

    /// The thread name and state letter of a `/proc/.../stat` line, "tid (comm) S ...": the
    /// name sits between the first '(' and the last ')' (it may hold either), the state after.
    fn name_and_state(line: &[u8]) -> Option<(&[u8], u8)> {
        let open = line.iter().position(|&c| c == b'(')?;
        let close = line.iter().rposition(|&c| c == b')')?;
        Some((line.get(open + 1..close)?, *line.get(close + 2)?))
    }

    /// Whether the team's remembered threads are spinning: using CPU time across a 3 us
    /// window, or else runnable. `None` when none are remembered, or one has exited (the team
    /// is then learnt again by parking it).
    fn team_is_spinning() -> Option<bool> {
        TEAM.with_borrow_mut(|team| {
            if team.is_empty() {
                return None;
            }
            let mut before = [std::time::Duration::ZERO; WATCHED];
            for (b, w) in before.iter_mut().zip(team.iter()) {
                match cpu_time(w.tid) {
                    Some(t) => *b = t,
                    None => {
                        team.clear();
                        return None;
                    }
                }
            }
            let start = std::time::Instant::now();
            while start.elapsed() < std::time::Duration::from_micros(3) {
                std::hint::spin_loop();
            }
            let used = team
                .iter()
                .zip(before)
                .any(|(w, b)| cpu_time(w.tid).is_some_and(|a| a > b));
            Some(used || team.iter().any(|w| w.stat.as_ref().is_some_and(runnable)))
        })
    }

    /// The record of [`unknown_team_may_spin`]'s scans on a thread.
    #[derive(Clone, Copy)]
    struct QuietScans {
        /// The [`super::PARKING_EPOCH`] it belongs to (switching parking on scans afresh).
        epoch: u32,
        /// When the last scan found no sign of a spinning team.
        at: std::time::Instant,
        /// How long to wait before the next scan.
        wait: std::time::Duration,
    }

    thread_local! {
        static QUIET_SCANS: std::cell::Cell<Option<QuietScans>> =
            const { std::cell::Cell::new(None) };
    }

    /// Whether, with no team known yet, some thread of this process other than the caller and
    /// this library's own workers (`moeq-cpu-*`) is on a CPU or waiting for one: the spinning
    /// OpenMP threads a park is for. A region is what reveals the team's threads (they enter
    /// it), and where none exists it creates them, so parking starts only once threads are
    /// seen spinning. Any busy thread counts (one hashing without the GIL as well): /proc does
    /// not tell an OpenMP spinner from it. A scan opens a file per thread (~0.1 ms for a few
    /// threads, ~4 ms for 300), so after one that finds none the next waits 100 ms, twice as
    /// long after each quiet one in a row (at most 6.4 s; forwards in between run unparked),
    /// until parking is switched on again ([`super::set_parking`]).
    fn unknown_team_may_spin() -> bool {
        let now = std::time::Instant::now();
        let epoch = super::PARKING_EPOCH.load(Ordering::Relaxed);
        let last = QUIET_SCANS.get().filter(|q| q.epoch == epoch);
        if last.is_some_and(|q| now.duration_since(q.at) < q.wait) {
            return false;
        }
        let seen = others_runnable();
        QUIET_SCANS.set((!seen).then(|| QuietScans {
            epoch,
            at: now,
            wait: super::quiet_scan_wait(last.map(|q| q.wait)),
        }));
        seen
    }

    /// The scan of [`unknown_team_may_spin`].
    fn others_runnable() -> bool {
        use std::io::Read;
        // SAFETY: gettid has no arguments and cannot fail.
        let me = unsafe { libc::gettid() };
        let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
            return false;
        };
        let mut line = [0u8; 512];
        tasks.flatten().any(|task| {
            let name = task.file_name();
            let tid = name.to_str().and_then(|n| n.parse::<libc::pid_t>().ok());
            if tid.is_none_or(|tid| tid == me) {
                return false;
            }
            // A thread that exited meanwhile fails to open or read: it is not spinning.
            let Ok(n) =
                std::fs::File::open(task.path().join("stat")).and_then(|mut f| f.read(&mut line))
            else {
                return false;
            };
            name_and_state(&line[..n])
                .is_some_and(|(name, state)| state == b'R' && !name.starts_with(b"moeq-cpu"))
        })
    }

    /// Remembers the team's other threads (`tids`, 0 for none) unless they are the ones
    /// remembered already.
    fn remember(tids: &[libc::pid_t]) {
        TEAM.with_borrow_mut(|team| {
            let seen = || tids.iter().copied().filter(|&t| t > 0);
            if !team.iter().map(|w| w.tid).eq(seen()) {
                *team = seen()
                    .map(|tid| Watched {
                        tid,
                        stat: std::fs::File::open(format!("/proc/self/task/{tid}/stat")).ok(),
                    })
                    .collect();
            }
        });
    }

    type Body = unsafe extern "C" fn(*mut c_void);
    type Query = unsafe extern "C" fn() -> c_int;

    /// The entry points of the process's OpenMP runtime (GNU ABI).
    pub(super) struct Runtime {
        parallel: unsafe extern "C" fn(Body, *mut c_void, c_uint, c_uint),
        thread_num: Query,
        max_threads: Query,
        in_parallel: Query,
    }

    /// The runtime and the size of this thread's team, when parking applies.
    pub(super) fn team() -> Option<(&'static Runtime, c_uint)> {
        if !super::parking().load(Ordering::Relaxed) || !super::same_process() {
            return None;
        }
        let rt = runtime()?;
        // SAFETY: OpenMP API calls without arguments, valid on any thread.
        let (threads, nested) = unsafe { ((rt.max_threads)(), (rt.in_parallel)() != 0) };
        (threads > 1 && !nested).then_some((rt, threads as c_uint))
    }

    /// The GNU OpenMP runtime already loaded into this process, if any.
    fn runtime() -> Option<&'static Runtime> {
        static RUNTIME: OnceLock<Option<Runtime>> = OnceLock::new();
        RUNTIME.get_or_init(find_runtime).as_ref()
    }

    /// The loaded libgomp's path: torch's copy (`.../torch/lib/libgomp*`, or `torch.libs/` in
    /// aarch64 wheels) when there are
    /// several, since torch's operators are what leave threads spinning; else the first.
    fn loaded_libgomp() -> Option<String> {
        let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
        let mut found: Vec<&str> = maps
            .lines()
            // A mapping's path is its sixth field; a deleted file's ends in " (deleted)".
            .filter_map(|line| line.splitn(6, char::is_whitespace).nth(5))
            .map(str::trim)
            .filter(|path| path.starts_with('/') && !path.ends_with("(deleted)"))
            .filter(|path| {
                path.rsplit('/')
                    .next()
                    .is_some_and(|name| name.starts_with("libgomp"))
            })
            .collect();
        found.dedup();
        let torch = found
            .iter()
            .find(|p| p.contains("/torch/lib/") || p.contains("/torch.libs/"));
        torch.or(found.first()).map(|p| p.to_string())
    }

    fn find_runtime() -> Option<Runtime> {
        let c_path = CString::new(loaded_libgomp()?).ok()?;
        // SAFETY: `c_path` is NUL-terminated. RTLD_NOLOAD returns a handle only for a library
        // that is loaded already; the handle is never closed, so it stays loaded.
        let handle = unsafe { libc::dlopen(c_path.as_ptr(), libc::RTLD_NOLOAD | libc::RTLD_NOW) };
        if handle.is_null() {
            return None;
        }
        let symbol = |name: &CStr| -> Option<*mut c_void> {
            // SAFETY: `handle` is a live dlopen handle and `name` is NUL-terminated.
            let p = unsafe { libc::dlsym(handle, name.as_ptr()) };
            (!p.is_null()).then_some(p)
        };
        let parallel = symbol(c"GOMP_parallel")?;
        let thread_num = symbol(c"omp_get_thread_num")?;
        let max_threads = symbol(c"omp_get_max_threads")?;
        let in_parallel = symbol(c"omp_in_parallel")?;
        // SAFETY: libgomp exports these functions with these C signatures: GOMP_parallel (what
        // `#pragma omp parallel` compiles to since GCC 4.9) and three OpenMP API functions.
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

    /// What the region's threads share: the work, run by thread 0 (the caller), its result,
    /// and the word the other threads sleep on until the work is done.
    struct Region<F, R> {
        work: UnsafeCell<Option<F>>,
        result: UnsafeCell<Option<std::thread::Result<R>>>,
        done: AtomicU32,
        runtime: &'static Runtime,
        /// The thread ids of threads 1..=WATCHED, as they enter (0 for none).
        tids: [AtomicI32; WATCHED],
        /// How long the work took (written by thread 0 only).
        worked: UnsafeCell<std::time::Duration>,
    }

    /// The region's body: thread 0 runs the work, the others sleep on `done`.
    unsafe extern "C" fn body<F: FnOnce() -> R, R>(data: *mut c_void) {
        // SAFETY: `data` is the `Region<F, R>` that `parked` passed to GOMP_parallel; it lives
        // until GOMP_parallel returns, after every thread of the region has left this body.
        let region = unsafe { &*(data as *const Region<F, R>) };
        // SAFETY: an OpenMP API call on a thread of the region.
        let me = unsafe { (region.runtime.thread_num)() };
        if me == 0 {
            // SAFETY: only thread 0 touches `work`, `result` and `worked`; `parked` reads
            // `result` and `worked` after GOMP_parallel has returned.
            let (work, result, worked) = unsafe {
                (
                    &mut *region.work.get(),
                    &mut *region.result.get(),
                    &mut *region.worked.get(),
                )
            };
            if let Some(f) = work.take() {
                let start = std::time::Instant::now();
                *result = Some(std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)));
                *worked = start.elapsed();
            }
            region.done.store(1, Ordering::Release);
            futex(&region.done, libc::FUTEX_WAKE, i32::MAX as u32);
        } else {
            if let Some(slot) = region.tids.get(me as usize - 1) {
                // SAFETY: gettid has no arguments and cannot fail.
                slot.store(unsafe { libc::gettid() }, Ordering::Relaxed);
            }
            while region.done.load(Ordering::Acquire) == 0 {
                // Sleeps only while `done` is still 0, so a wake that came first is not missed.
                futex(&region.done, libc::FUTEX_WAIT, 0);
            }
        }
    }

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

    thread_local! {
        /// This thread's [`super::Backoff`], and the [`super::PARKING_EPOCH`] it belongs to.
        static BACKOFF: std::cell::Cell<(u32, super::Backoff)> =
            const { std::cell::Cell::new((0, super::Backoff::NONE)) };
    }

    pub(super) fn parked<F: FnOnce() -> R, R>(f: F) -> R {
        let epoch = super::PARKING_EPOCH.load(Ordering::Relaxed);
        let backoff = match BACKOFF.get() {
            (e, b) if e == epoch && !super::always_park() => b,
            _ => super::Backoff::NONE,
        };
        if backoff.skip > 0 {
            let skip = backoff.skip - 1;
            BACKOFF.set((epoch, super::Backoff { skip, ..backoff }));
            return f();
        }
        let Some((rt, threads)) = team() else {
            return f();
        };
        let spinning = match team_is_spinning() {
            Some(known) => known,
            // A region would create the team where torch has not made one yet, leaving the
            // process with OpenMP threads that a forked child does not have (torch's own
            // parallel operators then hang there), so the first park waits for a sign of one.
            None => super::always_park() || unknown_team_may_spin(),
        };
        if !spinning {
            // Asleep already (or none yet): nothing to park, and waking it would cost.
            return f();
        }
        let region = Region {
            work: UnsafeCell::new(Some(f)),
            result: UnsafeCell::new(None),
            done: AtomicU32::new(0),
            runtime: rt,
            tids: Default::default(),
            worked: UnsafeCell::new(std::time::Duration::ZERO),
        };
        let start = std::time::Instant::now();
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
        let total = start.elapsed();
        REGIONS.fetch_add(1, Ordering::Relaxed);
        BACKOFF.set((epoch, backoff.after(region.worked.into_inner(), total)));
        remember(&region.tids.each_ref().map(|t| t.load(Ordering::Relaxed)));
        match region.result.into_inner() {
            Some(Ok(r)) => r,
            Some(Err(panic)) => std::panic::resume_unwind(panic),
            // OpenMP runs a region's body on its thread 0, the caller, whatever else happens.
            None => unreachable!("the OpenMP region did not run on its calling thread"),
        }
    }
}
