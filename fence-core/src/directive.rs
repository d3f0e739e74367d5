//! Fencing directives: `fencing_token` and `fencing_resource` in top-level SQL comments
//! (SPEC section 2, precedence 1).
//!
//! Both styles are read, in block and line comments:
//! - `/* fencing_token=34 fencing_resource=billing */ UPDATE ...`
//! - sqlcommenter: `UPDATE ... /*fencing_resource='billing',fencing_token='34'*/`
//!
//! Pairs are separated by commas or white space (also around `=`). A value is either a run
//! of bytes up to the next separator, or single-quoted with `\'` and `\\` escapes; either
//! way `%XX` is then URL-decoded (an invalid `%` sequence is kept as it is). Keys are
//! case-sensitive; unknown keys and words that are not pairs are ignored.
//!
//! Comments are found with the [`lexer`](crate::lexer), so text inside string literals,
//! quoted identifiers and dollar-quoted bodies never counts.
//!
//! Values are returned raw (decoded, not validated): a malformed token must reach the
//! database check so that the client gets FN003 naming it, rather than being dropped here
//! and silently replaced by the session token.

use crate::lexer::{find, Lexer, TokKind};

/// The fencing keys of one comment.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Directive {
    /// The decoded `fencing_resource` value, if the comment has one.
    pub resource: Option<Vec<u8>>,
    /// The decoded `fencing_token` value, if the comment has one.
    pub token: Option<Vec<u8>>,
}

const TOKEN_KEY: &[u8] = b"fencing_token";
const RESOURCE_KEY: &[u8] = b"fencing_resource";
/// The common prefix of both keys: text without it cannot hold a directive.
const KEY_PREFIX: &[u8] = b"fencing_";

/// The directives in `sql`, in order: one per comment that has at least one fencing key.
///
/// A key repeated within one comment starts a new entry, so that
/// `fencing_token=1 fencing_token=2` reaches the check as two tokens (a conflict, FN003)
/// instead of one silently winning.
///
/// Returns an empty `Vec`, which does not allocate, when `sql` has no `fencing_` at all.
pub fn extract(sql: &[u8]) -> Vec<Directive> {
    let mut out = Vec::new();
    if find(sql, KEY_PREFIX).is_none() {
        return out;
    }
    for tok in Lexer::new(sql) {
        if let TokKind::Comment { block } = tok.kind {
            from_comment(tok.text(sql), block, &mut out);
        }
    }
    out
}

/// Appends the directives of one comment token (delimiters included) to `out`.
pub(crate) fn from_comment(comment: &[u8], block: bool, out: &mut Vec<Directive>) {
    if find(comment, KEY_PREFIX).is_none() {
        return;
    }
    let body = if block {
        let inner = &comment[2..];
        inner.strip_suffix(b"*/").unwrap_or(inner)
    } else {
        &comment[2..]
    };
    parse_pairs(body, out);
}

fn is_separator(b: u8) -> bool {
    b == b',' || b.is_ascii_whitespace() || b == b'\x0b'
}

fn parse_pairs(body: &[u8], out: &mut Vec<Directive>) {
    let mut current = Directive::default();
    let mut i = 0;
    loop {
        while body.get(i).is_some_and(|&b| is_separator(b)) {
            i += 1;
        }
        if i >= body.len() {
            break;
        }
        let key_start = i;
        while body.get(i).is_some_and(|&b| !is_separator(b) && b != b'=') {
            i += 1;
        }
        if i == key_start {
            i += 1; // a stray `=`
            continue;
        }
        let key = &body[key_start..i];
        let mut j = i;
        while body.get(j).is_some_and(|&b| b.is_ascii_whitespace()) {
            j += 1;
        }
        if body.get(j) != Some(&b'=') {
            continue; // a bare word
        }
        j += 1;
        while body.get(j).is_some_and(|&b| b.is_ascii_whitespace()) {
            j += 1;
        }
        let (value, next) = scan_value(body, j);
        i = next;
        let is_token = match key {
            TOKEN_KEY => true,
            RESOURCE_KEY => false,
            _ => continue,
        };
        let repeated = if is_token {
            current.token.is_some()
        } else {
            current.resource.is_some()
        };
        if repeated {
            out.push(std::mem::take(&mut current));
        }
        let value = Some(decode(value));
        if is_token {
            current.token = value;
        } else {
            current.resource = value;
        }
    }
    if current.token.is_some() || current.resource.is_some() {
        out.push(current);
    }
}

/// The raw value starting at `at` and the position after it.
enum Value<'a> {
    Plain(&'a [u8]),
    /// Between single quotes, with `\` escapes still in.
    Quoted(&'a [u8]),
}

fn scan_value(body: &[u8], at: usize) -> (Value<'_>, usize) {
    if body.get(at) == Some(&b'\'') {
        let start = at + 1;
        let mut i = start;
        while i < body.len() {
            match body[i] {
                b'\\' => i += 2,
                b'\'' => return (Value::Quoted(&body[start..i]), i + 1),
                _ => i += 1,
            }
        }
        // Unterminated: the rest of the comment.
        (Value::Quoted(&body[start..]), body.len())
    } else {
        let end = body[at..]
            .iter()
            .position(|&b| is_separator(b))
            .map_or(body.len(), |n| at + n);
        (Value::Plain(&body[at..end]), end)
    }
}

/// Removes quoting escapes, then URL-decodes.
fn decode(value: Value<'_>) -> Vec<u8> {
    let unescaped: Vec<u8>;
    let bytes = match value {
        Value::Plain(bytes) => bytes,
        Value::Quoted(bytes) if !bytes.contains(&b'\\') => bytes,
        Value::Quoted(bytes) => {
            let mut v = Vec::with_capacity(bytes.len());
            let mut it = bytes.iter();
            while let Some(&b) = it.next() {
                v.push(if b == b'\\' {
                    *it.next().unwrap_or(&b)
                } else {
                    b
                });
            }
            unescaped = v;
            &unescaped
        }
    };
    percent_decode(bytes)
}

fn percent_decode(bytes: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            if let (Some(hi), Some(lo)) = (hex(bytes.get(i + 1)), hex(bytes.get(i + 2))) {
                out.push(hi << 4 | lo);
                i += 3;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    out
}

fn hex(b: Option<&u8>) -> Option<u8> {
    let b = *b?;
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(resource: Option<&str>, token: Option<&str>) -> Directive {
        Directive {
            resource: resource.map(|s| s.as_bytes().to_vec()),
            token: token.map(|s| s.as_bytes().to_vec()),
        }
    }

    #[test]
    fn leading_block_comment() {
        assert_eq!(
            extract(b"/* fencing_token=34 fencing_resource=billing */ UPDATE t SET a = 1"),
            vec![d(Some("billing"), Some("34"))]
        );
    }

    #[test]
    fn sqlcommenter_trailing() {
        assert_eq!(
            extract(b"UPDATE t SET a = 1 /*fencing_resource='billing',fencing_token='34'*/"),
            vec![d(Some("billing"), Some("34"))]
        );
        assert_eq!(
            extract(
                b"SELECT 1 /*action='run',controller='jobs',fencing_resource='tenant%3A42',\
                  fencing_token='0034',framework='django%3A4.2'*/"
            ),
            vec![d(Some("tenant:42"), Some("0034"))]
        );
    }

    #[test]
    fn quoted_values_keep_escapes_and_spaces() {
        assert_eq!(
            extract(br"/* fencing_resource='it\'s a, b' */ x"),
            vec![d(Some("it's a, b"), None)]
        );
        // Invalid percent sequences stay as they are; the check reports them (FN003).
        assert_eq!(
            extract(b"/* fencing_token=%zz3%4 */"),
            vec![d(None, Some("%zz3%4"))]
        );
        assert_eq!(
            extract(b"/* fencing_token='3%34' */"),
            vec![d(None, Some("34"))]
        );
        // Unterminated quoted value: the rest of the comment.
        assert_eq!(
            extract(b"/* fencing_token='34 */"),
            vec![d(None, Some("34 "))]
        );
    }

    #[test]
    fn spacing_and_separators() {
        assert_eq!(
            extract(b"/*fencing_token = 7,\tfencing_resource= r1*/"),
            vec![d(Some("r1"), Some("7"))]
        );
        assert_eq!(
            extract(b"/* just a comment with fencing_ in it = */"),
            Vec::<Directive>::new()
        );
        assert_eq!(extract(b"/* fencing_token= */"), vec![d(None, Some(""))]);
        assert_eq!(
            extract(b"/* = fencing_token=1 == */"),
            vec![d(None, Some("1"))]
        );
    }

    #[test]
    fn line_comments() {
        assert_eq!(
            extract(b"UPDATE t SET a = 1 -- fencing_token=5 fencing_resource=jobs\nWHERE id = 2"),
            vec![d(Some("jobs"), Some("5"))]
        );
    }

    #[test]
    fn keys_are_case_sensitive_and_unknown_keys_ignored() {
        assert_eq!(
            extract(b"/* FENCING_TOKEN=1 fencing_tokens=2 app=x */"),
            Vec::<Directive>::new()
        );
        assert_eq!(
            extract(b"/* a=1 fencing_token=3 b='x y' */"),
            vec![d(None, Some("3"))]
        );
    }

    #[test]
    fn one_entry_per_comment_and_repeats_split() {
        assert_eq!(
            extract(
                b"/* fencing_token=1 */ SELECT 1; /* fencing_resource=a */ UPDATE t \
                  /* no keys */ SET x = 1"
            ),
            vec![d(None, Some("1")), d(Some("a"), None)]
        );
        assert_eq!(
            extract(b"/* fencing_token=1 fencing_resource=a fencing_token=2 */"),
            vec![d(Some("a"), Some("1")), d(None, Some("2"))]
        );
    }

    #[test]
    fn not_inside_literals_or_identifiers() {
        for sql in [
            &b"SELECT '/* fencing_token=1 */'"[..],
            b"SELECT E'\\' /* fencing_token=1 */'",
            b"SELECT \"/* fencing_token=1 */\" FROM t",
            b"DO $$ BEGIN /* fencing_token=1 */ END $$",
            b"DO $f$ -- fencing_token=1\n $f$",
            b"SELECT fencing_token FROM t WHERE fencing_token = 1",
        ] {
            assert_eq!(extract(sql), Vec::<Directive>::new(), "{sql:?}");
        }
    }

    #[test]
    fn nested_comments() {
        assert_eq!(
            extract(b"/* outer /* inner */ fencing_token=9 */ UPDATE t SET a = 1"),
            vec![d(None, Some("9"))]
        );
    }

    #[test]
    fn non_utf8_values_pass_through() {
        assert_eq!(
            extract(b"/* fencing_resource=\xff\xfe fencing_token=%FF */"),
            vec![Directive {
                resource: Some(b"\xff\xfe".to_vec()),
                token: Some(b"\xff".to_vec()),
            }]
        );
    }

    #[test]
    fn no_fencing_no_allocation() {
        let v = extract(b"SELECT 1 /* app=x */");
        assert_eq!(v.capacity(), 0);
    }
}
