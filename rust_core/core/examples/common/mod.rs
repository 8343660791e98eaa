//! What the timing examples share.

/// A size from the environment variable `name`, or `default` when it is unset or not a count.
pub fn env_size(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(default)
}

/// Seconds per call of `f`: the best of 20 batches of `calls.div_ceil(20)` calls, as a shared
/// VM's neighbours slow whole batches by up to 2x (a mean over all calls swung 130-200 GMAC/s
/// between runs of the same binary).
pub fn best_per_call(calls: usize, mut f: impl FnMut()) -> f64 {
    let batch = calls.div_ceil(20).max(1);
    let mut best = f64::INFINITY;
    for _ in 0..20 {
        let t = std::time::Instant::now();
        for _ in 0..batch {
            f();
        }
        best = best.min(t.elapsed().as_secs_f64() / batch as f64);
    }
    best
}
