//! The FN001/FN002/FN003 errors as the client sees them (SPEC section 5).
//!
//! The texts here are a contract shared, word for word, with `pgfence.check` in
//! `sql/install.sql`: the proxy builds them for the fast path and recognises them in
//! errors coming back from PostgreSQL ([`Rejection::from_server`]) to log and count them.
//!
//! Raw values (a malformed token or resource as the client sent it) are embedded
//! sanitised by [`sanitize`]: printable ASCII only, with `"` and `\` replaced by `?` so the
//! quoting of the message stays unambiguous, at most [`MAX_RAW_LEN`] bytes.

use std::fmt;

use crate::token::{Resource, Token};

/// The longest raw value embedded in a message, in bytes.
pub const MAX_RAW_LEN: usize = 64;

/// Why a transaction was rejected; one SQLSTATE each.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reason {
    /// FN001: the token is lower than the fence.
    Stale,
    /// FN002: the transaction wrote without a token for a resource that requires one.
    Missing,
    /// FN003: a malformed token or resource, or two tokens for one resource.
    Invalid,
}

impl Reason {
    /// The label used in logs and metrics: `stale`, `missing`, `invalid`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Reason::Stale => "stale",
            Reason::Missing => "missing",
            Reason::Invalid => "invalid",
        }
    }

    /// The SQLSTATE: `FN001`, `FN002`, `FN003`.
    pub const fn sqlstate(self) -> &'static str {
        match self {
            Reason::Stale => "FN001",
            Reason::Missing => "FN002",
            Reason::Invalid => "FN003",
        }
    }

    /// The condition name from SPEC section 5, e.g. `stale_fencing_token`.
    pub const fn condition_name(self) -> &'static str {
        match self {
            Reason::Stale => "stale_fencing_token",
            Reason::Missing => "missing_fencing_token",
            Reason::Invalid => "invalid_fencing_token",
        }
    }

    /// The reason of a SQLSTATE, if it is one of ours.
    pub fn from_sqlstate(sqlstate: &str) -> Option<Reason> {
        match sqlstate {
            "FN001" => Some(Reason::Stale),
            "FN002" => Some(Reason::Missing),
            "FN003" => Some(Reason::Invalid),
            _ => None,
        }
    }
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A rejection: the fields operators log, and the ErrorResponse texts the client gets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejection {
    pub reason: Reason,
    /// The resource named in the message (sanitised if it was invalid).
    pub resource: Option<String>,
    /// The token as written in the message: a number, a sanitised raw value, or for
    /// conflicting tokens both of them as `a,b`.
    pub token: Option<String>,
    /// The fence the token was compared with (FN001 only; `None` if the server said
    /// `unknown`).
    pub fence: Option<i64>,
    pub message: String,
    pub detail: String,
    pub hint: String,
}

const ROLLED_BACK: &str = "This transaction was rolled back.";
const INVALID_HINT: &str = "Fencing tokens are integers from 0 to 9223372036854775807; \
                            resources are 1 to 63 characters from [A-Za-z0-9_.:-].";
const CONFLICT_HINT: &str = "A transaction belongs to one leader: use one token per resource.";
const MISSING_HINT: &str = "Set fencing.token (options=-c fencing.token=N, or SET fencing.token \
                            = N), or add /* fencing_token=N */ to a statement of the transaction.";

impl Rejection {
    /// FN001: `token` is lower than `fence`, the highest token accepted for `resource`.
    pub fn stale(resource: &Resource, token: Token, fence: impl Into<i64>) -> Rejection {
        let fence = fence.into();
        Self::stale_parts(resource.as_str(), token.to_string(), Some(fence))
    }

    fn stale_parts(r: &str, t: String, fence: Option<i64>) -> Rejection {
        let f = fence.map_or_else(|| "unknown".to_owned(), |f| f.to_string());
        Rejection {
            reason: Reason::Stale,
            message: format!(
                "stale fencing token {t} for resource \"{r}\": token {f} was already accepted"
            ),
            detail: format!(
                "A newer holder of the lease on \"{r}\" has written with token {f}. \
                 This transaction was rolled back and none of its writes were applied."
            ),
            hint: format!(
                "This client is no longer the leader for \"{r}\": stop writing, \
                 and re-acquire the lease to get a new token."
            ),
            resource: Some(r.to_owned()),
            token: Some(t),
            fence,
        }
    }

    /// FN002: the transaction wrote without a token for `resource`, which requires one.
    pub fn missing(resource: &Resource) -> Rejection {
        Self::missing_parts(resource.as_str())
    }

    fn missing_parts(r: &str) -> Rejection {
        Rejection {
            reason: Reason::Missing,
            message: format!(
                "missing fencing token for resource \"{r}\": the transaction wrote without a token"
            ),
            detail: format!(
                "Resource \"{r}\" requires a fencing token on every write transaction. \
                 This transaction was rolled back."
            ),
            hint: MISSING_HINT.to_owned(),
            resource: Some(r.to_owned()),
            token: None,
            fence: None,
        }
    }

    /// FN003: `raw` is not a token (not digits, or out of range).
    pub fn invalid_token(resource: &Resource, raw: &[u8]) -> Rejection {
        Self::invalid_token_parts(resource.as_str(), sanitize(raw))
    }

    fn invalid_token_parts(r: &str, raw: String) -> Rejection {
        Self::invalid(
            format!(
                "invalid fencing token \"{raw}\" for resource \"{r}\": \
                 expected an integer from 0 to 9223372036854775807"
            ),
            INVALID_HINT,
            Some(r.to_owned()),
            Some(raw),
        )
    }

    /// FN003: `raw` is not a resource name.
    pub fn invalid_resource(raw: &[u8]) -> Rejection {
        Self::invalid_resource_parts(sanitize(raw))
    }

    fn invalid_resource_parts(raw: String) -> Rejection {
        Self::invalid(
            format!(
                "invalid fencing resource \"{raw}\": \
                 expected 1 to 63 characters from [A-Za-z0-9_.:-]"
            ),
            INVALID_HINT,
            Some(raw),
            None,
        )
    }

    /// FN003: one transaction carries tokens `a` and `b` (raw, as written) for one resource.
    pub fn conflicting(resource: &[u8], a: &[u8], b: &[u8]) -> Rejection {
        Self::conflicting_parts(sanitize(resource), sanitize(a), sanitize(b))
    }

    fn conflicting_parts(r: String, a: String, b: String) -> Rejection {
        Self::invalid(
            format!(
                "conflicting fencing tokens {a} and {b} for resource \"{r}\" in one transaction"
            ),
            CONFLICT_HINT,
            Some(r),
            Some(format!("{a},{b}")),
        )
    }

    /// FN003: a token (raw) was given but no resource to apply it to.
    pub fn no_resource(raw_token: &[u8]) -> Rejection {
        Self::no_resource_parts(sanitize(raw_token))
    }

    fn no_resource_parts(raw: String) -> Rejection {
        Self::invalid(
            format!(
                "fencing token {raw} has no resource: \
                 set fencing.resource or add fencing_resource to the comment"
            ),
            INVALID_HINT,
            None,
            Some(raw),
        )
    }

    fn invalid(
        message: String,
        hint: &str,
        resource: Option<String>,
        token: Option<String>,
    ) -> Rejection {
        Rejection {
            reason: Reason::Invalid,
            resource,
            token,
            fence: None,
            message,
            detail: ROLLED_BACK.to_owned(),
            hint: hint.to_owned(),
        }
    }

    /// Recognises an FN001/FN002/FN003 error from PostgreSQL by its SQLSTATE and message
    /// text, recovering the resource, token and fence. `None` for any other error, or a
    /// message in a shape pgfence does not write.
    pub fn from_server(sqlstate: &str, message: &str) -> Option<Rejection> {
        match Reason::from_sqlstate(sqlstate)? {
            Reason::Stale => {
                let rest = between(message, "stale fencing token ", " was already accepted")?;
                let (t, rest) = rest.split_once(" for resource \"")?;
                let (r, f) = rest.rsplit_once("\": token ")?;
                let fence = match f {
                    "unknown" => None,
                    f => Some(f.parse().ok()?),
                };
                Some(Self::stale_parts(r, t.to_owned(), fence))
            }
            Reason::Missing => {
                let r = between(
                    message,
                    "missing fencing token for resource \"",
                    "\": the transaction wrote without a token",
                )?;
                Some(Self::missing_parts(r))
            }
            Reason::Invalid => Self::invalid_from_server(message),
        }
    }

    fn invalid_from_server(message: &str) -> Option<Rejection> {
        if let Some(rest) = between(
            message,
            "invalid fencing token \"",
            "\": expected an integer from 0 to 9223372036854775807",
        ) {
            let (raw, r) = rest.rsplit_once("\" for resource \"")?;
            return Some(Self::invalid_token_parts(r, raw.to_owned()));
        }
        if let Some(raw) = between(
            message,
            "invalid fencing resource \"",
            "\": expected 1 to 63 characters from [A-Za-z0-9_.:-]",
        ) {
            return Some(Self::invalid_resource_parts(raw.to_owned()));
        }
        if let Some(rest) = between(
            message,
            "conflicting fencing tokens ",
            "\" in one transaction",
        ) {
            let (tokens, r) = rest.split_once(" for resource \"")?;
            let (a, b) = tokens.split_once(" and ")?;
            return Some(Self::conflicting_parts(
                r.to_owned(),
                a.to_owned(),
                b.to_owned(),
            ));
        }
        let raw = between(
            message,
            "fencing token ",
            " has no resource: set fencing.resource or add fencing_resource to the comment",
        )?;
        Some(Self::no_resource_parts(raw.to_owned()))
    }
}

impl fmt::Display for Rejection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.reason.sqlstate(), self.message)
    }
}

impl std::error::Error for Rejection {}

fn between<'a>(s: &'a str, prefix: &str, suffix: &str) -> Option<&'a str> {
    s.strip_prefix(prefix)?.strip_suffix(suffix)
}

/// A raw value made safe to embed in a message: bytes outside printable ASCII, `"` and `\`
/// become `?`, and only the first [`MAX_RAW_LEN`] bytes are kept.
pub fn sanitize(raw: &[u8]) -> String {
    raw.iter()
        .take(MAX_RAW_LEN)
        .map(|&b| match b {
            b'"' | b'\\' => '?',
            0x20..=0x7e => char::from(b),
            _ => '?',
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn res(name: &str) -> Resource {
        Resource::parse(name.as_bytes()).unwrap()
    }

    fn tok(t: i64) -> Token {
        Token::new(t).unwrap()
    }

    fn round_trip(r: &Rejection) {
        let back = Rejection::from_server(r.reason.sqlstate(), &r.message);
        assert_eq!(back.as_ref(), Some(r), "{}", r.message);
    }

    #[test]
    fn stale_texts() {
        let r = Rejection::stale(&res("billing"), tok(33), tok(34));
        assert_eq!(r.reason.sqlstate(), "FN001");
        assert_eq!(r.reason.as_str(), "stale");
        assert_eq!(
            r.message,
            "stale fencing token 33 for resource \"billing\": token 34 was already accepted"
        );
        assert_eq!(
            r.detail,
            "A newer holder of the lease on \"billing\" has written with token 34. This \
             transaction was rolled back and none of its writes were applied."
        );
        assert_eq!(
            r.hint,
            "This client is no longer the leader for \"billing\": stop writing, and re-acquire \
             the lease to get a new token."
        );
        assert_eq!(
            (r.resource.as_deref(), r.token.as_deref(), r.fence),
            (Some("billing"), Some("33"), Some(34))
        );
        round_trip(&r);
        round_trip(&Rejection::stale(&res("a"), tok(0), i64::MAX));
    }

    #[test]
    fn stale_with_unknown_fence_from_server() {
        let r = Rejection::from_server(
            "FN001",
            "stale fencing token 3 for resource \"jobs\": token unknown was already accepted",
        )
        .unwrap();
        assert_eq!(r.fence, None);
        assert_eq!(r.token.as_deref(), Some("3"));
        assert_eq!(r.resource.as_deref(), Some("jobs"));
    }

    #[test]
    fn missing_texts() {
        let r = Rejection::missing(&res("billing"));
        assert_eq!(r.reason.sqlstate(), "FN002");
        assert_eq!(
            r.message,
            "missing fencing token for resource \"billing\": the transaction wrote without a token"
        );
        assert_eq!(
            r.detail,
            "Resource \"billing\" requires a fencing token on every write transaction. This \
             transaction was rolled back."
        );
        assert_eq!(
            r.hint,
            "Set fencing.token (options=-c fencing.token=N, or SET fencing.token = N), or add \
             /* fencing_token=N */ to a statement of the transaction."
        );
        assert_eq!(r.token, None);
        round_trip(&r);
    }

    #[test]
    fn invalid_texts() {
        let hint = "Fencing tokens are integers from 0 to 9223372036854775807; resources are 1 \
                    to 63 characters from [A-Za-z0-9_.:-].";
        let r = Rejection::invalid_token(&res("billing"), b"-5");
        assert_eq!(r.reason.sqlstate(), "FN003");
        assert_eq!(
            r.message,
            "invalid fencing token \"-5\" for resource \"billing\": expected an integer from 0 \
             to 9223372036854775807"
        );
        assert_eq!(r.detail, "This transaction was rolled back.");
        assert_eq!(r.hint, hint);
        round_trip(&r);

        let r = Rejection::invalid_resource(b"bill ing");
        assert_eq!(
            r.message,
            "invalid fencing resource \"bill ing\": expected 1 to 63 characters from \
             [A-Za-z0-9_.:-]"
        );
        assert_eq!(r.hint, hint);
        assert_eq!(r.resource.as_deref(), Some("bill ing"));
        round_trip(&r);

        let r = Rejection::conflicting(b"billing", b"34", b"035");
        assert_eq!(
            r.message,
            "conflicting fencing tokens 34 and 035 for resource \"billing\" in one transaction"
        );
        assert_eq!(r.detail, "This transaction was rolled back.");
        assert_eq!(
            r.hint,
            "A transaction belongs to one leader: use one token per resource."
        );
        assert_eq!(r.token.as_deref(), Some("34,035"));
        round_trip(&r);

        let r = Rejection::no_resource(b"34");
        assert_eq!(
            r.message,
            "fencing token 34 has no resource: set fencing.resource or add fencing_resource to \
             the comment"
        );
        assert_eq!(r.hint, hint);
        assert_eq!((r.resource, r.token.as_deref()), (None, Some("34")));
        round_trip(&Rejection::no_resource(b"34"));
    }

    #[test]
    fn raw_values_are_sanitised() {
        assert_eq!(sanitize(b"a\"b\\c\xff\n"), "a?b?c??");
        assert_eq!(sanitize(&[b'7'; 100]).len(), MAX_RAW_LEN);
        let r = Rejection::invalid_token(&res("r"), b"\" for resource \"x");
        assert_eq!(
            r.message,
            "invalid fencing token \"? for resource ?x\" for resource \"r\": expected an \
             integer from 0 to 9223372036854775807"
        );
        round_trip(&r);
        round_trip(&Rejection::invalid_resource("é\u{0}".as_bytes()));
        round_trip(&Rejection::no_resource(b" has no resource: x"));
        round_trip(&Rejection::conflicting(b"r\"", b"1", &[b'9'; 80]));
    }

    #[test]
    fn from_server_ignores_other_errors() {
        assert_eq!(Rejection::from_server("23505", "duplicate key"), None);
        assert_eq!(Rejection::from_server("FN001", "something else"), None);
        assert_eq!(
            Rejection::from_server(
                "FN001",
                "stale fencing token 1 for resource \"r\": token x was already accepted"
            ),
            None
        );
        assert_eq!(Rejection::from_server("FN003", ""), None);
    }

    #[test]
    fn reasons() {
        for (reason, s, code, name) in [
            (Reason::Stale, "stale", "FN001", "stale_fencing_token"),
            (Reason::Missing, "missing", "FN002", "missing_fencing_token"),
            (Reason::Invalid, "invalid", "FN003", "invalid_fencing_token"),
        ] {
            assert_eq!(reason.as_str(), s);
            assert_eq!(reason.to_string(), s);
            assert_eq!(reason.sqlstate(), code);
            assert_eq!(reason.condition_name(), name);
            assert_eq!(Reason::from_sqlstate(code), Some(reason));
        }
        assert_eq!(Reason::from_sqlstate("P0001"), None);
    }
}
