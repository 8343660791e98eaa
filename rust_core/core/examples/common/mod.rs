//! What the timing examples share.

/// A size from the environment variable `name`, or `default` when it is unset or not a count.
pub fn env_size(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(default)
}
