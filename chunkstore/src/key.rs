//! Content address of a stored chunk KV cache.

use std::fmt;
use std::str::FromStr;

use sha2::{Digest, Sha256};

use crate::version::{DTYPE_F16, FORMAT_VERSION};

/// A chunk key in text form is not 64 hex digits, or a stored key is not 32 bytes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid chunk key {input:?}: {reason}")]
pub struct KeyError {
    pub input: String,
    pub reason: &'static str,
}

/// sha256 of everything that determines a chunk's KV cache: format version, model fingerprint,
/// collection, precompute mode, dtype and the chunk's token ids.
///
/// A blob computed by another model, for another collection, in another mode or in another
/// format never answers a lookup, so no staleness check is needed at read time.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ChunkKey([u8; 32]);

impl ChunkKey {
    /// Key of the chunk `ids` of `collection`, precomputed by model `fingerprint` in `mode`.
    pub fn new(fingerprint: &str, collection: &str, mode: &str, ids: &[u32]) -> Self {
        let mut h = Sha256::new();
        h.update(b"specrag-chunkkey\0");
        h.update(FORMAT_VERSION.to_le_bytes());
        // Every variable-length field is length-prefixed, so ("ab", "c") and ("a", "bc") differ.
        for field in [fingerprint, collection, mode] {
            h.update((field.len() as u64).to_le_bytes());
            h.update(field.as_bytes());
        }
        h.update(DTYPE_F16.to_le_bytes());
        h.update((ids.len() as u64).to_le_bytes());
        for id in ids {
            h.update(id.to_le_bytes());
        }
        Self(h.finalize().into())
    }

    /// Key of a blob that belongs to this key's chunk and lives and dies with it (the
    /// speculator's own KV of the chunk, computed by model `fingerprint` in `mode`): derived
    /// from this key alone, so whoever holds the chunk's key finds its companion, and garbage
    /// collection keeps it exactly as long as the chunk is indexed.
    pub fn companion(&self, fingerprint: &str, mode: &str) -> Self {
        let mut h = Sha256::new();
        h.update(b"specrag-companion\0");
        h.update(self.0);
        for field in [fingerprint, mode] {
            h.update((field.len() as u64).to_le_bytes());
            h.update(field.as_bytes());
        }
        Self(h.finalize().into())
    }

    /// Key from its 32 raw bytes (as stored on disk).
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, KeyError> {
        let raw: [u8; 32] = bytes.try_into().map_err(|_| KeyError {
            input: hex(bytes),
            reason: "expected 32 bytes",
        })?;
        Ok(Self(raw))
    }

    /// The 32 raw bytes.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl fmt::Display for ChunkKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for b in self.0 {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for ChunkKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ChunkKey({self})")
    }
}

impl FromStr for ChunkKey {
    type Err = KeyError;

    /// Parses the 64 lowercase or uppercase hex digits written by `Display`.
    fn from_str(s: &str) -> Result<Self, KeyError> {
        let invalid = |reason| KeyError {
            input: s.to_string(),
            reason,
        };
        if s.len() != 64 || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(invalid("expected 64 hex digits"));
        }
        let nibble = |b: u8| match b {
            b'0'..=b'9' => b - b'0',
            b'a'..=b'f' => b - b'a' + 10,
            _ => b - b'A' + 10,
        };
        let mut raw = [0u8; 32];
        for (byte, pair) in raw.iter_mut().zip(s.as_bytes().chunks_exact(2)) {
            *byte = (nibble(pair[0]) << 4) | nibble(pair[1]);
        }
        Ok(Self(raw))
    }
}

impl serde::Serialize for ChunkKey {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_input_changes_the_key() {
        let base = ChunkKey::new("model-a", "docs", "standalone", &[1, 2, 3]);
        let variants = [
            ChunkKey::new("model-b", "docs", "standalone", &[1, 2, 3]),
            ChunkKey::new("model-a", "wiki", "standalone", &[1, 2, 3]),
            ChunkKey::new("model-a", "docs", "after_prefix:abc", &[1, 2, 3]),
            ChunkKey::new("model-a", "docs", "standalone", &[1, 2, 4]),
            ChunkKey::new("model-a", "docs", "standalone", &[1, 2]),
            ChunkKey::new("model-a", "docs", "standalone", &[]),
        ];
        for v in variants {
            assert_ne!(base, v);
        }
        assert_eq!(
            base,
            ChunkKey::new("model-a", "docs", "standalone", &[1, 2, 3])
        );
    }

    #[test]
    fn companions_differ_from_their_chunk_and_each_other() {
        let a = ChunkKey::new("model-a", "docs", "standalone", &[1, 2, 3]);
        let b = ChunkKey::new("model-a", "docs", "standalone", &[1, 2, 4]);
        let ca = a.companion("spec", "after_prefix:x");
        assert_eq!(ca, a.companion("spec", "after_prefix:x"));
        for other in [
            a,
            b.companion("spec", "after_prefix:x"),
            a.companion("spec2", "after_prefix:x"),
            a.companion("spec", "after_prefix:y"),
            a.companion("specafter_prefix:", "x"),
        ] {
            assert_ne!(ca, other);
        }
    }

    #[test]
    fn field_boundaries_are_unambiguous() {
        let a = ChunkKey::new("ab", "c", "m", &[1]);
        let b = ChunkKey::new("a", "bc", "m", &[1]);
        assert_ne!(a, b);
    }

    #[test]
    fn hex_roundtrip() -> Result<(), KeyError> {
        let key = ChunkKey::new("m", "c", "standalone", &[7, 8]);
        let text = key.to_string();
        assert_eq!(text.len(), 64);
        assert!(text.bytes().all(|b| b.is_ascii_hexdigit()));
        assert_eq!(text.parse::<ChunkKey>()?, key);
        assert_eq!(text.to_uppercase().parse::<ChunkKey>()?, key);
        assert_eq!(ChunkKey::from_bytes(key.as_bytes())?, key);
        Ok(())
    }

    #[test]
    fn malformed_keys_are_errors() {
        assert!("abc".parse::<ChunkKey>().is_err());
        assert!("zz".repeat(32).parse::<ChunkKey>().is_err());
        assert!("é".repeat(32).parse::<ChunkKey>().is_err());
        // from_str_radix would accept a sign; a key must not.
        assert!(format!("+f{}", "0".repeat(62)).parse::<ChunkKey>().is_err());
        assert!(ChunkKey::from_bytes(&[0u8; 31]).is_err());
    }
}
