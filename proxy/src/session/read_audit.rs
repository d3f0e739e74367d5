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
//! The answer holds for `fence.read_audit_max_age` (a second). The first Query, Parse, Bind or
//! FunctionCall after that takes a newer answer another session of the database got, or
//! else checks reads and asks again, right then if nothing is in flight and no batch is
//! open, or at the first such message when that is so: the question goes before it, in a
//! transaction of its own ([`Verdict`]). Reads are checked until the answer is in. Not
//! before a message that uses the unnamed statement the client parsed earlier, which a
//! Query drops: before the client's next Query, a Parse of the unnamed statement, or any
//! of these once a Close of it or a Query has dropped it. After
//! the session's own `CREATE` or `ALTER` ([`Statement::changes_schema`]) its reads are
//! checked to its end, from that statement on (see `TxState::note_schema_change`).
//!
//! Where the function is missing (a schema older than version 9: an older one answers for
//! an older classifier, with `pgfence.reads_may_write()`), every transaction is checked,
//! and a WARN says so once per database. Where schema pgfence is missing (writes fail
//! there) or the user may not call the function (nor then the check), reads are skipped as
//! the classifier says, with a WARN. A failure that passes (a cancel, a `statement_timeout`,
//! a lock timeout, a serialization failure or deadlock) leaves the answer unknown for
//! `read_audit_max_age` (at least a second) from when it came, doubled for each such
//! failure in a row up to a minute: the session checks reads and then asks again. Any
//! other failure leaves it unknown for the session, which checks reads to its end. A
//! database without the schema or the function is not asked again for a minute
//! (`state::READ_AUDIT_RETRY`): each question would log an error on the server.

use std::time::Instant;

use tracing::{debug, info, warn};

use crate::cancel;
use crate::error::SessionError;
use crate::protocol::message as msg;

use crate::state::ReadAuditKnown;

use super::replies::{Injected, Origin, Request};
use super::tx::View;
use super::{CommitCheck, Flushed, Hold, Phase, Session};

#[cfg(doc)]
use fence_core::classify::Statement;

/// Nanoseconds on `CLOCK_MONOTONIC_COARSE` (a few milliseconds of resolution), read before
/// every Query, Parse, Bind and FunctionCall of a session that follows the audit:
/// `Instant::now()` there cost about 60 instructions more per message (callgrind, select-only
/// `-M prepared`).
#[inline]
fn coarse_now() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::MonotonicCoarse);
    u64::try_from(t.tv_sec)
        .unwrap_or(0)
        .saturating_mul(1_000_000_000)
        .saturating_add(u64::try_from(t.tv_nsec).unwrap_or(0))
}

/// Where the session stands with the read audit's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Verdict {
    /// Not asked again: the session does not ask (the fence off, `fence.read_audit` or
    /// `fence.skip_read_only` false), has not had its first answer yet, or had no verdict
    /// for an answer (no schema, an older one, a failure), which holds for the session.
    Fixed,
    /// The database's verdict, given at `learnt`, good until `fence.read_audit_max_age`
    /// after: until `expires` on the [coarse clock](coarse_now). Also a question that
    /// failed in a way that passes (`PASSING`), with reads checked, as if the answer had
    /// been true.
    Known { learnt: Instant, expires: u64 },
    /// Out of date: reads are checked until the session asks, when nothing is in flight
    /// and no batch is open.
    Due,
    /// The question, sent at `since`, is in flight (at the session's start, or again as
    /// [`Injected::ReadAudit`]); reads are checked until its answer is in.
    Asking { since: Instant },
    /// The database had no schema `pgfence` when asked at `learnt` (reads skip the check
    /// as the classifier says): asked again once the lack is no longer known (a check ran
    /// there, or `state::READ_AUDIT_RETRY` passed), so that a session opened before
    /// `pgfence install` follows the audit after it. Looked at again at `expires` on the
    /// [coarse clock](coarse_now).
    Missing { expires: u64 },
}

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

/// Errors that pass: query canceled (a client's cancel that came late, or a
/// `statement_timeout`), lock not available (the question's own `lock_timeout`, behind a
/// `pgfence install` or a `VACUUM FULL`), serialization failure, deadlock. Reads are
/// checked, and the question asked again once the failed answer is as old as an answer
/// may be.
const PASSING: [&str; 4] = ["57014", "55P03", "40001", "40P01"];

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
    /// `asked_at`: when the question was sent (the answer is as old as that: a question
    /// that waited, behind a lock or a `DEFERRABLE` snapshot, answers for the moment it
    /// started); `again`: the session asked again.
    pub(super) fn apply_read_audit(&mut self, answer: Answer, asked_at: Instant, again: bool) {
        self.read_audit_asked = false;
        let verdict = matches!(answer, Answer::MayWrite(_));
        let missing = matches!(&answer, Answer::Failed(code, _) if code == "3F000");
        if let Answer::MayWrite(may_write) = answer {
            self.shared.learn_read_audit(
                &self.database,
                ReadAuditKnown::MayWrite(may_write),
                asked_at,
            );
        }
        if self.tx.schema_changed {
            // The session's own DDL went after the question: its reads stay checked.
            self.verdict = Verdict::Fixed;
            return;
        }
        if let Answer::Failed(code, message) = &answer {
            if PASSING.contains(&code.as_str()) {
                // Reads checked until the question, asked again, gets through. Counted from
                // the failure, not the question: one that waited out its `lock_timeout`
                // would be out of date at once, and every statement behind the lock would
                // wait a second for the next question.
                self.tx.check_reads = true;
                let wait = self.read_audit_retry_after_failure();
                self.verdict = Verdict::Known {
                    learnt: asked_at,
                    expires: coarse_now()
                        .saturating_add(u64::try_from(wait.as_nanos()).unwrap_or(u64::MAX)),
                };
                debug!(
                    database = self.database.as_str(),
                    sqlstate = %code,
                    error = %message,
                    retry_in = ?wait,
                    "the read audit's question failed: reads are checked until it is asked again"
                );
                return;
            }
        }
        self.read_audit_failures = 0;
        if again && !verdict && !missing {
            // Answered at the start, not now: the session's role may have changed (`SET
            // ROLE` to one without EXECUTE), or its settings (a `statement_timeout`), or
            // the schema. Whatever it was, reads stay checked: a check that cannot run
            // fails the read, where skipping it could let a write through.
            self.tx.check_reads = true;
            self.verdict = Verdict::Fixed;
            let (code, message) = match &answer {
                Answer::Failed(code, message) => (code.as_str(), message.as_str()),
                _ => ("", "no answer"),
            };
            self.warn_once(
                "read audit unanswered again",
                code,
                message,
                format_args!(
                    "asking again whether reads may write failed: this session checks every \
                     transaction from now on, reads too (logged once per database)"
                ),
            );
            return;
        }
        self.verdict = if verdict {
            Verdict::Known {
                learnt: asked_at,
                expires: self.read_audit_expiry(asked_at),
            }
        } else if missing {
            Verdict::Missing {
                expires: self.read_audit_expiry(asked_at),
            }
        } else {
            Verdict::Fixed
        };
        match answer {
            Answer::MayWrite(false) => self.tx.check_reads = false,
            Answer::MayWrite(true) | Answer::None => {
                self.tx.check_reads = true;
                if self.shared.first_report("reads may write", &self.database) {
                    info!(
                        database = self.database.as_str(),
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
                    .learn_read_audit(&self.database, ReadAuditKnown::OldSchema, asked_at);
                self.warn_once(
                    "read audit failed",
                    &code,
                    &message,
                    format_args!(
                        "schema pgfence in this database is older than version 9 (no \
                         pgfence.reads_may_write(integer)): every transaction is checked, reads \
                         too, until `pgfence install --database {:?}` upgrades it",
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
                    self.shared.learn_read_audit(
                        &self.database,
                        ReadAuditKnown::NoFunction,
                        asked_at,
                    );
                } else {
                    self.warn_once(
                        "read audit failed",
                        &code,
                        &message,
                        format_args!(
                            "cannot ask whether reads may write in this database: reads skip \
                             the check as the classifier says, and one that writes through the \
                             schema commits unchecked; grant EXECUTE on pgfence's functions \
                             (`pgfence install --database {:?}` grants them to `fence.grant_to`)",
                            self.database
                        ),
                    );
                }
            }
            // Anything else (an error inside the function, say): the
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
                database = self.database.as_str(),
                sqlstate = %code,
                error = %error,
                "{text}"
            );
        }
    }

    /// Takes what another session of the database learnt lately, instead of asking: reads
    /// are checked where it said they may write or found the schema older than version 9
    /// (without the schema, they skip as the classifier says).
    pub(super) fn take_known_read_audit(&mut self, learnt: Instant, known: ReadAuditKnown) {
        if std::mem::take(&mut self.read_audit_asked) {
            self.tx.check_reads = matches!(
                known,
                ReadAuditKnown::MayWrite(true) | ReadAuditKnown::OldSchema
            );
            let expires = self.read_audit_expiry(learnt);
            match known {
                ReadAuditKnown::MayWrite(_) => self.verdict = Verdict::Known { learnt, expires },
                ReadAuditKnown::NoFunction => self.verdict = Verdict::Missing { expires },
                ReadAuditKnown::OldSchema => {}
            }
        }
    }

    /// Before a client's Query, Parse, Bind or FunctionCall: asks the question again where
    /// the answer is out of date (see the module documentation). `may_ask`: a Query sent
    /// now drops nothing of the client's (see `Session::unnamed_statement_alive`).
    #[inline]
    pub(super) fn refresh_read_audit(&mut self, may_ask: bool) {
        match self.verdict {
            Verdict::Fixed | Verdict::Asking { .. } => {}
            _ if self.tx.schema_changed => self.verdict = Verdict::Fixed,
            Verdict::Known { learnt, expires } => {
                if coarse_now() >= expires {
                    self.read_audit_out_of_date(learnt, may_ask);
                }
            }
            Verdict::Missing { expires } => {
                if coarse_now() >= expires {
                    self.read_audit_missing_again(may_ask);
                }
            }
            Verdict::Due if may_ask => self.ask_read_audit_if_quiet(),
            Verdict::Due => {}
        }
    }

    /// The answer learnt at `learnt` is out of date: takes a newer one another session got,
    /// or else asks.
    #[cold]
    fn read_audit_out_of_date(&mut self, learnt: Instant, may_ask: bool) {
        if let Some((at, ReadAuditKnown::MayWrite(may_write))) = self
            .shared
            .known_read_audit(&self.database, self.read_audit_max_age)
        {
            if at > learnt {
                self.tx.check_reads = may_write;
                self.verdict = Verdict::Known {
                    learnt: at,
                    expires: self.read_audit_expiry(at),
                };
                return;
            }
        }
        self.read_audit_due(may_ask);
    }

    /// How long reads are checked before the question is asked again, after it failed in a
    /// way that passes: `read_audit_max_age` (at least a second), doubled for each such
    /// failure in a row, up to `state::READ_AUDIT_RETRY`.
    fn read_audit_retry_after_failure(&mut self) -> std::time::Duration {
        let base = self
            .read_audit_max_age
            .max(std::time::Duration::from_secs(1));
        let doublings = self.read_audit_failures.min(6);
        self.read_audit_failures = self.read_audit_failures.saturating_add(1);
        (base * (1 << doublings)).min(crate::state::READ_AUDIT_RETRY)
    }

    /// When an answer to a question sent at `asked_at` is out of date, on the coarse clock.
    fn read_audit_expiry(&self, asked_at: Instant) -> u64 {
        let left = self.read_audit_max_age.saturating_sub(asked_at.elapsed());
        coarse_now().saturating_add(u64::try_from(left.as_nanos()).unwrap_or(u64::MAX))
    }

    /// When the question in flight was sent.
    pub(super) fn question_sent_at(&self) -> Instant {
        match self.verdict {
            Verdict::Asking { since } => since,
            _ => Instant::now(),
        }
    }

    /// The database had no schema `pgfence` a while ago: asks again once that is no longer
    /// known, and checks reads until the answer (mostly a check ran there since, so the
    /// schema is back; if not, the read checked meanwhile fails for want of it, as writes
    /// do there).
    #[cold]
    fn read_audit_missing_again(&mut self, may_ask: bool) {
        if let Some((_, ReadAuditKnown::NoFunction)) = self
            .shared
            .known_read_audit(&self.database, self.read_audit_max_age)
        {
            self.verdict = Verdict::Missing {
                expires: self.read_audit_expiry(Instant::now()),
            };
            return;
        }
        self.read_audit_due(may_ask);
    }

    /// The session has no answer it may act on: reads are checked until it has asked, now
    /// if it may.
    fn read_audit_due(&mut self, may_ask: bool) {
        self.tx.check_reads = true;
        self.verdict = Verdict::Due;
        if may_ask {
            self.ask_read_audit_if_quiet();
        }
    }

    /// Sends the question, in a transaction of its own before the client's message being
    /// handled, when nothing is in flight, no block is open and no batch of the client's
    /// has begun (a Query there would end the batch's implicit transaction, and drop its
    /// unnamed statement).
    fn ask_read_audit_if_quiet(&mut self) {
        let quiet = self.tx.view == View::Idle
            && self.replies.is_empty()
            && !self.batch_open
            && !self.tx.batch_has_execute
            && self.commit_check == CommitCheck::None
            && self.hold == Hold::None
            && self.flushed == Flushed::No;
        if quiet {
            self.cancels.asking();
            msg::query(&mut self.to_server, QUERY);
            self.replies
                .push(Request::Query, Origin::Injected(Injected::ReadAudit));
            self.read_audit_answer = Answer::None;
            self.verdict = Verdict::Asking {
                since: Instant::now(),
            };
            self.shared.count_read_audit_question();
        }
    }

    /// The question is answered: a client's cancel that came meanwhile, held so as not to
    /// cancel the question (see `crate::cancel`), is forwarded now. It counts as in flight
    /// from here, so the client's next messages wait for it, as for any cancel.
    pub(super) fn question_answered(&self) {
        let Some(counted) = self.cancels.answered() else {
            return;
        };
        let Some(target) = self
            .client_key
            .and_then(|(pid, key)| self.shared.cancel.lookup(pid, key))
        else {
            return;
        };
        debug!(
            backend_pid = target.pid,
            "forwarding the cancel request held for the read audit's question"
        );
        let limit = self.shared.config().limits.connect_timeout;
        let forward = cancel::forward_counted(counted, target, limit);
        tokio::spawn(async move {
            if let Err(e) = forward.await {
                warn!(error = %e, "cannot forward cancel request to upstream");
            }
        });
    }

    /// The server's ReadyForQuery ended the login: asks the question, holding that
    /// ReadyForQuery back, and what the client sends meanwhile, until the answer is in.
    pub(super) fn ask_read_audit(&mut self, ready: &[u8]) {
        self.cancels.asking();
        msg::query(&mut self.to_server, QUERY);
        self.shared.count_read_audit_question();
        self.verdict = Verdict::Asking {
            since: Instant::now(),
        };
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
                self.question_answered();
                let answer = std::mem::take(&mut self.read_audit_answer);
                let asked_at = self.question_sent_at();
                self.apply_read_audit(answer, asked_at, false);
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
