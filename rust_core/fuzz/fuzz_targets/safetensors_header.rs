#![no_main]
//! Any byte string given to the header validator returns Ok or Err, never panics; an accepted
//! header describes tensors that lie inside the input, aligned, without overlaps.

use libfuzzer_sys::fuzz_target;
use moeq_core::checkpoint::header::parse;

fuzz_target!(|data: &[u8]| {
    if let Ok(h) = parse(data) {
        let mut end = h.data_start;
        let mut spans: Vec<(usize, usize)> = h.tensors.iter().map(|t| (t.start, t.len)).collect();
        spans.sort();
        for (start, len) in spans {
            assert_eq!(start, end, "tensors must tile the data section");
            end = start + len;
        }
        assert_eq!(end, data.len());
        for t in &h.tensors {
            assert_eq!(t.start % t.dtype.alignment(), 0);
        }
    }
});
