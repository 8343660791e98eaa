//! Element types of safetensors tensors.

use std::fmt;

/// The dtypes a safetensors header may name. Sub-byte float formats are listed so that such
/// files parse; their bit size is what the byte-length check uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    Bool,
    U8,
    I8,
    U16,
    I16,
    F16,
    BF16,
    U32,
    I32,
    F32,
    U64,
    I64,
    F64,
    C64,
    F8E4M3,
    F8E5M2,
    F8E8M0,
    F6E2M3,
    F6E3M2,
    F4,
}

impl DType {
    /// Parses the header spelling (`"BF16"`, `"I32"`, `"F8_E4M3"`, ...).
    pub fn from_header(s: &str) -> Option<DType> {
        Some(match s {
            "BOOL" => DType::Bool,
            "U8" => DType::U8,
            "I8" => DType::I8,
            "U16" => DType::U16,
            "I16" => DType::I16,
            "F16" => DType::F16,
            "BF16" => DType::BF16,
            "U32" => DType::U32,
            "I32" => DType::I32,
            "F32" => DType::F32,
            "U64" => DType::U64,
            "I64" => DType::I64,
            "F64" => DType::F64,
            "C64" => DType::C64,
            "F8_E4M3" => DType::F8E4M3,
            "F8_E5M2" => DType::F8E5M2,
            "F8_E8M0" => DType::F8E8M0,
            "F6_E2M3" => DType::F6E2M3,
            "F6_E3M2" => DType::F6E3M2,
            "F4" => DType::F4,
            _ => return None,
        })
    }

    /// The header spelling.
    pub fn name(self) -> &'static str {
        match self {
            DType::Bool => "BOOL",
            DType::U8 => "U8",
            DType::I8 => "I8",
            DType::U16 => "U16",
            DType::I16 => "I16",
            DType::F16 => "F16",
            DType::BF16 => "BF16",
            DType::U32 => "U32",
            DType::I32 => "I32",
            DType::F32 => "F32",
            DType::U64 => "U64",
            DType::I64 => "I64",
            DType::F64 => "F64",
            DType::C64 => "C64",
            DType::F8E4M3 => "F8_E4M3",
            DType::F8E5M2 => "F8_E5M2",
            DType::F8E8M0 => "F8_E8M0",
            DType::F6E2M3 => "F6_E2M3",
            DType::F6E3M2 => "F6_E3M2",
            DType::F4 => "F4",
        }
    }

    pub fn bit_size(self) -> usize {
        match self {
            DType::F4 => 4,
            DType::F6E2M3 | DType::F6E3M2 => 6,
            DType::Bool | DType::U8 | DType::I8 => 8,
            DType::F8E4M3 | DType::F8E5M2 | DType::F8E8M0 => 8,
            DType::U16 | DType::I16 | DType::F16 | DType::BF16 => 16,
            DType::U32 | DType::I32 | DType::F32 => 32,
            DType::U64 | DType::I64 | DType::F64 | DType::C64 => 64,
        }
    }

    /// Required byte alignment of the tensor's first element for a typed view.
    pub fn alignment(self) -> usize {
        match self {
            DType::C64 => 4,
            other => (other.bit_size() / 8).max(1),
        }
    }

    pub fn is_float(self) -> bool {
        matches!(
            self,
            DType::F16
                | DType::BF16
                | DType::F32
                | DType::F64
                | DType::F8E4M3
                | DType::F8E5M2
                | DType::F8E8M0
                | DType::F6E2M3
                | DType::F6E3M2
                | DType::F4
        )
    }

    /// numpy `__array_interface__` type string; bf16 and the fp8/fp6/fp4 types travel as their
    /// unsigned bit patterns (numpy has no such dtypes).
    pub fn numpy_typestr(self) -> &'static str {
        match self {
            DType::Bool => "|b1",
            DType::U8 | DType::F8E4M3 | DType::F8E5M2 | DType::F8E8M0 => "|u1",
            DType::F6E2M3 | DType::F6E3M2 | DType::F4 => "|u1",
            DType::I8 => "|i1",
            DType::U16 | DType::BF16 => "<u2",
            DType::I16 => "<i2",
            DType::F16 => "<f2",
            DType::U32 => "<u4",
            DType::I32 => "<i4",
            DType::F32 => "<f4",
            DType::U64 => "<u8",
            DType::I64 => "<i8",
            DType::F64 => "<f8",
            DType::C64 => "<c8",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
