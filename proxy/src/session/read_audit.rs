//! Whether the session's database lets a read write (`fence.read_audit`).
//!
//! The classifier reads text: a statement it takes for a read may still write through the
//! schema (a view, row-level security policy, domain, operator, cast, ... that calls a
//! function of the database's own). When a client session starts, pgfence asks
//! `pgfence.reads_may_write(9)` (schema version 9; an event trigger keeps its verdict
//! current; 9 names this classifier, which takes field selection and a qualified name next
//! to a function in `FROM` for calls) and skips reads' checks only when the answer is
//! false. Until the answer comes every transaction is checked; the client gets its login's
//! ReadyForQuery only after it, so in practice no transaction runs before it.
//!
//! Where the function is missing (a schema older than version 9: an older one answers for
//! an older classifier, with `pgfence.reads_may_write()`), every transaction is checked,
//! and a WARN says so once per database. Where schema pgfence is missing (writes fail
//! there) or the user may not call the function (nor then the check), reads are skipped as
//! the classifier says, with a WARN. Any other failure (a `statement_timeout`, a lock
//! timeout) leaves the answer unknown, and the session checks reads. A database without
//! the schema or the function is not asked again for a minute (`state::READ_AUDIT_RETRY`):
//! each question would log an error on the server.

use tracing::{info, warn};

use crate::error::SessionError;
use crate::protocol::message as msg;

use crate::state::ReadAuditKnown;

use super::{Hold, Phase, Session};

/// Whether sessions under `config` ask the question (those with the fence on).
pub(super) fn asks(config: &pgfence_config::Config) -> bool {
    config.fence.skip_read_only && config.fence.read_audit
}

/// Errors that mean the database cannot answer, for want of the schema or of the right to
/// call the function: undefined schema, insufficient privilege. Reads skip the check as
/// the classifier says (the check would fail there too).
const NOT_ASKABLE: [&str; 2] = ["3F000", "42501"];

/// Undefined function: a schema older than version 9 (or the function dropped).
const OLD_SCHEMA: &str = "42883";

/// The question, as a simple Query: 9 is the schema version whose classifier this is (see
/// `pgfence.read_audit_objects(integer)` in fence-core's install script). A proxy of an
/// older version asks `pgfence.reads_may_write()`, which answers for its classifier.
pub(super) const QUERY: &[u8] = b"SELECT pgfence.reads_may_write(9)";

/// The answer to [`QUERY`], as its replies arrive.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) enum Answer {
    /// No reply with a value (yet).
    #[default]
    None,
    /// The function's result (NULL counts as true).
    MayWrite(bool),
    /// The server's error: SQLSTATE and message.
    Failed(String, String),
}

impl Answer {
    /// Takes one reply to [`QUERY`] before its ReadyForQuery; refuses anything a Query
    /// returning one row of one column does not send. (Notices and ParameterStatus are the
    /// caller's.)
    pub(super) fn on_reply(&mut self, tag: u8, frame: &[u8]) -> Result<(), SessionError> {
        match tag {
            b'T' | b'C' => {}
            b'D' => *self = Answer::MayWrite(msg::first_column(frame) != Some(b"f")),
            b'E' => {
                let fields = msg::error_fields(frame);
                *self = Answer::Failed(
                    String::from_utf8_lossy(fields.code).into_owned(),
                    String::from_utf8_lossy(fields.message).into_owned(),
                );
            }
            _ => return Err(SessionError::UnexpectedServerMessage(tag as char)),
        }
        Ok(())
    }
}

impl Session {
    /// Puts the answer in force: checks reads unless the database said they cannot write.
    pub(super) fn apply_read_audit(&mut self, answer: Answer) {
        self.read_audit_asked = false;
        if let Answer::MayWrite(may_write) = answer {
            self.shared
                .learn_read_audit(&self.database, ReadAuditKnown::MayWrite(may_write));
        }
        match answer {
            Answer::MayWrite(false) => self.tx.check_reads = false,
            Answer::MayWrite(true) | Answer::None => {
                self.tx.check_reads = true;
                if self.shared.first_report("reads may write", &self.database) {
                    info!(
                        database = %self.database,
                        "every transaction is checked in this database, reads too: its schema \
                         lets a read call a function of its own (SELECT * FROM \
                         pgfence.read_audit_objects() lists the objects)"
                    );
                }
            }
            // A schema older than version 9: it cannot answer for this classifier.
            Answer::Failed(code, message) if code == OLD_SCHEMA => {
                self.tx.check_reads = true;
                self.shared
                    .learn_read_audit(&self.database, ReadAuditKnown::OldSchema);
                self.warn_once(
                    "read audit failed",
                    &code,
                    &message,
                    format_args!(
                        "schema pgfence in this database is older than version 9 (no \
                         pgfence.reads_may_write(integer)): every transaction is checked, reads \
                         too, until `pgfence install --database {}` upgrades it",
                        self.database
                    ),
                );
            }
            // No schema to ask (writes fail there, and say so: `schema_missing`), or no right
            // to call the function (nor, then, the check; it depends on the user, not the
            // database): reads skip the check as the classifier says.
            Answer::Failed(code, message) if NOT_ASKABLE.contains(&code.as_str()) => {
                self.tx.check_reads = false;
                if code == "3F000" {
                    self.shared
                        .learn_read_audit(&self.database, ReadAuditKnown::NoFunction);
                } else {
                    self.warn_once(
                        "read audit failed",
                        &code,
                        &message,
                        format_args!(
                            "cannot ask whether reads may write in this database: reads skip \
                             the check as the classifier says, and one that writes through the \
                             schema commits unchecked; grant EXECUTE on pgfence's functions \
                             (`pgfence install --database {}` grants them to `fence.grant_to`)",
                            self.database
                        ),
                    );
                }
            }
            // Anything else (a statement_timeout, a lock, a conflict with recovery): the
            // answer is not known, so this session checks reads.
            Answer::Failed(code, message) => {
                self.tx.check_reads = true;
                self.warn_once(
                    "read audit unanswered",
                    &code,
                    &message,
                    format_args!(
                        "asking whether reads may write failed: this session checks every \
                         transaction, reads too (logged once per database)"
                    ),
                );
            }
        }
    }

    /// Logs `text` at WARN with the question's error, the first time for `what` in this
    /// database.
    fn warn_once(&self, what: &'static str, code: &str, error: &str, text: std::fmt::Arguments) {
        if self.shared.first_report(what, &self.database) {
            warn!(
                database = %self.database,
                sqlstate = %code,
                error = %error,
                "{text}"
            );
        }
    }

    /// Takes what another session of the database learnt lately, instead of asking: reads
    /// are checked where it said they may write or found the schema older than version 9
    /// (without the schema, they skip as the classifier says).
    pub(super) fn take_known_read_audit(&mut self, known: ReadAuditKnown) {
        if std::mem::take(&mut self.read_audit_asked) {
            self.tx.check_reads = matches!(
                known,
                ReadAuditKnown::MayWrite(true) | ReadAuditKnown::OldSchema
            );
        }
    }

    /// The server's ReadyForQuery ended the login: asks the question, holding that
    /// ReadyForQuery back, and what the client sends meanwhile, until the answer is in.
    pub(super) fn ask_read_audit(&mut self, ready: &[u8]) {
        msg::query(&mut self.to_server, QUERY);
        self.read_audit_ready = ready.to_vec();
        self.phase = Phase::ReadAudit;
        self.hold = Hold::Waiting;
    }

    /// A reply to the question asked at login. Its notices are pgfence's alone (a
    /// `log_statement` echo, say), but a FATAL error ends the session as the server's.
    pub(super) fn on_read_audit_frame(
        &mut self,
        tag: u8,
        frame: &[u8],
    ) -> Result<(), SessionError> {
        match tag {
            b'N' => {}
            b'S' => {
                self.on_parameter_status(frame)?;
                self.to_client.extend_from_slice(frame);
            }
            b'E' if matches!(msg::error_fields(frame).severity, b"FATAL" | b"PANIC") => {
                self.to_client.extend_from_slice(frame);
            }
            b'Z' => {
                if msg::ready_status(frame) != b'I' {
                    return Err(SessionError::UnexpectedServerMessage('Z'));
                }
                let answer = std::mem::take(&mut self.read_audit_answer);
                self.apply_read_audit(answer);
                let ready = std::mem::take(&mut self.read_audit_ready);
                self.phase = Phase::Auth;
                self.hold = Hold::None;
                self.on_auth_server_frame(b'Z', &ready)?;
            }
            _ => self.read_audit_answer.on_reply(tag, frame)?,
        }
        Ok(())
    }
}
