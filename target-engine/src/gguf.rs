//! Reading a GGUF file: metadata access with errors that name the key, and the model
//! fingerprint that binds caches to the exact file they were computed with.

use crate::error::{EngineError, Result};
use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::quantized::QTensor;
use candle_core::Device;
use sha2::{Digest, Sha256};
use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};

/// An open GGUF file: parsed header plus a reader for tensor data.
pub struct GgufFile {
    path: PathBuf,
    content: Content,
    reader: BufReader<File>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

impl GgufFile {
    /// Opens and parses the header of `path`.
    pub fn open(path: &Path) -> Result<Self> {
        let file = File::open(path).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => EngineError::ModelNotFound {
                path: path.to_path_buf(),
            },
            _ => EngineError::Io(e),
        })?;
        let mut reader = BufReader::new(file);
        let content = Content::read(&mut reader).map_err(|e| EngineError::BadGguf {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })?;
        Ok(Self {
            path: path.to_path_buf(),
            content,
            reader,
        })
    }

    /// Path the file was opened from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A metadata value, if present.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.content.metadata.get(key)
    }

    /// A required string value.
    pub fn string(&self, key: &str) -> Result<&str> {
        match self.get(key) {
            Some(Value::String(s)) => Ok(s),
            Some(other) => Err(meta_err(
                key,
                format!("expected a string, found {:?}", other.value_type()),
            )),
            None => Err(meta_err(key, "missing")),
        }
    }

    /// A required unsigned integer value of any integer width.
    pub fn uint(&self, key: &str) -> Result<u64> {
        let v = self.get(key).ok_or_else(|| meta_err(key, "missing"))?;
        value_as_u64(v)
            .ok_or_else(|| meta_err(key, format!("expected an unsigned integer, found {v:?}")))
    }

    /// A required float value (f32 or f64).
    pub fn float(&self, key: &str) -> Result<f64> {
        match self.get(key) {
            Some(Value::F32(x)) => Ok(f64::from(*x)),
            Some(Value::F64(x)) => Ok(*x),
            Some(other) => Err(meta_err(key, format!("expected a float, found {other:?}"))),
            None => Err(meta_err(key, "missing")),
        }
    }

    /// A required array value.
    pub fn array(&self, key: &str) -> Result<&[Value]> {
        match self.get(key) {
            Some(Value::Array(a)) => Ok(a),
            Some(other) => Err(meta_err(
                key,
                format!("expected an array, found {:?}", other.value_type()),
            )),
            None => Err(meta_err(key, "missing")),
        }
    }

    /// True when the file holds a tensor of this name.
    /// The chat template the file carries (`tokenizer.chat_template`), if any.
    pub fn chat_template(&self) -> Option<&str> {
        match self.get("tokenizer.chat_template") {
            Some(Value::String(s)) => Some(s),
            _ => None,
        }
    }

    pub fn has_tensor(&self, name: &str) -> bool {
        self.content.tensor_infos.contains_key(name)
    }

    /// Reads one tensor in its stored (usually quantized) type.
    pub fn tensor(&mut self, name: &str) -> Result<QTensor> {
        if !self.has_tensor(name) {
            return Err(EngineError::BadGguf {
                path: self.path.clone(),
                reason: format!("tensor `{name}` is missing"),
            });
        }
        let t = self
            .content
            .tensor(&mut self.reader, name, &Device::Cpu)
            .map_err(|e| EngineError::BadGguf {
                path: self.path.clone(),
                reason: format!("tensor `{name}`: {e}"),
            })?;
        Ok(t)
    }

    /// Hex sha256 over every metadata entry and the tensor table (names, types, shapes,
    /// offsets), in sorted order. Cheap (no tensor data is read) and changes whenever the
    /// model, its quantization or its tokenizer changes.
    pub fn fingerprint(&self) -> String {
        let mut h = Sha256::new();
        let mut keys: Vec<&String> = self.content.metadata.keys().collect();
        keys.sort();
        for k in keys {
            h.update(k.as_bytes());
            h.update([0]);
            hash_value(&mut h, &self.content.metadata[k]);
        }
        let mut names: Vec<&String> = self.content.tensor_infos.keys().collect();
        names.sort();
        for n in names {
            let info = &self.content.tensor_infos[n];
            h.update(n.as_bytes());
            h.update(format!(
                "|{:?}|{:?}|{}",
                info.ggml_dtype,
                info.shape.dims(),
                info.offset
            ));
        }
        h.finalize().iter().map(|b| format!("{b:02x}")).collect()
    }
}

fn hash_value(h: &mut Sha256, v: &Value) {
    match v {
        Value::String(s) => {
            h.update((s.len() as u64).to_le_bytes());
            h.update(s.as_bytes());
        }
        Value::Array(a) => {
            h.update((a.len() as u64).to_le_bytes());
            a.iter().for_each(|x| hash_value(h, x));
        }
        other => h.update(format!("{other:?}")),
    }
}

/// Any GGUF integer as u64 (negative values are not unsigned integers).
pub(crate) fn value_as_u64(v: &Value) -> Option<u64> {
    match *v {
        Value::U8(x) => Some(u64::from(x)),
        Value::U16(x) => Some(u64::from(x)),
        Value::U32(x) => Some(u64::from(x)),
        Value::U64(x) => Some(x),
        Value::I8(x) => u64::try_from(x).ok(),
        Value::I16(x) => u64::try_from(x).ok(),
        Value::I32(x) => u64::try_from(x).ok(),
        Value::I64(x) => u64::try_from(x).ok(),
        _ => None,
    }
}

pub(crate) fn meta_err(key: &str, reason: impl Into<String>) -> EngineError {
    EngineError::Metadata {
        key: key.to_string(),
        reason: reason.into(),
    }
}
