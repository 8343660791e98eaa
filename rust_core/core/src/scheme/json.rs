//! Typed access to JSON config fields that remembers the dotted key path, so that every type
//! error names the exact field (`quantization_config.config_groups.group_1.weights.num_bits`).

use std::path::Path;

use serde_json::{Map, Value};

use crate::error::{ConfigError, Error, Result};

/// A field at a key path, possibly absent.
#[derive(Clone, Debug)]
pub struct Field<'a> {
    pub file: &'a Path,
    pub path: String,
    pub value: Option<&'a Value>,
}

/// An object at a key path.
#[derive(Clone, Debug)]
pub struct Obj<'a> {
    pub file: &'a Path,
    pub path: String,
    pub map: &'a Map<String, Value>,
}

pub fn describe(v: &Value) -> String {
    let kind = match v {
        Value::Null => return "null".into(),
        Value::Bool(b) => return b.to_string(),
        Value::Number(n) => return format!("number {n}"),
        Value::String(s) => {
            let short: String = s.chars().take(40).collect();
            return format!("string \"{short}\"");
        }
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    };
    kind.to_string()
}

impl<'a> Field<'a> {
    pub fn new(file: &'a Path, path: impl Into<String>, value: Option<&'a Value>) -> Self {
        Field {
            file,
            path: path.into(),
            value,
        }
    }

    pub fn invalid(&self, reason: impl Into<String>) -> Error {
        ConfigError {
            file: self.file.to_path_buf(),
            key: self.path.clone(),
            reason: reason.into(),
        }
        .into()
    }

    fn wrong_type(&self, expected: &str) -> Error {
        let found = self.value.map_or("nothing".to_string(), describe);
        self.invalid(format!("expected {expected}, found {found}"))
    }

    /// The value as an object; absent or null is an error.
    pub fn object(&self) -> Result<Obj<'a>> {
        match self.value {
            Some(Value::Object(map)) => Ok(Obj {
                file: self.file,
                path: self.path.clone(),
                map,
            }),
            _ => Err(self.wrong_type("an object")),
        }
    }

    /// `None` for absent or null, the object otherwise.
    pub fn opt_object(&self) -> Result<Option<Obj<'a>>> {
        match self.value {
            None | Some(Value::Null) => Ok(None),
            _ => self.object().map(Some),
        }
    }

    pub fn opt_array(&self) -> Result<Option<&'a Vec<Value>>> {
        match self.value {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Array(a)) => Ok(Some(a)),
            _ => Err(self.wrong_type("a list")),
        }
    }

    pub fn opt_str(&self) -> Result<Option<&'a str>> {
        match self.value {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            _ => Err(self.wrong_type("a string")),
        }
    }

    pub fn opt_bool(&self) -> Result<Option<bool>> {
        match self.value {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            _ => Err(self.wrong_type("true or false")),
        }
    }

    pub fn opt_i64(&self) -> Result<Option<i64>> {
        match self.value {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Number(n)) => n
                .as_i64()
                .map(Some)
                .ok_or_else(|| self.wrong_type("an integer")),
            _ => Err(self.wrong_type("an integer")),
        }
    }

    pub fn opt_u64(&self) -> Result<Option<u64>> {
        match self.value {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Number(n)) => n
                .as_u64()
                .map(Some)
                .ok_or_else(|| self.wrong_type("a non-negative integer")),
            _ => Err(self.wrong_type("a non-negative integer")),
        }
    }

    pub fn opt_f64(&self) -> Result<Option<f64>> {
        match self.value {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Number(n)) => n
                .as_f64()
                .map(Some)
                .ok_or_else(|| self.wrong_type("a number")),
            _ => Err(self.wrong_type("a number")),
        }
    }
}

impl<'a> Obj<'a> {
    pub fn root(file: &'a Path, path: impl Into<String>, map: &'a Map<String, Value>) -> Self {
        Obj {
            file,
            path: path.into(),
            map,
        }
    }

    pub fn get(&self, key: &str) -> Option<&'a Value> {
        self.map.get(key)
    }

    pub fn field(&self, key: &str) -> Field<'a> {
        let path = if self.path.is_empty() {
            key.to_string()
        } else {
            format!("{}.{key}", self.path)
        };
        Field::new(self.file, path, self.map.get(key))
    }

    pub fn opt_str(&self, key: &str) -> Result<Option<&'a str>> {
        self.field(key).opt_str()
    }
    pub fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        self.field(key).opt_bool()
    }
    pub fn opt_i64(&self, key: &str) -> Result<Option<i64>> {
        self.field(key).opt_i64()
    }
    pub fn opt_u64(&self, key: &str) -> Result<Option<u64>> {
        self.field(key).opt_u64()
    }
    pub fn opt_f64(&self, key: &str) -> Result<Option<f64>> {
        self.field(key).opt_f64()
    }
}
