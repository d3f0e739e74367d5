//! The untagged packets a client sends first: SSLRequest, GSSENCRequest, CancelRequest and
//! StartupMessage.

/// PostgreSQL caps startup packets at this size (`MAX_STARTUP_PACKET_LENGTH`).
pub const MAX_STARTUP_PACKET: u32 = 10_000;
const SSL_REQUEST: u32 = 80877103;
/// The whole SSLRequest packet, as pgfence sends it to a server: length 8, then the code.
pub const SSL_REQUEST_PACKET: [u8; 8] = {
    let code = SSL_REQUEST.to_be_bytes();
    [0, 0, 0, 8, code[0], code[1], code[2], code[3]]
};
const GSSENC_REQUEST: u32 = 80877104;
const CANCEL_REQUEST: u32 = 80877102;

/// One decoded startup-phase packet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StartupPacket {
    /// The client asks for TLS.
    SslRequest,
    /// The client asks for GSSAPI encryption.
    GssEncRequest,
    /// Cancel the query running on the session with this key.
    Cancel { pid: i32, key: i32 },
    /// Opens a session.
    Startup(Startup),
}

/// Startup parameters, `(name, value)` in the order sent, raw bytes.
pub type Params = Vec<(Vec<u8>, Vec<u8>)>;

/// A StartupMessage: protocol version and `name=value` parameters, as sent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Startup {
    /// The requested version, `major << 16 | minor`. Any 3.x minor is passed on to the
    /// server, which negotiates it.
    pub version: u32,
    /// Parameters in order, raw bytes (PostgreSQL does not require them to be UTF-8).
    pub params: Params,
}

impl Startup {
    /// A parameter's value: the last one of its name, as PostgreSQL's
    /// `ProcessStartupPacket` keeps the last `user`, `database` and `options`, and applies
    /// settings in order.
    pub fn param(&self, name: &str) -> Option<&[u8]> {
        self.params
            .iter()
            .rev()
            .find(|(k, _)| k == name.as_bytes())
            .map(|(_, v)| v.as_slice())
    }

    /// A parameter's value as text (lossy: for names, logs and config lookups only).
    pub fn param_str(&self, name: &str) -> Option<String> {
        self.param(name)
            .map(|v| String::from_utf8_lossy(v).into_owned())
    }

    /// The packet again, with `database` set to `database`.
    pub fn encode_with_database(&self, database: &str) -> Vec<u8> {
        let mut body = self.version.to_be_bytes().to_vec();
        let mut seen = false;
        for (k, v) in &self.params {
            body.extend_from_slice(k);
            body.push(0);
            if k == b"database" {
                seen = true;
                body.extend_from_slice(database.as_bytes());
            } else {
                body.extend_from_slice(v);
            }
            body.push(0);
        }
        if !seen {
            body.extend_from_slice(b"database\0");
            body.extend_from_slice(database.as_bytes());
            body.push(0);
        }
        body.push(0);
        let mut packet = ((body.len() + 4) as u32).to_be_bytes().to_vec();
        packet.extend(body);
        packet
    }

    /// Whether this is a replication connection (`replication=true` for physical
    /// replication, `replication=database` for logical): any value PostgreSQL does not
    /// read as false (its boolean spellings: prefixes of `false` and `no`, `off`, `0`).
    pub fn replication(&self) -> bool {
        let Some(value) = self.param("replication") else {
            return false;
        };
        let value = value.to_ascii_lowercase();
        let prefix_of = |word: &[u8]| !value.is_empty() && word.starts_with(&value);
        !(prefix_of(b"false")
            || prefix_of(b"no")
            || value == b"of"
            || value == b"off"
            || value == b"0")
    }

    /// The user name (required by PostgreSQL).
    pub fn user(&self) -> String {
        self.param_str("user").unwrap_or_default()
    }

    /// The database name; PostgreSQL defaults it to the user name.
    pub fn database(&self) -> String {
        self.param_str("database")
            .filter(|d| !d.is_empty())
            .unwrap_or_else(|| self.user())
    }
}

/// Why a startup packet was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StartupError {
    #[error("invalid startup packet length {0}: expected 8 to 10000 bytes")]
    Length(i32),
    #[error("unsupported frontend protocol {major}.{minor}: pgfence supports 3.0 and later 3.x")]
    Version { major: u16, minor: u16 },
    #[error("invalid startup packet layout: {0}")]
    Layout(&'static str),
    /// PostgreSQL's words and SQLSTATE (28000) for a StartupMessage without `user`.
    #[error("no PostgreSQL user name specified in startup packet")]
    NoUser,
}

/// Decodes the startup packet at the start of `buf`: `Ok(None)` when incomplete, else the
/// packet and the number of bytes it took.
pub fn next_startup(buf: &[u8]) -> Result<Option<(StartupPacket, usize)>, StartupError> {
    if buf.len() < 4 {
        return Ok(None);
    }
    let length = u32::from_be_bytes([buf[0], buf[1], buf[2], buf[3]]);
    if !(8..=MAX_STARTUP_PACKET).contains(&length) {
        return Err(StartupError::Length(length as i32));
    }
    let total = length as usize;
    if buf.len() < total {
        return Ok(None);
    }
    let code = u32::from_be_bytes([buf[4], buf[5], buf[6], buf[7]]);
    let payload = &buf[8..total];
    let packet = match code {
        SSL_REQUEST | GSSENC_REQUEST if total != 8 => {
            return Err(StartupError::Layout("SSL/GSSENC request must be 8 bytes"))
        }
        SSL_REQUEST => StartupPacket::SslRequest,
        GSSENC_REQUEST => StartupPacket::GssEncRequest,
        CANCEL_REQUEST => {
            if payload.len() != 8 {
                return Err(StartupError::Layout("cancel request must be 16 bytes"));
            }
            StartupPacket::Cancel {
                pid: i32::from_be_bytes([payload[0], payload[1], payload[2], payload[3]]),
                key: i32::from_be_bytes([payload[4], payload[5], payload[6], payload[7]]),
            }
        }
        _ => {
            let (major, minor) = ((code >> 16) as u16, (code & 0xffff) as u16);
            if major != 3 {
                return Err(StartupError::Version { major, minor });
            }
            StartupPacket::Startup(Startup {
                version: code,
                params: parse_params(payload)?,
            })
        }
    };
    Ok(Some((packet, total)))
}

fn parse_params(mut rest: &[u8]) -> Result<Params, StartupError> {
    let mut params = Vec::new();
    loop {
        let Some(end) = rest.iter().position(|&b| b == 0) else {
            return Err(StartupError::Layout("parameters are not NUL-terminated"));
        };
        if end == 0 {
            if rest.len() != 1 {
                return Err(StartupError::Layout("bytes after the final terminator"));
            }
            break;
        }
        let name = rest[..end].to_vec();
        rest = &rest[end + 1..];
        let Some(vend) = rest.iter().position(|&b| b == 0) else {
            return Err(StartupError::Layout(
                "parameter value is not NUL-terminated",
            ));
        };
        params.push((name, rest[..vend].to_vec()));
        rest = &rest[vend + 1..];
    }
    if !params.iter().any(|(k, _)| k == b"user") {
        return Err(StartupError::NoUser);
    }
    Ok(params)
}

/// White space as C's `isspace` in the "C" locale, which PostgreSQL's `pg_split_opts`
/// splits `options` at: vertical tab included (Rust's `is_ascii_whitespace` leaves it out).
fn is_c_space(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | b'\x0b' | b'\x0c' | b'\r')
}

/// The switches of PostgreSQL's `process_postgres_switches` that take an argument (its
/// getopt string `B:bc:C:D:d:efFj:k:lN:nOPp:r:S:sTt:v:W:-:`, PostgreSQL 15).
const SWITCHES_WITH_ARGUMENT: &[u8] = b"BcCDdjkNprStvW-";

/// Session settings given as `-c name=value` or `--name=value` in the `options` startup
/// parameter, read as PostgreSQL reads them: words split at white space, where a backslash
/// escapes the next byte, then getopt, so switches combine (`-ec name=value`, `-cname=value`)
/// and an argument is the rest of its word or the next word. A word that is not a switch,
/// or one PostgreSQL does not know, makes the server refuse the connection; such words
/// are skipped here.
pub fn options_settings(options: &[u8]) -> Vec<(String, String)> {
    let mut words = Vec::new();
    let mut word = Vec::new();
    let mut escaped = false;
    for &b in options {
        if escaped {
            word.push(b);
            escaped = false;
        } else if b == b'\\' {
            escaped = true;
        } else if is_c_space(b) {
            if !word.is_empty() {
                words.push(std::mem::take(&mut word));
            }
        } else {
            word.push(b);
        }
    }
    if !word.is_empty() {
        words.push(word);
    }
    let mut settings = Vec::new();
    let mut it = words.iter();
    while let Some(w) = it.next() {
        if w.as_slice() == b"--" {
            break;
        }
        let Some(switches) = w.strip_prefix(b"-").filter(|s| !s.is_empty()) else {
            continue;
        };
        for (i, &switch) in switches.iter().enumerate() {
            if !SWITCHES_WITH_ARGUMENT.contains(&switch) {
                continue;
            }
            let rest = &switches[i + 1..];
            let argument = if rest.is_empty() {
                it.next().map(Vec::as_slice)
            } else {
                Some(rest)
            };
            if let (Some(s), b'c' | b'-') = (argument, switch) {
                if let Some(eq) = s.iter().position(|&b| b == b'=') {
                    // GUC names fold ASCII letters only (`guc_name_compare`).
                    let name = String::from_utf8_lossy(&s[..eq])
                        .replace('-', "_")
                        .to_ascii_lowercase();
                    settings.push((name, String::from_utf8_lossy(&s[eq + 1..]).into_owned()));
                }
            }
            break;
        }
    }
    settings
}
