//! Fencing tokens and resource names, validated exactly as SPEC section 1 says.
//!
//! Both parse from bytes because they arrive as raw bytes from SQL comments and startup
//! options; a value that is not valid UTF-8 is simply invalid, never converted.

use std::fmt;
use std::str::FromStr;

/// A lease generation: an integer from 0 to `i64::MAX` (PostgreSQL `bigint`, non-negative).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Token(i64);

/// Why a token was rejected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenError {
    /// No digits at all.
    Empty,
    /// A byte other than an ASCII digit (signs and spaces included).
    NotDigits,
    /// More than 9223372036854775807.
    OutOfRange,
}

impl Token {
    /// The largest token, 2^63 - 1.
    pub const MAX: Token = Token(i64::MAX);

    /// A token from a number, if it is in range (not negative).
    pub const fn new(value: i64) -> Option<Token> {
        if value < 0 {
            None
        } else {
            Some(Token(value))
        }
    }

    /// Parses ASCII digits only (leading zeros allowed): no sign, no spaces, no `_`.
    pub fn parse(raw: &[u8]) -> Result<Token, TokenError> {
        if raw.is_empty() {
            return Err(TokenError::Empty);
        }
        let mut value: i64 = 0;
        for &b in raw {
            if !b.is_ascii_digit() {
                return Err(TokenError::NotDigits);
            }
            value = value
                .checked_mul(10)
                .and_then(|v| v.checked_add(i64::from(b - b'0')))
                .ok_or(TokenError::OutOfRange)?;
        }
        Ok(Token(value))
    }

    /// The token as the database stores it.
    pub const fn get(self) -> i64 {
        self.0
    }
}

impl fmt::Display for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

impl FromStr for Token {
    type Err = TokenError;

    fn from_str(s: &str) -> Result<Token, TokenError> {
        Token::parse(s.as_bytes())
    }
}

impl TryFrom<i64> for Token {
    type Error = TokenError;

    fn try_from(value: i64) -> Result<Token, TokenError> {
        Token::new(value).ok_or(TokenError::OutOfRange)
    }
}

impl From<Token> for i64 {
    fn from(token: Token) -> i64 {
        token.0
    }
}

impl fmt::Display for TokenError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TokenError::Empty => "fencing token is empty",
            TokenError::NotDigits => {
                "fencing token must be ASCII digits only (no sign, spaces or other characters)"
            }
            TokenError::OutOfRange => "fencing token is larger than 9223372036854775807",
        })
    }
}

impl std::error::Error for TokenError {}

/// The name of what a lease protects: 1 to 63 characters from `[A-Za-z0-9_.:-]`.
///
/// 63 is PostgreSQL's identifier limit, so a resource always fits in a `name` column.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Resource(String);

/// Why a resource name was rejected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResourceError {
    /// Zero characters.
    Empty,
    /// More than [`Resource::MAX_LEN`] bytes; carries the length.
    TooLong(usize),
    /// A byte outside `[A-Za-z0-9_.:-]` at a zero-based position.
    InvalidByte { position: usize, byte: u8 },
}

impl Resource {
    /// The longest resource name, in bytes (all allowed characters are one byte).
    pub const MAX_LEN: usize = 63;

    /// Validates a resource name.
    pub fn parse(raw: &[u8]) -> Result<Resource, ResourceError> {
        if raw.is_empty() {
            return Err(ResourceError::Empty);
        }
        if raw.len() > Self::MAX_LEN {
            return Err(ResourceError::TooLong(raw.len()));
        }
        if let Some(position) = raw.iter().position(|&b| !is_resource_byte(b)) {
            return Err(ResourceError::InvalidByte {
                position,
                byte: raw[position],
            });
        }
        // Every byte is ASCII, checked above.
        let name = raw.iter().map(|&b| char::from(b)).collect();
        Ok(Resource(name))
    }

    /// The name.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

fn is_resource_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b':' | b'-')
}

impl fmt::Display for Resource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl FromStr for Resource {
    type Err = ResourceError;

    fn from_str(s: &str) -> Result<Resource, ResourceError> {
        Resource::parse(s.as_bytes())
    }
}

impl AsRef<str> for Resource {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for ResourceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const RULE: &str = "a fencing resource is 1 to 63 characters from [A-Za-z0-9_.:-]";
        match self {
            ResourceError::Empty => write!(f, "fencing resource is empty: {RULE}"),
            ResourceError::TooLong(len) => {
                write!(f, "fencing resource is {len} bytes long: {RULE}")
            }
            ResourceError::InvalidByte { position, byte } => {
                if byte.is_ascii_graphic() {
                    let c = char::from(*byte);
                    write!(
                        f,
                        "fencing resource has '{c}' at position {position}: {RULE}"
                    )
                } else {
                    write!(
                        f,
                        "fencing resource has byte 0x{byte:02x} at position {position}: {RULE}"
                    )
                }
            }
        }
    }
}

impl std::error::Error for ResourceError {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_accepts_digits() {
        assert_eq!(Token::parse(b"0").unwrap().get(), 0);
        assert_eq!(Token::parse(b"34").unwrap().get(), 34);
        assert_eq!(Token::parse(b"0034").unwrap().get(), 34);
        assert_eq!(Token::parse(b"9223372036854775807").unwrap(), Token::MAX);
        assert_eq!(
            Token::parse(b"000000000000000000000000001").unwrap().get(),
            1
        );
        assert_eq!("42".parse::<Token>().unwrap().to_string(), "42");
    }

    #[test]
    fn token_rejects_everything_else() {
        assert_eq!(Token::parse(b""), Err(TokenError::Empty));
        for bad in [
            &b"-1"[..],
            b"+1",
            b" 1",
            b"1 ",
            b"1_000",
            b"1.0",
            b"0x10",
            b"\xff",
            b"\xd9\xa3", // ARABIC-INDIC DIGIT THREE: not ASCII
        ] {
            assert_eq!(Token::parse(bad), Err(TokenError::NotDigits), "{bad:?}");
        }
        assert_eq!(
            Token::parse(b"9223372036854775808"),
            Err(TokenError::OutOfRange)
        );
        assert_eq!(
            Token::parse(b"99999999999999999999999"),
            Err(TokenError::OutOfRange)
        );
    }

    #[test]
    fn token_from_i64() {
        assert_eq!(Token::new(-1), None);
        assert_eq!(Token::try_from(7).map(i64::from), Ok(7));
        assert_eq!(Token::try_from(-7), Err(TokenError::OutOfRange));
    }

    #[test]
    fn resource_rules() {
        let r = Resource::parse(b"billing").unwrap();
        assert_eq!(r.as_str(), "billing");
        assert_eq!(r.to_string(), "billing");
        assert!(Resource::parse(b"Tenant-42:queue_a.b").is_ok());
        assert!(Resource::parse(&[b'a'; 63]).is_ok());
        assert_eq!(
            Resource::parse(&[b'a'; 64]),
            Err(ResourceError::TooLong(64))
        );
        assert_eq!(Resource::parse(b""), Err(ResourceError::Empty));
        assert_eq!(
            Resource::parse(b"bill ing"),
            Err(ResourceError::InvalidByte {
                position: 4,
                byte: b' '
            })
        );
        assert!(Resource::parse("bïlling".as_bytes()).is_err());
        assert!(Resource::parse(b"a/b").is_err());
        assert!(Resource::parse(b"a\"b").is_err());
    }

    #[test]
    fn error_messages_are_clear() {
        assert_eq!(
            TokenError::OutOfRange.to_string(),
            "fencing token is larger than 9223372036854775807"
        );
        assert_eq!(
            Resource::parse(b"a b").unwrap_err().to_string(),
            "fencing resource has byte 0x20 at position 1: \
             a fencing resource is 1 to 63 characters from [A-Za-z0-9_.:-]"
        );
        assert_eq!(
            Resource::parse(b"a/b").unwrap_err().to_string(),
            "fencing resource has '/' at position 1: \
             a fencing resource is 1 to 63 characters from [A-Za-z0-9_.:-]"
        );
    }
}
