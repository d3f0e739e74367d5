//! Raw PostgreSQL wire protocol for tests that send exact bytes: frame builders for every
//! frontend message, and [`RawConn`], a blocking TCP connection that reads backend messages
//! with deadlines.
//!
//! Builders return the complete frame (tag, length, body) so a test can concatenate them
//! into one write (a pipelined batch), cut them (a truncated frame) or corrupt them.
//! Reading never blocks forever: every read has a deadline and a test that waits too long
//! fails with what it had received so far.

use std::fmt;
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::time::{Duration, Instant};

/// How long a test waits for a reply before failing.
pub const REPLY_TIMEOUT: Duration = Duration::from_secs(10);

/// Protocol version 3.0 as sent in a StartupMessage.
pub const PROTOCOL_3_0: u32 = 3 << 16;
/// The request code of an SSLRequest.
pub const SSL_REQUEST_CODE: u32 = 80877103;
/// The request code of a GSSENCRequest.
pub const GSSENC_REQUEST_CODE: u32 = 80877104;
/// The request code of a CancelRequest.
pub const CANCEL_REQUEST_CODE: u32 = 80877102;

/// A frame: `tag`, then the length (counting itself), then `body`.
pub fn frame(tag: u8, body: &[u8]) -> Vec<u8> {
    let len = u32::try_from(body.len() + 4).expect("frame body fits in u32");
    let mut out = Vec::with_capacity(body.len() + 5);
    out.push(tag);
    out.extend_from_slice(&len.to_be_bytes());
    out.extend_from_slice(body);
    out
}

/// An untagged startup-phase packet: length, then `code`, then `payload`.
pub fn startup_packet(code: u32, payload: &[u8]) -> Vec<u8> {
    let len = u32::try_from(payload.len() + 8).expect("packet fits in u32");
    let mut out = Vec::with_capacity(payload.len() + 8);
    out.extend_from_slice(&len.to_be_bytes());
    out.extend_from_slice(&code.to_be_bytes());
    out.extend_from_slice(payload);
    out
}

/// A StartupMessage of protocol `version` with `params` (`user`, `database`, ...).
pub fn startup_version(version: u32, params: &[(&str, &[u8])]) -> Vec<u8> {
    let mut payload = Vec::new();
    for (name, value) in params {
        payload.extend_from_slice(name.as_bytes());
        payload.push(0);
        payload.extend_from_slice(value);
        payload.push(0);
    }
    payload.push(0);
    startup_packet(version, &payload)
}

/// A protocol 3.0 StartupMessage for `user` on `database`.
pub fn startup(user: &str, database: &str) -> Vec<u8> {
    startup_version(
        PROTOCOL_3_0,
        &[("user", user.as_bytes()), ("database", database.as_bytes())],
    )
}

/// An SSLRequest.
pub fn ssl_request() -> Vec<u8> {
    startup_packet(SSL_REQUEST_CODE, &[])
}

/// A GSSENCRequest.
pub fn gssenc_request() -> Vec<u8> {
    startup_packet(GSSENC_REQUEST_CODE, &[])
}

/// A CancelRequest for the session with BackendKeyData `(pid, key)`.
pub fn cancel_request(pid: i32, key: i32) -> Vec<u8> {
    let mut payload = pid.to_be_bytes().to_vec();
    payload.extend_from_slice(&key.to_be_bytes());
    startup_packet(CANCEL_REQUEST_CODE, &payload)
}

fn cstr(out: &mut Vec<u8>, s: &[u8]) {
    out.extend_from_slice(s);
    out.push(0);
}

/// Query (`Q`), SQL as raw bytes (not necessarily UTF-8).
pub fn query(sql: impl AsRef<[u8]>) -> Vec<u8> {
    let mut body = Vec::new();
    cstr(&mut body, sql.as_ref());
    frame(b'Q', &body)
}

/// Parse (`P`) of `sql` as statement `name` with the given parameter type oids.
pub fn parse(name: &str, sql: impl AsRef<[u8]>, param_types: &[u32]) -> Vec<u8> {
    let mut body = Vec::new();
    cstr(&mut body, name.as_bytes());
    cstr(&mut body, sql.as_ref());
    let n = u16::try_from(param_types.len()).expect("parameter count fits in u16");
    body.extend_from_slice(&n.to_be_bytes());
    for oid in param_types {
        body.extend_from_slice(&oid.to_be_bytes());
    }
    frame(b'P', &body)
}

/// Bind (`B`) of statement `statement` to `portal`, every parameter and result in text
/// format; `None` is SQL NULL.
pub fn bind(portal: &str, statement: &str, params: &[Option<&[u8]>]) -> Vec<u8> {
    let mut body = Vec::new();
    cstr(&mut body, portal.as_bytes());
    cstr(&mut body, statement.as_bytes());
    body.extend_from_slice(&0u16.to_be_bytes()); // all parameters in text
    let n = u16::try_from(params.len()).expect("parameter count fits in u16");
    body.extend_from_slice(&n.to_be_bytes());
    for p in params {
        match p {
            Some(v) => {
                let len = i32::try_from(v.len()).expect("parameter fits in i32");
                body.extend_from_slice(&len.to_be_bytes());
                body.extend_from_slice(v);
            }
            None => body.extend_from_slice(&(-1i32).to_be_bytes()),
        }
    }
    body.extend_from_slice(&0u16.to_be_bytes()); // all results in text
    frame(b'B', &body)
}

/// Describe (`D`) of a statement (`kind` `b'S'`) or portal (`b'P'`).
pub fn describe(kind: u8, name: &str) -> Vec<u8> {
    let mut body = vec![kind];
    cstr(&mut body, name.as_bytes());
    frame(b'D', &body)
}

/// Execute (`E`) of `portal`, at most `max_rows` rows (0: all).
pub fn execute(portal: &str, max_rows: i32) -> Vec<u8> {
    let mut body = Vec::new();
    cstr(&mut body, portal.as_bytes());
    body.extend_from_slice(&max_rows.to_be_bytes());
    frame(b'E', &body)
}

/// Close (`C`) of a statement (`b'S'`) or portal (`b'P'`).
pub fn close(kind: u8, name: &str) -> Vec<u8> {
    let mut body = vec![kind];
    cstr(&mut body, name.as_bytes());
    frame(b'C', &body)
}

/// Sync (`S`).
pub fn sync() -> Vec<u8> {
    frame(b'S', &[])
}

/// Flush (`H`).
pub fn flush() -> Vec<u8> {
    frame(b'H', &[])
}

/// Terminate (`X`).
pub fn terminate() -> Vec<u8> {
    frame(b'X', &[])
}

/// CopyData (`d`).
pub fn copy_data(data: &[u8]) -> Vec<u8> {
    frame(b'd', data)
}

/// CopyDone (`c`).
pub fn copy_done() -> Vec<u8> {
    frame(b'c', &[])
}

/// CopyFail (`f`) with `reason`.
pub fn copy_fail(reason: &str) -> Vec<u8> {
    let mut body = Vec::new();
    cstr(&mut body, reason.as_bytes());
    frame(b'f', &body)
}

/// FunctionCall (`F`) of function `oid` with text arguments and a text result.
pub fn function_call(oid: u32, args: &[Option<&[u8]>]) -> Vec<u8> {
    let mut body = oid.to_be_bytes().to_vec();
    body.extend_from_slice(&0u16.to_be_bytes()); // all arguments in text
    let n = u16::try_from(args.len()).expect("argument count fits in u16");
    body.extend_from_slice(&n.to_be_bytes());
    for a in args {
        match a {
            Some(v) => {
                let len = i32::try_from(v.len()).expect("argument fits in i32");
                body.extend_from_slice(&len.to_be_bytes());
                body.extend_from_slice(v);
            }
            None => body.extend_from_slice(&(-1i32).to_be_bytes()),
        }
    }
    body.extend_from_slice(&0u16.to_be_bytes()); // text result
    frame(b'F', &body)
}

/// One backend message.
#[derive(Clone, PartialEq, Eq)]
pub struct Msg {
    pub tag: u8,
    pub body: Vec<u8>,
}

impl Msg {
    /// The message as it was on the wire.
    pub fn to_bytes(&self) -> Vec<u8> {
        frame(self.tag, &self.body)
    }

    /// The fields of an ErrorResponse or NoticeResponse, `(code, value)` in order.
    pub fn fields(&self) -> Vec<(u8, String)> {
        error_fields(&self.body)
    }

    /// One field of an ErrorResponse or NoticeResponse (`b'C'` SQLSTATE, `b'S'` severity,
    /// `b'M'` message, ...).
    pub fn field(&self, code: u8) -> Option<String> {
        self.fields()
            .into_iter()
            .find(|(c, _)| *c == code)
            .map(|(_, v)| v)
    }

    /// The SQLSTATE of an ErrorResponse or NoticeResponse.
    pub fn sqlstate(&self) -> Option<String> {
        self.field(b'C')
    }

    /// The transaction status of a ReadyForQuery.
    pub fn ready_status(&self) -> Option<u8> {
        (self.tag == b'Z')
            .then(|| self.body.first().copied())
            .flatten()
    }

    /// The command tag of a CommandComplete.
    pub fn command_tag(&self) -> Option<String> {
        (self.tag == b'C').then(|| text_until_nul(&self.body))
    }

    /// The text columns of a DataRow (`None` for NULL).
    pub fn data_row(&self) -> Option<Vec<Option<Vec<u8>>>> {
        if self.tag != b'D' || self.body.len() < 2 {
            return None;
        }
        let n = u16::from_be_bytes([self.body[0], self.body[1]]);
        let mut at = 2;
        let mut cols = Vec::new();
        for _ in 0..n {
            let len_bytes: [u8; 4] = self.body.get(at..at + 4)?.try_into().ok()?;
            let len = i32::from_be_bytes(len_bytes);
            at += 4;
            if len < 0 {
                cols.push(None);
            } else {
                let len = usize::try_from(len).ok()?;
                cols.push(Some(self.body.get(at..at + len)?.to_vec()));
                at += len;
            }
        }
        Some(cols)
    }
}

impl fmt::Debug for Msg {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let shown: String = self
            .body
            .iter()
            .take(120)
            .map(|&b| {
                if b.is_ascii_graphic() || b == b' ' {
                    (b as char).to_string()
                } else {
                    format!("\\x{b:02x}")
                }
            })
            .collect();
        let more = if self.body.len() > 120 { "..." } else { "" };
        write!(f, "{}[{}] {shown}{more}", self.tag as char, self.body.len())
    }
}

fn text_until_nul(b: &[u8]) -> String {
    let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
    String::from_utf8_lossy(&b[..end]).into_owned()
}

/// The fields of an ErrorResponse or NoticeResponse body.
pub fn error_fields(body: &[u8]) -> Vec<(u8, String)> {
    let mut out = Vec::new();
    let mut rest = body;
    while let Some((&code, tail)) = rest.split_first() {
        if code == 0 {
            break;
        }
        let end = tail.iter().position(|&c| c == 0).unwrap_or(tail.len());
        out.push((code, String::from_utf8_lossy(&tail[..end]).into_owned()));
        rest = tail.get(end + 1..).unwrap_or(&[]);
    }
    out
}

/// Splits a byte stream of complete backend messages; panics on a partial one.
pub fn split_messages(mut bytes: &[u8]) -> Vec<Msg> {
    let mut out = Vec::new();
    while !bytes.is_empty() {
        assert!(bytes.len() >= 5, "partial message header: {bytes:?}");
        let len = u32::from_be_bytes([bytes[1], bytes[2], bytes[3], bytes[4]]) as usize;
        assert!(len >= 4 && bytes.len() > len, "partial message: {bytes:?}");
        out.push(Msg {
            tag: bytes[0],
            body: bytes[5..1 + len].to_vec(),
        });
        bytes = &bytes[1 + len..];
    }
    out
}

/// What a read found.
#[derive(Debug)]
pub enum Read1 {
    Msg(Msg),
    /// The peer closed the connection (EOF or reset) with no partial message pending.
    Closed,
}

/// A blocking TCP connection speaking raw protocol, with deadlines on every read.
pub struct RawConn {
    stream: TcpStream,
    buf: Vec<u8>,
    /// Where the connection goes, for failure messages.
    pub addr: SocketAddr,
}

impl RawConn {
    /// Connects to `addr`.
    pub fn connect(addr: SocketAddr) -> RawConn {
        let stream = TcpStream::connect_timeout(&addr, REPLY_TIMEOUT)
            .unwrap_or_else(|e| panic!("connect to {addr}: {e}"));
        stream.set_nodelay(true).expect("set TCP_NODELAY");
        RawConn {
            stream,
            buf: Vec::new(),
            addr,
        }
    }

    /// Connects to `addr` and completes a trust login as `user` on `database`, returning
    /// every message up to and including the first ReadyForQuery.
    pub fn login(addr: SocketAddr, user: &str, database: &str) -> (RawConn, Vec<Msg>) {
        let mut conn = RawConn::connect(addr);
        conn.send(&startup(user, database));
        let msgs = conn.until_ready();
        assert_eq!(
            msgs.first().map(|m| (m.tag, m.body.clone())),
            Some((b'R', 0u32.to_be_bytes().to_vec())),
            "login at {addr} did not start with AuthenticationOk: {msgs:?}"
        );
        (conn, msgs)
    }

    /// Connects to `addr` and logs in as `user` on `database` with startup `options` (e.g.
    /// `-c fencing.token=34`), reading up to the first ReadyForQuery, which must not follow
    /// an error.
    pub fn login_with_options(
        addr: SocketAddr,
        user: &str,
        database: &str,
        options: &str,
    ) -> RawConn {
        RawConn::login_with_params(
            addr,
            &[
                ("user", user.as_bytes()),
                ("database", database.as_bytes()),
                ("options", options.as_bytes()),
            ],
        )
    }

    /// Connects and logs in (trust) with these startup parameters, in this order; panics
    /// on failure.
    pub fn login_with_params(addr: SocketAddr, params: &[(&str, &[u8])]) -> RawConn {
        let mut conn = RawConn::connect(addr);
        conn.send(&startup_version(PROTOCOL_3_0, params));
        let msgs = conn.until_ready();
        assert!(
            msgs.iter().all(|m| m.tag != b'E'),
            "login at {addr} with {params:?} failed: {msgs:?}"
        );
        conn
    }

    /// A second handle on the connection's socket (for a writer on another thread).
    pub fn try_clone_stream(&self) -> TcpStream {
        self.stream.try_clone().expect("clone the socket")
    }

    /// Writes `bytes`; panics on failure.
    pub fn send(&mut self, bytes: &[u8]) {
        self.try_send(bytes)
            .unwrap_or_else(|e| panic!("write to {}: {e}", self.addr));
    }

    /// Writes `bytes`, returning the error (a closed peer may reset the connection).
    pub fn try_send(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.stream.write_all(bytes)?;
        self.stream.flush()
    }

    /// Closes the write side (the peer sees EOF).
    pub fn shutdown_write(&mut self) {
        let _ = self.stream.shutdown(Shutdown::Write);
    }

    /// Reads exactly `n` raw bytes (for the one-byte answer to an SSLRequest).
    pub fn read_bytes(&mut self, n: usize) -> Vec<u8> {
        let deadline = Instant::now() + REPLY_TIMEOUT;
        while self.buf.len() < n {
            match self.fill(deadline) {
                Ok(true) => {}
                Ok(false) => panic!(
                    "{} closed after {} of {n} bytes: {:?}",
                    self.addr,
                    self.buf.len(),
                    self.buf
                ),
                Err(e) => panic!("reading {n} bytes from {}: {e}", self.addr),
            }
        }
        self.buf.drain(..n).collect()
    }

    /// Every byte until the peer closes the connection, unparsed (for replies that are not
    /// protocol 3 messages).
    pub fn read_to_end(&mut self) -> Vec<u8> {
        let deadline = Instant::now() + REPLY_TIMEOUT;
        loop {
            match self.fill(deadline) {
                Ok(true) => {}
                Ok(false) => return std::mem::take(&mut self.buf),
                Err(e) => panic!(
                    "{} did not close within {REPLY_TIMEOUT:?} ({e}); received {:?}",
                    self.addr, self.buf
                ),
            }
        }
    }

    /// Reads more bytes into the buffer: `Ok(false)` on EOF or reset.
    fn fill(&mut self, deadline: Instant) -> std::io::Result<bool> {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(ErrorKind::TimedOut.into());
        }
        self.stream.set_read_timeout(Some(left))?;
        let mut chunk = [0u8; 16 * 1024];
        match self.stream.read(&mut chunk) {
            Ok(0) => Ok(false),
            Ok(n) => {
                self.buf.extend_from_slice(&chunk[..n]);
                Ok(true)
            }
            Err(e) if e.kind() == ErrorKind::ConnectionReset => Ok(false),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                Err(ErrorKind::TimedOut.into())
            }
            Err(e) => Err(e),
        }
    }

    /// The next message or the connection's end, waiting up to `timeout`; `Err` on timeout.
    pub fn next(&mut self, timeout: Duration) -> Result<Read1, String> {
        let deadline = Instant::now() + timeout;
        loop {
            if self.buf.len() >= 5 {
                let len = u32::from_be_bytes([self.buf[1], self.buf[2], self.buf[3], self.buf[4]]);
                let total = 1 + len as usize;
                if len >= 4 && self.buf.len() >= total {
                    let body = self.buf[5..total].to_vec();
                    let tag = self.buf[0];
                    self.buf.drain(..total);
                    return Ok(Read1::Msg(Msg { tag, body }));
                }
            }
            match self.fill(deadline) {
                Ok(true) => {}
                Ok(false) if self.buf.is_empty() => return Ok(Read1::Closed),
                Ok(false) => {
                    return Err(format!(
                        "{} closed in the middle of a message: {:?}",
                        self.addr, self.buf
                    ))
                }
                Err(e) if e.kind() == ErrorKind::TimedOut => {
                    return Err(format!(
                        "no complete message from {} in {timeout:?}",
                        self.addr
                    ))
                }
                Err(e) => return Err(format!("reading from {}: {e}", self.addr)),
            }
        }
    }

    /// The next message; panics on timeout or a closed connection.
    pub fn recv(&mut self) -> Msg {
        match self.next(REPLY_TIMEOUT) {
            Ok(Read1::Msg(m)) => m,
            Ok(Read1::Closed) => panic!("{} closed the connection", self.addr),
            Err(e) => panic!("{e}"),
        }
    }

    /// Messages up to and including the one `stop` accepts.
    pub fn until(&mut self, mut stop: impl FnMut(&Msg) -> bool) -> Vec<Msg> {
        let mut out = Vec::new();
        loop {
            match self.next(REPLY_TIMEOUT) {
                Ok(Read1::Msg(m)) => {
                    let done = stop(&m);
                    out.push(m);
                    if done {
                        return out;
                    }
                }
                Ok(Read1::Closed) => {
                    panic!(
                        "{} closed the connection; received so far: {out:?}",
                        self.addr
                    )
                }
                Err(e) => panic!("{e}; received so far: {out:?}"),
            }
        }
    }

    /// Messages up to and including the next ReadyForQuery.
    pub fn until_ready(&mut self) -> Vec<Msg> {
        self.until(|m| m.tag == b'Z')
    }

    /// Sends `sql` as a simple Query and returns the rows of its answer (up to its
    /// ReadyForQuery), each column as bytes or NULL.
    pub fn query_rows(&mut self, sql: &str) -> Vec<Vec<Option<Vec<u8>>>> {
        self.send(&query(sql));
        self.until_ready()
            .iter()
            .filter_map(|m| m.data_row())
            .collect()
    }

    /// Every message until the peer closes the connection (panics after the timeout).
    pub fn until_closed(&mut self) -> Vec<Msg> {
        let mut out = Vec::new();
        loop {
            match self.next(REPLY_TIMEOUT) {
                Ok(Read1::Msg(m)) => out.push(m),
                Ok(Read1::Closed) => return out,
                Err(e) => panic!("{e}; expected the connection to close; received: {out:?}"),
            }
        }
    }

    /// Asserts that nothing arrives for `quiet`: the peer is waiting for more input.
    pub fn expect_silence(&mut self, quiet: Duration) {
        match self.next(quiet) {
            Err(_) => {}
            Ok(got) => panic!("expected silence from {}, got {got:?}", self.addr),
        }
    }
}

/// Asserts that `msg` is an ErrorResponse with severity `severity` and SQLSTATE `code`;
/// returns its message text.
pub fn assert_error(msg: &Msg, severity: &str, code: &str) -> String {
    assert_eq!(msg.tag, b'E', "expected an ErrorResponse, got {msg:?}");
    let fields = msg.fields();
    let get = |c: u8| {
        fields
            .iter()
            .find(|(k, _)| *k == c)
            .map(|(_, v)| v.as_str())
    };
    assert_eq!(get(b'S'), Some(severity), "severity of {fields:?}");
    assert_eq!(
        get(b'V'),
        Some(severity),
        "non-localized severity of {fields:?}"
    );
    assert_eq!(get(b'C'), Some(code), "SQLSTATE of {fields:?}");
    get(b'M').unwrap_or_default().to_string()
}
