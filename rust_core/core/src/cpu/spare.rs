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
spare!(Line, SPARE_LINE, Line([0xA5; LINE]));

/// Bytes per cache line.
pub const LINE: usize = 64;

/// One cache line of bytes, on a cache line's boundary: the unit of [`LineBytes`].
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug)]
pub struct Line(pub [u8; LINE]);

/// `T` on a cache line's boundary: the accumulators AMX passes store their C tiles into (and
/// load carried ones from). On the stack or in a `Vec`, an array of `i32` or `f32` starts
/// anywhere 4 bytes apart, and every 64-byte tile row then spans two lines.
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct OnLine<T>(pub T);

impl<T> std::ops::Deref for OnLine<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

impl<T> std::ops::DerefMut for OnLine<T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.0
    }
}

/// Plain numbers an [`AlignedBuf`] holds: every bit pattern is a value, and the size divides
/// a [`Line`].
pub trait LineValue: Copy + sealed::Sealed {
    /// A line of `v`s.
    fn line_of(v: Self) -> Line;
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for u8 {}
    impl Sealed for u32 {}
}

impl LineValue for u8 {
    fn line_of(v: u8) -> Line {
        Line([v; LINE])
    }
}

impl LineValue for u32 {
    fn line_of(v: u32) -> Line {
        let mut line = [0u8; LINE];
        for c in line.chunks_exact_mut(4) {
            c.copy_from_slice(&v.to_ne_bytes());
        }
        Line(line)
    }
}

/// A buffer that starts on a cache line's boundary, taken from this thread's spares. AMX
/// tiles are loaded from such buffers (the int8 activations, and the bf16 rows and widened
/// weights): a tile load whose 64-byte rows straddle two cache lines ran 2-6x slower than an
/// aligned one on an Emerald Rapids-class VM, and a `Vec` from the allocator starts 16, 32 or
/// 48 bytes past a line's start as often as not.
#[derive(Debug)]
pub struct AlignedBuf<T: LineValue> {
    lines: Vec<Line>,
    len: usize,
    of: std::marker::PhantomData<T>,
}

/// Bytes on a cache line's boundary (the int8 activations).
pub type LineBytes = AlignedBuf<u8>;

impl<T: LineValue> Default for AlignedBuf<T> {
    fn default() -> Self {
        AlignedBuf {
            lines: Vec::new(),
            len: 0,
            of: std::marker::PhantomData,
        }
    }
}

impl<T: LineValue> AlignedBuf<T> {
    fn lines_for(len: usize) -> usize {
        len.saturating_mul(std::mem::size_of::<T>()).div_ceil(LINE)
    }

    /// `len` values in `lines`, which holds exactly the lines they need.
    fn holding(lines: Vec<Line>, len: usize) -> Self {
        // What `deref` relies on (`take` and `take_any` return as many values as asked for).
        debug_assert_eq!(lines.len(), Self::lines_for(len));
        AlignedBuf {
            lines,
            len,
            of: std::marker::PhantomData,
        }
    }

    /// `len` copies of `fill` (as [`take`]).
    pub fn take(len: usize, fill: T) -> Self {
        Self::holding(take(Self::lines_for(len), T::line_of(fill)), len)
    }

    /// `len` values for a caller that overwrites them all (as [`take_any`]: under
    /// `MOEQ_POISON_SCRATCH=1` every byte is 0xA5, which for u32 values is no NaN pattern).
    pub fn take_any(len: usize) -> Self {
        Self::holding(take_any(Self::lines_for(len), Line([0; LINE])), len)
    }

    /// Back to this thread's spares.
    pub fn give(self) {
        give(self.lines);
    }
}

impl<T: LineValue> std::ops::Deref for AlignedBuf<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: `Line` is `repr(C)` over `[u8; 64]` (size 64, no padding) and 64-aligned,
        // so `lines` is `64 * lines.len()` initialised, contiguous bytes on an alignment `T`
        // (u8 or u32: `LineValue` is sealed) meets; every bit pattern is a `T`; and every
        // constructor sizes `lines` to hold `len` values of `T`.
        unsafe { std::slice::from_raw_parts(self.lines.as_ptr().cast::<T>(), self.len) }
    }
}

impl<T: LineValue> std::ops::DerefMut for AlignedBuf<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as in `deref`; the borrow of `self` is exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.lines.as_mut_ptr().cast::<T>(), self.len) }
    }
}

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
    drain::<u8>()
        + drain::<u16>()
        + drain::<f32>()
        + drain::<i32>()
        + drain::<u32>()
        + drain::<Line>()
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

    /// Both AMX pass outputs lie on a line wherever they are: on the stack and in a `Vec`.
    #[test]
    fn pass_outputs_lie_on_lines() {
        let one = OnLine([[0i32; 16]; 64]);
        let many = vec![[OnLine([[0f32; 16]; 64]); 1]; 3];
        assert!((one.as_ptr() as usize).is_multiple_of(LINE));
        assert!(many
            .iter()
            .all(|p| (p[0].as_ptr() as usize).is_multiple_of(LINE)));
        assert_eq!(std::mem::align_of::<crate::cpu::amx::PassOut>(), LINE);
        assert_eq!(std::mem::align_of::<crate::cpu::amx_bf16::PassOut>(), LINE);
    }

    /// A word buffer holds its fill in every word (the line is built from the word's bytes).
    #[test]
    fn aligned_words_are_filled() {
        let w = AlignedBuf::take(37, 0x0102_0304u32);
        assert_eq!(w.len(), 37);
        assert!((w.as_ptr() as usize).is_multiple_of(LINE));
        assert!(w.iter().all(|&v| v == 0x0102_0304));
        w.give();
    }

    /// Byte buffers of every length start on a line, come back through the spares, and come
    /// poisoned from `take_any` under `MOEQ_POISON_SCRATCH=1`.
    #[test]
    fn line_bytes_start_on_a_line_and_come_back() {
        for len in [0, 1, 63, 64, 65, 1000, 100_000] {
            let mut b = LineBytes::take(len, 128);
            assert_eq!(b.len(), len);
            assert!((b.as_ptr() as usize).is_multiple_of(LINE), "{len} bytes");
            assert!(b.iter().all(|&v| v == 128));
            b.fill(3);
            let ptr = b.as_ptr();
            b.give();
            let again = LineBytes::take_any(len);
            assert_eq!(again.len(), len);
            if len > 0 {
                assert_eq!(again.as_ptr(), ptr, "the spare is reused");
            }
            if poisoning() {
                assert!(again.iter().all(|&v| v == 0xA5));
            }
            again.give();
        }
        assert!(release_here() >= 100_000);
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
