//! Message tags as enums, and the handful of messages pgfence reads or writes itself.

use bytes::{BufMut, BytesMut};

/// How many bytes of a statement or portal name PostgreSQL keeps (`NAMEDATALEN - 1`).
pub const NAME_BYTES: usize = 63;

/// Messages a client sends after startup.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Frontend {
    Query,
    Parse,
    Bind,
    Describe,
    Execute,
    Close,
    Sync,
    Flush,
    FunctionCall,
    CopyData,
    CopyDone,
    CopyFail,
    Terminate,
    /// PasswordMessage, SASLInitialResponse, SASLResponse and GSSResponse share this tag.
    Password,
}

impl Frontend {
    /// The message type of a tag byte, or `None` for a tag a client may not send.
    #[inline]
    pub fn from_tag(tag: u8) -> Option<Frontend> {
        Some(match tag {
            b'Q' => Frontend::Query,
            b'P' => Frontend::Parse,
            b'B' => Frontend::Bind,
            b'D' => Frontend::Describe,
            b'E' => Frontend::Execute,
            b'C' => Frontend::Close,
            b'S' => Frontend::Sync,
            b'H' => Frontend::Flush,
            b'F' => Frontend::FunctionCall,
            b'd' => Frontend::CopyData,
            b'c' => Frontend::CopyDone,
            b'f' => Frontend::CopyFail,
            b'X' => Frontend::Terminate,
            b'p' => Frontend::Password,
            _ => return None,
        })
    }

    /// The message's name, for errors.
    pub fn name(self) -> &'static str {
        match self {
            Frontend::Query => "Query",
            Frontend::Parse => "Parse",
            Frontend::Bind => "Bind",
            Frontend::Describe => "Describe",
            Frontend::Execute => "Execute",
            Frontend::Close => "Close",
            Frontend::Sync => "Sync",
            Frontend::Flush => "Flush",
            Frontend::FunctionCall => "FunctionCall",
            Frontend::CopyData => "CopyData",
            Frontend::CopyDone => "CopyDone",
            Frontend::CopyFail => "CopyFail",
            Frontend::Terminate => "Terminate",
            Frontend::Password => "PasswordMessage",
        }
    }
}

/// Whether a client message that pgfence forwards without reading (Describe, Sync, Flush,
/// FunctionCall) holds what PostgreSQL reads from it, and nothing more. The messages pgfence
/// reads are checked the same way by the functions that read them ([`query_text`],
/// [`parse_message`], [`bind_names`], [`execute_portal`], [`target`]); copy messages,
/// Terminate and password messages by nobody: the server reads them only where their
/// content is free-form, or not at all.
///
/// PostgreSQL refuses a malformed message (`ERROR 08P01 invalid message format`), but as an
/// ERROR in place of the message's replies: a Sync or Flush refused that way owes nothing it
/// would have (a Sync's ReadyForQuery never comes, and the server then skips to the next
/// Sync), and pgfence, which counts the replies owed, would wait for replies that never
/// come. So pgfence refuses such a message itself, as input it cannot follow (FATAL 08P01,
/// SPEC section 8).
pub fn well_formed(kind: Frontend, frame: &[u8]) -> bool {
    match kind {
        Frontend::Describe => target(frame).is_some(),
        Frontend::Sync | Frontend::Flush => frame.len() == 5,
        Frontend::FunctionCall => {
            let mut r = Reader(body(frame));
            r.skip(4)
                .and_then(|()| r.formats())
                .and_then(|()| r.values())
                .and_then(|_| r.skip(2))
                .and_then(|()| r.end())
                .is_some()
        }
        Frontend::Query
        | Frontend::Parse
        | Frontend::Bind
        | Frontend::Execute
        | Frontend::Close
        | Frontend::CopyData
        | Frontend::CopyDone
        | Frontend::CopyFail
        | Frontend::Terminate
        | Frontend::Password => true,
    }
}

/// Reads a message body front to back, as PostgreSQL's `pq_getmsg*` functions do: `None`
/// where the body ends too soon.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn skip(&mut self, n: usize) -> Option<()> {
        self.0 = self.0.get(n..)?;
        Some(())
    }

    fn byte(&mut self) -> Option<u8> {
        let (&b, rest) = self.0.split_first()?;
        self.0 = rest;
        Some(b)
    }

    /// A NUL-terminated string of any length (SQL text): memchr.
    fn cstr(&mut self) -> Option<&'a [u8]> {
        let (s, rest) = cstr(self.0)?;
        self.0 = rest;
        Some(s)
    }

    /// A NUL-terminated statement or portal name: a byte loop, which for the few bytes of a
    /// name costs less than memchr's setup. Its first [`NAME_BYTES`] bytes, as PostgreSQL
    /// keys its statements and portals: two longer names that share them are one (a
    /// review parsed a `COMMIT` under a name pgfence took for another one's).
    fn name(&mut self) -> Option<&'a [u8]> {
        let end = self.0.iter().position(|&b| b == 0)?;
        let (s, rest) = (&self.0[..end.min(NAME_BYTES)], &self.0[end + 1..]);
        self.0 = rest;
        Some(s)
    }

    /// An Int16 count (PostgreSQL reads it unsigned).
    fn count(&mut self) -> Option<usize> {
        let (n, rest) = self.0.split_first_chunk::<2>()?;
        self.0 = rest;
        Some(usize::from(u16::from_be_bytes(*n)))
    }

    /// A count of format codes, then the codes (Int16 each).
    fn formats(&mut self) -> Option<()> {
        let n = self.count()?;
        self.skip(2 * n)
    }

    /// A count of values, then each value's Int32 length (-1: NULL, no bytes) and bytes;
    /// the count.
    fn values(&mut self) -> Option<usize> {
        let n = self.count()?;
        for _ in 0..n {
            let (len, rest) = self.0.split_first_chunk::<4>()?;
            self.0 = rest;
            let len = i32::from_be_bytes(*len);
            if len != -1 {
                self.skip(usize::try_from(len).ok()?)?;
            }
        }
        Some(n)
    }

    /// Nothing may follow (PostgreSQL's `pq_getmsgend`).
    fn end(&self) -> Option<()> {
        self.0.is_empty().then_some(())
    }
}

/// Messages the server sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Authentication,
    BackendKeyData,
    BindComplete,
    CloseComplete,
    CommandComplete,
    CopyData,
    CopyDone,
    CopyInResponse,
    CopyOutResponse,
    CopyBothResponse,
    DataRow,
    EmptyQueryResponse,
    ErrorResponse,
    FunctionCallResponse,
    NegotiateProtocolVersion,
    NoData,
    NoticeResponse,
    NotificationResponse,
    ParameterDescription,
    ParameterStatus,
    ParseComplete,
    PortalSuspended,
    ReadyForQuery,
    RowDescription,
}

impl Backend {
    /// The message type of a tag byte, or `None` for a tag PostgreSQL does not send.
    #[inline]
    pub fn from_tag(tag: u8) -> Option<Backend> {
        Some(match tag {
            b'R' => Backend::Authentication,
            b'K' => Backend::BackendKeyData,
            b'2' => Backend::BindComplete,
            b'3' => Backend::CloseComplete,
            b'C' => Backend::CommandComplete,
            b'd' => Backend::CopyData,
            b'c' => Backend::CopyDone,
            b'G' => Backend::CopyInResponse,
            b'H' => Backend::CopyOutResponse,
            b'W' => Backend::CopyBothResponse,
            b'D' => Backend::DataRow,
            b'I' => Backend::EmptyQueryResponse,
            b'E' => Backend::ErrorResponse,
            b'V' => Backend::FunctionCallResponse,
            b'v' => Backend::NegotiateProtocolVersion,
            b'n' => Backend::NoData,
            b'N' => Backend::NoticeResponse,
            b'A' => Backend::NotificationResponse,
            b't' => Backend::ParameterDescription,
            b'S' => Backend::ParameterStatus,
            b'1' => Backend::ParseComplete,
            b's' => Backend::PortalSuspended,
            b'Z' => Backend::ReadyForQuery,
            b'T' => Backend::RowDescription,
            _ => return None,
        })
    }
}

/// Splits a NUL-terminated string off the front of `buf`.
#[inline]
pub fn cstr(buf: &[u8]) -> Option<(&[u8], &[u8])> {
    let end = memchr::memchr(0, buf)?;
    Some((&buf[..end], &buf[end + 1..]))
}

/// The body of a frame (after tag and length).
#[inline]
pub fn body(frame: &[u8]) -> &[u8] {
    frame.get(5..).unwrap_or_default()
}

/// SQL text of a Query message (without the terminating NUL), or `None` if malformed
/// (no NUL, or bytes after it).
pub fn query_text(frame: &[u8]) -> Option<&[u8]> {
    let mut r = Reader(body(frame));
    let sql = r.cstr()?;
    r.end()?;
    Some(sql)
}

/// `(statement name, SQL)` of a Parse message, or `None` if malformed.
pub fn parse_message(frame: &[u8]) -> Option<(&[u8], &[u8])> {
    let mut r = Reader(body(frame));
    let name = r.name()?;
    let sql = r.cstr()?;
    let types = r.count()?;
    r.skip(4 * types)?;
    r.end()?;
    Some((name, sql))
}

/// `(portal name, statement name, number of parameter values)` of a Bind message, or
/// `None` if malformed (its parameter formats, values and result formats are checked too,
/// not read).
pub fn bind_names(frame: &[u8]) -> Option<(&[u8], &[u8], usize)> {
    let mut r = Reader(body(frame));
    let portal = r.name()?;
    let statement = r.name()?;
    r.formats()?;
    let params = r.values()?;
    r.formats()?;
    r.end()?;
    Some((portal, statement, params))
}

/// `(kind, name)` of a Close or Describe message (kind `S`, statement, or `P`, portal, as
/// the client wrote it), or `None` if malformed.
pub fn target(frame: &[u8]) -> Option<(u8, &[u8])> {
    let mut r = Reader(body(frame));
    let kind = r.byte()?;
    let name = r.name()?;
    r.end()?;
    Some((kind, name))
}

/// Portal name of an Execute message, or `None` if malformed.
pub fn execute_portal(frame: &[u8]) -> Option<&[u8]> {
    let mut r = Reader(body(frame));
    let portal = r.name()?;
    r.skip(4)?;
    r.end()?;
    Some(portal)
}

/// Transaction status byte of a ReadyForQuery message (`I`, `T` or `E`).
pub fn ready_status(frame: &[u8]) -> u8 {
    frame.get(5).copied().unwrap_or(b'I')
}

/// Fields of an ErrorResponse or NoticeResponse worth reading.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ErrorFields<'a> {
    pub severity: &'a [u8],
    pub code: &'a [u8],
    pub message: &'a [u8],
}

/// Reads severity, SQLSTATE and message of an ErrorResponse frame.
pub fn error_fields(frame: &[u8]) -> ErrorFields<'_> {
    let mut fields = ErrorFields::default();
    let mut rest = body(frame);
    while let Some((&kind, after)) = rest.split_first() {
        if kind == 0 {
            break;
        }
        let Some((value, next)) = cstr(after) else {
            break;
        };
        match kind {
            b'V' => fields.severity = value,
            b'S' if fields.severity.is_empty() => fields.severity = value,
            b'C' => fields.code = value,
            b'M' => fields.message = value,
            _ => {}
        }
        rest = next;
    }
    fields
}

/// Copies an ErrorResponse or NoticeResponse without its location fields: context (`W`),
/// source file (`F`), line (`L`) and routine (`R`).
pub fn without_location(frame: &[u8], out: &mut BytesMut) {
    copy_fields(frame, out, |o, kind, value| {
        if !matches!(kind, b'W' | b'F' | b'L' | b'R') {
            o.put_u8(kind);
            put_cstr(o, value);
        }
    });
}

/// Copies an ErrorResponse or NoticeResponse with its position field (`P`, a character
/// index into the query string) mapped by `map`; other fields unchanged.
pub fn with_position(frame: &[u8], map: impl Fn(u64) -> u64, out: &mut BytesMut) {
    copy_fields(frame, out, |o, kind, value| {
        o.put_u8(kind);
        let position = (kind == b'P')
            .then(|| std::str::from_utf8(value).ok()?.parse::<u64>().ok())
            .flatten();
        match position {
            Some(p) => put_cstr(o, map(p).to_string().as_bytes()),
            None => put_cstr(o, value),
        }
    });
}

/// Copies an ErrorResponse or NoticeResponse with `hint` as its hint (`H`), in place of
/// the one it had, if any.
pub fn with_hint(frame: &[u8], hint: &[u8], out: &mut BytesMut) {
    copy_fields(frame, out, |o, kind, value| match kind {
        b'H' => {}
        b'M' => {
            o.put_u8(kind);
            put_cstr(o, value);
            o.put_u8(b'H');
            put_cstr(o, hint);
        }
        _ => {
            o.put_u8(kind);
            put_cstr(o, value);
        }
    });
}

/// Copies an ErrorResponse or NoticeResponse field by field: `field` writes each field
/// (its code and value) as it should appear, or not at all.
fn copy_fields(frame: &[u8], out: &mut BytesMut, mut field: impl FnMut(&mut BytesMut, u8, &[u8])) {
    write_message(out, frame[0], |o| {
        let mut rest = body(frame);
        while let Some((&kind, after)) = rest.split_first() {
            if kind == 0 {
                break;
            }
            let Some((value, next)) = cstr(after) else {
                break;
            };
            field(o, kind, value);
            rest = next;
        }
        o.put_u8(0);
    });
}

/// The first column of a DataRow as bytes, `None` when it is NULL or the row is malformed.
pub fn first_column(frame: &[u8]) -> Option<&[u8]> {
    let b = body(frame);
    if b.len() < 6 || u16::from_be_bytes([b[0], b[1]]) == 0 {
        return None;
    }
    let len = i32::from_be_bytes([b[2], b[3], b[4], b[5]]);
    if len < 0 {
        return None;
    }
    b.get(6..6 + len as usize)
}

/// Command tag of a CommandComplete message.
pub fn command_tag(frame: &[u8]) -> &[u8] {
    cstr(body(frame)).map(|(t, _)| t).unwrap_or_default()
}

/// Writes a message: tag, length, then whatever `fill` appends.
#[inline]
pub fn write_message(out: &mut BytesMut, tag: u8, fill: impl FnOnce(&mut BytesMut)) {
    out.put_u8(tag);
    let at = out.len();
    out.put_u32(0);
    fill(out);
    let len = (out.len() - at) as u32;
    out[at..at + 4].copy_from_slice(&len.to_be_bytes());
}

/// Appends a NUL-terminated string.
#[inline]
pub fn put_cstr(out: &mut BytesMut, s: &[u8]) {
    out.put_slice(s);
    out.put_u8(0);
}

/// What an ErrorResponse built by pgfence says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ErrorMessage<'a> {
    /// `ERROR` or `FATAL`.
    pub severity: &'a str,
    pub code: &'a str,
    pub message: &'a str,
    pub detail: Option<&'a str>,
    pub hint: Option<&'a str>,
}

/// Appends an ErrorResponse.
pub fn error_response(out: &mut BytesMut, e: &ErrorMessage<'_>) {
    write_message(out, b'E', |o| {
        for (kind, value) in [
            (b'S', Some(e.severity)),
            (b'V', Some(e.severity)),
            (b'C', Some(e.code)),
            (b'M', Some(e.message)),
            (b'D', e.detail),
            (b'H', e.hint),
        ] {
            if let Some(v) = value {
                o.put_u8(kind);
                put_cstr(o, v.as_bytes());
            }
        }
        o.put_u8(0);
    });
}

/// Terminate (`X`), the whole message: how a client ends its session.
pub const TERMINATE: [u8; 5] = [b'X', 0, 0, 0, 4];

/// Appends a ReadyForQuery with the given transaction status.
pub fn ready_for_query(out: &mut BytesMut, status: u8) {
    write_message(out, b'Z', |o| o.put_u8(status));
}

/// Appends a BackendKeyData.
pub fn backend_key_data(out: &mut BytesMut, pid: i32, key: i32) {
    write_message(out, b'K', |o| {
        o.put_i32(pid);
        o.put_i32(key);
    });
}

/// Appends a Sync.
pub fn sync(out: &mut BytesMut) {
    write_message(out, b'S', |_| {});
}

/// Appends a Flush.
pub fn flush(out: &mut BytesMut) {
    write_message(out, b'H', |_| {});
}

/// Appends a Parse of a named statement with no parameter types given.
pub fn parse(out: &mut BytesMut, name: &[u8], sql: &[u8]) {
    write_message(out, b'P', |o| {
        put_cstr(o, name);
        put_cstr(o, sql);
        o.put_u16(0);
    });
}

/// Appends a Close of a statement (`kind` `S`) or portal (`P`). Closing one that does not
/// exist is no error.
pub fn close(out: &mut BytesMut, kind: u8, name: &[u8]) {
    write_message(out, b'C', |o| {
        o.put_u8(kind);
        put_cstr(o, name);
    });
}

/// Appends a Bind of `statement` into `portal` with text parameters (None = NULL) and a
/// text-format result.
pub fn bind_text(out: &mut BytesMut, portal: &[u8], statement: &[u8], params: &[Option<Vec<u8>>]) {
    write_message(out, b'B', |o| {
        put_cstr(o, portal);
        put_cstr(o, statement);
        o.put_u16(0);
        o.put_u16(params.len() as u16);
        for p in params {
            match p {
                Some(v) => {
                    o.put_i32(v.len() as i32);
                    o.put_slice(v);
                }
                None => o.put_i32(-1),
            }
        }
        o.put_u16(0);
    });
}

/// Appends an Execute of `portal` with no row limit.
pub fn execute(out: &mut BytesMut, portal: &[u8]) {
    write_message(out, b'E', |o| {
        put_cstr(o, portal);
        o.put_i32(0);
    });
}

/// Appends a simple Query.
pub fn query(out: &mut BytesMut, sql: &[u8]) {
    write_message(out, b'Q', |o| put_cstr(o, sql));
}
