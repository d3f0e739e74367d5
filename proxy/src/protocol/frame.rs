//! Framing by the length field: `tag (1 byte) | length (4 bytes, includes itself) | body`.

/// Why a byte stream is not a valid sequence of protocol messages.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// The length field is below its own size (4).
    #[error("invalid message length {length} for message type {tag:?}: below the minimum of 4")]
    TooShort { tag: char, length: i32 },
    /// The length field exceeds the configured cap (negative lengths read as huge ones).
    #[error("message type {tag:?} of {length} bytes exceeds the limit of {max} bytes (limits.max_message_size)")]
    TooLarge { tag: char, length: u32, max: u32 },
}

/// Finds the next complete message at the start of `buf`.
///
/// Returns `Ok(Some((tag, len)))` where `len` is the whole frame's size in bytes (tag
/// included), `Ok(None)` when more bytes are needed, or an error for a length that can
/// never be valid. A negative length (top bit set) is reported as too large.
#[inline]
pub fn next_frame(buf: &[u8], max: u32) -> Result<Option<(u8, usize)>, FrameError> {
    if buf.len() < 5 {
        return Ok(None);
    }
    let tag = buf[0];
    let length = u32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]);
    if length < 4 {
        return Err(FrameError::TooShort {
            tag: tag as char,
            length: length as i32,
        });
    }
    if length > max {
        return Err(FrameError::TooLarge {
            tag: tag as char,
            length,
            max,
        });
    }
    let total = 1 + length as usize;
    if buf.len() < total {
        return Ok(None);
    }
    Ok(Some((tag, total)))
}
