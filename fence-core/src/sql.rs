//! The SQL side of the fence: the schema pgfence installs in the upstream database, and
//! the calls the proxy makes into it.
//!
//! The check runs inside the client's transaction, immediately before it commits, as
//! `pgfence.check(...)` (SPEC sections 3 and 4). It is the authority on every fence: it
//! reads, creates or advances the fence row under the locks explained in
//! `docs/fence-locking.md`, and raises FN001/FN002/FN003 to roll the transaction back.
//! This module only builds text: the install script, the Bind parameters or literal SQL
//! of the check, the fast-path rejection, and the parser for the check's result.
//!
//! Raw directive values are passed to the server unvalidated (the server validates them),
//! but every byte that is not printable ASCII is replaced by `?` first: valid tokens and
//! resources are printable ASCII, so this never turns an invalid value into a valid one,
//! and it keeps non-UTF-8 or multibyte-encoding bytes out of literals and parameters.

use crate::directive::Directive;

/// Version of the schema created by [`install_sql`], stored in `pgfence.schema_version`.
/// An installed schema with a higher version makes the install fail instead of downgrading.
pub const SCHEMA_VERSION: i32 = 9;

/// The install script with placeholders (see the head of the file).
const INSTALL_TEMPLATE: &str = include_str!("sql/install.sql");

/// The check as an extended-protocol statement: Parse it once per upstream connection,
/// then Bind the text parameters from [`check_params`].
pub const CHECK_SQL: &str =
    "SELECT pgfence.check($1::text[], $2::text[], $3::text, $4::text[], $5::text, $6::boolean)";

/// The check behind a guard that answers NULL without calling `pgfence.check` while the
/// server session has neither `fencing.resource` nor `fencing.token` set (the very case in
/// which `pgfence.check` itself returns NULL for a transaction without comment directives
/// or default resource). PostgreSQL evaluates the guard, from its own settings, inside the
/// transaction. It is only for such transactions, so it takes only what stays the same for a
/// whole session (the policy's `allow_missing` and the client address) and bakes them in as
/// literals: the statement has no parameters, a Bind converts nothing, and executor start
/// compiles a small expression. The server runs 28% fewer instructions for it than for the
/// same guard over [`CHECK_SQL`]'s six parameters (docs/fence-locking.md).
pub fn guarded_check_sql(allow_missing: &[String], client: &str) -> Vec<u8> {
    let args = CheckArgs {
        directives: &[],
        default_resource: None,
        allow_missing,
        client,
        force: false,
    };
    let mut out = Vec::with_capacity(256);
    out.extend_from_slice(
        b"SELECT CASE WHEN pg_catalog.current_setting('fencing.resource', true) IS NULL \
          AND pg_catalog.current_setting('fencing.token', true) IS NULL THEN NULL ELSE ",
    );
    push_check_call(&args, &mut out);
    out.extend_from_slice(b" END");
    out
}

/// Everything `pgfence.check` needs to know about one transaction.
#[derive(Debug, Clone, Copy)]
pub struct CheckArgs<'a> {
    /// One entry per fencing comment seen in the transaction, in order.
    pub directives: &'a [Directive],
    /// The configured resource of this database/user, used when `fencing.resource` is unset.
    pub default_resource: Option<&'a str>,
    /// Resources whose policy allows writes without a token.
    pub allow_missing: &'a [String],
    /// Who is writing (client address), recorded in `pgfence.history`.
    pub client: &'a str,
    /// Check even if the transaction has not written (before `CALL`, `VACUUM`, ...).
    pub force: bool,
}

/// How a transaction that accepts a fence (its token equals the fence or is older) locks it
/// until it ends; stored in `pgfence.schema_version.accept_lock` (docs/fence-locking.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AcceptLock {
    /// A shared transaction-level advisory lock under READ COMMITTED, `FOR SHARE` under the
    /// other levels. Advancers take the exclusive advisory lock and the row lock.
    Advisory,
    /// `FOR SHARE` at every level, as schema versions before 4 did. An upgrade installs this
    /// first, and switches to [`AcceptLock::Advisory`] once no transaction that may still be
    /// running the old functions is left (their advancers take no advisory lock).
    Row,
}

impl AcceptLock {
    /// The value stored in `pgfence.schema_version.accept_lock`.
    pub fn as_str(self) -> &'static str {
        match self {
            AcceptLock::Advisory => "advisory",
            AcceptLock::Row => "row",
        }
    }
}

/// The idempotent install script for a database where no older pgfence schema may be in use
/// (see [`install_sql_with`]).
pub fn install_sql(grant_role: Option<&str>) -> String {
    install_sql_with(grant_role, AcceptLock::Advisory)
}

/// The idempotent install/upgrade script, granting read access to the tables and EXECUTE on
/// the check functions to `grant_role` (`None`, or `public` in any case, means PUBLIC), with
/// the given accept lock. Runs as one transaction (it contains its own `BEGIN` and `COMMIT`,
/// and an advisory lock serialises concurrent installs); send it as one simple Query. If it
/// fails, the transaction block is left aborted: send `ROLLBACK`.
pub fn install_sql_with(grant_role: Option<&str>, accept: AcceptLock) -> String {
    let grantee = match grant_role {
        Some(role) if !role.eq_ignore_ascii_case("public") => quote_ident(role),
        _ => "PUBLIC".to_owned(),
    };
    INSTALL_TEMPLATE
        .replace("__PGFENCE_SCHEMA_VERSION__", &SCHEMA_VERSION.to_string())
        .replace("__PGFENCE_GRANTEE__", &grantee)
        .replace("__PGFENCE_ACCEPT_LOCK__", accept.as_str())
        .replace(
            "__PGFENCE_ACCEPT_ADVISORY__",
            if accept == AcceptLock::Advisory {
                "true"
            } else {
                "false"
            },
        )
}

/// The six text-format Bind parameter values for [`CHECK_SQL`] (`None` is SQL NULL). No
/// comment directives: both arrays are NULL (the case [`guarded_check_sql`] is for).
pub fn check_params(args: &CheckArgs) -> [Option<Vec<u8>>; 6] {
    let (resources, tokens) = if args.directives.is_empty() {
        (None, None)
    } else {
        let mut resources = Vec::new();
        array_literal(
            args.directives.iter().map(|d| d.resource.as_deref()),
            &mut resources,
        );
        let mut tokens = Vec::new();
        array_literal(
            args.directives.iter().map(|d| d.token.as_deref()),
            &mut tokens,
        );
        (Some(resources), Some(tokens))
    };
    let mut allow = Vec::new();
    array_literal(
        args.allow_missing.iter().map(|r| Some(r.as_bytes())),
        &mut allow,
    );
    let default_resource = args.default_resource.map(|r| {
        let mut v = Vec::with_capacity(r.len());
        push_sanitized(r.as_bytes(), &mut v);
        v
    });
    let mut client = Vec::with_capacity(args.client.len());
    push_sanitized(args.client.as_bytes(), &mut client);
    let force = if args.force {
        b"t".to_vec()
    } else {
        b"f".to_vec()
    };
    [
        resources,
        tokens,
        default_resource,
        Some(allow),
        Some(client),
        Some(force),
    ]
}

/// Appends `SELECT pgfence.check(...)` with the arguments as literals, for the simple query
/// protocol. Uses `E''` strings, so it means the same whether `standard_conforming_strings`
/// is on or off. The literals are untyped: `pgfence.check` has one signature, and casts
/// cost the server about 21,000 instructions of parse analysis on every call
/// (docs/fence-locking.md).
pub fn check_call_literal(args: &CheckArgs, out: &mut Vec<u8>) {
    out.extend_from_slice(b"SELECT ");
    push_check_call(args, out);
}

/// Appends `pgfence.check(...)` with the arguments as untyped literals.
fn push_check_call(args: &CheckArgs, out: &mut Vec<u8>) {
    let [resources, tokens, default_resource, allow, client, _] = check_params(args);
    out.extend_from_slice(b"pgfence.check(");
    push_literal(resources.as_deref(), out);
    out.extend_from_slice(b", ");
    push_literal(tokens.as_deref(), out);
    out.extend_from_slice(b", ");
    push_literal(default_resource.as_deref(), out);
    out.extend_from_slice(b", ");
    push_literal(allow.as_deref(), out);
    out.extend_from_slice(b", ");
    push_literal(client.as_deref(), out);
    out.extend_from_slice(if args.force { b", true)" } else { b", false)" });
}

/// Appends `SELECT pgfence.fast_reject(...)`: the statement the fast path sends instead of
/// one known to be stale, so that the server transaction fails with FN001 as the client is
/// told (the function always raises; it never accepts anything).
pub fn fast_reject_literal(resource: &str, token: i64, known_fence: i64, out: &mut Vec<u8>) {
    let mut r = Vec::with_capacity(resource.len());
    push_sanitized(resource.as_bytes(), &mut r);
    out.extend_from_slice(b"SELECT pgfence.fast_reject(");
    push_literal(Some(&r), out);
    out.extend_from_slice(b"::text");
    // Quoted, so that even i64::MIN needs no unary minus applied to an out-of-range literal.
    out.extend_from_slice(format!(", '{token}'::bigint, '{known_fence}'::bigint)").as_bytes());
}

/// Parses the value returned by `pgfence.check`: `resource=token` pairs joined by `,`
/// (the accepted token of each resource, which is now its fence). Malformed entries are
/// skipped: the proxy then merely learns less.
pub fn parse_check_result(value: &[u8]) -> Vec<(String, i64)> {
    value
        .split(|&b| b == b',')
        .filter_map(|pair| {
            let eq = pair.iter().position(|&b| b == b'=')?;
            let resource = std::str::from_utf8(&pair[..eq]).ok()?;
            let token = std::str::from_utf8(&pair[eq + 1..])
                .ok()?
                .parse::<i64>()
                .ok()?;
            (!resource.is_empty() && token >= 0).then(|| (resource.to_owned(), token))
        })
        .collect()
}

/// `"name"` with embedded double quotes doubled (NUL bytes cannot be in a role name).
fn quote_ident(name: &str) -> String {
    let mut q = String::with_capacity(name.len() + 2);
    q.push('"');
    for c in name.chars().filter(|&c| c != '\0') {
        if c == '"' {
            q.push('"');
        }
        q.push(c);
    }
    q.push('"');
    q
}

/// Copies `bytes`, replacing every byte that is not printable ASCII by `?`.
fn push_sanitized(bytes: &[u8], out: &mut Vec<u8>) {
    out.extend(
        bytes
            .iter()
            .map(|&b| if (0x20..0x7f).contains(&b) { b } else { b'?' }),
    );
}

/// A PostgreSQL array literal (text input form): every element double-quoted with `\` and
/// `"` backslash-escaped, so commas, braces, spaces and the word NULL stay data;
/// `None` becomes an unquoted `NULL` element.
fn array_literal<'a>(elements: impl Iterator<Item = Option<&'a [u8]>>, out: &mut Vec<u8>) {
    out.push(b'{');
    for (i, element) in elements.enumerate() {
        if i > 0 {
            out.push(b',');
        }
        match element {
            None => out.extend_from_slice(b"NULL"),
            Some(bytes) => {
                out.push(b'"');
                for &b in bytes {
                    if b == b'"' || b == b'\\' {
                        out.push(b'\\');
                    }
                    push_sanitized(&[b], out);
                }
                out.push(b'"');
            }
        }
    }
    out.push(b'}');
}

/// `E'...'` (or `NULL`) for already-sanitized printable ASCII, untyped.
fn push_literal(value: Option<&[u8]>, out: &mut Vec<u8>) {
    match value {
        None => out.extend_from_slice(b"NULL"),
        Some(bytes) => {
            out.extend_from_slice(b"E'");
            for &b in bytes {
                match b {
                    b'\\' => out.extend_from_slice(b"\\\\"),
                    b'\'' => out.extend_from_slice(b"''"),
                    _ => push_sanitized(&[b], out),
                }
            }
            out.push(b'\'');
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(resource: Option<&[u8]>, token: Option<&[u8]>) -> Directive {
        Directive {
            resource: resource.map(<[u8]>::to_vec),
            token: token.map(<[u8]>::to_vec),
        }
    }

    fn text(bytes: &Option<Vec<u8>>) -> Option<&str> {
        bytes.as_deref().map(|b| std::str::from_utf8(b).unwrap())
    }

    /// The read audit counts user functions named like the classifier's infix keywords.
    #[test]
    fn the_read_audit_lists_the_infix_keywords() {
        let listed = crate::classify::INFIX_KEYWORDS
            .iter()
            .map(|k| format!("'{k}'"))
            .collect::<Vec<_>>()
            .join(", ");
        let rule = format!("AND p.proname IN ({listed})");
        assert!(install_sql(None).contains(&rule), "{rule}");
    }

    #[test]
    fn sql_install_substitutes_placeholders() {
        let sql = install_sql(None);
        assert!(!sql.contains("__PGFENCE_"));
        assert!(sql.contains("GRANT USAGE ON SCHEMA pgfence TO PUBLIC;"));
        assert!(sql.contains(&format!("IF v_installed > {SCHEMA_VERSION} THEN")));
        assert!(sql.trim_start().starts_with("--"));
        assert!(sql.trim_end().ends_with("COMMIT;"));
        assert!(install_sql(Some("public")).contains("TO PUBLIC;"));
        let sql = install_sql(Some(r#"app "rw""#));
        assert!(sql.contains(r#"GRANT USAGE ON SCHEMA pgfence TO "app ""rw""";"#));
        assert!(!sql.contains("TO PUBLIC"));
        let advisory = install_sql(None);
        assert!(advisory.contains("v_adv := true"));
        assert!(advisory.contains("'advisory')"));
        let row = install_sql_with(None, AcceptLock::Row);
        assert!(!row.contains("__PGFENCE_"));
        assert!(row.contains("v_adv := false"));
        assert!(row.contains("'row')"));
    }

    #[test]
    fn sql_check_sql_matches_the_function_signature() {
        assert!(install_sql(None)
            .contains("pgfence.check(text[], text[], text, text[], text, boolean)"));
        assert!(CHECK_SQL.contains("$6::boolean"));
    }

    #[test]
    fn sql_params_escape_array_elements() {
        let directives = [
            d(Some(b"billing"), Some(b"34")),
            d(None, Some(br#"a"b\c"#)),
            d(Some(b"x,y{z}"), None),
            d(Some(b"NULL"), Some(b"")),
        ];
        let allow = vec!["orders".to_owned(), "a b".to_owned()];
        let args = CheckArgs {
            directives: &directives,
            default_resource: Some("billing"),
            allow_missing: &allow,
            client: "10.0.0.1:5000",
            force: false,
        };
        let p = check_params(&args);
        assert_eq!(text(&p[0]), Some(r#"{"billing",NULL,"x,y{z}","NULL"}"#));
        assert_eq!(text(&p[1]), Some(r#"{"34","a\"b\\c",NULL,""}"#));
        assert_eq!(text(&p[2]), Some("billing"));
        assert_eq!(text(&p[3]), Some(r#"{"orders","a b"}"#));
        assert_eq!(text(&p[4]), Some("10.0.0.1:5000"));
        assert_eq!(text(&p[5]), Some("f"));
    }

    #[test]
    fn sql_params_empty_and_null() {
        let args = CheckArgs {
            directives: &[],
            default_resource: None,
            allow_missing: &[],
            client: "",
            force: true,
        };
        let p = check_params(&args);
        assert_eq!(p[0], None);
        assert_eq!(p[1], None);
        assert_eq!(p[2], None);
        assert_eq!(text(&p[3]), Some("{}"));
        assert_eq!(text(&p[5]), Some("t"));
    }

    #[test]
    fn sql_params_replace_non_printable_bytes() {
        let directives = [d(Some(b"bill\xffing\n"), Some("3\u{e9}4\0".as_bytes()))];
        let args = CheckArgs {
            directives: &directives,
            default_resource: None,
            allow_missing: &[],
            client: "c\u{e9}",
            force: false,
        };
        let p = check_params(&args);
        assert_eq!(text(&p[0]), Some(r#"{"bill?ing?"}"#));
        assert_eq!(text(&p[1]), Some(r#"{"3??4?"}"#));
        assert_eq!(text(&p[4]), Some("c??"));
    }

    #[test]
    fn sql_literal_uses_escape_strings() {
        let directives = [
            d(Some(b"billing"), Some(b"34")),
            d(Some(br"it's\"), None),
            d(None, Some(b"\xc3\xa9'")),
        ];
        let allow = vec!["o'k".to_owned()];
        let args = CheckArgs {
            directives: &directives,
            default_resource: None,
            allow_missing: &allow,
            client: r"127.0.0.1\x",
            force: false,
        };
        let mut out = b"prefix; ".to_vec();
        check_call_literal(&args, &mut out);
        assert_eq!(
            std::str::from_utf8(&out).unwrap(),
            concat!(
                r#"prefix; SELECT pgfence.check(E'{"billing","it''s\\\\",NULL}', "#,
                r#"E'{"34",NULL,"??''"}', NULL, E'{"o''k"}', "#,
                r#"E'127.0.0.1\\x', false)"#
            )
        );
    }

    #[test]
    fn sql_literal_default_resource_and_force() {
        let args = CheckArgs {
            directives: &[],
            default_resource: Some("billing"),
            allow_missing: &[],
            client: "c",
            force: true,
        };
        let mut out = Vec::new();
        check_call_literal(&args, &mut out);
        assert_eq!(
            std::str::from_utf8(&out).unwrap(),
            "SELECT pgfence.check(NULL, NULL, E'billing', E'{}', E'c', true)"
        );
    }

    #[test]
    fn sql_guarded_check_has_no_parameters_and_escapes_its_literals() {
        let sql = guarded_check_sql(&["o'k".to_owned(), "*".to_owned()], r"[::1]:5\");
        assert_eq!(
            std::str::from_utf8(&sql).unwrap(),
            concat!(
                "SELECT CASE WHEN pg_catalog.current_setting('fencing.resource', true) IS NULL ",
                "AND pg_catalog.current_setting('fencing.token', true) IS NULL THEN NULL ",
                r#"ELSE pgfence.check(NULL, NULL, NULL, E'{"o''k","*"}', E'[::1]:5\\', false) END"#
            )
        );
        assert!(!sql.contains(&b'$'));
    }

    #[test]
    fn sql_fast_reject_literal() {
        let mut out = Vec::new();
        fast_reject_literal("billing", 33, 34, &mut out);
        assert_eq!(
            std::str::from_utf8(&out).unwrap(),
            "SELECT pgfence.fast_reject(E'billing'::text, '33'::bigint, '34'::bigint)"
        );
        out.clear();
        fast_reject_literal("a'b\\", i64::MIN, i64::MAX, &mut out);
        assert_eq!(
            std::str::from_utf8(&out).unwrap(),
            r"SELECT pgfence.fast_reject(E'a''b\\'::text, '-9223372036854775808'::bigint, '9223372036854775807'::bigint)"
        );
    }

    #[test]
    fn sql_parse_check_result() {
        assert_eq!(
            parse_check_result(b"billing=34"),
            vec![("billing".to_owned(), 34)]
        );
        assert_eq!(
            parse_check_result(b"a.b:c-d_e=0,billing=9223372036854775807"),
            vec![
                ("a.b:c-d_e".to_owned(), 0),
                ("billing".to_owned(), i64::MAX)
            ]
        );
        assert_eq!(parse_check_result(b""), vec![]);
        assert_eq!(
            parse_check_result(b"=1,x,y=,z=-1,w=9223372036854775808,ok=1"),
            vec![("ok".to_owned(), 1)]
        );
    }
}
