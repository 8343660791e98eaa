#![allow(clippy::unwrap_used, clippy::expect_used)]
//! `moeq_core::cpu::omp`: a forward parks the calling thread's idle OpenMP threads, with the
//! system's GNU OpenMP runtime loaded as torch loads its own. One test function, so that no
//! other test's threads run in this process while it reads thread states.
#![cfg(target_os = "linux")]

use std::ffi::{c_int, c_uint, c_void};

use moeq_core::cpu::omp;

type Body = unsafe extern "C" fn(*mut c_void);

unsafe extern "C" fn nothing(_: *mut c_void) {}

/// The scheduler states ('R', 'S', ...) of this process's threads other than the caller.
fn other_thread_states() -> Vec<char> {
    // SAFETY: gettid has no arguments and cannot fail.
    let me = unsafe { libc::gettid() }.to_string();
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|e| {
            let e = e.ok()?;
            if e.file_name().to_str()? == me {
                return None;
            }
            let stat = std::fs::read_to_string(e.path().join("stat")).ok()?;
            stat.rsplit_once(')')?.1.trim_start().chars().next()
        })
        .collect()
}

fn running(states: &[char]) -> usize {
    states.iter().filter(|&&s| s == 'R').count()
}

/// Polls [`other_thread_states`] for up to a second until `want` holds of them (a loaded
/// machine may take a while to put a thread to sleep or on a CPU); the last reading.
fn states_until(want: impl Fn(&[char]) -> bool) -> Vec<char> {
    let mut states = other_thread_states();
    for _ in 0..100 {
        if want(&states) {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
        states = other_thread_states();
    }
    states
}

#[test]
fn a_forward_parks_the_idle_openmp_team_and_gives_back_its_result() {
    // Idle OpenMP threads spin forever, so that a parked one is told apart from an idle one
    // (GOMP_SPINCOUNT would override the policy).
    std::env::set_var("OMP_WAIT_POLICY", "active");
    // Every forward parks: no backing off after a park that a busy machine made costly.
    std::env::set_var("MOEQ_PARK_OPENMP", "always");
    std::env::remove_var("GOMP_SPINCOUNT");
    // libgomp spins only briefly when its threads outnumber the CPUs this process may use.
    let spins = std::thread::available_parallelism().map_or(1, |n| n.get()) >= 2;
    // SAFETY: loads the system's libgomp (a dependency of gcc, which the toolchain has).
    let lib = unsafe { libc::dlopen(c"libgomp.so.1".as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
    assert!(
        !lib.is_null(),
        "libgomp.so.1 (Debian's libgomp1) is needed for this test"
    );
    // SAFETY: symbols of the library just loaded, with libgomp's C signatures.
    let (set_threads, parallel) = unsafe {
        (
            std::mem::transmute::<*mut c_void, unsafe extern "C" fn(c_int)>(libc::dlsym(
                lib,
                c"omp_set_num_threads".as_ptr(),
            )),
            std::mem::transmute::<
                *mut c_void,
                unsafe extern "C" fn(Body, *mut c_void, c_uint, c_uint),
            >(libc::dlsym(lib, c"GOMP_parallel".as_ptr())),
        )
    };
    // SAFETY: OpenMP API calls; the region's body does nothing.
    unsafe {
        set_threads(2);
        parallel(nothing, std::ptr::null_mut(), 2, 0);
    }
    // The team (one thread besides this one) now spins, ready for work.
    if spins {
        let idle = states_until(|s| running(s) >= 1);
        assert!(running(&idle) >= 1, "the idle team should spin: {idle:?}");
    } else {
        eprintln!("one CPU: libgomp does not spin here, so only the results are checked");
    }

    assert!(omp::would_park());
    let me = std::thread::current().id();
    let (ran_on, parked_states, nested) = omp::parked(|| {
        (
            std::thread::current().id(),
            states_until(|s| running(s) == 0),
            omp::would_park(),
        )
    });
    assert_eq!(ran_on, me, "the work runs on the calling thread");
    assert_eq!(
        running(&parked_states),
        0,
        "the team should sleep while parked: {parked_states:?}"
    );
    assert!(!nested, "inside the region a forward does not park again");

    // A panic in the work comes out of `parked` after the region has ended (the team is
    // released: the next region runs).
    // The team spins (OMP_WAIT_POLICY=active), so both run in a parked region.
    let regions = omp::parked_regions();
    let caught = std::panic::catch_unwind(|| omp::parked(|| panic!("from the work")));
    let message = caught.expect_err("the panic comes back");
    assert_eq!(message.downcast_ref::<&str>(), Some(&"from the work"));
    assert_eq!(omp::parked(|| 7), 7);
    if spins {
        assert_eq!(omp::parked_regions(), regions + 2, "both ran parked");
    }

    omp::set_parking(false);
    assert!(!omp::would_park());
    let unparked = omp::parked(|| states_until(|s| running(s) >= 1));
    if spins {
        assert!(
            running(&unparked) >= 1,
            "with parking off the team keeps spinning: {unparked:?}"
        );
    }
    omp::set_parking(true);

    // A team of one has nothing to park.
    // SAFETY: OpenMP API call.
    unsafe { set_threads(1) };
    assert!(!omp::would_park());
}
