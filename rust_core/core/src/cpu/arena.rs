//! One read-only allocation holding every packed weight of a layer, backed by 2 MiB pages where
//! the kernel allows it.
//!
//! Decode streams tens of megabytes of randomly chosen experts per call. With 4 KiB pages that
//! is thousands of TLB misses, and the hardware prefetchers stop at every 4 KiB boundary; in one
//! huge-page arena the streams run uninterrupted. Elsewhere (or if the mapping fails) the arena
//! is an ordinary heap allocation with identical contents.

use std::sync::Arc;

/// Byte alignment of every slice handed out: a cache line, so 64-byte vector loads never split.
pub const ALIGN: usize = 64;

/// Immutable bytes shared by the layer's linear layers.
#[derive(Debug)]
pub struct Arena {
    mem: Memory,
    len: usize,
}

#[derive(Debug)]
enum Memory {
    /// An anonymous mapping `[base, base + map_len)` with the data at `data`.
    #[cfg(target_os = "linux")]
    Mapped {
        base: *mut libc::c_void,
        map_len: usize,
        data: *mut i8,
    },
    Heap(Vec<i8>),
}

// SAFETY: the mapping is written only inside `Arena::build`, before the arena is shared; after
// that it is read-only memory owned by this value, so sharing references across threads is
// as safe as sharing a `&[i8]`.
unsafe impl Send for Arena {}
// SAFETY: as above: no interior mutability after construction.
unsafe impl Sync for Arena {}

impl Drop for Arena {
    fn drop(&mut self) {
        #[cfg(target_os = "linux")]
        if let Memory::Mapped { base, map_len, .. } = self.mem {
            // SAFETY: `base`/`map_len` are exactly the mapping made in `build`, unmapped once.
            unsafe {
                libc::munmap(base, map_len);
            }
        }
    }
}

impl Arena {
    /// Lays `parts` out one after another (each at a multiple of [`ALIGN`]) and returns the
    /// arena with each part's offset.
    pub fn build(parts: &[&[i8]]) -> (Arc<Arena>, Vec<usize>) {
        let mut offsets = Vec::with_capacity(parts.len());
        let mut len = 0usize;
        for p in parts {
            offsets.push(len);
            len += p.len().div_ceil(ALIGN) * ALIGN;
        }
        let mem = Self::map(len).unwrap_or_else(|| Memory::Heap(vec![0i8; len + ALIGN]));
        let mut arena = Arena { mem, len };
        let base = arena.start_mut();
        for (p, &at) in parts.iter().zip(&offsets) {
            // SAFETY: `at + p.len() <= len`, and `base` points at `len` writable bytes that no
            // other reference sees yet (the arena is not shared before this function returns).
            unsafe { std::ptr::copy_nonoverlapping(p.as_ptr(), base.add(at), p.len()) };
        }
        (Arc::new(arena), offsets)
    }

    #[cfg(target_os = "linux")]
    fn map(len: usize) -> Option<Memory> {
        const HUGE: usize = 2 << 20;
        if len < HUGE {
            return None;
        }
        let map_len = len + HUGE;
        // SAFETY: a fresh private anonymous mapping; no existing memory is touched.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return None;
        }
        let aligned = (base as usize).div_ceil(HUGE) * HUGE;
        // SAFETY: [aligned, aligned + len) lies inside the mapping (it has HUGE spare bytes);
        // the advice only changes how untouched pages will be backed, before any is touched.
        unsafe {
            libc::madvise(aligned as *mut libc::c_void, len, libc::MADV_HUGEPAGE);
        }
        Some(Memory::Mapped {
            base,
            map_len,
            data: aligned as *mut i8,
        })
    }

    #[cfg(not(target_os = "linux"))]
    fn map(_len: usize) -> Option<Memory> {
        None
    }

    /// The first data byte ([`ALIGN`]-aligned).
    fn start(&self) -> *const i8 {
        match &self.mem {
            #[cfg(target_os = "linux")]
            Memory::Mapped { data, .. } => *data,
            Memory::Heap(v) => v.as_ptr().wrapping_add(v.as_ptr().align_offset(ALIGN)),
        }
    }

    /// [`Arena::start`] for writing (only while building).
    fn start_mut(&mut self) -> *mut i8 {
        match &mut self.mem {
            #[cfg(target_os = "linux")]
            Memory::Mapped { data, .. } => *data,
            Memory::Heap(v) => {
                let at = v.as_ptr().align_offset(ALIGN);
                v.as_mut_ptr().wrapping_add(at)
            }
        }
    }

    /// `len` bytes at `offset`; empty when out of range.
    pub fn slice(&self, offset: usize, len: usize) -> &[i8] {
        if offset.checked_add(len).is_none_or(|end| end > self.len) {
            return &[];
        }
        // SAFETY: offset + len <= self.len, and `start()` points at self.len initialised bytes
        // that live as long as `self` and are never written after `build`.
        unsafe { std::slice::from_raw_parts(self.start().add(offset), len) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_round_trip_aligned() {
        let big: Vec<i8> = (0..5_000_000).map(|i| (i % 253) as i8).collect();
        let small: Vec<i8> = vec![-7; 100];
        let (arena, at) = Arena::build(&[&small, &big, &small]);
        assert_eq!(arena.slice(at[0], 100), &small[..]);
        assert_eq!(arena.slice(at[1], big.len()), &big[..]);
        assert_eq!(arena.slice(at[2], 100), &small[..]);
        for &o in &at {
            assert_eq!(arena.slice(o, 1).as_ptr() as usize % ALIGN, 0);
        }
        assert!(arena.slice(at[2], 10_000).is_empty());
        let (tiny, at) = Arena::build(&[&small]);
        assert_eq!(tiny.slice(at[0], 100), &small[..]);
    }
}
