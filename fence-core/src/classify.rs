//! Splits a query string into statements and classifies each one, conservatively, in one
//! pass of the [`lexer`](crate::lexer); the fencing directives of its comments are
//! collected on the way.
//!
//! Safety never depends on this (SPEC section 3): the database decides whether a
//! transaction wrote. The classification only lets the proxy skip the check for statements
//! that provably cannot write, find the statements that end a transaction (the check goes
//! right before them) or cannot run inside one, and reject known-stale writes early.
//! Anything it does not recognise is [`StatementKind::MayWrite`].
//!
//! # Splitting
//!
//! Statements end at a top-level `;`: not inside comments, literals, quoted identifiers,
//! dollar-quoted bodies or parentheses, and not inside the `BEGIN ATOMIC ... END` body of
//! `CREATE [OR REPLACE] FUNCTION|PROCEDURE` (the same rule as psql). Segments holding only
//! white space and comments are not statements; their directives go to the statement
//! before them (or after, if there is none before).
//!
//! # What is `ReadOnly`, and why that is safe
//!
//! A statement is [`StatementKind::ReadOnly`] only when it cannot assign a transaction id:
//! - `SELECT`, `VALUES`, `TABLE`, `WITH ...` and a parenthesised `(SELECT ...)`, and
//!   `DECLARE ... CURSOR FOR` such a query, when the text has
//!   - no function call other than the built-in, side-effect-free functions listed in
//!     `classify/words.rs`, unqualified or qualified with `pg_catalog` (`name(` is a call
//!     unless the grammar makes it something else: a keyword such as `IN (` or `OVER (`, a
//!     type modifier after `::` or `AS`, a column list after `AS` or of a `WITH` query);
//!   - no field selection (`(expr).name`, `$1.name`, `a[1].name`: attribute notation
//!     calls `name(expr)` for a function `name` of one argument of any type), and not
//!     both a qualified name and a function in a `SELECT`'s `FROM` clause (its alias is
//!     a scalar, so `g.name` calls `name(g)`; a call in an `ON` condition counts too);
//!   - no `INTO` (`SELECT INTO` creates a table);
//!   - no `INSERT`, `UPDATE`, `DELETE` or `MERGE` anywhere (data-modifying `WITH`);
//!   - no locking clause (`FOR UPDATE`, `FOR NO KEY UPDATE`, `FOR SHARE`, `FOR KEY SHARE`:
//!     row locks take a transaction id).
//! - `SHOW`, `SET`, `RESET`, `LISTEN`, `UNLISTEN`, `CLOSE`: session state only.
//! - `EXPLAIN` without `ANALYZE`/`ANALYSE` (it only plans) of a `SELECT`, `VALUES`, `TABLE`
//!   or `WITH` query that is `ReadOnly` by the rules above (the planner may run immutable
//!   functions, which write only if a user's immutable function lies; see below). Of anything else (`INSERT`, `EXECUTE`, `CREATE TABLE ... AS`) it is
//!   `MayWrite` whatever the options, since PostgreSQL takes a quoted identifier for an
//!   option name too (`EXPLAIN ("analyze") INSERT ...` runs the insert).
//! - `PREPARE name AS` a query that is `ReadOnly` by the rules above.
//! - `COPY table [(columns)] TO STDOUT` and `COPY (query) TO STDOUT` with a query that is
//!   `ReadOnly` by the rules above (parentheses outside the query hold columns or options,
//!   never calls).
//!
//! `FETCH` and `MOVE` run a query classified elsewhere and are `MayWrite`, as are `NOTIFY`, `COPY ... FROM`, `COPY ... TO` a file or program, `LOCK`, `ANALYZE` and
//! everything not listed. `EXECUTE` is [`StatementKind::Execute`]: the statement it runs
//! may be transaction control.
//!
//! Known limitations, inherent in classifying text (the proxy's switch that turns
//! read-skipping off covers them): the text does not show that a view, a row-level security
//! policy, a domain's `CHECK` constraint, a user-defined operator, cast (implicit ones too,
//! and those built-ins such as `to_json` apply), aggregate, operator class or type input
//! function, a function called with attribute notation on a relation's whole row
//! (`t.full_name`, which the text cannot tell from a column), a user function
//! that overloads or shadows a listed name (through `search_path`), or an `IMMUTABLE`
//! function the planner folds for a plain `EXPLAIN` writes. So `ReadOnly` is a claim about
//! the text, which holds only for schemas without such objects (README, known
//! limitations; each was verified to let a stale write commit, 2026-12-06). The lexer's assumptions (standard-conforming strings
//! unless told otherwise, an ASCII-safe client encoding) apply too.

use std::ops::{Deref, DerefMut, Range};

use crate::directive::{self, Directive};
use crate::lexer::{LexOptions, Lexer, TokKind};

use scan::Scan;

mod scan;
mod words;

pub use words::INFIX_KEYWORDS;

/// What a statement does, as far as fencing cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StatementKind {
    /// Only white space and comments. Never in [`Analysis::statements`].
    Empty,
    /// Provably cannot write (see the module documentation).
    ReadOnly,
    /// Anything else: may write, directly or through functions.
    MayWrite,
    /// `BEGIN [WORK|TRANSACTION] ...`, `START TRANSACTION ...`.
    Begin,
    /// `COMMIT`/`END [WORK|TRANSACTION] [AND [NO] CHAIN]` (not `COMMIT PREPARED`).
    Commit,
    /// `ROLLBACK`/`ABORT` (not `ROLLBACK TO SAVEPOINT`, not `ROLLBACK PREPARED`).
    Rollback,
    /// `ROLLBACK [WORK|TRANSACTION] TO [SAVEPOINT] name`.
    RollbackToSavepoint,
    /// `SAVEPOINT name`, `RELEASE [SAVEPOINT] name`.
    Savepoint,
    /// `PREPARE TRANSACTION 'gid'`: ends the transaction, so it is checked before it.
    PrepareTransaction,
    /// Cannot run in a transaction block, or commits internally, so it cannot be fenced
    /// atomically: `VACUUM`, `CREATE`/`DROP DATABASE`, `CREATE`/`DROP TABLESPACE`,
    /// `ALTER SYSTEM`, `CREATE`/`DROP INDEX CONCURRENTLY`, every `REINDEX`, `CLUSTER` and
    /// `ANALYZE` (outside a block each commits a transaction per relation where it acts on
    /// several, a partitioned table's partitions say), `CALL`, `ALTER DATABASE ... SET
    /// TABLESPACE`, `CREATE`/`DROP SUBSCRIPTION`, `ALTER SUBSCRIPTION ... PUBLICATION`,
    /// `ALTER TABLE ... DETACH PARTITION ... CONCURRENTLY`.
    NonTransactional,
    /// `COMMIT PREPARED 'gid'`, `ROLLBACK PREPARED 'gid'`: finishes a transaction that was
    /// checked at its `PREPARE TRANSACTION`, and writes nothing of its own, so it is not
    /// checked again. (Checked before it, in a transaction of its own as a
    /// `NonTransactional` statement is, the check would wait for the locks the prepared
    /// transaction holds on its fences until the very `COMMIT PREPARED` it holds back.)
    /// Cannot run in a transaction block.
    FinishPrepared,
    /// `DISCARD ALL`, `DISCARD PLANS`, `DEALLOCATE ...`: drops prepared statements, so the
    /// proxy must prepare its own again. (`DISCARD ALL` also cannot run in a transaction
    /// block; its only writes are to the session's temporary objects.)
    Discard,
    /// `EXECUTE name`: runs a prepared statement its text does not show, which may be
    /// anything. One prepared through the extended protocol may be transaction control
    /// (`EXECUTE c` of a `COMMIT` commits), so it may write and may end the transaction,
    /// and a check goes before it as before a `COMMIT`. The proxy gives this kind to an
    /// extended-protocol Execute of a portal it does not know, too.
    Execute,
}

impl StatementKind {
    /// Whether the statement may write to the database: `MayWrite`, `NonTransactional` or
    /// `Execute`.
    pub fn may_write(self) -> bool {
        matches!(
            self,
            StatementKind::MayWrite | StatementKind::NonTransactional | StatementKind::Execute
        )
    }

    /// Whether the statement starts, ends or nests a transaction, or may: `Begin`,
    /// `Commit`, `Rollback`, `RollbackToSavepoint`, `Savepoint`, `PrepareTransaction`,
    /// `Execute`.
    pub fn is_tx_control(self) -> bool {
        matches!(
            self,
            StatementKind::Begin
                | StatementKind::Commit
                | StatementKind::Rollback
                | StatementKind::RollbackToSavepoint
                | StatementKind::Savepoint
                | StatementKind::PrepareTransaction
                | StatementKind::Execute
        )
    }

    /// Whether the statement ends the transaction (the check goes before `Commit` and
    /// `PrepareTransaction`).
    pub fn ends_transaction(self) -> bool {
        matches!(
            self,
            StatementKind::Commit | StatementKind::Rollback | StatementKind::PrepareTransaction
        )
    }

    /// Whether the statement ends, or may end, the transaction: those that
    /// [`ends_transaction`](Self::ends_transaction), and `Execute`, whose prepared statement
    /// may be a `COMMIT`.
    pub fn may_end_transaction(self) -> bool {
        self.ends_transaction() || self == StatementKind::Execute
    }
}

/// One statement of a query string.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Statement {
    /// Byte offset of its first token (a leading comment included).
    pub start: usize,
    /// Byte offset just past its last token: excludes the `;` and trailing white space.
    pub end: usize,
    pub kind: StatementKind,
    /// Its directives: indices into [`Analysis::directives`].
    pub directives: Range<usize>,
    /// Alone in a Query, it does something else in a transaction block than outside one
    /// (and the Query's implicit block counts as one when it holds other statements):
    /// `LOCK` and `DECLARE` of a cursor without `WITH HOLD` fail outside a block
    /// (PostgreSQL's `RequireTransactionBlock`; the savepoint commands have kinds of their
    /// own), `SET LOCAL`, `SET TRANSACTION` and `SET CONSTRAINTS` only warn there
    /// (`WarnNoTransactionBlock`), and `DISCARD ALL` fails inside one
    /// (`PreventInTransactionBlock`, like the [`StatementKind::NonTransactional`] ones).
    pub block_sensitive: bool,
    /// SQL `PREPARE name ...` (not `PREPARE TRANSACTION`): it replaces the prepared
    /// statement of that name, the extended protocol's too (its name follows `PREPARE`).
    pub prepares_in_sql: bool,
    /// `DO` and `CALL`: run by an Execute outside a transaction block, PostgreSQL runs them
    /// non-atomic, so a `COMMIT` inside commits what was written until then, before the
    /// check at the Sync, and with it what the batch's earlier Executes wrote (`CALL` is
    /// also [`StatementKind::NonTransactional`]: a Query of it alone is checked first, in a
    /// transaction of its own).
    pub may_commit_inside: bool,
    /// Always refused in a transaction block, and committed as soon as it has run, in the
    /// one transaction it ran in (`PreventInTransactionBlock`: `DISCARD ALL`, `CREATE
    /// DATABASE`, `ALTER SYSTEM`, ...): an Execute of it leaves no pipelined transaction
    /// behind. Not `CALL`, `ANALYZE`, `REINDEX` or `CLUSTER` (a block may hold them), nor a
    /// statement that commits transactions of its own as it runs (`VACUUM`, `CREATE`/`DROP
    /// INDEX CONCURRENTLY`, ...: PostgreSQL forgets there that it was to commit at once,
    /// and the batch's next statement is pipelined, a `VACUUM` Query after it refused
    /// "within a pipeline"), nor the subscription commands (refused in a block only with
    /// some options).
    pub commits_at_once: bool,
    /// `ANALYZE`, `REINDEX` or `CLUSTER` without `CONCURRENTLY`: [`StatementKind::
    /// NonTransactional`] for what it does outside a block (a transaction per relation), it
    /// runs in the one it is in when pipelined. Where it cannot be checked first in a
    /// transaction of its own, it is checked right before it, in its transaction, which
    /// pipelines it (a `VACUUM` or a `CONCURRENTLY` statement would then be refused).
    pub runs_in_block: bool,
    /// `CREATE` or `ALTER` of an object that may give a read a way to call a function of
    /// the database's own (a view, a function, a policy, a rule, a cast, ...): any but
    /// `CREATE SEQUENCE`, a `CREATE TABLE` without `CHECK`, `EXCLUDE`, `INHERITS` or
    /// `PARTITION`, and a `CREATE INDEX` without an expression or `WHERE`. After it, the
    /// proxy checks the session's reads to its end (the read audit's answer may no longer
    /// hold, and leaves the session's temporary objects out).
    pub changes_schema: bool,
}

impl Statement {
    /// The statement's text in `sql` (the string it was found in).
    pub fn text<'a>(&self, sql: &'a [u8]) -> &'a [u8] {
        &sql[self.start..self.end]
    }
}

/// The statements of a query string, in order. Dereferences to a slice; a query with one
/// statement (the usual case) does not allocate.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Statements {
    /// The only statement while there is one.
    first: Option<Statement>,
    /// All statements once there are two or more.
    all: Vec<Statement>,
}

impl Statements {
    fn push(&mut self, statement: Statement) {
        if self.all.is_empty() {
            match self.first.take() {
                None => {
                    self.first = Some(statement);
                    return;
                }
                Some(first) => self.all.push(first),
            }
        }
        self.all.push(statement);
    }

    fn last_mut(&mut self) -> Option<&mut Statement> {
        match self.all.last_mut() {
            Some(last) => Some(last),
            None => self.first.as_mut(),
        }
    }
}

impl Deref for Statements {
    type Target = [Statement];

    fn deref(&self) -> &[Statement] {
        match &self.first {
            Some(first) => std::slice::from_ref(first),
            None => &self.all,
        }
    }
}

impl DerefMut for Statements {
    fn deref_mut(&mut self) -> &mut [Statement] {
        match &mut self.first {
            Some(first) => std::slice::from_mut(first),
            None => &mut self.all,
        }
    }
}

/// Everything the proxy needs to know about one query string.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Analysis {
    /// The non-empty statements, in order.
    pub statements: Statements,
    /// The directives of all comments, in order (see [`directive`]).
    pub directives: Vec<Directive>,
    /// Whether the session's `fencing.*` settings may have changed: an identifier, quoted
    /// identifier or literal mentions `fencing` (any case) or `set_config`, or a quoted one
    /// holds a backslash or is a `U&` one (an escape could spell either), or a statement is `RESET ALL` or
    /// `DISCARD ALL`. Over-reports. A hint, not a guarantee: a function can call
    /// `set_config` too. Transaction control that undoes a `SET` or ends a `SET LOCAL`
    /// shows in the statement kinds instead.
    pub mentions_fencing: bool,
    /// A statement [`Statement::prepares_in_sql`].
    pub prepares_in_sql: bool,
    /// The text ended inside a `BEGIN ATOMIC` body of `CREATE FUNCTION|PROCEDURE`: its
    /// `CASE` and `END` words did not balance. PostgreSQL rejects such a body, so the count
    /// was wrong (a column label `case` the grammar allows, say), and where the statements
    /// end is not known: a `COMMIT` may hide after the body (a review, 2026-12-07). The
    /// proxy refuses such a Query.
    pub body_in_doubt: bool,
}

impl Analysis {
    /// Whether any statement may write.
    pub fn may_write(&self) -> bool {
        self.statements.iter().any(|s| s.kind.may_write())
    }

    /// Whether a statement is [`Statement::may_commit_inside`].
    pub fn may_commit_inside(&self) -> bool {
        self.statements.iter().any(|s| s.may_commit_inside)
    }

    /// Whether any statement is transaction control (see [`StatementKind::is_tx_control`]).
    pub fn tx_control(&self) -> bool {
        self.statements.iter().any(|s| s.kind.is_tx_control())
    }

    /// Whether any statement is [`StatementKind::NonTransactional`].
    pub fn non_transactional(&self) -> bool {
        self.statements
            .iter()
            .any(|s| s.kind == StatementKind::NonTransactional)
    }

    /// Whether any statement is [`StatementKind::Discard`].
    pub fn discards(&self) -> bool {
        self.statements
            .iter()
            .any(|s| s.kind == StatementKind::Discard)
    }

    /// Whether the query has no statements at all (an empty query).
    pub fn is_empty(&self) -> bool {
        self.statements.is_empty()
    }

    /// The directives in the comments of `statement`.
    pub fn directives_of(&self, statement: &Statement) -> &[Directive] {
        &self.directives[statement.directives.clone()]
    }
}

/// Analyses `sql` assuming `standard_conforming_strings = on`.
pub fn analyze(sql: &[u8]) -> Analysis {
    analyze_with(sql, LexOptions::default())
}

/// Analyses `sql` lexed with the session's settings.
pub fn analyze_with(sql: &[u8], options: LexOptions) -> Analysis {
    analyze_impl(sql, options, true)
}

/// [`analyze_with`]; `skip` lets a statement whose first word decided its kind skip plain
/// tokens, and a query keep only what its kind depends on (the tests compare both with
/// the full token-by-token walk).
#[inline(always)]
fn analyze_impl(sql: &[u8], options: LexOptions, skip: bool) -> Analysis {
    let mut out = Analysis::default();
    // Where the directives of comment-only segments before the first statement begin.
    let mut orphans_from = None;
    let mut scan = Scan::new(sql, 0);
    let mut lexer = Lexer::with_options(sql, options);
    while let Some(tok) = lexer.next() {
        match tok.kind {
            TokKind::Comment { block } => {
                directive::from_comment(tok.text(sql), block, &mut out.directives);
                scan.extend(tok);
                continue;
            }
            TokKind::Semicolon if scan.at_top_level() => {
                out.end_segment(&mut scan, &mut orphans_from);
                continue;
            }
            _ => {}
        }
        if !out.mentions_fencing {
            out.mentions_fencing = mentions_fencing(tok.kind, tok.text(sql));
        }
        if skip && scan.is_query() {
            scan.feed_query(tok);
            continue;
        }
        scan.feed(tok);
        if skip && scan.head_decides() {
            // Only where the statement ends and what its comments say matter now: plain
            // tokens are skipped without being made (see `Lexer::skip_plain`).
            let mentions = &mut out.mentions_fencing;
            let skipped = lexer.skip_plain(|text| {
                if !*mentions {
                    *mentions = ends_a_fencing_word(text);
                }
            });
            if let Some(end) = skipped {
                scan.extend_to(end);
            }
        }
    }
    out.end_segment(&mut scan, &mut orphans_from);
    out
}

impl Analysis {
    /// Adds the statement of a segment, or hands the directives of a comment-only segment
    /// to the statement before it (or, before the first statement, after it).
    /// Resets `segment` for the next one.
    fn end_segment(&mut self, segment: &mut Scan<'_>, orphans_from: &mut Option<usize>) {
        let from = segment.directives_from;
        self.mentions_fencing |= segment.resets_all_settings();
        self.body_in_doubt |= segment.in_atomic_body();
        let statement = segment.finish(self.directives.len());
        self.prepares_in_sql |= statement.as_ref().is_some_and(|s| s.prepares_in_sql);
        segment.reset(self.directives.len());
        match statement {
            Some(mut statement) => {
                if let Some(orphans) = orphans_from.take() {
                    statement.directives.start = orphans;
                }
                self.statements.push(statement);
            }
            None => match self.statements.last_mut() {
                Some(last) => last.directives.end = self.directives.len(),
                None => {
                    orphans_from.get_or_insert(from);
                }
            },
        }
    }
}

/// See [`Analysis::mentions_fencing`]. One pass over the token: both words end in `g`, so
/// it stops only at a `g` (any case) far enough in to end one, and at `\\` in quoted text
/// (`b | 0x20` folds case, and maps `\\` to `|`).
#[inline]
fn mentions_fencing(kind: TokKind, text: &[u8]) -> bool {
    const FENCING: &[u8] = b"fencing";
    let escapes = match kind {
        TokKind::Ident if text.len() < FENCING.len() => return false,
        TokKind::Ident => false,
        TokKind::QuotedIdent | TokKind::String => true,
        _ => return false,
    };
    // `U&'...'` and `U&"..."` may spell anything with an escape character of their
    // `UESCAPE`, not only with `\\` (a review: `SET U&"!0066encing.token" UESCAPE '!'`).
    if escapes && text.get(1) == Some(&b'&') {
        return true;
    }
    // An identifier has no `\\`: its first `g` that matters is the seventh byte.
    let mut from = if escapes { 0 } else { FENCING.len() - 1 };
    while let Some(n) = text
        .get(from..)
        .and_then(|t| t.iter().position(|&b| matches!(b | 0x20, b'g' | b'|')))
    {
        let at = from + n;
        let found = match text[at] {
            b'g' | b'G' => ends_a_fencing_word(&text[..=at]),
            b'\\' => escapes,
            _ => false,
        };
        if found {
            return true;
        }
        from = at + 1;
    }
    false
}

/// Whether `text` ends with `fencing` or `set_config`, ignoring ASCII case (both end in
/// `g`: see [`mentions_fencing`] and `Lexer::skip_plain`).
#[inline]
fn ends_a_fencing_word(text: &[u8]) -> bool {
    let ends = |word: &[u8]| {
        text.len() >= word.len() && text[text.len() - word.len()..].eq_ignore_ascii_case(word)
    };
    ends(b"fencing") || ends(b"set_config")
}

#[cfg(test)]
mod tests;
