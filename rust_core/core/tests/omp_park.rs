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

#[test]
fn a_forward_parks_the_idle_openmp_team_and_gives_back_its_result() {
    // Idle OpenMP threads spin forever, so that a parked one is told apart from an idle one.
    std::env::set_var("OMP_WAIT_POLICY", "active");
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
    // The team (one thread besides this one: no more than the CPUs, else libgomp spins only
    // briefly) now spins, ready for work.
    std::thread::sleep(std::time::Duration::from_millis(20));
    let idle = other_thread_states();
    assert!(
        idle.iter().filter(|&&s| s == 'R').count() >= 1,
        "the idle team should spin: {idle:?}"
    );

    assert!(omp::would_park());
    let me = std::thread::current().id();
    let (ran_on, parked_states, nested) = omp::parked(|| {
        std::thread::sleep(std::time::Duration::from_millis(20));
        (
            std::thread::current().id(),
            other_thread_states(),
            omp::would_park(),
        )
    });
    assert_eq!(ran_on, me, "the work runs on the calling thread");
    assert!(
        !parked_states.contains(&'R'),
        "the team should sleep while parked: {parked_states:?}"
    );
    assert!(!nested, "inside the region a forward does not park again");

    // A panic in the work comes out of `parked` after the region has ended (the team is
    // released: the next region runs).
    let caught = std::panic::catch_unwind(|| omp::parked(|| panic!("from the work")));
    let message = caught.expect_err("the panic comes back");
    assert_eq!(message.downcast_ref::<&str>(), Some(&"from the work"));
    assert_eq!(omp::parked(|| 7), 7);

    omp::set_parking(false);
    assert!(!omp::would_park());
    let unparked = omp::parked(|| {
        std::thread::sleep(std::time::Duration::from_millis(20));
        other_thread_states()
    });
    assert!(
        unparked.iter().filter(|&&s| s == 'R').count() >= 1,
        "with parking off the team keeps spinning: {unparked:?}"
    );
    omp::set_parking(true);

    // A team of one has nothing to park.
    // SAFETY: OpenMP API call.
    unsafe { set_threads(1) };
    assert!(!omp::would_park());
}
