//! Per-thread spare buffers for the forward's per-call scratch (prepared inputs, bf16 rows,
//! converted activations). A prefill call would otherwise allocate and free tens of MB; once
//! the allocator hands that memory back to the OS (as glibc does after other code in the
//! process frees large blocks) every call faults it in again: measured 18 ms of 75 at the
//! Qwen3 shape, T=1024, inside a torch process.

use std::cell::RefCell;

/// Spare buffers kept per thread and element type.
const KEEP: usize = 8;
/// Buffers larger than this are freed rather than kept (bytes).
pub(crate) const MAX_BYTES: usize = 256 << 20;

/// Element types with a per-thread spare list.
pub trait Spare: Copy + 'static {
    /// What [`take_any`] fills a buffer with under `MOEQ_POISON_SCRATCH=1` ([`poisoning`]):
    /// a value no computation produces by accident (NaN for floats).
    const POISON: Self;
    /// Runs `f` on this thread's spares (`None` if re-entered).
    fn with_spares<R>(f: impl FnOnce(Option<&mut Vec<Vec<Self>>>) -> R) -> R;
}

/// `MOEQ_POISON_SCRATCH=1` (read once): buffers handed out for overwriting come filled with
/// [`Spare::POISON`] instead of what they held, so a value a forward forgets to write shows
/// as NaN in the tests that set it, never as a stale number from an earlier call.
pub fn poisoning() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("MOEQ_POISON_SCRATCH").is_some_and(|v| v == "1"))
}

/// Whether a buffer handed out for overwriting comes poisoned (see [`poisoning`]), checked on
/// a real one: lets a test that compares poisoned and normal runs prove that poisoning was on.
pub fn hands_out_poison() -> bool {
    let v = take_any::<f32>(64, 0.0);
    let poisoned = v.iter().all(|x| x.is_nan());
    give(v);
    poisoned
}

macro_rules! spare {
    ($t:ty, $name:ident, $poison:expr) => {
        thread_local! {
            static $name: RefCell<Vec<Vec<$t>>> = const { RefCell::new(Vec::new()) };
        }
        impl Spare for $t {
            const POISON: $t = $poison;
            fn with_spares<R>(f: impl FnOnce(Option<&mut Vec<Vec<$t>>>) -> R) -> R {
                $name.with(|c| match c.try_borrow_mut() {
                    Ok(mut s) => f(Some(&mut s)),
                    Err(_) => f(None),
                })
            }
        }
    };
}

spare!(u8, SPARE_U8, 0xA5);
// A bf16 NaN (u16 spares hold bf16 bits).
spare!(u16, SPARE_U16, 0x7FC1);
spare!(f32, SPARE_F32, f32::NAN);
spare!(i32, SPARE_I32, i32::MIN);
// Two bf16 NaNs (u32 spares hold bf16 pairs).
spare!(u32, SPARE_U32, 0x7FC1_7FC1);

/// `len` copies of `fill`, in a buffer as [`take_empty`] finds one.
pub fn take<T: Spare>(len: usize, fill: T) -> Vec<T> {
    let mut v = take_empty(len);
    v.resize(len, fill);
    v
}

/// An empty buffer with room for `len` values, for a caller that appends them: the smallest
/// spare buffer of this thread that holds `len` values and is at most twice that size (or
/// 64 KiB), else a new one. The bound keeps a small result (which may be handed to Python)
/// from pinning a large buffer.
pub fn take_empty<T: Spare>(len: usize) -> Vec<T> {
    let mut v = find(len);
    v.clear();
    v
}

/// `len` values, for a caller that overwrites every one: a buffer as [`take_empty`] finds
/// one, holding what it held (values past its old length are `fill`). Saves the pass that
/// [`take`] spends filling a buffer about to be overwritten. Under [`poisoning`] every value
/// is [`Spare::POISON`].
pub fn take_any<T: Spare>(len: usize, fill: T) -> Vec<T> {
    let mut v = find(len);
    if poisoning() {
        v.clear();
        v.resize(len, T::POISON);
    } else if v.len() >= len {
        v.truncate(len);
    } else {
        v.resize(len, fill);
    }
    v
}

/// The smallest spare buffer of this thread that holds `len` values and is at most twice
/// that size (or 64 KiB), as it was given back; else a new empty one with room for `len`.
fn find<T: Spare>(len: usize) -> Vec<T> {
    let limit = (2 * len).max((64 << 10) / std::mem::size_of::<T>().max(1));
    T::with_spares(|s| {
        let s = s?;
        let at = (0..s.len())
            .filter(|&i| (len..=limit).contains(&s[i].capacity()))
            .min_by_key(|&i| s[i].capacity())?;
        Some(s.swap_remove(at))
    })
    .unwrap_or_else(|| Vec::with_capacity(len))
}

/// Gives `v` back to this thread's spares (dropped when there are enough, or when it is
/// larger than 256 MiB).
pub fn give<T: Spare>(v: Vec<T>) {
    if v.capacity() == 0 || v.capacity() * std::mem::size_of::<T>() > MAX_BYTES {
        return;
    }
    T::with_spares(|s| {
        if let Some(s) = s {
            if s.len() < KEEP {
                s.push(v);
            }
        }
    });
}

/// Frees this thread's spare buffers; returns the bytes they held.
pub fn release_here() -> usize {
    fn drain<T: Spare>() -> usize {
        T::with_spares(|s| {
            s.map_or(0, |s| {
                let bytes = s
                    .iter()
                    .map(|v| v.capacity() * std::mem::size_of::<T>())
                    .sum();
                *s = Vec::new();
                bytes
            })
        })
    }
    drain::<u8>() + drain::<u16>() + drain::<f32>()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_come_back_filled_and_reused() {
        let a = take(1000, 7u8);
        assert_eq!(a, vec![7u8; 1000]);
        let ptr = a.as_ptr();
        give(a);
        let b = take(600, 3u8);
        assert_eq!(b, vec![3u8; 600]);
        assert_eq!(b.as_ptr(), ptr, "the spare is reused");
        give(b);
        let c = take(5000, 1u8);
        assert_eq!(c, vec![1u8; 5000]);
        give(c);
        let e = take_empty::<u8>(4000);
        assert!(e.is_empty() && e.capacity() >= 4000);
        // The smallest spare that fits; never one more than twice the size asked for.
        give(vec![0u8; 1 << 20]);
        give(vec![0u8; 1 << 18]);
        assert_eq!(take(200_000, 0u8).capacity(), 1 << 18);
        // A small request takes a small spare (the 1000-byte one) or a new buffer, never 1 MiB.
        assert!(take(100, 0u8).capacity() <= 64 << 10);
        for _ in 0..20 {
            give(vec![0f32; 10]);
        }
        assert_eq!(f32::with_spares(|s| s.map(|s| s.len())), Some(KEEP));
        assert!(release_here() >= KEEP * 10 * 4 + (1 << 20));
        assert_eq!(f32::with_spares(|s| s.map(|s| s.len())), Some(0));
        assert_eq!(release_here(), 0);
    }

    #[test]
    fn take_any_keeps_what_the_buffer_held() {
        if poisoning() {
            // Under MOEQ_POISON_SCRATCH=1 it hands out poison instead, by design.
            assert!(take_any(10, 1f32).iter().all(|v| v.is_nan()));
            return;
        }
        // u16 spares are used by no other test in this thread.
        let mut a = take_empty::<u16>(3000);
        a.extend((0..2000).map(|i| i as u16));
        let ptr = a.as_ptr();
        give(a);
        let b = take_any(1500, 9u16);
        assert_eq!(b.as_ptr(), ptr, "the spare is reused");
        assert!(b.iter().enumerate().all(|(i, &v)| v == i as u16));
        give(b);
        // Longer than it held: the rest is `fill`.
        let c = take_any(2500, 9u16);
        assert_eq!(c.len(), 2500);
        assert!(c[..1500].iter().enumerate().all(|(i, &v)| v == i as u16));
        assert!(c[1500..].iter().all(|&v| v == 9));
    }
}
