//! The admin console, in the PgBouncer tradition: connect to the virtual database `pgfence`
//! on the proxy port (as a user listed in `admin.users`; the password is checked by the
//! upstream server) and run `SHOW FENCES`, `SHOW REJECTIONS`, `SHOW CLIENTS`, `SHOW SERVERS`,
//! `SHOW STATS`, `SHOW CONFIG`, `SHOW VERSION`, `RELOAD`, `KILL_CLIENT id`, `SHOW HELP`.
//! Simple query protocol only (psql, `simple_query`).

use std::sync::atomic::Ordering;
use std::sync::PoisonError;
use std::time::SystemTime;

use bytes::{BufMut, BytesMut};

use tracing::info;

use crate::protocol::message::{self as msg, ErrorMessage};
use crate::state::Shared;

/// The virtual database name of the console.
pub const DATABASE: &str = "pgfence";

/// What `SHOW FENCES` runs upstream: the fences live in the database.
pub const FENCES_SQL: &[u8] =
    b"SELECT resource, token, updated_at FROM pgfence.fences ORDER BY resource";

/// A console command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    Help,
    Fences,
    Rejections,
    Clients,
    Servers,
    Stats,
    Config,
    Version,
    Reload,
    /// End the session with this id (`SHOW CLIENTS`), as PgBouncer's `KILL_CLIENT`.
    KillClient(u64),
    /// An empty query string.
    Empty,
}

impl Command {
    /// Parses a console command: case-insensitive, surrounding white space and one trailing
    /// `;` allowed.
    pub fn parse(sql: &[u8]) -> Result<Command, String> {
        let text = String::from_utf8_lossy(sql);
        let text = text.trim().trim_end_matches(';').trim();
        let words: Vec<String> = text
            .split_whitespace()
            .map(|w| w.to_ascii_uppercase())
            .collect();
        let words: Vec<&str> = words.iter().map(String::as_str).collect();
        Ok(match words.as_slice() {
            [] => Command::Empty,
            ["SHOW", "HELP"] | ["HELP"] => Command::Help,
            ["SHOW", "FENCES"] => Command::Fences,
            ["SHOW", "REJECTIONS"] => Command::Rejections,
            ["SHOW", "CLIENTS"] => Command::Clients,
            ["SHOW", "SERVERS"] => Command::Servers,
            ["SHOW", "STATS"] => Command::Stats,
            ["SHOW", "CONFIG"] => Command::Config,
            ["SHOW", "VERSION"] => Command::Version,
            ["RELOAD"] => Command::Reload,
            ["KILL_CLIENT", id] => match id.parse() {
                Ok(id) => Command::KillClient(id),
                Err(_) => {
                    // As the client wrote it, not upper-cased.
                    let id = text.split_whitespace().nth(1).unwrap_or_default();
                    return Err(format!(
                        "KILL_CLIENT takes a client id from SHOW CLIENTS, not {id:?}"
                    ));
                }
            },
            ["KILL_CLIENT", ..] => {
                return Err("KILL_CLIENT takes one client id from SHOW CLIENTS".to_string())
            }
            _ => return Err(format!("unknown admin command {text:?}: try SHOW HELP")),
        })
    }
}

/// What the console does with a command.
pub enum Answer {
    /// Send this SQL upstream and forward its replies.
    Upstream(&'static [u8]),
    /// The reply is ready in the output buffer.
    Done,
}

const HELP: &[(&str, &str)] = &[
    (
        "SHOW FENCES",
        "resource, token and updated_at of every fence, read from the database",
    ),
    (
        "SHOW REJECTIONS",
        "the latest rejected transactions, newest first",
    ),
    ("SHOW CLIENTS", "connected client sessions"),
    (
        "SHOW SERVERS",
        "idle server connections kept for the next client ([pool])",
    ),
    ("SHOW STATS", "counters since pgfence started"),
    ("SHOW CONFIG", "the configuration in force"),
    ("SHOW VERSION", "pgfence's version"),
    (
        "RELOAD",
        "read the configuration file again (also on SIGHUP)",
    ),
    (
        "KILL_CLIENT id",
        "end a client's session now (id from SHOW CLIENTS); an open transaction rolls back",
    ),
    ("SHOW HELP", "this list"),
];

/// Answers one console query of user `admin` into `out` (ending with ReadyForQuery), or
/// says to ask the upstream server.
pub fn answer(shared: &Shared, admin: &str, sql: &[u8], out: &mut BytesMut) -> Answer {
    let command = match Command::parse(sql) {
        Ok(c) => c,
        Err(message) => {
            error(out, "42601", &message);
            msg::ready_for_query(out, b'I');
            return Answer::Done;
        }
    };
    match command {
        Command::Empty => msg::write_message(out, b'I', |_| {}),
        Command::Fences => return Answer::Upstream(FENCES_SQL),
        Command::Help => {
            let rows: Vec<Vec<String>> = HELP
                .iter()
                .map(|(c, d)| vec![c.to_string(), d.to_string()])
                .collect();
            table(out, &["command", "description"], &[], &rows, "SHOW");
        }
        Command::Rejections => {
            let log = shared
                .rejections
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            let rows: Vec<Vec<String>> = log
                .iter()
                .rev()
                .map(|r| {
                    vec![
                        time(r.at),
                        r.resource.clone(),
                        r.token.clone(),
                        r.fence.map(|f| f.to_string()).unwrap_or_default(),
                        r.reason.to_string(),
                        r.path.to_string(),
                        r.client_addr.clone(),
                        r.user.clone(),
                        r.database.clone(),
                        r.application_name.clone(),
                        r.backend_pid.to_string(),
                        r.statement.clone(),
                    ]
                })
                .collect();
            table(
                out,
                &[
                    "time",
                    "resource",
                    "token",
                    "fence",
                    "reason",
                    "path",
                    "client_addr",
                    "user",
                    "database",
                    "application_name",
                    "backend_pid",
                    "statement",
                ],
                &["fence", "backend_pid"],
                &rows,
                "SHOW",
            );
        }
        Command::Clients => {
            let mut clients: Vec<_> = shared
                .clients
                .iter()
                .map(|e| (*e.key(), e.value().clone()))
                .collect();
            clients.sort_by_key(|(id, _)| *id);
            let rows: Vec<Vec<String>> = clients
                .into_iter()
                .map(|(id, c)| {
                    vec![
                        id.to_string(),
                        c.addr,
                        c.user,
                        c.database,
                        c.application_name,
                        c.backend_pid.to_string(),
                        time(c.connected_at),
                        c.tls.unwrap_or_default(),
                        c.certificate_cn.unwrap_or_default(),
                    ]
                })
                .collect();
            table(
                out,
                &[
                    "id",
                    "addr",
                    "user",
                    "database",
                    "application_name",
                    "backend_pid",
                    "connected_at",
                    "tls",
                    "certificate_cn",
                ],
                &["id", "backend_pid"],
                &rows,
                "SHOW",
            );
        }
        Command::Servers => {
            let rows: Vec<Vec<String>> = shared
                .pool
                .list()
                .into_iter()
                .map(|s| {
                    vec![
                        s.info.backend_pid.to_string(),
                        s.info.user,
                        s.info.database,
                        s.info.application_name,
                        s.idle_for.as_secs().to_string(),
                        s.age.as_secs().to_string(),
                        s.info.tls.unwrap_or_default(),
                    ]
                })
                .collect();
            table(
                out,
                &[
                    "backend_pid",
                    "user",
                    "database",
                    "application_name",
                    "idle_seconds",
                    "age_seconds",
                    "tls",
                ],
                &["backend_pid", "idle_seconds", "age_seconds"],
                &rows,
                "SHOW",
            );
        }
        Command::Stats => {
            let s = &shared.stats;
            let rows: Vec<Vec<String>> = [
                ("clients_active", shared.active_sessions() as u64),
                ("clients_total", s.clients_total.load(Ordering::Relaxed)),
                ("queries", s.queries.get()),
                ("fence_checks", s.checks.get()),
                ("rejections", s.rejections.load(Ordering::Relaxed)),
                ("fast_rejections", s.fast_rejections.load(Ordering::Relaxed)),
                ("upstream_errors", s.upstream_errors.load(Ordering::Relaxed)),
                (
                    "read_audit_questions",
                    s.read_audit_questions.load(Ordering::Relaxed),
                ),
                ("servers_idle", shared.pool.idle_count() as u64),
                ("servers_reused", shared.pool.reused()),
            ]
            .iter()
            .map(|(k, v)| vec![k.to_string(), v.to_string()])
            .collect();
            table(out, &["stat", "value"], &["value"], &rows, "SHOW");
        }
        Command::Config => {
            let config = shared.config();
            let mut rows = Vec::new();
            if let Ok(value) = toml::Value::try_from(&*config) {
                flatten("", &value, &mut rows);
            }
            table(out, &["key", "value"], &[], &rows, "SHOW");
        }
        Command::Version => {
            let version = format!("pgfence {}", env!("CARGO_PKG_VERSION"));
            table(out, &["version"], &[], &[vec![version]], "SHOW");
        }
        Command::KillClient(id) => match shared.clients.get(&id) {
            Some(client) => {
                info!(
                    client_id = id,
                    client = %client.addr,
                    user = client.user.as_str(),
                    database = client.database.as_str(),
                    application_name = client.application_name.as_str(),
                    backend_pid = client.backend_pid,
                    admin,
                    "KILL_CLIENT: ending the session"
                );
                client.stop.kill_now();
                msg::write_message(out, b'C', |o| msg::put_cstr(o, b"KILL_CLIENT"));
            }
            None => error(
                out,
                "42704",
                &format!("no client with id {id}: SHOW CLIENTS lists the connected ones"),
            ),
        },
        Command::Reload => match shared.reload() {
            Ok(()) => msg::write_message(out, b'C', |o| msg::put_cstr(o, b"RELOAD")),
            Err(e) => error(out, "F0000", &e),
        },
    }
    msg::ready_for_query(out, b'I');
    Answer::Done
}

fn flatten(prefix: &str, value: &toml::Value, rows: &mut Vec<Vec<String>>) {
    match value {
        toml::Value::Table(t) => {
            for (k, v) in t {
                let key = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                flatten(&key, v, rows);
            }
        }
        toml::Value::String(s) => rows.push(vec![prefix.to_string(), s.clone()]),
        other => rows.push(vec![prefix.to_string(), other.to_string()]),
    }
}

fn time(t: SystemTime) -> String {
    humantime::format_rfc3339_millis(t).to_string()
}

fn error(out: &mut BytesMut, code: &str, message: &str) {
    msg::error_response(
        out,
        &ErrorMessage {
            severity: "ERROR",
            code,
            message,
            detail: None,
            hint: None,
        },
    );
}

/// Appends RowDescription, DataRows and CommandComplete. The columns named in `numbers`
/// are `int8` (an empty value there is NULL), so that scripts sort and compare them as
/// numbers, as PgBouncer's console types its counters; the others are `text`.
fn table(out: &mut BytesMut, columns: &[&str], numbers: &[&str], rows: &[Vec<String>], tag: &str) {
    const TEXT: u32 = 25;
    const INT8: u32 = 20;
    let numeric: Vec<bool> = columns.iter().map(|c| numbers.contains(c)).collect();
    msg::write_message(out, b'T', |o| {
        o.put_u16(columns.len() as u16);
        for (c, &number) in columns.iter().zip(&numeric) {
            msg::put_cstr(o, c.as_bytes());
            o.put_u32(0); // table oid
            o.put_u16(0); // column number
            if number {
                o.put_u32(INT8);
                o.put_i16(8);
            } else {
                o.put_u32(TEXT);
                o.put_i16(-1);
            }
            o.put_i32(-1);
            o.put_u16(0); // text format
        }
    });
    for row in rows {
        msg::write_message(out, b'D', |o| {
            o.put_u16(row.len() as u16);
            for (v, &number) in row
                .iter()
                .zip(numeric.iter().chain(std::iter::repeat(&false)))
            {
                if number && v.is_empty() {
                    o.put_i32(-1);
                } else {
                    o.put_i32(v.len() as i32);
                    o.put_slice(v.as_bytes());
                }
            }
        });
    }
    let tag = format!("{tag} {}", rows.len());
    msg::write_message(out, b'C', |o| msg::put_cstr(o, tag.as_bytes()));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commands_parse_loosely() {
        assert_eq!(Command::parse(b"show fences;").unwrap(), Command::Fences);
        assert_eq!(
            Command::parse(b"  SHOW   Rejections  ").unwrap(),
            Command::Rejections
        );
        assert_eq!(Command::parse(b"reload").unwrap(), Command::Reload);
        assert_eq!(Command::parse(b"").unwrap(), Command::Empty);
        assert_eq!(Command::parse(b"show version").unwrap(), Command::Version);
        assert_eq!(
            Command::parse(b"kill_client 17;").unwrap(),
            Command::KillClient(17)
        );
        assert!(Command::parse(b"KILL_CLIENT x")
            .unwrap_err()
            .contains("SHOW CLIENTS"));
        assert!(
            Command::parse(b"kill_client abc")
                .unwrap_err()
                .ends_with("not \"abc\""),
            "the id as written"
        );
        for bare in ["KILL_CLIENT", "kill_client 1 2"] {
            assert!(
                Command::parse(bare.as_bytes())
                    .unwrap_err()
                    .contains("one client id from SHOW CLIENTS"),
                "{bare}"
            );
        }
        assert!(Command::parse(b"DROP TABLE x")
            .unwrap_err()
            .contains("SHOW HELP"));
    }
}
