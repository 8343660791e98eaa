#![allow(clippy::unwrap_used, clippy::expect_used)]
//! One test per header validation rule, on byte literals.

use moeq_core::checkpoint::header::{parse, MAX_HEADER_SIZE};
use moeq_core::checkpoint::DType;

/// Builds a file image: length prefix, header JSON (padded with spaces to `pad_to`), data.
fn image(header: &str, data: &[u8], pad_to: usize) -> Vec<u8> {
    let mut h = header.as_bytes().to_vec();
    while pad_to > 0 && !(8 + h.len()).is_multiple_of(pad_to) {
        h.push(b' ');
    }
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&h);
    out.extend_from_slice(data);
    out
}

fn reason(bytes: &[u8]) -> String {
    match parse(bytes) {
        Ok(_) => panic!("expected an error"),
        Err(e) => format!("{:?} {}", e.tensor, e.reason),
    }
}

#[test]
fn valid_file_parses_sorted_with_absolute_offsets() {
    let hdr = r#"{"b":{"dtype":"I32","shape":[2],"data_offsets":[0,8]},"a":{"dtype":"BF16","shape":[2,2],"data_offsets":[8,16]},"__metadata__":{"format":"pt"}}"#;
    let img = image(hdr, &[0u8; 16], 8);
    let h = parse(&img).expect("valid");
    assert_eq!(h.tensors.len(), 2);
    assert_eq!(h.tensors[0].name, "a");
    assert_eq!(h.tensors[0].dtype, DType::BF16);
    assert_eq!(h.tensors[0].shape.as_slice(), &[2, 2]);
    assert_eq!(h.tensors[0].start, h.data_start + 8);
    assert_eq!(h.tensors[1].start, h.data_start);
    assert_eq!(h.metadata.get("format").map(String::as_str), Some("pt"));
}

#[test]
fn empty_header_and_empty_data_is_valid() {
    let img = image("{}", &[], 8);
    assert!(parse(&img).expect("valid").tensors.is_empty());
}

#[test]
fn truncated_prefix() {
    assert!(reason(&[1, 2, 3]).contains("shorter than the 8-byte"));
}

#[test]
fn header_length_beyond_file() {
    let mut img = 1000u64.to_le_bytes().to_vec();
    img.extend_from_slice(b"{}");
    assert!(reason(&img).contains("runs past the end"));
}

#[test]
fn oversized_header() {
    let img = (MAX_HEADER_SIZE + 1).to_le_bytes().to_vec();
    assert!(reason(&img).contains("exceeds"));
}

#[test]
fn invalid_utf8() {
    let mut img = 4u64.to_le_bytes().to_vec();
    img.extend_from_slice(&[0x7b, 0xff, 0xfe, 0x7d]);
    assert!(reason(&img).contains("UTF-8"));
}

#[test]
fn invalid_json() {
    assert!(reason(&image("{\"a\":", &[], 0)).contains("not valid JSON"));
}

#[test]
fn non_object_header() {
    assert!(reason(&image("[1,2]", &[], 0)).contains("not valid JSON"));
}

#[test]
fn unknown_dtype() {
    let hdr = r#"{"a":{"dtype":"Q4","shape":[1],"data_offsets":[0,1]}}"#;
    assert!(reason(&image(hdr, &[0], 0)).contains("unknown dtype"));
}

#[test]
fn unknown_entry_field() {
    let hdr = r#"{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"extra":1}}"#;
    assert!(reason(&image(hdr, &[0], 0)).contains("unknown field"));
}

#[test]
fn duplicate_name() {
    let hdr = r#"{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}"#;
    let r = reason(&image(hdr, &[0], 0));
    assert!(r.contains("more than once") && r.contains("\"a\""), "{r}");
}

#[test]
fn overlapping_offsets() {
    let hdr = r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}}"#;
    let r = reason(&image(hdr, &[0; 6], 0));
    assert!(r.contains("overlaps") && r.contains("\"b\""), "{r}");
}

#[test]
fn hole_between_tensors() {
    let hdr = r#"{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"b":{"dtype":"U8","shape":[2],"data_offsets":[4,6]}}"#;
    assert!(reason(&image(hdr, &[0; 6], 0)).contains("gap"));
}

#[test]
fn dtype_shape_mismatch() {
    let hdr = r#"{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}"#;
    let r = reason(&image(hdr, &[0; 8], 8));
    assert!(r.contains("12 bytes") && r.contains("span 8"), "{r}");
}

#[test]
fn shape_overflow_is_an_error_not_a_panic() {
    let hdr = r#"{"a":{"dtype":"F32","shape":[18446744073709551615,4],"data_offsets":[0,8]}}"#;
    assert!(reason(&image(hdr, &[0; 8], 8)).contains("overflows"));
}

#[test]
fn offsets_reversed() {
    let hdr = r#"{"a":{"dtype":"U8","shape":[0],"data_offsets":[4,0]}}"#;
    assert!(reason(&image(hdr, &[0; 4], 0)).contains("end before they begin"));
}

#[test]
fn data_past_end_of_file() {
    let hdr = r#"{"a":{"dtype":"U8","shape":[16],"data_offsets":[0,16]}}"#;
    assert!(reason(&image(hdr, &[0; 8], 0)).contains("run past the end"));
}

#[test]
fn trailing_bytes() {
    let hdr = r#"{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}"#;
    assert!(reason(&image(hdr, &[0; 5], 0)).contains("3 trailing bytes"));
}

#[test]
fn misaligned_tensor() {
    // Header padded so the data starts 8-aligned; the I32 tensor then starts at data offset 1.
    let hdr = r#"{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"b":{"dtype":"I32","shape":[1],"data_offsets":[1,5]}}"#;
    let r = reason(&image(hdr, &[0; 5], 8));
    assert!(r.contains("not aligned") && r.contains("\"b\""), "{r}");
}

#[test]
fn lfs_pointer() {
    let img = b"version https://git-lfs.github.com/spec/v1\noid sha256:abc\nsize 123\n";
    assert!(parse(img).err().is_some_and(|e| e.lfs_pointer));
}

#[test]
fn sub_byte_dtype_must_fill_bytes() {
    let hdr = r#"{"a":{"dtype":"F4","shape":[3],"data_offsets":[0,1]}}"#;
    assert!(reason(&image(hdr, &[0], 0)).contains("whole bytes"));
}
