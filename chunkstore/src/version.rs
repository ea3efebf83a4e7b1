//! The numbers that version stored KV: the blob format and its original codec tag. Both a blob's
//! header ([`crate::format`]) and a chunk's key ([`crate::key`]) carry them, so a format change
//! makes old blobs unreachable rather than misread.

/// Version written by [`encode`](crate::encode) and the only one [`decode`](crate::decode) reads.
pub const FORMAT_VERSION: u16 = 1;
/// Codec tag of raw IEEE half precision values (the only tag before codecs existed).
pub const DTYPE_F16: u16 = 1;
