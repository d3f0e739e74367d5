//! What is fenced and how, end to end through pgfence with tokio-postgres (simple and
//! extended protocol) and psql, against a real PostgreSQL. One cluster per test.
//!
//! - [`hidden_writes_are_fenced`]: writes in a function called from `SELECT`, a DO block, a
//!   data-modifying CTE and a trigger are rejected with a stale token and accepted with the
//!   current one (SPEC section 3: the database decides what wrote).
//! - [`a_cursor_with_hold_is_checked_for_what_it_writes_at_commit`]: a `DECLARE ... WITH
//!   HOLD` whose query writes when the transaction commits (after the check) is checked as
//!   a write: stale FN001, missing FN002, nothing written; the current token writes.
//! - [`a_do_block_that_commits_inside_is_checked_before_it_runs`]: over the extended
//!   protocol (non-atomic there), alone and behind an INSERT of its batch: stale FN001,
//!   nothing written; the current token writes.
//! - [`text_pipelined_behind_a_change_of_client_encoding_is_not_misread`]: behind a switch
//!   to SJIS in flight, `E'表'` (second byte `\`) cannot hide a stale write.
//! - [`a_comment_token_stays_in_its_transaction`]: not applied to another transaction of
//!   its Query, to what is pipelined behind it, or after `COMMIT AND CHAIN`.
//! - [`writes_the_classifier_once_took_for_reads_are_checked`]: `EXPLAIN` with a quoted
//!   `"analyze"`, a function with a column definition list after a comma, a 17 keyword
//!   that is a function name on 15, `ORDER BY rollup(`: each is checked.
//! - [`reads_do_not_pay`]: reads with a stale token are not rejected and cost no check.
//! - [`reads_that_write_through_the_schema_are_checked`] and
//!   [`the_read_audit_follows_the_schema`]: in a database whose schema lets a read call a
//!   function of its own (a domain, an operator, an overload, a view), reads are checked.
//! - [`a_question_that_timed_out_is_asked_again`]: a read audit question that failed in a
//!   way that passes (57014) checks reads for a second, then is asked again.
//! - [`missing_token_policy`]: FN002 for a resource that requires a token, a comment naming
//!   another resource adds it to the default one (a session's own replaces it), `allow` lets
//!   the write through, an unfenced session is not checked, a token without a resource is
//!   FN003.
//! - [`conflicting_and_malformed_tokens`]: two comment tokens for one resource in one
//!   transaction, malformed tokens and resources from every source: FN003; a comment token
//!   overrides the session token.
//! - [`tokens_in_literals_do_not_count`]: `fencing_token` inside string literals, dollar
//!   quotes, quoted identifiers and a DO body is not a directive.
//! - [`session_settings_follow_postgresql`]: `SET LOCAL` ends with its transaction, a `SET`
//!   rolled back is undone, `RESET` and `set_config()` work, `SHOW fencing.token` works.
//! - [`commit_of_failed_transaction_is_untouched`]: a transaction that failed before its
//!   COMMIT is not checked; psql's output is byte for byte what PostgreSQL gives.
//! - [`prepare_transaction_is_checked`]: `PREPARE TRANSACTION` is checked like COMMIT.
//! - [`non_transactional_statements_are_prechecked`]: VACUUM, CALL (a procedure that
//!   commits inside) and CREATE INDEX CONCURRENTLY get the check in a transaction of their
//!   own first: a stale token stops them before they run.
//! - [`a_bind_that_wrote_is_checked_before_what_commits_at_once`]: an Executed `DISCARD
//!   ALL`, `COMMIT PREPARED`, `ROLLBACK PREPARED` or `VACUUM` commits what a Bind before it
//!   wrote: checked first.
//! - [`a_comment_token_ends_with_a_statement_that_commits_as_it_runs`]: the comment token
//!   of a `VACUUM` or `DISCARD ALL` does not fence the batch's statements after it.
//! - [`a_transaction_made_read_only_after_it_wrote_does_not_commit_unchecked`]: the check
//!   cannot run in it (25006), so the writes roll back where PostgreSQL commits them.
//!
//! - From drivers' reports: a check statement skipped or dropped, or forgotten after a
//!   DEALLOCATE, is prepared again; a fast-path rejection in a block shows only its error; a
//!   client's Parse the server refused or skipped does not change what pgfence thinks the
//!   name runs; `COMMIT PREPARED`/`ROLLBACK PREPARED` with a token finish; the hint's reset
//!   after a `PREPARE TRANSACTION` keeps the client's unnamed statement, and the ROLLBACK
//!   after a failed check before a COMMIT does to it what the COMMIT would have; a fast-path
//!   rejection keeps the client's unnamed portal.
//!
//! Every rejection is asserted field by field (SPEC section 5), and the session is then
//! shown to be usable and outside any transaction.

use std::time::Duration;

use harness::fence::{
    assert_rejected, conflicting, connect_with_notices, drain_notices, install, invalid_resource,
    invalid_token, missing, psql_script, sqlstate, stale, Expected, INVALID_DETAIL, INVALID_HINT,
};
use harness::wire::{self, Msg, RawConn};
use harness::{quote_conn_value, PgCluster, Proxy, APP_DB, SUPERUSER};
use pgfence_config::{Config, DefaultResource, OnMissingToken, ResourcePolicy};
use tokio::sync::mpsc::UnboundedReceiver;
use tokio_postgres::error::DbError;
use tokio_postgres::{Client, SimpleQueryMessage};

/// A cluster with schema `pgfence` installed, a proxy in front of it, a direct client.
struct Fixture {
    cluster: PgCluster,
    proxy: Proxy,
    direct: Client,
}

impl Fixture {
    /// Runs `setup` (SQL, as the superuser, directly) and starts a proxy with the default
    /// config changed by `configure`.
    async fn start(setup: &str, configure: impl FnOnce(&mut Config)) -> Fixture {
        let cluster = PgCluster::start();
        let direct = cluster.connect(APP_DB).await;
        install(&direct).await;
        direct.batch_execute(setup).await.expect("setup SQL");
        let mut config = Proxy::config_for(&cluster);
        configure(&mut config);
        let proxy = Proxy::start(config);
        Fixture {
            cluster,
            proxy,
            direct,
        }
    }

    /// A session through the proxy as `user`, with `options` (e.g. `-c fencing.token=5`).
    async fn session(&self, user: &str, options: Option<&str>) -> Session {
        let mut connstr = self.proxy.connstr_as(APP_DB, user, None);
        if let Some(o) = options {
            connstr.push_str(&format!(" options={}", quote_conn_value(o)));
        }
        let (client, notices) = connect_with_notices(&connstr).await;
        Session { client, notices }
    }

    /// A raw-protocol session through the proxy as `postgres` with startup `options`,
    /// logged in (its first ReadyForQuery read).
    fn raw_session(&self, options: &str) -> RawConn {
        RawConn::login_with_options(self.proxy.addr(), SUPERUSER, APP_DB, options)
    }

    /// A connection straight to PostgreSQL holding `pgfence.read_audit` locked in a
    /// transaction, so that the read audit's question waits (up to its `lock_timeout`, 1
    /// s) until the returned client runs `ROLLBACK`.
    async fn lock_read_audit(&self) -> Client {
        let locker = self.cluster.connect(APP_DB).await;
        locker
            .batch_execute("BEGIN; LOCK TABLE pgfence.read_audit IN ACCESS EXCLUSIVE MODE")
            .await
            .unwrap();
        locker
    }

    /// A raw connection straight to PostgreSQL, logged in to `app`: what pgfence is
    /// compared with byte for byte.
    fn raw_direct(&self) -> RawConn {
        let addr = std::net::SocketAddr::from(([127, 0, 0, 1], self.cluster.port()));
        RawConn::login(addr, SUPERUSER, APP_DB).0
    }

    /// A fixture with `table (tag text)`, to which a leader with token 34 of resource
    /// `table` has written through the proxy, and the startup options of a stale session
    /// (token 33 of that resource).
    async fn after_leader_34(
        table: &str,
        configure: impl FnOnce(&mut Config),
    ) -> (Fixture, String) {
        let fx = Fixture::start(&format!("CREATE TABLE {table} (tag text);"), configure).await;
        fx.leader(table, 34)
            .await
            .simple(&format!("INSERT INTO {table} VALUES ('leader 34')"))
            .await
            .unwrap();
        (
            fx,
            format!("-c fencing.token=33 -c fencing.resource={table}"),
        )
    }

    /// A session as `postgres` with `fencing.token` and `fencing.resource` from startup.
    async fn leader(&self, resource: &str, token: i64) -> Session {
        self.session(
            SUPERUSER,
            Some(&format!(
                "-c fencing.token={token} -c fencing.resource={resource}"
            )),
        )
        .await
    }

    async fn fence(&self, resource: &str) -> Option<i64> {
        self.direct
            .query_opt(
                "SELECT token FROM pgfence.fences WHERE resource = $1",
                &[&resource],
            )
            .await
            .unwrap()
            .map(|r| r.get(0))
    }

    /// `SELECT count(*)` of `from_where` (e.g. `t WHERE tag = 'x'`), read directly.
    async fn count(&self, from_where: &str) -> i64 {
        self.direct
            .query_one(&format!("SELECT count(*) FROM {from_where}"), &[])
            .await
            .unwrap_or_else(|e| panic!("count {from_where}: {e:?}"))
            .get(0)
    }

    /// pgfence's `fence_checks` counter, from the admin console.
    async fn checks_done(&self) -> u64 {
        self.stat("fence_checks").await
    }

    /// A counter of the admin console's `SHOW STATS`.
    async fn stat(&self, name: &str) -> u64 {
        let admin = harness::connect_to(&self.proxy.connstr("pgfence")).await;
        for m in admin.simple_query("SHOW STATS").await.unwrap() {
            if let SimpleQueryMessage::Row(row) = m {
                if row.get(0) == Some(name) {
                    return row.get(1).unwrap().parse().unwrap();
                }
            }
        }
        panic!("SHOW STATS has no {name}");
    }
}

/// A client through the proxy whose notices are kept.
struct Session {
    client: Client,
    notices: UnboundedReceiver<DbError>,
}

impl Session {
    /// Usable, and outside any transaction block on the server: a ROLLBACK warns that
    /// there is none (so no rejection left the server transaction open behind the client's
    /// back).
    async fn assert_idle(&mut self, context: &str) {
        drain_notices(&mut self.notices);
        self.client
            .batch_execute("ROLLBACK")
            .await
            .unwrap_or_else(|e| panic!("{context}: ROLLBACK: {e:?}"));
        let one: i32 = self
            .client
            .query_one("SELECT 1", &[])
            .await
            .unwrap_or_else(|e| panic!("{context}: SELECT 1: {e:?}"))
            .get(0);
        assert_eq!(one, 1);
        assert_eq!(
            drain_notices(&mut self.notices),
            vec!["25P01".to_string()],
            "{context}: a transaction is still open on the server"
        );
    }

    async fn simple(&self, sql: &str) -> Result<(), tokio_postgres::Error> {
        self.client.batch_execute(sql).await
    }

    async fn extended(&self, sql: &str) -> Result<(), tokio_postgres::Error> {
        self.client.execute(sql, &[]).await.map(|_| ())
    }

    /// `statements` as one simple Query, or one by one with the extended protocol, stopping
    /// at the first error. Returns the result and, on error, the failing statement's index
    /// (0 for the simple protocol).
    async fn run_at(
        &self,
        protocol: Protocol,
        statements: &[&str],
    ) -> (Result<(), tokio_postgres::Error>, usize) {
        match protocol {
            Protocol::Simple => (self.simple(&statements.join("; ")).await, 0),
            Protocol::Extended => {
                for (i, statement) in statements.iter().enumerate() {
                    if let Err(e) = self.extended(statement).await {
                        return (Err(e), i);
                    }
                }
                (Ok(()), 0)
            }
        }
    }

    async fn run(
        &self,
        protocol: Protocol,
        statements: &[&str],
    ) -> Result<(), tokio_postgres::Error> {
        self.run_at(protocol, statements).await.0
    }

    /// Runs `statements` (see [`Session::run_at`]) and expects `expected`. A statement
    /// rejected inside a transaction block (the fast path rejects a write before it runs)
    /// leaves the block failed, as any failed statement does: the application's ROLLBACK
    /// follows. A rejected COMMIT must end the block by itself. Then the session must be
    /// idle.
    async fn expect_rejection(
        &mut self,
        protocol: Protocol,
        statements: &[&str],
        expected: &Expected,
        context: &str,
    ) {
        let context = format!("{context} ({protocol:?}: {statements:?})");
        let (result, at) = self.run_at(protocol, statements).await;
        assert_rejected(&result, expected, &context);
        let in_block = statements.first().is_some_and(|s| s.starts_with("BEGIN"));
        if protocol == Protocol::Extended && in_block && at + 1 < statements.len() {
            self.simple("ROLLBACK").await.unwrap();
        }
        self.assert_idle(&context).await;
    }
}

impl Session {
    /// [`Session::expect_rejection`] of `sql` alone, then inside `BEGIN` ... `COMMIT`.
    async fn expect_rejection_alone_and_in_block(
        &mut self,
        protocol: Protocol,
        sql: &str,
        expected: &Expected,
        context: &str,
    ) {
        self.expect_rejection(protocol, &[sql], expected, context)
            .await;
        self.expect_rejection(protocol, &["BEGIN", sql, "COMMIT"], expected, context)
            .await;
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Protocol {
    Simple,
    Extended,
}

const PROTOCOLS: [Protocol; 2] = [Protocol::Simple, Protocol::Extended];

// ---------------------------------------------------------------------------------------

const HIDDEN_SETUP: &str = "
CREATE TABLE hw (tag text);
-- Two arguments: with one, attribute notation could call it, and the read audit would
-- have every read checked.
CREATE FUNCTION hw_write(tag text, n int) RETURNS int LANGUAGE plpgsql
    AS $$ BEGIN INSERT INTO hw VALUES (tag); RETURN 1; END $$;
-- A BEFORE trigger that writes elsewhere and skips the row: the INSERT reports 0 rows.
CREATE TABLE hw_src (tag text);
CREATE FUNCTION hw_divert() RETURNS trigger LANGUAGE plpgsql
    AS $$ BEGIN INSERT INTO hw VALUES (NEW.tag); RETURN NULL; END $$;
CREATE TRIGGER hw_divert BEFORE INSERT ON hw_src FOR EACH ROW EXECUTE FUNCTION hw_divert();
";

/// The hidden writes, each writing the row `tag` into `hw`.
fn hidden_writes(tag: &str) -> [(&'static str, String); 4] {
    [
        ("function", format!("SELECT hw_write('{tag}', 1)")),
        (
            "DO block",
            format!("DO $$ BEGIN INSERT INTO hw VALUES ('{tag}'); END $$"),
        ),
        (
            "data-modifying CTE",
            format!(
                "WITH x AS (INSERT INTO hw VALUES ('{tag}') RETURNING 1) SELECT count(*) FROM x"
            ),
        ),
        ("trigger", format!("INSERT INTO hw_src VALUES ('{tag}')")),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hidden_writes_are_fenced() {
    let fx = Fixture::start(HIDDEN_SETUP, |_| {}).await;
    let r = "hidden";
    fx.leader(r, 34)
        .await
        .simple("SELECT hw_write('b', 1)")
        .await
        .unwrap();
    assert_eq!(fx.fence(r).await, Some(34));

    // Token from startup (the fast path may know it) and from SET (only the database does).
    let mut from_options = fx.leader(r, 33).await;
    let mut from_set = fx.session(SUPERUSER, None).await;
    from_set
        .simple(&format!(
            "SET fencing.token = 33; SET fencing.resource = '{r}'"
        ))
        .await
        .unwrap();
    for (source, session) in [("options", &mut from_options), ("SET", &mut from_set)] {
        for protocol in PROTOCOLS {
            let tag = format!("stale {source} {protocol:?}");
            for (what, sql) in hidden_writes(&tag) {
                let context = format!("{what}, token from {source}");
                session
                    .expect_rejection_alone_and_in_block(
                        protocol,
                        &sql,
                        &stale(r, 33, 34),
                        &context,
                    )
                    .await;
            }
            assert_eq!(
                fx.count(&format!("hw WHERE tag = '{tag}'")).await,
                0,
                "{tag}"
            );
        }
    }

    // The current leader's hidden writes are accepted.
    let leader = fx.leader(r, 34).await;
    for protocol in PROTOCOLS {
        let tag = format!("current {protocol:?}");
        for (what, sql) in hidden_writes(&tag) {
            leader
                .run(protocol, &[&sql])
                .await
                .unwrap_or_else(|e| panic!("{what} with the current token: {e:?}"));
        }
        assert_eq!(
            fx.count(&format!("hw WHERE tag = '{tag}'")).await,
            4,
            "{tag}"
        );
    }
    assert_eq!(fx.count("hw_src").await, 0);
    assert_eq!(fx.fence(r).await, Some(34));
}

/// A cursor declared `WITH HOLD` runs the rest of its query when its transaction commits,
/// after pgfence's check: a write it makes then had no transaction id when the check
/// looked. The check treats a holdable cursor declared in the transaction as a write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cursor_with_hold_is_checked_for_what_it_writes_at_commit() {
    let fx = Fixture::start(HIDDEN_SETUP, |c| {
        c.fence.defaults.push(DefaultResource {
            database: APP_DB.into(),
            user: None,
            resource: "held".into(),
        });
    })
    .await;
    let r = "held";
    fx.leader(r, 34)
        .await
        .simple("INSERT INTO hw VALUES ('leader')")
        .await
        .unwrap();
    let declare = |tag: &str| {
        format!(
            "DECLARE c CURSOR WITH HOLD FOR SELECT hw_write('{tag}', 1) FROM generate_series(1, 3)"
        )
    };

    // A stale token from SET (only the database knows it is stale), and no token at all.
    let mut stale_session = fx.session(SUPERUSER, None).await;
    stale_session
        .simple("SET fencing.token = 33")
        .await
        .unwrap();
    let mut tokenless = fx.session(SUPERUSER, None).await;
    for protocol in PROTOCOLS {
        for (session, expected, tag) in [
            (
                &mut stale_session,
                stale(r, 33, 34),
                format!("stale {protocol:?}"),
            ),
            (&mut tokenless, missing(r), format!("missing {protocol:?}")),
        ] {
            session
                .expect_rejection_alone_and_in_block(protocol, &declare(&tag), &expected, &tag)
                .await;
            assert_eq!(
                fx.count(&format!("hw WHERE tag = '{tag}'")).await,
                0,
                "{tag}"
            );
        }
    }

    // The current leader's cursor writes, and stays usable after its transaction.
    let leader = fx.leader(r, 34).await;
    for protocol in PROTOCOLS {
        let tag = format!("current {protocol:?}");
        leader
            .run(protocol, &[&declare(&tag)])
            .await
            .unwrap_or_else(|e| panic!("{tag}: {e:?}"));
        assert_eq!(
            fx.count(&format!("hw WHERE tag = '{tag}'")).await,
            3,
            "{tag}"
        );
        leader.simple("CLOSE c").await.unwrap();
    }
    // A holdable cursor over a plain SELECT reads: no token needed, no check.
    tokenless
        .simple("DECLARE r CURSOR WITH HOLD FOR SELECT tag FROM hw; CLOSE r")
        .await
        .expect("a read-only holdable cursor");
    assert_eq!(fx.fence(r).await, Some(34));
}

/// A `DO` run by an Execute outside a block is non-atomic in PostgreSQL: a `COMMIT` inside
/// it commits what was written so far, before the check at the Sync could see it. pgfence
/// checks (forced) right before its Execute.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_do_block_that_commits_inside_is_checked_before_it_runs() {
    let fx = Fixture::start(HIDDEN_SETUP, |_| {}).await;
    let r = "do_commit";
    fx.leader(r, 34)
        .await
        .simple("INSERT INTO hw VALUES ('leader')")
        .await
        .unwrap();
    let do_commit = |tag: &str| {
        format!("DO $$ BEGIN INSERT INTO hw VALUES ('{tag} 1'); COMMIT; INSERT INTO hw VALUES ('{tag} 2'); END $$")
    };
    let mut stale_session = fx.session(SUPERUSER, None).await;
    stale_session
        .simple(&format!(
            "SET fencing.token = 33; SET fencing.resource = '{r}'"
        ))
        .await
        .unwrap();
    // tokio-postgres: Parse, Describe, Sync, then Bind, Execute, Sync.
    stale_session
        .expect_rejection(
            Protocol::Extended,
            &[&do_commit("stale")],
            &stale(r, 33, 34),
            "DO",
        )
        .await;
    // Raw protocol: an INSERT, then the DO, in one batch (one implicit transaction).
    let options = format!("-c fencing.token=33 -c fencing.resource={r}");
    let mut raw = fx.raw_session(&options);
    raw.send(
        &[
            pbe("INSERT INTO hw VALUES ('stale batch 0')"),
            pbe(&do_commit("stale batch")),
            wire::sync(),
        ]
        .concat(),
    );
    expect_raw_rejection(&mut raw, "INSERT then DO in one batch");
    assert_eq!(fx.count("hw WHERE tag LIKE 'stale%'").await, 0);

    // The current token: everything lands, with or without a COMMIT inside, and a DO
    // whose token is in a comment too.
    let leader = fx.leader(r, 34).await;
    leader.extended(&do_commit("current")).await.unwrap();
    leader
        .extended("DO $$ BEGIN INSERT INTO hw VALUES ('current plain'); END $$")
        .await
        .unwrap();
    let commented = fx.session(SUPERUSER, None).await;
    commented
        .extended(&format!(
            "/* fencing_resource={r} fencing_token=34 */ DO $$ BEGIN INSERT INTO hw VALUES ('current comment'); COMMIT; END $$"
        ))
        .await
        .unwrap();
    assert_eq!(fx.count("hw WHERE tag LIKE 'current%'").await, 4);
    assert_eq!(fx.fence(r).await, Some(34));
}

/// A comment's token applies to the transaction that contains its statement (SPEC section
/// 2), not to another one: of the same Query string, pipelined behind it, or chained to it.
/// Each of these once let a stale write commit on a later transaction's comment.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_comment_token_stays_in_its_transaction() {
    let (fx, options) = Fixture::after_leader_34("scope", |c| c.fence.fast_path = false).await;
    let comment = "/* fencing_token=34 */ SELECT 1";
    let write = |tag: &str| format!("INSERT INTO scope VALUES ('stale {tag}')");
    // One Query, the comment in a later or earlier transaction than the write.
    for (what, sql) in [
        (
            "later",
            format!("BEGIN; {}; COMMIT; {comment}", write("later")),
        ),
        (
            "earlier",
            format!("{comment}; COMMIT; {}", write("earlier")),
        ),
        (
            "rolled back",
            format!("BEGIN; {comment}; ROLLBACK; {}", write("rolled back")),
        ),
    ] {
        let mut stale = fx.raw_session(&options);
        stale.send(&wire::query(&sql));
        expect_raw_rejection(&mut stale, what);
    }
    // Pipelined behind a Query or a batch that carried the comment and wrote nothing.
    let mut stale = fx.raw_session(&options);
    stale.send(&[wire::query(comment), wire::query(write("behind a Query"))].concat());
    stale.until_ready();
    expect_raw_rejection(&mut stale, "behind a Query");
    let mut stale = fx.raw_session(&options);
    stale.send(
        &[
            pbe(comment),
            wire::sync(),
            pbe(&write("behind a batch")),
            wire::sync(),
        ]
        .concat(),
    );
    stale.until_ready();
    expect_raw_rejection(&mut stale, "behind a batch");
    // Chained: COMMIT AND CHAIN starts a transaction of its own.
    let mut stale = fx.raw_session(&options);
    for sql in ["BEGIN", comment, "COMMIT AND CHAIN", &write("chained")] {
        stale.send(&wire::query(sql));
        stale.until_ready();
    }
    stale.send(&wire::query("COMMIT"));
    expect_raw_rejection(&mut stale, "after COMMIT AND CHAIN");
    assert_eq!(fx.count("scope WHERE tag LIKE 'stale%'").await, 0);

    // An honest client with a token per transaction in one Query: no conflict between them.
    let honest = fx
        .session(SUPERUSER, Some("-c fencing.resource=scope"))
        .await;
    honest
        .simple(
            "BEGIN; /* fencing_token=34 */ INSERT INTO scope VALUES ('t34'); COMMIT; \
             BEGIN; /* fencing_token=35 */ INSERT INTO scope VALUES ('t35'); COMMIT",
        )
        .await
        .unwrap();
    assert_eq!(fx.fence("scope").await, Some(35));
}

/// Statements an acceptance review found the classifier taking for reads: each writes, so
/// each must be checked (with a stale token: FN001, nothing written).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_the_classifier_once_took_for_reads_are_checked() {
    let setup = format!(
        "{HIDDEN_SETUP}
CREATE FUNCTION hw_rec(tag text) RETURNS record LANGUAGE sql
    AS $$ INSERT INTO hw VALUES (tag) RETURNING 1 $$;
CREATE FUNCTION json_scalar(tag text) RETURNS int LANGUAGE sql
    AS $$ INSERT INTO hw VALUES (tag) RETURNING 1 $$;
CREATE FUNCTION rollup(tag text) RETURNS int LANGUAGE sql
    AS $$ INSERT INTO hw VALUES (tag) RETURNING 1 $$;"
    );
    let fx = Fixture::start(&setup, |_| {}).await;
    let r = "classified";
    fx.leader(r, 34)
        .await
        .simple("INSERT INTO hw VALUES ('leader')")
        .await
        .unwrap();
    let mut stale_session = fx.session(SUPERUSER, None).await;
    stale_session
        .simple(&format!(
            "SET fencing.token = 33; SET fencing.resource = '{r}'"
        ))
        .await
        .unwrap();
    for protocol in PROTOCOLS {
        let tag = format!("stale {protocol:?}");
        for sql in [
            format!("EXPLAIN (\"analyze\") INSERT INTO hw VALUES ('{tag}')"),
            format!("EXPLAIN (U&\"analyze\", costs off) INSERT INTO hw VALUES ('{tag}')"),
            format!("SELECT * FROM (VALUES (1)) v, hw_rec('{tag}') AS (a int)"),
            format!("SELECT json_scalar('{tag}')"),
            format!("SELECT 1 ORDER BY rollup('{tag}')"),
        ] {
            stale_session
                .expect_rejection(protocol, &[&sql], &stale(r, 33, 34), &sql)
                .await;
        }
        assert_eq!(
            fx.count(&format!("hw WHERE tag = '{tag}'")).await,
            0,
            "{tag}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_do_not_pay() {
    let fx = Fixture::start(HIDDEN_SETUP, |c| c.admin.users = vec![SUPERUSER.into()]).await;
    let r = "reads";
    fx.leader(r, 34)
        .await
        .simple("SELECT hw_write('b', 1)")
        .await
        .unwrap();
    let stale_reader = fx.leader(r, 33).await;
    let before = fx.checks_done().await;
    let reads = [
        "SELECT count(*) FROM hw",
        "SELECT tag, length(tag) FROM hw WHERE tag = 'b' ORDER BY 1",
        "WITH x AS (SELECT tag FROM hw) SELECT count(*) FROM x",
        "SHOW fencing.token",
    ];
    for sql in reads {
        stale_reader
            .simple(sql)
            .await
            .unwrap_or_else(|e| panic!("simple {sql}: {e:?}"));
        stale_reader
            .client
            .query(sql, &[])
            .await
            .unwrap_or_else(|e| panic!("extended {sql}: {e:?}"));
        stale_reader
            .simple(&format!("BEGIN; {sql}; COMMIT"))
            .await
            .unwrap_or_else(|e| panic!("in a transaction {sql}: {e:?}"));
    }
    // An explicit read-only transaction, statement by statement.
    stale_reader.simple("BEGIN").await.unwrap();
    stale_reader.client.query(reads[0], &[]).await.unwrap();
    stale_reader.extended("COMMIT").await.unwrap();
    assert_eq!(
        fx.checks_done().await,
        before,
        "reads made pgfence run the check"
    );
    // A write does (the counter is not blind).
    let writer = fx.leader(r, 34).await;
    writer.simple("SELECT hw_write('w', 1)").await.unwrap();
    assert!(fx.checks_done().await > before);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_token_policy() {
    let setup = "
        CREATE TABLE mt (tag text);
        CREATE ROLE mt_strict LOGIN; CREATE ROLE mt_lenient LOGIN;
        GRANT ALL ON mt TO PUBLIC;";
    let fx = Fixture::start(setup, |c| {
        c.fence.resources.insert(
            "strict".into(),
            ResourcePolicy {
                on_missing_token: None,
            },
        );
        c.fence.resources.insert(
            "lenient".into(),
            ResourcePolicy {
                on_missing_token: Some(OnMissingToken::Allow),
            },
        );
        for (user, resource) in [("mt_strict", "strict"), ("mt_lenient", "lenient")] {
            c.fence.defaults.push(DefaultResource {
                database: APP_DB.into(),
                user: Some(user.into()),
                resource: resource.into(),
            });
        }
    })
    .await;

    // A configured resource without a token: FN002, from every protocol and mode.
    let mut strict = fx.session("mt_strict", None).await;
    for protocol in PROTOCOLS {
        let write = "INSERT INTO mt VALUES ('strict')";
        for statements in [&[write][..], &["BEGIN", write, "COMMIT"]] {
            strict
                .expect_rejection(protocol, statements, &missing("strict"), "strict resource")
                .await;
        }
    }
    // Named by the session, without a token: FN002 too.
    let mut named = fx
        .session(SUPERUSER, Some("-c fencing.resource=named"))
        .await;
    named
        .expect_rejection(
            Protocol::Simple,
            &["INSERT INTO mt VALUES ('named')"],
            &missing("named"),
            "resource from the session",
        )
        .await;
    assert_eq!(fx.count("mt").await, 0);
    assert_eq!(fx.fence("strict").await, None);

    // A comment naming another resource adds it: the default resource still needs a token
    // (README, "How the fence works"). A session's own resource replaces the default.
    strict
        .expect_rejection(
            Protocol::Simple,
            &["/* fencing_resource=other fencing_token=5 */ INSERT INTO mt VALUES ('other')"],
            &missing("strict"),
            "a comment adds its resource to the default one",
        )
        .await;
    assert_eq!(fx.fence("other").await, None);
    let both = fx.session("mt_strict", Some("-c fencing.token=2")).await;
    both.simple("/* fencing_resource=other fencing_token=6 */ INSERT INTO mt VALUES ('both')")
        .await
        .unwrap();
    assert_eq!(
        (fx.fence("strict").await, fx.fence("other").await),
        (Some(2), Some(6))
    );
    let replaced = fx
        .session(
            "mt_strict",
            Some("-c fencing.resource=other -c fencing.token=7"),
        )
        .await;
    replaced
        .extended("INSERT INTO mt VALUES ('replaced')")
        .await
        .unwrap();
    assert_eq!(
        (fx.fence("strict").await, fx.fence("other").await),
        (Some(2), Some(7))
    );
    fx.direct.batch_execute("DELETE FROM mt").await.unwrap();

    // `allow`: the write goes through, unfenced.
    let lenient = fx.session("mt_lenient", None).await;
    lenient
        .simple("INSERT INTO mt VALUES ('lenient')")
        .await
        .unwrap();
    lenient
        .extended("INSERT INTO mt VALUES ('lenient')")
        .await
        .unwrap();
    assert_eq!(fx.count("mt WHERE tag = 'lenient'").await, 2);
    assert_eq!(fx.fence("lenient").await, None);
    // ... but a token, when given, is still enforced.
    let lenient_token = fx.session("mt_lenient", Some("-c fencing.token=3")).await;
    lenient_token
        .simple("INSERT INTO mt VALUES ('lenient 3')")
        .await
        .unwrap();
    assert_eq!(fx.fence("lenient").await, Some(3));
    let mut lenient_stale = fx.session("mt_lenient", Some("-c fencing.token=2")).await;
    lenient_stale
        .expect_rejection(
            Protocol::Simple,
            &["INSERT INTO mt VALUES ('lenient 2')"],
            &stale("lenient", 2, 3),
            "allow does not mean unchecked",
        )
        .await;

    // No resource anywhere: nothing to fence, not checked against anything.
    let plain = fx.session(SUPERUSER, None).await;
    plain
        .simple("INSERT INTO mt VALUES ('plain')")
        .await
        .unwrap();
    assert_eq!(fx.count("mt WHERE tag = 'plain'").await, 1);

    // A token without a resource: FN003.
    let mut orphan = fx.session(SUPERUSER, Some("-c fencing.token=5")).await;
    let no_resource = Expected {
        code: "FN003",
        message: "fencing token 5 has no resource: set fencing.resource or add \
                  fencing_resource to the comment"
            .into(),
        detail: INVALID_DETAIL.into(),
        hint: INVALID_HINT.into(),
    };
    orphan
        .expect_rejection(
            Protocol::Extended,
            &["INSERT INTO mt VALUES ('orphan')"],
            &no_resource,
            "token without a resource",
        )
        .await;
    assert_eq!(fx.count("mt WHERE tag = 'orphan'").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conflicting_and_malformed_tokens() {
    let fx = Fixture::start("CREATE TABLE ct (tag text);", |_| {}).await;
    let mut s = fx.session(SUPERUSER, None).await;
    let c = |token: u32, tag: &str| {
        format!("/* fencing_token={token} fencing_resource=cf */ INSERT INTO ct VALUES ('{tag}')")
    };

    // Two different comment tokens for one resource in one transaction: FN003, in order.
    for protocol in PROTOCOLS {
        let (x, y) = (c(40, "x"), c(41, "y"));
        s.expect_rejection(
            protocol,
            &["BEGIN", &x, &y, "COMMIT"],
            &conflicting("cf", "40", "41"),
            "two statements",
        )
        .await;
    }
    // ... also within one statement with two comments.
    let two = "/* fencing_token=40 fencing_resource=cf */ INSERT INTO ct VALUES ('z') \
               /*fencing_resource='cf',fencing_token='42'*/";
    s.expect_rejection(
        Protocol::Extended,
        &[two],
        &conflicting("cf", "40", "42"),
        "one statement",
    )
    .await;
    assert_eq!(fx.count("ct").await, 0);
    assert_eq!(fx.fence("cf").await, None);

    // The same token twice is one leader: accepted.
    s.simple(&format!("BEGIN; {}; {}; COMMIT", c(40, "a"), c(40, "b")))
        .await
        .unwrap();
    assert_eq!(fx.fence("cf").await, Some(40));

    // A comment token overrides the session token of its resource for its transaction.
    let session_10 = fx.leader("cf", 10).await;
    session_10
        .simple(&format!(
            "BEGIN; INSERT INTO ct VALUES ('s'); {}; COMMIT",
            c(45, "c")
        ))
        .await
        .expect("the comment's 45 overrides the session's 10 (stale on its own)");
    assert_eq!(fx.fence("cf").await, Some(45));
    let mut stale_session = fx.leader("cf", 10).await;
    stale_session
        .expect_rejection(
            Protocol::Simple,
            &["INSERT INTO ct VALUES ('s')"],
            &stale("cf", 10, 45),
            "the session token applies without a comment",
        )
        .await;
    // With the fence known to the fast path, two tokens for it, one of them below, are
    // still a conflict: the fast path leaves them to the check (it once answered FN001).
    for protocol in PROTOCOLS {
        let (x, y) = (c(45, "x"), c(44, "y"));
        s.expect_rejection(
            protocol,
            &["BEGIN", &x, &y, "COMMIT"],
            &conflicting("cf", "45", "44"),
            "two statements, the fence known",
        )
        .await;
    }
    s.expect_rejection(
        Protocol::Simple,
        &[&format!("{}; {}", c(45, "x"), c(44, "y"))],
        &conflicting("cf", "45", "44"),
        "one Query, the fence known",
    )
    .await;

    // Malformed tokens and resources, from comments, SET and startup: FN003.
    let m = |comment: &str| format!("{comment} INSERT INTO ct VALUES ('malformed')");
    let cases = [
        (
            m("/* fencing_token=abc fencing_resource=mf */"),
            invalid_token("mf", "abc"),
        ),
        (
            m("/* fencing_token=-1 fencing_resource=mf */"),
            invalid_token("mf", "-1"),
        ),
        (
            m("/* fencing_token=9223372036854775808 fencing_resource=mf */"),
            invalid_token("mf", "9223372036854775808"),
        ),
        (
            m("/*fencing_resource='mf',fencing_token='1.5'*/"),
            invalid_token("mf", "1.5"),
        ),
        (
            m("/*fencing_resource='bad%20name',fencing_token='1'*/"),
            invalid_resource("bad name"),
        ),
    ];
    for (sql, expected) in &cases {
        for protocol in PROTOCOLS {
            s.expect_rejection(protocol, &[sql], expected, "malformed comment")
                .await;
        }
    }
    let mut set = fx.session(SUPERUSER, None).await;
    set.simple("SET fencing.token = '12x'; SET fencing.resource = 'mf'")
        .await
        .unwrap();
    set.expect_rejection(
        Protocol::Extended,
        &["INSERT INTO ct VALUES ('malformed')"],
        &invalid_token("mf", "12x"),
        "malformed SET",
    )
    .await;
    let mut startup = fx
        .session(
            SUPERUSER,
            Some("-c fencing.token=abc -c fencing.resource=mf"),
        )
        .await;
    startup
        .expect_rejection(
            Protocol::Simple,
            &["INSERT INTO ct VALUES ('malformed')"],
            &invalid_token("mf", "abc"),
            "malformed startup option",
        )
        .await;
    assert_eq!(fx.count("ct WHERE tag = 'malformed'").await, 0);
    assert_eq!(fx.fence("mf").await, None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_in_literals_do_not_count() {
    let fx = Fixture::start("CREATE TABLE lt (tag text);", |_| {}).await;
    let r = "lit";
    let leader = fx.leader(r, 50).await;
    leader
        .simple("INSERT INTO lt VALUES ('first')")
        .await
        .unwrap();
    let d = |t: u32| format!("/* fencing_token={t} fencing_resource={r} */");
    let sc = |t: u32| format!("/*fencing_resource='{r}',fencing_token='{t}'*/");
    let statements = [
        format!("INSERT INTO lt VALUES ('{}')", d(1)),
        format!("INSERT INTO lt VALUES (E'\\' {}')", d(2)),
        format!("INSERT INTO lt VALUES ($${}$$)", d(3)),
        format!("INSERT INTO lt VALUES ($tag${}$tag$)", sc(4)),
        format!("INSERT INTO lt SELECT 'ident' AS \"{}\"", d(5)),
        format!("DO $$ BEGIN {} INSERT INTO lt VALUES ('do'); END $$", d(6)),
    ];
    for protocol in PROTOCOLS {
        for sql in &statements {
            leader
                .run(protocol, &[sql])
                .await
                .unwrap_or_else(|e| panic!("{protocol:?} {sql}: {e:?}"));
        }
    }
    assert_eq!(fx.count("lt").await, 1 + 2 * statements.len() as i64);
    assert_eq!(fx.fence(r).await, Some(50));
    assert_eq!(
        fx.count(&format!("pgfence.history WHERE resource = '{r}'"))
            .await,
        1,
        "only the session's token 50 was ever accepted"
    );

    // A comment ends where PostgreSQL ends it (comments nest): the directive after the
    // nested comment is still inside the outer one, and counts.
    leader
        .simple(&format!(
            "/* outer /* nested */ fencing_token=51 fencing_resource={r} */ \
             INSERT INTO lt VALUES ('nested')"
        ))
        .await
        .unwrap();
    assert_eq!(fx.fence(r).await, Some(51));

    // A directive really in a comment next to the literal still counts.
    let mut s = fx.leader(r, 50).await;
    s.expect_rejection(
        Protocol::Simple,
        &[&format!("INSERT INTO lt VALUES ('{}') {}", d(1), d(49))],
        &stale(r, 49, 51),
        "a real comment after the literal",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_settings_follow_postgresql() {
    let fx = Fixture::start("CREATE TABLE ss (tag text);", |_| {}).await;
    let r = "settings";
    let mut s = fx.session(SUPERUSER, None).await;
    s.simple(&format!("SET fencing.resource = '{r}'"))
        .await
        .unwrap();

    // SET LOCAL: the token lasts for its transaction only.
    s.simple("BEGIN; SET LOCAL fencing.token = 60; INSERT INTO ss VALUES ('local'); COMMIT")
        .await
        .unwrap();
    assert_eq!(fx.fence(r).await, Some(60));
    s.expect_rejection(
        Protocol::Simple,
        &["INSERT INTO ss VALUES ('after local')"],
        &missing(r),
        "SET LOCAL ended with its transaction",
    )
    .await;
    // Statement by statement with the extended protocol, SHOW in between.
    s.simple("BEGIN").await.unwrap();
    s.extended("SET LOCAL fencing.token = 61").await.unwrap();
    let shown: String = s
        .client
        .query_one("SHOW fencing.token", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(shown, "61");
    s.extended("INSERT INTO ss VALUES ('local 61')")
        .await
        .unwrap();
    s.extended("COMMIT").await.unwrap();
    assert_eq!(fx.fence(r).await, Some(61));
    s.expect_rejection(
        Protocol::Extended,
        &["INSERT INTO ss VALUES ('after local 61')"],
        &missing(r),
        "SET LOCAL ended (extended)",
    )
    .await;

    // A SET in a rolled-back transaction is undone: the session keeps 70.
    s.simple("SET fencing.token = 70; INSERT INTO ss VALUES ('70')")
        .await
        .unwrap();
    s.simple("BEGIN; SET fencing.token = 65; ROLLBACK")
        .await
        .unwrap();
    s.simple("INSERT INTO ss VALUES ('70 again')")
        .await
        .expect("the rolled-back SET to 65 must be undone");
    s.simple("BEGIN; SET fencing.token = 80; ROLLBACK")
        .await
        .unwrap();
    s.simple("INSERT INTO ss VALUES ('70 once more')")
        .await
        .unwrap();
    assert_eq!(fx.fence(r).await, Some(70), "the rolled-back 80 was used");
    // ... also when the transaction fails and is rolled back afterwards.
    let failed = s.simple("BEGIN; SET fencing.token = 90; SELECT 1/0").await;
    assert_eq!(sqlstate(&failed).as_deref(), Some("22012"));
    s.simple("ROLLBACK").await.unwrap();
    s.simple("INSERT INTO ss VALUES ('70 after failure')")
        .await
        .unwrap();
    assert_eq!(fx.fence(r).await, Some(70));

    // RESET: no token any more.
    s.simple("RESET fencing.token").await.unwrap();
    s.expect_rejection(
        Protocol::Simple,
        &["INSERT INTO ss VALUES ('reset')"],
        &missing(r),
        "after RESET",
    )
    .await;

    // set_config(), also over a startup token that pgfence knows (and must then forget:
    // the fast path would otherwise reject with the startup token).
    let mut started = fx.leader(r, 1).await;
    started
        .expect_rejection(
            Protocol::Simple,
            &["INSERT INTO ss VALUES ('startup 1')"],
            &stale(r, 1, 70),
            "startup token",
        )
        .await;
    started
        .client
        .query("SELECT set_config('fencing.token', '75', false)", &[])
        .await
        .unwrap();
    started
        .simple("INSERT INTO ss VALUES ('set_config 75')")
        .await
        .expect("set_config's 75 must be used");
    assert_eq!(fx.fence(r).await, Some(75));
    started
        .client
        .query("SELECT set_config('fencing.token', '74', true)", &[])
        .await
        .unwrap();
    started
        .simple("INSERT INTO ss VALUES ('set_config local')")
        .await
        .expect("set_config(.., true) lasts for its (implicit) transaction only");
    assert_eq!(fx.count("ss WHERE tag = 'set_config local'").await, 1);
    assert_eq!(
        fx.count("ss WHERE tag IN ('after local', 'after local 61', 'reset', 'startup 1')")
            .await,
        0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commit_of_failed_transaction_is_untouched() {
    let fx = Fixture::start("CREATE TABLE ft (id int PRIMARY KEY);", |_| {}).await;
    let r = "failed";
    fx.leader(r, 34)
        .await
        .simple("INSERT INTO ft VALUES (1)")
        .await
        .unwrap();
    // A stale token, but the transaction fails before COMMIT: COMMIT says ROLLBACK, no FN
    // error, exactly as PostgreSQL itself says it.
    let script = "SET fencing.token = 33;
SET fencing.resource = 'failed';
BEGIN;
INSERT INTO ft VALUES (2);
INSERT INTO ft VALUES (1);
COMMIT;
BEGIN;
INSERT INTO ft VALUES (3);
SELECT 1/0;
INSERT INTO ft VALUES (4);
END;
BEGIN \\; INSERT INTO ft VALUES (5) \\; INSERT INTO ft VALUES (1) \\; COMMIT;
ROLLBACK;
SELECT count(*) FROM ft;
";
    let direct = psql_script(fx.cluster.psql_cmd(), APP_DB, script);
    fx.direct
        .batch_execute("DELETE FROM ft WHERE id <> 1")
        .await
        .unwrap();
    let proxied = psql_script(fx.proxy.psql_cmd(), APP_DB, script);
    assert!(direct.stdout.contains("ROLLBACK"), "{direct:?}");
    assert_eq!(
        proxied.stdout, direct.stdout,
        "stdout through pgfence vs PostgreSQL"
    );
    assert_eq!(
        proxied.stderr, direct.stderr,
        "stderr through pgfence vs PostgreSQL"
    );
    assert!(!proxied.stderr.contains("FN00"), "{}", proxied.stderr);

    // Extended protocol: the COMMIT of the failed block succeeds (it rolls back).
    let s = fx.leader(r, 33).await;
    s.simple("BEGIN").await.unwrap();
    s.extended("INSERT INTO ft VALUES (6)").await.unwrap_err();
    let dup = s.extended("INSERT INTO ft VALUES (1)").await;
    assert_eq!(sqlstate(&dup).as_deref(), Some("25P02"), "{dup:?}");
    s.extended("COMMIT")
        .await
        .expect("COMMIT of a failed transaction");
    // Pipelined: the failure is not yet known when COMMIT goes out (so pgfence may send its
    // check before it, and meet the failed transaction). Several times, for the timing.
    let mut s = s;
    for round in 0..20 {
        let statements = [
            "BEGIN",
            "INSERT INTO ft VALUES (7)",
            "INSERT INTO ft VALUES (1)",
            "COMMIT",
        ];
        let mut prepared = Vec::new();
        for sql in statements {
            prepared.push(s.client.prepare(sql).await.unwrap());
        }
        let results =
            futures_util::future::join_all(prepared.iter().map(|p| s.client.execute(p, &[]))).await;
        let codes: Vec<Option<String>> = results.iter().map(sqlstate).collect();
        // The stale token may be rejected by the check at the first write's Sync, before the
        // duplicate key; or the duplicate key fails the transaction first. Never at COMMIT,
        // which rolls back and ends the block, as in PostgreSQL.
        assert!(
            codes[3].is_none(),
            "round {round}: COMMIT: {:?}",
            results[3]
        );
        assert!(
            codes[..3] == [None, None, Some("23505".to_string())]
                || codes[..3] == [None, Some("FN001".to_string()), Some("25P02".to_string())],
            "round {round}: {results:?}"
        );
        s.assert_idle(&format!(
            "round {round}: after COMMIT of a failed transaction"
        ))
        .await;
    }
    // The failure in flight when the COMMIT goes out, with a valid token: pgfence checks
    // before the COMMIT (it still believes the block healthy), the check meets the failed
    // transaction, and the COMMIT must still roll back and end the block.
    let leader = fx.leader(r, 34).await;
    let dup = leader
        .client
        .prepare("INSERT INTO ft VALUES (1)")
        .await
        .unwrap();
    let commit = leader.client.prepare("COMMIT").await.unwrap();
    let mut leader = leader;
    for round in 0..20 {
        leader.simple("BEGIN").await.unwrap();
        let (failed, committed) = tokio::join!(
            leader.client.execute(&dup, &[]),
            leader.client.execute(&commit, &[])
        );
        assert_eq!(sqlstate(&failed).as_deref(), Some("23505"), "round {round}");
        assert!(committed.is_ok(), "round {round}: COMMIT: {committed:?}");
        leader
            .assert_idle(&format!("round {round}: COMMIT after an in-flight failure"))
            .await;
        // The same with a simple-protocol COMMIT: pgfence sends its check right before it
        // without a Sync, the server skips both, pgfence ends the block itself.
        leader.simple("BEGIN").await.unwrap();
        let (failed, committed) = tokio::join!(
            leader.client.execute(&dup, &[]),
            leader.client.simple_query("COMMIT")
        );
        assert_eq!(sqlstate(&failed).as_deref(), Some("23505"), "round {round}");
        let tags: Vec<u64> = committed
            .unwrap_or_else(|e| panic!("round {round}: simple COMMIT: {e:?}"))
            .iter()
            .filter_map(|m| match m {
                tokio_postgres::SimpleQueryMessage::CommandComplete(n) => Some(*n),
                _ => None,
            })
            .collect();
        assert_eq!(tags, vec![0], "round {round}: one command tag (ROLLBACK)");
        leader
            .assert_idle(&format!(
                "round {round}: simple COMMIT after an in-flight failure"
            ))
            .await;
    }
    assert_eq!(fx.count("ft").await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prepare_transaction_is_checked() {
    let fx = Fixture::start("CREATE TABLE pt (tag text);", |_| {}).await;
    let r = "prepared";
    let mut leader = fx.leader(r, 34).await;
    leader.simple("INSERT INTO pt VALUES ('b')").await.unwrap();
    let mut old = fx.leader(r, 33).await;
    let mut from_set = fx.session(SUPERUSER, None).await;
    from_set
        .simple(&format!(
            "SET fencing.token = 33; SET fencing.resource = '{r}'"
        ))
        .await
        .unwrap();
    for (who, s) in [("options", &mut old), ("SET", &mut from_set)] {
        // Simple protocol: BEGIN, the write and PREPARE TRANSACTION each on their own and
        // in one string.
        s.simple("BEGIN").await.unwrap();
        s.simple("INSERT INTO pt VALUES ('stale')").await.ok();
        let result = s.simple("PREPARE TRANSACTION 'stale_simple'").await;
        if let Err(e) = &result {
            // Already rejected at the write by the fast path, or rejected now.
            assert_eq!(e.code().map(|c| c.code()), Some("FN001"), "{who}: {e:?}");
        } else {
            // PREPARE of a transaction that failed at its write: rolled back.
            assert_eq!(who, "options", "PREPARE TRANSACTION was not checked");
        }
        s.assert_idle("PREPARE TRANSACTION, simple").await;
        let result = s
            .simple("BEGIN; INSERT INTO pt VALUES ('stale'); PREPARE TRANSACTION 'stale_string'")
            .await;
        assert_rejected(&result, &stale(r, 33, 34), &format!("{who}: one string"));
        s.assert_idle("PREPARE TRANSACTION, one string").await;
        // Extended protocol.
        s.simple("BEGIN").await.unwrap();
        let write = s.extended("INSERT INTO pt VALUES ('stale')").await;
        let prepare = s.extended("PREPARE TRANSACTION 'stale_extended'").await;
        match (&write, &prepare) {
            (Ok(()), Err(_)) => assert_rejected(&prepare, &stale(r, 33, 34), who),
            (Err(_), Ok(())) => assert_rejected(&write, &stale(r, 33, 34), who),
            _ => panic!("{who}: write {write:?}, prepare {prepare:?}"),
        }
        s.assert_idle("PREPARE TRANSACTION, extended").await;
    }
    assert_eq!(fx.count("pg_prepared_xacts").await, 0);
    assert_eq!(fx.count("pt WHERE tag = 'stale'").await, 0);

    // The current token prepares; the prepared transaction commits later.
    leader
        .simple("BEGIN; INSERT INTO pt VALUES ('prepared'); PREPARE TRANSACTION 'good'")
        .await
        .unwrap();
    leader.simple("BEGIN").await.unwrap();
    leader
        .extended("INSERT INTO pt VALUES ('prepared 2')")
        .await
        .unwrap();
    leader
        .extended("PREPARE TRANSACTION 'good2'")
        .await
        .unwrap();
    assert_eq!(fx.count("pg_prepared_xacts").await, 2);
    leader.simple("COMMIT PREPARED 'good'").await.unwrap();
    leader.simple("COMMIT PREPARED 'good2'").await.unwrap();
    assert_eq!(fx.count("pt WHERE tag LIKE 'prepared%'").await, 2);
    leader.assert_idle("after COMMIT PREPARED").await;
}

/// Table `table (tag text)` and procedure `<table>_proc(tag)`, which writes `<tag> 1`,
/// commits, then writes `<tag> 2`.
fn table_and_committing_procedure(table: &str) -> String {
    format!(
        "CREATE TABLE {table} (tag text);
        CREATE PROCEDURE {table}_proc(tag text) LANGUAGE plpgsql AS $$
        BEGIN
            INSERT INTO {table} VALUES (tag || ' 1');
            COMMIT;
            INSERT INTO {table} VALUES (tag || ' 2');
        END $$;"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_transactional_statements_are_prechecked() {
    let fx = Fixture::start(&table_and_committing_procedure("nt"), |_| {}).await;
    let r = "nontx";
    let leader = fx.leader(r, 34).await;
    leader.simple("CALL nt_proc('b')").await.unwrap();
    assert_eq!(fx.count("nt").await, 2);
    assert_eq!(
        fx.fence(r).await,
        Some(34),
        "the pre-check of CALL advances the fence"
    );

    // A partitioned table whose index expression calls a function that writes: `REINDEX`,
    // `CLUSTER` and `ANALYZE` of it commit a transaction per partition outside a block, and
    // with it that write (a stale one committed over the extended protocol, and the leader's
    // simple Query failed "cannot run inside a transaction block"; review I, stop 54).
    fx.direct
        .batch_execute(
            "CREATE TABLE nt_audit (x text); \
             CREATE FUNCTION nt_g() RETURNS int LANGUAGE plpgsql VOLATILE AS \
               $$ BEGIN INSERT INTO nt_audit VALUES ('w'); RETURN 1; END $$; \
             CREATE FUNCTION nt_f(int) RETURNS int LANGUAGE plpgsql IMMUTABLE AS \
               $$ BEGIN RETURN $1 + nt_g(); END $$; \
             CREATE TABLE ntp (a int) PARTITION BY RANGE (a); \
             CREATE TABLE ntp1 PARTITION OF ntp FOR VALUES FROM (0) TO (100); \
             INSERT INTO ntp VALUES (1); CREATE INDEX ntp_fi ON ntp ((nt_f(a))); \
             DELETE FROM nt_audit",
        )
        .await
        .expect("partitioned table");
    let per_partition = [
        "REINDEX TABLE ntp",
        "CLUSTER ntp USING ntp_fi",
        "ANALYZE ntp",
    ];
    let vacuums = "(SELECT vacuum_count FROM pg_stat_user_tables WHERE relname = 'nt') v \
                   WHERE vacuum_count > 0";
    let mut old = fx.leader(r, 33).await;
    let mut from_set = fx.session(SUPERUSER, None).await;
    from_set
        .simple(&format!(
            "SET fencing.token = 33; SET fencing.resource = '{r}'"
        ))
        .await
        .unwrap();
    for (who, s) in [("options", &mut old), ("SET", &mut from_set)] {
        for protocol in PROTOCOLS {
            for sql in [
                "CALL nt_proc('stale')",
                "VACUUM nt",
                "CREATE INDEX CONCURRENTLY nt_stale ON nt (tag)",
            ]
            .into_iter()
            .chain(per_partition)
            {
                s.expect_rejection(protocol, &[sql], &stale(r, 33, 34), who)
                    .await;
            }
        }
    }
    assert_eq!(fx.count("nt WHERE tag LIKE 'stale%'").await, 0, "CALL ran");
    // Behind an Executed `COMMIT`, `ROLLBACK` or `DISCARD ALL` of its batch (not checked
    // at its Bind, the batch has run an Execute), and bound behind another portal: first
    // in a new transaction, PostgreSQL runs it as alone. It once went unchecked, and a
    // stale `ANALYZE` committed (review K, stop 54). The session's token is from `SET`, so
    // the database checks it.
    let set_stale = format!("SET fencing.token = 33; SET fencing.resource = '{r}'");
    let mut raw = fx.raw_session("");
    raw.send(&wire::query(&set_stale));
    raw.until_ready();
    // `DISCARD ALL` resets the session's token: a comment gives it.
    let clustered = format!("/* fencing_token=33 fencing_resource={r} */ CLUSTER ntp USING ntp_fi");
    // A `VACUUM` or a `CONCURRENTLY` statement behind them too, or behind an Executed
    // empty statement: pgfence learns the state first (a Sync of its own once the batch's
    // replies are in) and checks it first as at the start of a batch (a stale `VACUUM FULL`
    // committed its index function's write; stop 54, older).
    let vacuumed = format!("/* fencing_token=33 fencing_resource={r} */ VACUUM (ANALYZE) ntp1");
    for (before, sql) in [
        ("COMMIT", "ANALYZE ntp"),
        ("ROLLBACK", "REINDEX TABLE ntp"),
        ("DISCARD ALL", clustered.as_str()),
        ("SELECT 1", "ANALYZE ntp"),
        ("COMMIT", "VACUUM FULL ntp1"),
        (
            "ROLLBACK",
            "CREATE INDEX CONCURRENTLY nt_stale ON ntp1 ((nt_f(a) + 1))",
        ),
        ("DISCARD ALL", vacuumed.as_str()),
        ("", "VACUUM FULL ntp1"),
    ] {
        let mut batch = wire::parse("", before, &[]);
        if before == "SELECT 1" {
            batch.extend(wire::bind("other", "", &[]));
        } else {
            batch.extend(wire::bind("", "", &[]));
            batch.extend(wire::execute("", 0));
        }
        batch.extend(wire::parse("", sql, &[]));
        batch.extend(wire::bind("", "", &[]));
        batch.extend(wire::execute("", 0));
        batch.extend(wire::sync());
        raw.send(&batch);
        let replies = raw.until_ready();
        assert!(
            replies
                .iter()
                .any(|m| m.sqlstate().as_deref() == Some("FN001")),
            "{sql} behind {before}: {replies:?}"
        );
        if before == "DISCARD ALL" {
            raw.send(&wire::query(&set_stale));
            raw.until_ready();
        }
    }
    assert_eq!(fx.count(vacuums).await, 0, "VACUUM ran");
    assert_eq!(
        fx.count("nt_audit").await,
        0,
        "a stale per-partition statement wrote"
    );
    assert_eq!(
        fx.count("pg_class WHERE relname = 'nt_stale'").await,
        0,
        "CREATE INDEX ran"
    );

    // The current token runs them, with both protocols.
    leader.simple("VACUUM nt").await.unwrap();
    leader.extended("CALL nt_proc('c')").await.unwrap();
    leader
        .extended("CREATE INDEX CONCURRENTLY nt_current ON nt (tag)")
        .await
        .unwrap();
    // Refused in a block: it once got pgfence's check appended to its Query, which made one
    // ("REINDEX SCHEMA cannot run inside a transaction block").
    leader.simple("REINDEX SCHEMA public").await.unwrap();
    leader.extended("REINDEX SCHEMA public").await.unwrap();
    for sql in per_partition {
        leader
            .simple(sql)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
        leader
            .extended(sql)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
    }
    assert!(
        fx.count("nt_audit").await > 0,
        "the leader's statements wrote"
    );
    assert_eq!(fx.count(vacuums).await, 1);
    assert_eq!(fx.count("nt WHERE tag LIKE 'c%'").await, 2);
    assert_eq!(fx.count("pg_class WHERE relname = 'nt_current'").await, 1);
}

/// Reads whose writes only the schema shows: a domain's CHECK, a user-defined operator, a
/// user function overloading a built-in name. The classifier takes each for a read; a
/// review found that with `fence.skip_read_only = true` (the default) a stale session's
/// write through them committed (2026-12-06). Now the database's read audit
/// (`pgfence.reads_may_write()`, asked at session start) says reads may write there, so
/// the session checks every transaction and each is rejected. With `fence.read_audit =
/// false` (the classifier alone) the stale writes commit, which shows the test can fail;
/// with `skip_read_only = false` every one is checked too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_that_write_through_the_schema_are_checked() {
    let setup = "
        CREATE TABLE sw (tag text);
        CREATE FUNCTION sw_write(tag text) RETURNS boolean LANGUAGE plpgsql
            AS $$ BEGIN INSERT INTO sw VALUES (tag); RETURN true; END $$;
        CREATE DOMAIN sw_d AS int CHECK (sw_write('domain'));
        CREATE FUNCTION sw_op(a int, b int) RETURNS int LANGUAGE plpgsql
            AS $$ BEGIN PERFORM sw_write('operator'); RETURN a + b; END $$;
        CREATE OPERATOR ### (FUNCTION = sw_op, LEFTARG = int, RIGHTARG = int);
        CREATE FUNCTION public.lower(i int) RETURNS int LANGUAGE plpgsql
            AS $$ BEGIN PERFORM sw_write('overload'); RETURN i; END $$;";
    let reads = ["SELECT 1::sw_d", "SELECT 1 ### 2", "SELECT lower(1)"];
    for (read_audit, skip_read_only) in [(true, true), (false, true), (false, false)] {
        let fx = Fixture::start(setup, |c| {
            c.fence.skip_read_only = skip_read_only;
            c.fence.read_audit = read_audit;
            c.fence.fast_path = false;
        })
        .await;
        let r = "schema_reads";
        fx.leader(r, 34)
            .await
            .simple("INSERT INTO sw VALUES ('leader')")
            .await
            .unwrap();
        let unchecked = !read_audit && skip_read_only;
        let mut stale_session = fx.leader(r, 33).await;
        for sql in reads {
            if unchecked {
                stale_session
                    .simple(sql)
                    .await
                    .unwrap_or_else(|e| panic!("{sql}: {e:?}"));
            } else {
                stale_session
                    .expect_rejection(Protocol::Simple, &[sql], &stale(r, 33, 34), sql)
                    .await;
                stale_session
                    .expect_rejection(Protocol::Extended, &[sql], &stale(r, 33, 34), sql)
                    .await;
            }
        }
        let landed = fx.count("sw WHERE tag <> 'leader'").await;
        assert_eq!(
            landed,
            if unchecked { 3 } else { 0 },
            "read_audit = {read_audit}, skip_read_only = {skip_read_only}"
        );
    }
}

/// A string literal continued on another line (`E'a'`, a newline, `'\'x'`) is one literal
/// to PostgreSQL, in its first part's mode. A review (2026-12-07) hid a stale `INSERT`, and
/// a `DELETE` with a `COMMIT` after it, in what pgfence's lexer took for a new literal: both
/// committed, the second with `skip_read_only = false` too. Run directly, each payload
/// writes (so the test can fail); through pgfence a stale session's is rejected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_string_continued_on_another_line_hides_no_statement() {
    let insert = "SELECT E'a'\n'\\'x' ; INSERT INTO sc VALUES ('stale'); SELECT 1 -- '";
    let delete = "SELECT e'a' -- c\n  '\\'x' ; DELETE FROM sc; COMMIT; SELECT 1 -- '";
    for skip_read_only in [true, false] {
        let fx = Fixture::start("CREATE TABLE sc (tag text);", |c| {
            c.fence.skip_read_only = skip_read_only;
            c.fence.fast_path = false;
        })
        .await;
        fx.direct.batch_execute(insert).await.unwrap();
        assert_eq!(fx.count("sc").await, 1, "the payload inserts");
        fx.direct.batch_execute("BEGIN").await.unwrap();
        fx.direct.batch_execute(delete).await.unwrap();
        assert_eq!(fx.count("sc").await, 0, "the payload deletes and commits");
        let r = "continued";
        fx.leader(r, 34)
            .await
            .simple("INSERT INTO sc VALUES ('leader')")
            .await
            .unwrap();
        let context = format!("skip_read_only = {skip_read_only}");
        let stale_session = fx.leader(r, 33).await;
        let result = stale_session.simple(insert).await;
        assert_rejected(&result, &stale(r, 33, 34), &context);
        stale_session.simple("BEGIN").await.unwrap();
        let result = stale_session.simple(delete).await;
        assert_rejected(&result, &stale(r, 33, 34), &context);
        stale_session.simple("ROLLBACK").await.unwrap();
        assert_eq!(
            fx.count("sc WHERE tag = 'leader'").await,
            1,
            "{context}: a stale DELETE committed"
        );
        assert_eq!(
            fx.count("sc WHERE tag = 'stale'").await,
            0,
            "{context}: a stale INSERT committed"
        );
    }
}

/// A `COMMIT` after a `BEGIN ATOMIC` body whose column label is `case` (a review,
/// 2026-12-07: pgfence counted the label as a `CASE`, took the rest of the Query for the
/// body, and a stale insert before the `COMMIT` committed unchecked). Run directly, each
/// payload commits its insert; through pgfence the stale one is rejected, or, where the
/// body cannot be balanced (a bare label), the Query is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_after_a_begin_atomic_body_is_seen() {
    let labelled = "BEGIN; INSERT INTO ab VALUES ('stale'); CREATE FUNCTION ab_f() RETURNS int \
                    LANGUAGE sql BEGIN ATOMIC SELECT 1 AS case; END; COMMIT; BEGIN; SELECT 1";
    let bare = "BEGIN; INSERT INTO ab VALUES ('stale'); CREATE FUNCTION ab_g() RETURNS int \
                LANGUAGE sql BEGIN ATOMIC SELECT 1 case; END; COMMIT; BEGIN; SELECT 1";
    let fx = Fixture::start("CREATE TABLE ab (tag text);", |c| c.fence.fast_path = false).await;
    for payload in [labelled, bare] {
        fx.direct.batch_execute(payload).await.unwrap();
        fx.direct.batch_execute("ROLLBACK").await.unwrap();
    }
    assert_eq!(fx.count("ab").await, 2, "each payload commits its insert");
    fx.direct
        .batch_execute("DELETE FROM ab; DROP FUNCTION ab_f(), ab_g()")
        .await
        .unwrap();
    let r = "atomic";
    fx.leader(r, 34)
        .await
        .simple("INSERT INTO ab VALUES ('leader')")
        .await
        .unwrap();
    let stale_session = fx.leader(r, 33).await;
    let result = stale_session.simple(labelled).await;
    assert_rejected(&result, &stale(r, 33, 34), labelled);
    let refused = fx.leader(r, 33).await.simple(bare).await;
    let code = refused
        .as_ref()
        .err()
        .and_then(|e| e.code())
        .map(|c| c.code());
    assert_eq!(code, Some("0A000"), "{refused:?}");
    assert_eq!(
        fx.count("ab WHERE tag = 'stale'").await,
        0,
        "a stale write committed"
    );
}

/// Attribute notation on a value that is not a relation's whole row (`('x').f` is `f('x')`,
/// `g.f` is `f(g)` for a function `g` in FROM) reaches any function of one argument, which
/// the read audit (schema version 9) no longer counts: the classifier takes these
/// statements for calls, so they are checked while plain reads skip the check. Run
/// directly, each statement writes (so the test can fail: a stale one through pgfence
/// would commit if it were skipped).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attribute_notation_on_a_value_is_checked() {
    let fx = Fixture::start(
        "CREATE TABLE an (tag text);
         CREATE FUNCTION an_write(tag text) RETURNS boolean LANGUAGE plpgsql
             AS $$ BEGIN INSERT INTO an VALUES (tag); RETURN true; END $$;",
        |c| {
            c.admin.users = vec![SUPERUSER.into()];
            c.fence.fast_path = false;
        },
    )
    .await;
    let reads = [
        "SELECT ('field').an_write",
        "SELECT (ARRAY['subscript'])[1].an_write",
        "SELECT g.an_write FROM lower('from') AS g",
        "SELECT g.an_write FROM ROWS FROM (lower('rows')) AS g",
        "SELECT g.an_write FROM coalesce('coalesce') AS g",
        "SELECT g.an_write FROM (SELECT 1) values, lower('values') g",
        "SELECT U&\"an_write\" UESCAPE '!'('uescape')",
    ];
    for sql in reads {
        fx.direct.batch_execute(sql).await.unwrap();
    }
    let direct_writes = fx.count("an").await;
    assert_eq!(direct_writes, reads.len() as i64, "each statement writes");
    let r = "attribute_notation";
    fx.leader(r, 34)
        .await
        .simple("INSERT INTO an VALUES ('leader')")
        .await
        .unwrap();
    // The read audit finds no way in: a plain read skips the check.
    let before = fx.checks_done().await;
    fx.leader(r, 33)
        .await
        .simple("SELECT count(*) FROM an")
        .await
        .unwrap();
    assert_eq!(fx.checks_done().await, before, "a plain read was checked");
    let mut stale_session = fx.leader(r, 33).await;
    for sql in reads {
        for protocol in [Protocol::Simple, Protocol::Extended] {
            stale_session
                .expect_rejection(protocol, &[sql], &stale(r, 33, 34), sql)
                .await;
        }
    }
    assert_eq!(
        fx.count("an").await,
        direct_writes + 1,
        "a stale write landed"
    );
}

/// A session's answer from the read audit does not outlive a change of the schema. A
/// session that started before a view calling a writer was created checks its reads once
/// its answer is a second old (it asks again), and its stale read through the view is
/// rejected. A session's own `CREATE VIEW` makes it check its reads at once and to its end:
/// a leader that created such a view and was deposed right after cannot write through it.
/// Meanwhile a session that only reads asks again about once a second, and skips nearly
/// every check.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_read_audit_is_asked_again() {
    let fx = Fixture::start(
        "CREATE TABLE rq (tag text);
         CREATE FUNCTION rq_write(tag text, n int) RETURNS boolean LANGUAGE plpgsql
             AS $$ BEGIN INSERT INTO rq VALUES (tag); RETURN true; END $$;
         CREATE FUNCTION rq_chk(n int) RETURNS int LANGUAGE plpgsql IMMUTABLE
             AS $$ BEGIN PERFORM rq_write('check', n); RETURN n; END $$;",
        |c| {
            c.admin.users = vec![SUPERUSER.into()];
            c.fence.fast_path = false;
        },
    )
    .await;
    let r = "asked_again";
    fx.leader(r, 34)
        .await
        .simple("INSERT INTO rq VALUES ('leader')")
        .await
        .unwrap();

    // A session that only reads, for 2.5 s: it asks again, and its reads skip the check
    // but for those made while an answer was out of date (one a question at most).
    let mut reader = fx.leader(r, 33).await;
    let (checks, questions) = (
        fx.checks_done().await,
        fx.stat("read_audit_questions").await,
    );
    let started = std::time::Instant::now();
    let mut reads = 0;
    while started.elapsed() < Duration::from_millis(2500) {
        reader.simple("SELECT count(*) FROM rq").await.unwrap();
        reader.extended("SELECT count(*) FROM rq").await.unwrap();
        reads += 2;
    }
    let asked = fx.stat("read_audit_questions").await - questions;
    let checked = fx.checks_done().await - checks;
    assert!(
        (1..=4).contains(&asked),
        "{asked} questions in 2.5 s of reads (one a second expected)"
    );
    assert!(
        checked <= asked,
        "{checked} of {reads} reads checked, with {asked} questions"
    );

    // The question is a Query, which drops the unnamed statement: it never goes before a
    // message that uses one the client parsed before (a Bind of it across a Sync), only
    // before a message that drops or replaces it (a Query).
    let mut raw = fx.raw_session(&format!("-c fencing.token=34 -c fencing.resource={r}"));
    raw.send(
        &[
            wire::parse("", "SELECT count(*) FROM rq", &[]),
            wire::sync(),
        ]
        .concat(),
    );
    raw.until_ready();
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let questions = fx.stat("read_audit_questions").await;
    raw.send(&[wire::bind("", "", &[]), wire::execute("", 0), wire::sync()].concat());
    let replies = raw.until_ready();
    assert!(
        replies.iter().all(|m| m.tag != b'E'),
        "the unnamed statement was lost: {replies:?}"
    );
    assert_eq!(
        fx.stat("read_audit_questions").await,
        questions,
        "asked before a Bind of the unnamed statement"
    );
    assert_eq!(raw.query_rows("SELECT 1").len(), 1);
    assert_eq!(
        fx.stat("read_audit_questions").await,
        questions + 1,
        "not asked before a Query"
    );
    drop(raw);

    // Another session's DDL: the reader's answer is out of date a second later.
    fx.direct
        .batch_execute("CREATE VIEW rq_v AS SELECT rq_write('view', 0) AS w")
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(1200)).await;
    for protocol in PROTOCOLS {
        reader
            .expect_rejection(
                protocol,
                &["SELECT * FROM rq_v"],
                &stale(r, 33, 34),
                "a session older than the view",
            )
            .await;
    }
    assert_eq!(
        fx.count("rq WHERE tag = 'view'").await,
        0,
        "a stale write landed"
    );
    fx.direct.batch_execute("DROP VIEW rq_v").await.unwrap();
    tokio::time::sleep(Duration::from_millis(1200)).await;

    // The session's own DDL: the leader creates a view calling the writer, a new leader
    // takes over, and the first one, deposed, reads through its view at once.
    for (protocol, token) in [(Protocol::Simple, 34), (Protocol::Extended, 35)] {
        let view = format!("rq_own_{token}");
        let mut leader = fx.leader(r, token).await;
        let checks = fx.checks_done().await;
        leader.simple("SELECT count(*) FROM rq").await.unwrap();
        assert_eq!(
            fx.checks_done().await,
            checks,
            "{protocol:?}: reads are checked before the view"
        );
        let create = format!("CREATE VIEW {view} AS SELECT rq_write('{view}', 0) AS w");
        match protocol {
            Protocol::Simple => leader.simple(&create).await.unwrap(),
            Protocol::Extended => leader.extended(&create).await.unwrap(),
        }
        fx.leader(r, token + 1)
            .await
            .simple("INSERT INTO rq VALUES ('new leader')")
            .await
            .unwrap();
        let read = format!("SELECT * FROM {view}");
        leader
            .expect_rejection(
                protocol,
                &[&read],
                &stale(r, token, token + 1),
                "a deposed leader reading through its own view",
            )
            .await;
        assert_eq!(
            fx.count(&format!("rq WHERE tag = '{view}'")).await,
            0,
            "{protocol:?}: a stale write landed through the session's own view"
        );
        // Its reads stay checked after its answer's second (the audit leaves temporary
        // objects out, so asking again would not tell).
        tokio::time::sleep(Duration::from_millis(1200)).await;
        let checks = fx.checks_done().await;
        leader.simple("SELECT count(*) FROM rq").await.unwrap();
        assert_eq!(
            fx.checks_done().await,
            checks + 1,
            "{protocol:?}: a read after the session's own DDL was not checked"
        );
        // Gone again, so that the next round's leader starts with reads skipping the check.
        fx.direct
            .batch_execute(&format!("DROP VIEW {view}"))
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(1200)).await;
    }

    // A temporary child table whose CHECK calls a writer: the planner runs it for a plain
    // SELECT of the parent (constraint exclusion), and the audit leaves temporary relations
    // out. Directly, such a read writes; the session's own CREATE TABLE counts.
    let temp_tables = "CREATE TEMP TABLE rq_tp (a int);
         CREATE TEMP TABLE rq_tc (CHECK (a > rq_chk(0))) INHERITS (rq_tp)";
    let other = fx.cluster.connect(APP_DB).await;
    other.batch_execute(temp_tables).await.unwrap();
    let before = fx.count("rq WHERE tag = 'check'").await;
    other
        .batch_execute("SELECT * FROM rq_tp WHERE a = 1")
        .await
        .unwrap();
    assert!(
        fx.count("rq WHERE tag = 'check'").await > before,
        "directly, the read did not write: the test proves nothing"
    );
    drop(other);
    let before = fx.count("rq WHERE tag = 'check'").await;
    let mut leader = fx.leader(r, 37).await;
    leader.simple(temp_tables).await.unwrap();
    fx.leader(r, 38)
        .await
        .simple("INSERT INTO rq VALUES ('new leader')")
        .await
        .unwrap();
    leader
        .expect_rejection(
            Protocol::Simple,
            &["SELECT * FROM rq_tp WHERE a = 1"],
            &stale(r, 37, 38),
            "a deposed leader reading its temporary table with a CHECK",
        )
        .await;
    assert_eq!(
        fx.count("rq WHERE tag = 'check'").await,
        before,
        "a stale write landed through a temporary table's CHECK"
    );
}

/// A session that started while its database had no schema `pgfence` (reads skip the check
/// as the classifier says) follows the read audit once the schema is installed: a view
/// calling a writer created after the install makes its stale read fail. The question's
/// own notices (a `log_statement` echo) do not reach the client.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_opened_before_the_schema_follows_the_audit_after_it() {
    let fx = Fixture::start(
        "CREATE TABLE rm (tag text);
         CREATE FUNCTION rm_write(tag text, n int) RETURNS boolean LANGUAGE plpgsql
             AS $$ BEGIN INSERT INTO rm VALUES (tag); RETURN true; END $$;
         DROP SCHEMA pgfence CASCADE;",
        |c| {
            c.admin.users = vec![SUPERUSER.into()];
            c.fence.fast_path = false;
        },
    )
    .await;
    let r = "before_the_schema";
    let mut stale_session = fx.leader(r, 33).await;
    stale_session
        .simple("SELECT count(*) FROM rm")
        .await
        .unwrap();
    // A leader of another resource, opened before the schema too, that will make a
    // temporary view after the install (the audit leaves those out).
    let own = "own_temp_view";
    let mut leader = fx.leader(own, 40).await;
    install(&fx.direct).await;
    leader
        .simple("CREATE TEMP VIEW rm_tv AS SELECT rm_write('temp', 0) AS w")
        .await
        .unwrap();
    fx.leader(own, 41)
        .await
        .simple("INSERT INTO rm VALUES ('new leader')")
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(1200)).await;
    // The first read is checked while the session asks again; the next ones after the
    // answer (false: the audit leaves the temporary view out).
    for protocol in [Protocol::Simple, Protocol::Simple, Protocol::Extended] {
        leader
            .expect_rejection(
                protocol,
                &["SELECT * FROM rm_tv"],
                &stale(own, 40, 41),
                "a deposed leader reading its temporary view, made before its first answer",
            )
            .await;
    }
    assert_eq!(
        fx.count("rm WHERE tag = 'temp'").await,
        0,
        "a stale write landed through the session's temporary view"
    );
    fx.direct
        .batch_execute("CREATE VIEW rm_v AS SELECT rm_write('view', 0) AS w")
        .await
        .unwrap();
    fx.leader(r, 34)
        .await
        .simple("INSERT INTO rm VALUES ('leader')")
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(1200)).await;
    for protocol in PROTOCOLS {
        stale_session
            .expect_rejection(
                protocol,
                &["SELECT * FROM rm_v"],
                &stale(r, 33, 34),
                "a session opened before pgfence install",
            )
            .await;
    }
    assert_eq!(
        fx.count("rm WHERE tag = 'view'").await,
        0,
        "a stale write landed"
    );

    // The question asked again says nothing to the client.
    let mut session = fx.leader(r, 34).await;
    session
        .simple("SET client_min_messages = log; SET log_statement = 'all'")
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(1200)).await;
    session.simple("SELECT 1").await.unwrap();
    session.simple("SELECT 2").await.unwrap();
    // Nor does the check of an extended-protocol write (its Bind and Execute).
    session
        .extended("INSERT INTO rm VALUES ('echoed')")
        .await
        .unwrap();
    let mut seen = Vec::new();
    while let Ok(notice) = session.notices.try_recv() {
        seen.push(notice.message().to_string());
    }
    assert!(
        seen.iter().any(|m| m.contains("SELECT 2")),
        "no statement echo at all: {seen:?}"
    );
    assert!(
        !seen.iter().any(|m| m.contains("reads_may_write")),
        "the question's notice reached the client: {seen:?}"
    );
    assert!(
        seen.iter().any(|m| m.contains("echoed")),
        "no echo of the write: {seen:?}"
    );
    // (A simple Query's check is part of the client's Query: its echo shows it.)
    assert!(
        !seen.iter().any(|m| m.starts_with("execute pgfence_")),
        "the check's notice reached the client: {seen:?}"
    );
}

/// A stale write Query that the fast path rejects without a round trip drops the client's
/// unnamed statement, as PostgreSQL drops it at any Query: with one alive, the rejection
/// goes upstream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fast_path_rejection_drops_the_unnamed_statement() {
    let fx = Fixture::start("CREATE TABLE fu (tag text);", |c| {
        c.admin.users = vec![SUPERUSER.into()];
    })
    .await;
    let r = "fast_unnamed";
    fx.leader(r, 34)
        .await
        .simple("INSERT INTO fu VALUES ('leader')")
        .await
        .unwrap();
    let mut direct = fx.raw_direct();
    let mut stale_session = fx.raw_session(&format!("-c fencing.token=33 -c fencing.resource={r}"));
    let mut replies = Vec::new();
    for conn in [&mut direct, &mut stale_session] {
        conn.send(&[wire::parse("", "SELECT 41 + 1", &[]), wire::sync()].concat());
        conn.until_ready();
        conn.send(&wire::query("INSERT INTO fu VALUES ('stale')"));
        conn.until_ready();
        conn.send(&[wire::bind("", "", &[]), wire::execute("", 0), wire::sync()].concat());
        let msgs = conn.until_ready();
        replies.push(msgs.iter().find_map(|m| m.sqlstate()));
    }
    assert_eq!(
        replies[0].as_deref(),
        Some("26000"),
        "PostgreSQL: {replies:?}"
    );
    assert_eq!(replies[1], replies[0], "through pgfence: {replies:?}");
    assert_eq!(
        fx.count("fu WHERE tag = 'stale'").await,
        1,
        "the direct insert only"
    );
}

/// pgfence's `RESET pgfence.accepted` after a `PREPARE TRANSACTION` that accepted a token
/// leaves the client's unnamed statement alone: a simple Query would drop it, so a Bind of
/// it after the prepared transaction runs, as on PostgreSQL directly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reset_after_a_prepared_transaction_keeps_the_unnamed_statement() {
    let fx = Fixture::start("CREATE TABLE pu (tag text);", |_| {}).await;
    let r = "prepared_unnamed";
    let mut direct = fx.raw_direct();
    let mut fenced = fx.raw_session(&format!("-c fencing.token=34 -c fencing.resource={r}"));
    let mut answers = Vec::new();
    for (conn, gid) in [(&mut direct, "pu_direct"), (&mut fenced, "pu_fenced")] {
        conn.send(&wire::query("BEGIN; INSERT INTO pu VALUES ('prepared')"));
        conn.until_ready();
        let prepare = format!("PREPARE TRANSACTION '{gid}'");
        conn.send(
            &[
                wire::parse("", "SELECT 41 + 1", &[]),
                wire::parse("pu_prepare", prepare.as_str(), &[]),
                wire::bind("", "pu_prepare", &[]),
                wire::execute("", 0),
                wire::sync(),
            ]
            .concat(),
        );
        let prepared = conn.until_ready();
        assert!(
            prepared.iter().all(|m| m.tag != b'E'),
            "{gid}: {prepared:?}"
        );
        conn.send(&[wire::bind("", "", &[]), wire::execute("", 0), wire::sync()].concat());
        let msgs = conn.until_ready();
        answers.push(
            msgs.iter()
                .map(|m| m.data_row().map_or(m.tag, |_| b'D'))
                .collect::<Vec<u8>>(),
        );
        conn.send(&wire::query(format!("COMMIT PREPARED '{gid}'")));
        conn.until_ready();
    }
    assert_eq!(answers[0], b"2DCZ", "PostgreSQL: {answers:?}");
    assert_eq!(answers[1], answers[0], "through pgfence: {answers:?}");
    assert_eq!(fx.count("pu").await, 2, "both prepared transactions commit");
}

/// pgfence's `ROLLBACK` after a failed check before a client's `COMMIT` (the server skipped
/// the `COMMIT` and left the block failed) does to the client's unnamed statement what the
/// `COMMIT` would have done on PostgreSQL directly: a `COMMIT` in an extended-protocol batch
/// leaves it (a Bind of it after the rejection runs), a `COMMIT` Query drops it (26000).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rollback_after_a_failed_check_keeps_the_unnamed_statement() {
    let fx = Fixture::start("CREATE TABLE ru (tag text);", |c| {
        c.fence.fast_path = false;
    })
    .await;
    let r = "rollback_unnamed";
    fx.leader(r, 34)
        .await
        .simple("INSERT INTO ru VALUES ('leader')")
        .await
        .unwrap();
    let mut direct = fx.raw_direct();
    let mut stale = fx.raw_session(&format!("-c fencing.token=33 -c fencing.resource={r}"));
    let commit_in_batch = [
        wire::parse("ru_commit", "COMMIT", &[]),
        wire::bind("", "ru_commit", &[]),
        wire::execute("", 0),
        wire::sync(),
    ]
    .concat();
    let mut answers = Vec::new();
    for conn in [&mut direct, &mut stale] {
        for commit in [commit_in_batch.clone(), wire::query("COMMIT")] {
            conn.send(&wire::query("BEGIN; INSERT INTO ru VALUES ('stale')"));
            conn.until_ready();
            conn.send(&[wire::parse("", "SELECT 41 + 1", &[]), wire::sync()].concat());
            conn.until_ready();
            conn.send(&commit);
            let committed = conn.until_ready();
            answers.push(first_error(&committed));
            conn.send(&[wire::bind("", "", &[]), wire::execute("", 0), wire::sync()].concat());
            let msgs = conn.until_ready();
            answers.push(Some(
                msgs.iter()
                    .map(|m| m.data_row().map_or(m.tag as char, |_| 'D'))
                    .collect(),
            ));
        }
    }
    let (ran, dropped) = (Some("2DCZ".to_string()), Some("EZ".to_string()));
    let stale_write = Some("FN001".to_string());
    assert_eq!(
        answers,
        [
            None,
            ran.clone(),
            None,
            dropped.clone(),
            stale_write.clone(),
            ran,
            stale_write,
            dropped
        ],
        "PostgreSQL directly (COMMIT in a batch, as a Query), then the stale session through \
         pgfence"
    );
    assert_eq!(
        fx.count("ru WHERE tag = 'stale'").await,
        2,
        "the direct inserts only"
    );
}

/// The fast path's rejection of an extended-protocol write runs in a portal of pgfence's
/// own: the client's suspended unnamed portal lives on, as after any error on PostgreSQL,
/// and goes on after `ROLLBACK TO SAVEPOINT`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fast_path_rejection_keeps_the_unnamed_portal() {
    let fx = Fixture::start("CREATE TABLE fp (tag text CHECK (tag <> 'stale'));", |_| {}).await;
    let r = "fast_portal";
    fx.leader(r, 34)
        .await
        .simple("INSERT INTO fp VALUES ('leader')")
        .await
        .unwrap();
    let mut direct = fx.raw_direct();
    let mut stale = fx.raw_session(&format!("-c fencing.token=33 -c fencing.resource={r}"));
    // Directly, the CHECK fails the write where pgfence's fast path rejects it.
    let named = |name: &str, sql: &str| {
        [
            wire::parse(name, sql, &[]),
            wire::bind(name, name, &[]),
            wire::execute(name, 0),
        ]
        .concat()
    };
    let mut answers = Vec::new();
    for conn in [&mut direct, &mut stale] {
        conn.send(&wire::query("BEGIN"));
        conn.until_ready();
        conn.send(
            &[
                wire::parse("", "SELECT generate_series(1, 6)", &[]),
                wire::bind("", "", &[]),
                wire::execute("", 2),
                named("fp_savepoint", "SAVEPOINT s"),
                named("fp_write", "INSERT INTO fp VALUES ('stale')"),
                wire::sync(),
            ]
            .concat(),
        );
        let failed = conn.until_ready();
        answers.push(first_error(&failed));
        conn.send(
            &[
                named("fp_back", "ROLLBACK TO SAVEPOINT s"),
                wire::execute("", 2),
                wire::sync(),
            ]
            .concat(),
        );
        let rows: Vec<String> = conn
            .until_ready()
            .iter()
            .map(|m| match m.data_row() {
                Some(row) => String::from_utf8_lossy(row[0].as_deref().unwrap_or_default()).into(),
                None => (m.tag as char).to_string(),
            })
            .collect();
        answers.push(Some(rows.concat()));
        conn.send(&wire::query("ROLLBACK"));
        conn.until_ready();
    }
    let resumed = Some("12C34sZ".to_string());
    assert_eq!(
        answers,
        [
            Some("23514".to_string()),
            resumed.clone(),
            Some("FN001".to_string()),
            resumed
        ],
        "PostgreSQL directly, then the stale session through pgfence"
    );
    // A client's portal of the rejection's name is pgfence's to close: the client is still
    // told its write is stale (not 42P03, cursor already exists).
    stale.send(&wire::query("BEGIN"));
    stale.until_ready();
    stale.send(
        &[
            wire::parse("fp_rows", "SELECT generate_series(1, 6)", &[]),
            wire::bind("pgfence_fast_reject", "fp_rows", &[]),
            wire::execute("pgfence_fast_reject", 2),
            named("fp_write_2", "INSERT INTO fp VALUES ('stale')"),
            wire::sync(),
        ]
        .concat(),
    );
    let failed = stale.until_ready();
    assert_eq!(first_error(&failed).as_deref(), Some("FN001"), "{failed:?}");
    stale.send(&wire::query("ROLLBACK"));
    stale.until_ready();
}

/// A question asked again that fails in a way that passes (here its session's
/// `statement_timeout`, behind a lock on the audit's table; a client's cancel that comes
/// late is the same 57014) checks reads until it is asked again, a second later, and then
/// the reads skip the check again: the session does not pay for every read to its end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_question_that_timed_out_is_asked_again() {
    let fx = Fixture::start("CREATE TABLE qt (tag text);", |c| {
        c.admin.users = vec![SUPERUSER.into()];
        c.fence.fast_path = false;
    })
    .await;
    let r = "question_timed_out";
    let reader = fx.leader(r, 34).await;
    reader
        .simple("SET statement_timeout = '300ms'")
        .await
        .unwrap();
    let locker = fx.lock_read_audit().await;
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let (checks, questions) = (
        fx.checks_done().await,
        fx.stat("read_audit_questions").await,
    );
    // Asked before this read, and timed out: the read is checked, and answered.
    reader.simple("SELECT count(*) FROM qt").await.unwrap();
    assert_eq!(fx.stat("read_audit_questions").await - questions, 1);
    assert_eq!(fx.checks_done().await - checks, 1, "the read is checked");
    locker.batch_execute("ROLLBACK").await.unwrap();
    // The failure came 300 ms after the question; reads are checked for a second after it.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let (checks, questions) = (
        fx.checks_done().await,
        fx.stat("read_audit_questions").await,
    );
    for _ in 0..10 {
        reader.simple("SELECT count(*) FROM qt").await.unwrap();
        reader.extended("SELECT count(*) FROM qt").await.unwrap();
    }
    let asked = fx.stat("read_audit_questions").await - questions;
    let checked = fx.checks_done().await - checks;
    assert!(asked >= 1, "not asked again");
    assert!(
        checked <= asked,
        "{checked} of 20 reads checked after the question got through ({asked} asked)"
    );
}

/// A fixture whose console counts the read audit's questions, and a leader of `resource`
/// whose answer is out of date: its next statement goes behind a question.
async fn reader_due_to_ask(resource: &str) -> (Fixture, Session) {
    let fx = Fixture::start("", |c| {
        c.admin.users = vec![SUPERUSER.into()];
    })
    .await;
    let reader = fx.leader(resource, 34).await;
    reader.simple("SELECT 1").await.unwrap();
    tokio::time::sleep(Duration::from_millis(1200)).await;
    (fx, reader)
}

/// While a lock holds the read audit's question up, a session does not ask again at every
/// statement: each question waits out its `lock_timeout` (1 s), so a failure counts from
/// when it came, and the wait before the next question doubles. Over 3.5 s of statements
/// behind the lock, the session asks at 0 s, 2 s and then not before 5 s: two questions. It
/// asked four times, each statement behind one waiting a second, when a failed question
/// counted from when it was sent (and so was out of date as it failed).
#[tokio::test]
async fn a_locked_audit_is_not_asked_about_at_every_statement() {
    let (fx, reader) = reader_due_to_ask("question_locked").await;
    let locker = fx.lock_read_audit().await;
    let questions = fx.stat("read_audit_questions").await;
    let started = std::time::Instant::now();
    while started.elapsed() < Duration::from_millis(3500) {
        reader.simple("SELECT 1").await.unwrap();
    }
    let asked = fx.stat("read_audit_questions").await - questions;
    locker.batch_execute("ROLLBACK").await.unwrap();
    assert!(
        (1..=2).contains(&asked),
        "{asked} questions in 3.5 s behind the lock"
    );
}

/// A client's cancel that comes while the read audit's question runs before the client's
/// statement cancels the statement, as it would directly, not the question: pgfence holds
/// it until the question is answered. Here the question waits for a lock on the audit's
/// table; the cancel comes meanwhile, and the lock goes before the question's own
/// `lock_timeout` (1 s). Without the hold the cancel failed the question and the
/// statement ran to its end.
#[tokio::test]
async fn a_cancel_during_the_question_cancels_the_clients_statement() {
    let (fx, reader) = reader_due_to_ask("question_cancel").await;
    let locker = fx.lock_read_audit().await;
    let questions = fx.stat("read_audit_questions").await;
    let token = reader.client.cancel_token();
    let canceller = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(300)).await;
        token
            .cancel_query(tokio_postgres::NoTls)
            .await
            .expect("cancel_query");
        tokio::time::sleep(Duration::from_millis(300)).await;
        locker.batch_execute("ROLLBACK").await.unwrap();
    });
    let slept = reader.client.simple_query("SELECT pg_sleep(10)").await;
    canceller.await.unwrap();
    assert_eq!(
        fx.stat("read_audit_questions").await - questions,
        1,
        "the question went before the statement"
    );
    assert_eq!(
        sqlstate(&slept).as_deref(),
        Some("57014"),
        "the cancel reached the client's statement: {slept:?}"
    );
    reader.simple("SELECT 1").await.unwrap();
}

/// The same when the client leaves right after its cancel (a client that gives up on a
/// statement: cancel, then close): the held cancel still reaches the statement, which
/// directly would be cancelled and commit nothing. The session stays until the question is
/// answered and the cancel forwarded; before, the `INSERT` behind the question committed.
/// The cancel's own connection stays open until then, as PostgreSQL keeps it until it has
/// signalled the backend.
#[tokio::test]
async fn a_cancel_held_for_the_question_outlives_its_client() {
    let fx = Fixture::start("CREATE TABLE cl (tag text);", |_| {}).await;
    let mut conn = RawConn::connect(fx.proxy.addr());
    conn.send(&wire::startup_version(
        wire::PROTOCOL_3_0,
        &[
            ("user", SUPERUSER.as_bytes()),
            ("database", APP_DB.as_bytes()),
            (
                "options",
                b"-c fencing.token=34 -c fencing.resource=cancel_left",
            ),
        ],
    ));
    let login = conn.until_ready();
    let key = login
        .iter()
        .find(|m| m.tag == b'K')
        .map(|m| m.body.clone())
        .expect("BackendKeyData");
    let pid = i32::from_be_bytes([key[0], key[1], key[2], key[3]]);
    let secret = i32::from_be_bytes([key[4], key[5], key[6], key[7]]);
    conn.send(&wire::query("SELECT 1"));
    conn.until_ready();
    // The answer is out of date: the question goes before the INSERT, and waits.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let locker = fx.lock_read_audit().await;
    conn.send(&wire::query("INSERT INTO cl SELECT 'x' FROM pg_sleep(3)"));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut cancel = RawConn::connect(fx.proxy.addr());
    cancel.send(&wire::cancel_request(pid, secret));
    // The cancel connection stays open until the cancel reaches the server (libpq's
    // PQcancel returns then), not while it is held.
    cancel.expect_silence(Duration::from_millis(200));
    conn.send(&wire::terminate());
    drop(conn);
    tokio::time::sleep(Duration::from_millis(200)).await;
    locker.batch_execute("ROLLBACK").await.unwrap();
    cancel.read_to_end();
    // pg_sleep(3) would have ended by now.
    tokio::time::sleep(Duration::from_millis(3500)).await;
    assert_eq!(fx.count("cl").await, 0, "the cancelled INSERT committed");
}

/// Writers a Bind can run with no Execute after it: `bw_imm` is declared `IMMUTABLE` (the
/// planner folds it at Bind) and calls a writer; `bw_dom`'s `CHECK` calls one when a
/// parameter is converted to it.
const BIND_WRITERS: &str = "CREATE TABLE bw (tag text);
     CREATE FUNCTION bw_w(t text) RETURNS int LANGUAGE plpgsql
         AS $$ BEGIN INSERT INTO bw VALUES (t); RETURN 1; END $$;
     CREATE FUNCTION bw_imm(t text) RETURNS int LANGUAGE plpgsql IMMUTABLE
         AS $$ BEGIN PERFORM bw_w(t); RETURN 1; END $$;
     CREATE DOMAIN bw_dom AS text CHECK (bw_w(VALUE) = 1);";

/// A cluster with [`BIND_WRITERS`], the fast path off (the database check is under test),
/// where the leader of resource `bw` wrote with token 34.
async fn bind_writers_after_leader_34() -> Fixture {
    let fx = Fixture::start(BIND_WRITERS, |c| c.fence.fast_path = false).await;
    fx.leader("bw", 34)
        .await
        .simple("INSERT INTO bw VALUES ('leader 34')")
        .await
        .unwrap();
    fx
}

/// The oid of [`BIND_WRITERS`]' domain `bw_dom`, for a Parse that declares it.
async fn bw_dom_oid(fx: &Fixture) -> u32 {
    fx.direct
        .query_one("SELECT 'bw_dom'::regtype::oid", &[])
        .await
        .unwrap()
        .get(0)
}

/// No row tagged `stale...` reached table `bw`.
async fn assert_no_stale_bind_write(fx: &Fixture) {
    assert_eq!(
        fx.count("bw WHERE tag LIKE 'stale%'").await,
        0,
        "a stale Bind's write committed"
    );
}

/// A Bind writes, directly, when its planning or its parameters run a writer: Parse, Bind,
/// Sync with no Execute commits a row. Through pgfence a stale session's such batch is
/// checked at its Sync (FN001, nothing written), and so is one pipelined behind a batch
/// whose `BEGIN` never ran, or ended by a Query rather than a Sync. (An adversarial review
/// found all three committing: the first two since before stop 51, the last two after a
/// change that gave a Sync no check when its batch executed nothing.)
#[tokio::test]
async fn a_bind_that_writes_is_checked() {
    let fx = bind_writers_after_leader_34().await;
    let stale = "-c fencing.token=33 -c fencing.resource=bw";
    let bind_alone = |statement: &str, sql: &str, param: Option<&str>| {
        [
            wire::parse(statement, sql, &[]),
            wire::bind("", statement, &[param.map(str::as_bytes)]),
            wire::sync(),
        ]
        .concat()
    };
    let mut direct = fx.raw_direct();
    direct.send(&bind_alone("d", "SELECT $1::bw_dom", Some("direct")));
    direct.until_ready();
    assert_eq!(
        fx.count("bw WHERE tag = 'direct'").await,
        1,
        "a Bind writes"
    );

    let mut conn = fx.raw_session(stale);
    conn.send(&bind_alone("d", "SELECT $1::bw_dom", Some("domain")));
    assert_eq!(first_error(&conn.until_ready()).as_deref(), Some("FN001"));
    let folded = [
        wire::parse("i", "SELECT bw_imm('folded')", &[]),
        wire::bind("", "i", &[]),
        wire::sync(),
    ]
    .concat();
    conn.send(&folded);
    assert_eq!(first_error(&conn.until_ready()).as_deref(), Some("FN001"));

    // Behind a batch whose BEGIN an error skipped (pgfence cannot tell, and has no check
    // at that Sync), all in one write.
    let failed_begin = [
        wire::parse("", "SELECT 1/0", &[]),
        wire::bind("", "", &[]),
        wire::execute("", 0),
        wire::parse("", "BEGIN", &[]),
        wire::bind("", "", &[]),
        wire::execute("", 0),
        wire::sync(),
    ]
    .concat();
    let mut conn = fx.raw_session(stale);
    conn.send(
        &[
            failed_begin.clone(),
            wire::parse("", "SELECT bw_imm('behind')", &[]),
            wire::bind("", "", &[]),
            wire::sync(),
        ]
        .concat(),
    );
    conn.until_ready();
    assert_eq!(first_error(&conn.until_ready()).as_deref(), Some("FN001"));
    let mut conn = fx.raw_session(stale);
    conn.send(
        &[
            failed_begin,
            wire::parse("", "SELECT bw_imm('query')", &[]),
            wire::bind("", "", &[]),
            wire::query("SET LOCAL work_mem = '2MB'"),
            wire::sync(),
        ]
        .concat(),
    );
    conn.until_ready();
    conn.until_ready();
    conn.until_ready();
    assert_eq!(
        fx.count("bw WHERE tag <> 'leader 34' AND tag <> 'direct'")
            .await,
        0,
        "a stale Bind's write committed"
    );
}

/// A Bind converts every parameter value it carries, whatever its statement: a Parse may
/// declare a domain type that the text never uses, even for `COMMIT`, `BEGIN` or an empty
/// statement, and the domain's `CHECK` then runs at the Bind (directly, Parse, Bind, Sync
/// commits a row). Through pgfence a stale session's such batch is checked at its Sync,
/// also when a `VACUUM` Query ends it; and a comment token on a statement that is only
/// bound applies to its transaction, as at its Execute. (An adversarial review found each
/// committing: pgfence counted such Binds as writing nothing, and read a bound statement's
/// comment only at its Execute.)
#[tokio::test]
async fn a_bind_of_any_statement_converts_its_parameters_under_the_fence() {
    let fx = bind_writers_after_leader_34().await;
    let dom = bw_dom_oid(&fx).await;
    let bind_alone = |sql: &str, tag: &str| {
        [
            wire::parse("d", sql, &[dom]),
            wire::bind("", "d", &[Some(tag.as_bytes())]),
            wire::sync(),
        ]
        .concat()
    };
    let mut direct = fx.raw_direct();
    direct.send(&bind_alone("COMMIT", "direct"));
    let replies = direct.until_ready();
    assert_eq!(first_error(&replies), None, "{replies:?}");
    assert_eq!(
        fx.count("bw WHERE tag = 'direct'").await,
        1,
        "a Bind writes"
    );

    let stale = "-c fencing.token=33 -c fencing.resource=bw";
    for sql in ["", "COMMIT", "BEGIN", "SAVEPOINT a", "DISCARD ALL"] {
        let mut conn = fx.raw_session(stale);
        conn.send(&bind_alone(sql, &format!("stale {sql}")));
        let replies = conn.until_ready();
        assert_eq!(
            first_error(&replies).as_deref(),
            Some("FN001"),
            "{sql:?}: {replies:?}"
        );
    }
    let mut conn = fx.raw_session(stale);
    conn.send(
        &[
            wire::parse("", "COMMIT", &[]),
            wire::bind("", "", &[]),
            wire::execute("", 0),
            wire::parse("d", "COMMIT", &[dom]),
            wire::bind("", "d", &[Some(b"stale vacuum")]),
            wire::query("VACUUM bw"),
            wire::sync(),
        ]
        .concat(),
    );
    assert_eq!(first_error(&conn.until_ready()).as_deref(), Some("FN001"));
    conn.until_ready();

    // The current leader's session, but the bound statement's comment carries a stale
    // token: it is that transaction's.
    let commented = "/* fencing_token=33 fencing_resource=bw */ SELECT $1::bw_dom";
    let mut conn = fx.raw_session("-c fencing.token=34 -c fencing.resource=bw");
    conn.send(&bind_alone(commented, "stale comment"));
    let replies = conn.until_ready();
    assert_stale(&replies);
    // The same Bind sent while the previous batch's ReadyForQuery is still to come, its
    // Sync after that: the ReadyForQuery ends the previous transaction, not the Bind's.
    let mut conn = fx.raw_session("-c fencing.token=34 -c fencing.resource=bw");
    conn.send(
        &[
            wire::parse("", "SELECT 1", &[]),
            wire::bind("", "", &[]),
            wire::execute("", 0),
            wire::sync(),
            wire::parse("d", commented, &[dom]),
            wire::bind("", "d", &[Some(b"stale comment later")]),
        ]
        .concat(),
    );
    conn.until_ready();
    tokio::time::sleep(Duration::from_millis(200)).await;
    conn.send(&wire::sync());
    let replies = conn.until_ready();
    assert_stale(&replies);
    // And in one write, behind a Query, with an Executed COMMIT that waits for the Query's
    // ReadyForQuery (a review's variant).
    let mut conn = fx.raw_session("-c fencing.token=34 -c fencing.resource=bw");
    conn.send(
        &[
            wire::query("ROLLBACK"),
            wire::parse("d", commented, &[]),
            wire::bind("", "d", &[Some(b"stale behind a query")]),
            wire::parse("c", "COMMIT", &[]),
            wire::bind("c", "c", &[]),
            wire::execute("c", 0),
            wire::sync(),
        ]
        .concat(),
    );
    conn.until_ready();
    let replies = conn.until_ready();
    assert_stale(&replies);
    assert_no_stale_bind_write(&fx).await;
}

/// A Bind flushed and answered, then a Query: the Query runs in the Bind's implicit
/// transaction and commits what the Bind wrote, so its check covers that. pgfence may
/// prepare its check statement before a Query, with a Sync of its own, when nothing is in
/// flight; after such a Bind that Sync committed the Bind's write before the check (a
/// review found it; older than stop 51). The first Query makes pgfence send its next check
/// as text, and prepare it before the next Query.
#[tokio::test]
async fn a_query_after_a_flushed_bind_prepares_nothing_before_it() {
    let fx = bind_writers_after_leader_34().await;
    let dom = bw_dom_oid(&fx).await;
    let mut conn = fx.raw_session("-c fencing.token=33 -c fencing.resource=bw");
    conn.send(&wire::query("INSERT INTO bw VALUES ('stale query')"));
    assert_eq!(first_error(&conn.until_ready()).as_deref(), Some("FN001"));
    conn.send(
        &[
            wire::parse("d", "SELECT $1::bw_dom", &[dom]),
            wire::bind("", "d", &[Some(b"stale flushed bind")]),
            wire::flush(),
        ]
        .concat(),
    );
    conn.until(|m| m.tag == b'2');
    tokio::time::sleep(Duration::from_millis(200)).await;
    conn.send(&wire::query("SELECT 1"));
    let replies = conn.until_ready();
    assert_stale(&replies);
    // Queries pgfence plans no check of their own for (an empty one, a lone block-sensitive
    // statement, `DISCARD ALL`): the batch's write is checked before them (a review found
    // each committing it; older than stop 51).
    for query in ["", "/* hi */", "DISCARD ALL", "SET LOCAL work_mem = '5MB'"] {
        conn.send(
            &[
                wire::bind("", "d", &[Some(b"stale flushed bind")]),
                wire::flush(),
            ]
            .concat(),
        );
        conn.until(|m| m.tag == b'2');
        tokio::time::sleep(Duration::from_millis(100)).await;
        conn.send(&wire::query(query));
        assert_stale(&conn.until_ready());
    }
    assert_no_stale_bind_write(&fx).await;
}

/// A comment token ends with its transaction also where pgfence cannot tell whether a
/// statement ended it: an Executed `DO` or `CALL` that commits inside, and a SQL `EXECUTE`
/// of a `COMMIT` parsed in the extended protocol. The current token on a read before them
/// once fenced a stale session's write after them (a review; older than stop 51).
#[tokio::test]
async fn a_comment_token_ends_where_a_statement_of_the_batch_may_end_its_transaction() {
    let (fx, stale) = Fixture::after_leader_34("ct", |_| {}).await;
    fx.direct
        .batch_execute(
            "CREATE PROCEDURE ct_pc(t text) LANGUAGE plpgsql AS \
             $$ BEGIN COMMIT; INSERT INTO ct VALUES (t); END $$",
        )
        .await
        .unwrap();
    let read = "/* fencing_token=34 fencing_resource=ct */ SELECT 1";
    for (case, ends) in [
        ("DO", "DO $$ BEGIN ROLLBACK; END $$"),
        ("CALL", "CALL ct_pc('stale call')"),
        ("EXECUTE", "EXECUTE c"),
    ] {
        let mut conn = fx.raw_session(&stale);
        conn.send(&[wire::parse("c", "COMMIT", &[]), wire::sync()].concat());
        conn.until_ready();
        conn.send(
            &[
                pbe(read),
                pbe(ends),
                pbe(&format!("INSERT INTO ct VALUES ('stale {case}')")),
                wire::sync(),
            ]
            .concat(),
        );
        let replies = conn.until_ready();
        assert_stale(&replies);
    }
    // An `EXECUTE` of transaction control that ends nothing (a `BEGIN` in a block, which
    // only warns) keeps them: a session whose token is the comment's. (PostgreSQL 15 ends
    // the session, XX000, at a `COMMIT` after an `EXECUTE` of a `SAVEPOINT` in one Query.)
    let comment = "/* fencing_token=33 fencing_resource=ct */ SELECT 1";
    let mut conn = fx.raw_session("");
    conn.send(&[wire::parse("b", "BEGIN", &[]), wire::sync()].concat());
    conn.until_ready();
    conn.send(&wire::query(format!(
        "BEGIN; {comment}; EXECUTE b; INSERT INTO ct VALUES ('stale begin query'); COMMIT"
    )));
    assert_stale(&conn.until_ready());
    assert_stale(&batch_in_a_block(
        &mut conn,
        &[
            comment,
            "EXECUTE b",
            "INSERT INTO ct VALUES ('stale begin batch')",
        ],
    ));
    assert_eq!(
        fx.count("ct WHERE tag LIKE 'stale%'").await,
        0,
        "a stale write after a statement that ended its transaction committed"
    );
}

/// A client that leaves after a Bind it never synced: its server connection is not kept,
/// since the reset's `DISCARD ALL` would end the batch's implicit transaction and commit
/// what the Bind wrote (here its planning folds an `IMMUTABLE` writer), unchecked. It
/// ends with the session, as directly (a review).
#[tokio::test]
async fn a_bind_the_client_left_unsynced_is_not_committed_by_the_reset() {
    let fx = bind_writers_after_leader_34().await;
    let mut conn = fx.raw_session("-c fencing.token=33 -c fencing.resource=bw");
    conn.send(
        &[
            wire::parse("", "SELECT bw_imm('stale unsynced')", &[]),
            wire::bind("", "", &[]),
            wire::terminate(),
        ]
        .concat(),
    );
    conn.until_closed();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_no_stale_bind_write(&fx).await;
}

/// A `VACUUM` Query inside a batch, behind an Executed `COMMIT` of it and a Bind that
/// writes: PostgreSQL commits what the Bind wrote before it runs the `VACUUM`. pgfence
/// learns the state with a Sync of its own there; that Sync is checked, so a stale
/// session's write does not commit (it did, with a Sync of pgfence's and no check).
#[tokio::test]
async fn a_bind_before_a_vacuum_is_checked() {
    let fx = bind_writers_after_leader_34().await;
    let batch = |tag: &str| {
        [
            wire::parse("", "COMMIT", &[]),
            wire::bind("", "", &[]),
            wire::execute("", 0),
            wire::parse("d", "SELECT $1::bw_dom", &[]),
            wire::bind("", "d", &[Some(tag.as_bytes())]),
            wire::query("VACUUM bw"),
            wire::sync(),
        ]
        .concat()
    };
    let mut direct = fx.raw_direct();
    direct.send(&batch("direct"));
    let replies = direct.until_ready();
    assert_eq!(first_error(&replies), None, "{replies:?}");
    direct.until_ready();
    assert_eq!(
        fx.count("bw WHERE tag = 'direct'").await,
        1,
        "the VACUUM commits what the Bind wrote"
    );

    // The stale session's is rejected; the current leader's goes through, VACUUM and all.
    for (token, error, rows) in [(33, Some("FN001"), 0), (34, None, 1)] {
        let mut conn = fx.raw_session(&format!("-c fencing.token={token} -c fencing.resource=bw"));
        conn.send(&batch(&format!("token {token}")));
        let replies = conn.until_ready();
        assert_eq!(first_error(&replies).as_deref(), error, "{replies:?}");
        conn.until_ready();
        assert_eq!(
            fx.count(&format!("bw WHERE tag = 'token {token}'")).await,
            rows,
            "token {token}: the Bind's write before the VACUUM"
        );
    }
}

/// A comment token earlier in the transaction overrides the session's for the rest of it
/// (SPEC section 2): the fast path does not reject a later statement of the transaction by
/// the session's token, which the check does not compare. Before, an Execute with no
/// comment after one with the current token got FN001 from the fast path, while the same
/// as one Query, or with the fast path off, committed (review finding, older than stop 51).
#[tokio::test]
async fn an_earlier_comment_token_overrides_the_session_token_for_the_fast_path() {
    let (fx, stale_session) = Fixture::after_leader_34("eo", |_| {}).await;
    let mut conn = fx.raw_session(&stale_session);
    conn.send(
        &[
            wire::parse(
                "",
                "/* fencing_token=34 fencing_resource=eo */ SELECT 1",
                &[],
            ),
            wire::bind("", "", &[]),
            wire::execute("", 0),
            wire::parse("", "INSERT INTO eo VALUES ('34 by comment')", &[]),
            wire::bind("", "", &[]),
            wire::execute("", 0),
            wire::sync(),
        ]
        .concat(),
    );
    let replies = conn.until_ready();
    assert_eq!(first_error(&replies), None, "{replies:?}");
    assert_eq!(fx.count("eo WHERE tag = '34 by comment'").await, 1);
    // The session's own stale token is still rejected, by the fast path.
    conn.send(&wire::query("INSERT INTO eo VALUES ('33')"));
    assert_eq!(first_error(&conn.until_ready()).as_deref(), Some("FN001"));
}

/// A Query inside an extended-protocol batch whose last transaction control is a `BEGIN`
/// makes a block of the batch's transaction, as one that starts with `BEGIN` does: nothing
/// commits at its end, so no check goes before it, where it would take a snapshot and fail
/// the Query's `SET TRANSACTION ISOLATION LEVEL` (25001; directly, behind a `SET LOCAL`
/// that takes none, it runs). The block's `COMMIT` is checked; a Query that fails rolls
/// the batch back, and what the batch writes after it is checked at its Sync. Found by
/// `random_sessions_with_function_calls_same_replies` seed 31309 (older than stop 51).
#[tokio::test]
async fn a_query_that_ends_in_a_block_inside_a_batch_is_not_checked_before() {
    let fx = Fixture::start(
        "CREATE TABLE eb (tag text);
         CREATE FUNCTION eb_w() RETURNS int LANGUAGE sql AS $$ SELECT 1 $$;
         CREATE VIEW eb_v AS SELECT eb_w() AS w;",
        |c| c.fence.fast_path = false,
    )
    .await;
    fx.leader("eb", 34)
        .await
        .simple("INSERT INTO eb VALUES ('leader 34')")
        .await
        .unwrap();
    let steps = [
        [
            wire::parse("", "SET LOCAL application_name = 'eb'", &[]),
            wire::bind("", "", &[]),
            wire::execute("", 0),
            wire::query(
                "SET TRANSACTION ISOLATION LEVEL REPEATABLE READ; \
                 INSERT INTO eb VALUES ('in the block'); BEGIN",
            ),
            wire::sync(),
        ]
        .concat(),
        wire::query("COMMIT"),
    ];
    replies_as_directly(&fx, "-c fencing.token=34 -c fencing.resource=eb", &steps);
    assert_eq!(fx.count("eb WHERE tag = 'in the block'").await, 2);
    let stale = run_steps(
        &mut fx.raw_session("-c fencing.token=33 -c fencing.resource=eb"),
        &steps,
    );
    assert_eq!(
        first_error(&stale[1]).as_deref(),
        Some("FN001"),
        "{stale:?}"
    );
    // A Query ending in `BEGIN` that fails whole (a syntax error) opens no block: the
    // INSERT after it in the batch commits at the Sync, which is checked.
    let failing = [
        wire::parse("", "INSERT INTO eb VALUES ('before')", &[]),
        wire::bind("", "", &[]),
        wire::execute("", 0),
        wire::query("SELEC 1; BEGIN"),
        wire::parse("", "INSERT INTO eb VALUES ('after')", &[]),
        wire::bind("", "", &[]),
        wire::execute("", 0),
        wire::sync(),
    ]
    .concat();
    let stale = run_steps(
        &mut fx.raw_session("-c fencing.token=33 -c fencing.resource=eb"),
        &[failing],
    );
    assert_eq!(
        stale[0]
            .iter()
            .filter(|m| m.sqlstate().as_deref() == Some("FN001"))
            .count(),
        1,
        "{stale:?}"
    );
    assert_eq!(
        fx.count("eb WHERE tag = 'in the block' OR tag IN ('before', 'after')")
            .await,
        2,
        "a stale session's write committed"
    );
}

/// A comment token is its transaction's, also when the client pipelines it behind
/// transaction control whose outcome is still in flight: pgfence cannot tell at once
/// whether that transaction ends at its sync point, so what may be checked behind it waits
/// for the ReadyForQuery that tells. Before, a stale session's uncommented `INSERT`,
/// pipelined behind a `ROLLBACK` and a read commented with the current token, was checked
/// with that token and committed (a review found it; older than stop 51).
#[tokio::test]
async fn a_comment_token_pipelined_behind_transaction_control_stays_in_its_transaction() {
    let (fx, stale) = Fixture::after_leader_34("hl", |_| {}).await;
    let read = "/* fencing_token=34 fencing_resource=hl */ SELECT 1";
    let extended = |sql: &str| {
        [
            wire::parse("", sql, &[]),
            wire::bind("", "", &[]),
            wire::execute("", 0),
            wire::sync(),
        ]
        .concat()
    };
    let cases = [
        (
            "Queries",
            [
                wire::query("ROLLBACK"),
                wire::query(read),
                wire::query("INSERT INTO hl VALUES ('queries')"),
            ]
            .concat(),
        ),
        (
            "a Query, then a batch",
            [
                wire::query("ROLLBACK"),
                wire::query(read),
                extended("INSERT INTO hl VALUES ('query then batch')"),
            ]
            .concat(),
        ),
        (
            "batches behind a ROLLBACK Query",
            [
                wire::query("ROLLBACK"),
                extended(read),
                extended("INSERT INTO hl VALUES ('batches')"),
            ]
            .concat(),
        ),
        (
            "batches behind an Executed COMMIT",
            [
                wire::parse("", "COMMIT", &[]),
                wire::bind("", "", &[]),
                wire::execute("", 0),
                extended(read),
                extended("INSERT INTO hl VALUES ('commit')"),
            ]
            .concat(),
        ),
    ];
    for (case, bytes) in &cases {
        let mut conn = fx.raw_session(&stale);
        conn.send(bytes);
        let ends = wire::split_messages(bytes)
            .iter()
            .filter(|m| matches!(m.tag, b'S' | b'Q'))
            .count();
        let replies: Vec<Msg> = (0..ends).flat_map(|_| conn.until_ready()).collect();
        assert_eq!(
            replies
                .iter()
                .filter(|m| m.sqlstate().as_deref() == Some("FN001"))
                .count(),
            1,
            "{case}: {replies:?}"
        );
    }
    assert_eq!(
        fx.count("hl WHERE tag <> 'leader 34'").await,
        0,
        "a stale session's uncommented write committed"
    );
}

/// A Bind plans its statement, which may run a function that writes (an `IMMUTABLE` one
/// folded with constant arguments), in the batch's transaction. An Executed `DISCARD
/// ALL`, `COMMIT PREPARED` or `ROLLBACK PREPARED` commits that transaction at once, and a
/// `VACUUM` as it starts: a stale session's write through such a Bind committed unchecked
/// (review L, stop 55; older), also behind an Executed `COMMIT` of the batch with a named
/// portal bound since, or bound between the statement's Bind and its Execute. PostgreSQL
/// directly commits each write (so the test can fail); through pgfence each batch gets an
/// error (FN001, or 25001 for the statement checked right before it) and nothing commits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bind_that_wrote_is_checked_before_what_commits_at_once() {
    let (fx, stale) = Fixture::after_leader_34("bw", |_| {}).await;
    fx.direct
        .batch_execute(
            "CREATE FUNCTION bw_g() RETURNS int LANGUAGE plpgsql VOLATILE AS \
               $$ BEGIN INSERT INTO bw VALUES ('bind'); RETURN 1; END $$; \
             CREATE FUNCTION bw_f(int) RETURNS int LANGUAGE plpgsql IMMUTABLE AS \
               $$ BEGIN RETURN $1 + bw_g(); END $$",
        )
        .await
        .unwrap();
    let batch = |before: &[u8], commits: &str| {
        let mut b = before.to_vec();
        b.extend(wire::parse("", "SELECT bw_f(1)", &[]));
        b.extend(wire::bind("pw", "", &[]));
        b.extend(wire::parse("", commits, &[]));
        b.extend(wire::bind("", "", &[]));
        b.extend(wire::execute("", 0));
        b.extend(wire::sync());
        b
    };
    let commit = [
        wire::parse("", "COMMIT", &[]),
        wire::bind("", "", &[]),
        wire::execute("", 0),
    ]
    .concat();
    // The Bind that writes between the Bind and the Execute of the statement: its check
    // (if any) came before that write (review N, stop 55), even with the current token in
    // a comment of its own. pgfence checks right before it, which makes PostgreSQL refuse it
    // "within a pipeline" (25001) and roll the write back.
    let between = |commits: &str| {
        [
            wire::parse("", commits, &[]),
            wire::bind("pc", "", &[]),
            wire::parse("", "SELECT bw_f(1)", &[]),
            wire::bind("pw", "", &[]),
            wire::execute("pc", 0),
            wire::sync(),
        ]
        .concat()
    };
    let batches = [
        batch(&[], "DISCARD ALL"),
        batch(&[], "COMMIT PREPARED 'bw_px'"),
        batch(&[], "ROLLBACK PREPARED 'bw_px'"),
        batch(&commit, "DISCARD ALL"),
        batch(&commit, "VACUUM bw"),
        between("DISCARD ALL"),
        between("ROLLBACK PREPARED 'bw_px'"),
        between("VACUUM bw"),
        between("/* fencing_token=34 fencing_resource=bw */ VACUUM bw"),
    ];
    let prepare = "BEGIN; INSERT INTO bw VALUES ('prepared'); PREPARE TRANSACTION 'bw_px'";
    for (through_pgfence, mut conn) in [(false, fx.raw_direct()), (true, fx.raw_session(&stale))] {
        for (i, bytes) in batches.iter().enumerate() {
            if fx.count("pg_prepared_xacts WHERE gid = 'bw_px'").await == 0 {
                fx.direct.batch_execute(prepare).await.unwrap();
            }
            conn.send(bytes);
            let replies = conn.until_ready();
            let refused = replies.iter().any(|m| m.tag == b'E');
            assert_eq!(refused, through_pgfence, "batch {i}: {replies:?}");
        }
        let wrote = fx.count("bw WHERE tag = 'bind'").await;
        if through_pgfence {
            assert_eq!(wrote, 0, "a stale Bind's write committed");
        } else {
            assert_eq!(
                wrote,
                batches.len() as i64,
                "directly, every batch commits its write"
            );
            fx.direct
                .batch_execute("DELETE FROM bw WHERE tag = 'bind'")
                .await
                .unwrap();
        }
    }
    fx.direct
        .batch_execute("ROLLBACK PREPARED 'bw_px'")
        .await
        .unwrap();
}

/// A comment token is its transaction's: on a statement that commits the batch's
/// transaction as it runs (`VACUUM`, `DISCARD ALL`, ...) it ends with it, as at a `COMMIT`.
/// It was kept for what followed in the batch, which runs in a new transaction: a stale
/// session's `INSERT` after `/* fencing_token=34 */ VACUUM` committed, and the leader's
/// after `/* fencing_token=33 */ DISCARD ALL` got FN001 (review N, stop 55). The simple
/// protocol did it right already.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_comment_token_ends_with_a_statement_that_commits_as_it_runs() {
    let (fx, stale) = Fixture::after_leader_34("ct", |_| {}).await;
    let batch = |first: &str, tag: &str| {
        [
            wire::parse("", first, &[]),
            wire::bind("", "", &[]),
            wire::execute("", 0),
            wire::parse("", format!("INSERT INTO ct VALUES ('{tag}')"), &[]),
            wire::bind("", "", &[]),
            wire::execute("", 0),
            wire::sync(),
        ]
        .concat()
    };
    let mut old = fx.raw_session(&stale);
    for (i, first) in [
        "/* fencing_token=34 fencing_resource=ct */ VACUUM ct",
        "/* fencing_token=34 fencing_resource=ct */ DISCARD ALL",
        "/* fencing_token=34 fencing_resource=ct */ CREATE INDEX CONCURRENTLY ct_i ON ct (tag)",
    ]
    .into_iter()
    .enumerate()
    {
        old.send(&batch(first, &format!("stale {i}")));
        let replies = old.until_ready();
        assert!(
            replies
                .iter()
                .any(|m| m.sqlstate().as_deref() == Some("FN001")),
            "{first}: {replies:?}"
        );
    }
    assert_eq!(
        fx.count("ct WHERE tag LIKE 'stale%'").await,
        0,
        "a stale write committed"
    );
    let mut leader = fx.raw_session("-c fencing.token=34 -c fencing.resource=ct");
    leader.send(&batch(
        "/* fencing_token=33 fencing_resource=ct */ DISCARD ALL",
        "leader",
    ));
    let replies = leader.until_ready();
    assert!(replies.iter().all(|m| m.tag != b'E'), "{replies:?}");
    assert_eq!(fx.count("ct WHERE tag = 'leader'").await, 1);
}

/// In a failed block, a FunctionCall behind a Sync still in flight and an Execute of a
/// portal the same batch closed:
/// the Execute fails (34000) and the server skips the rest up to the Sync. pgfence held
/// the FunctionCall for the Execute's reply (whether a block is open), and when the error
/// came, nothing was left in flight to release it: the Sync behind it never went, and the
/// session hung (random FunctionCalls seed 32094; older than stop 51). The held message
/// now goes on as it is, and the server skips it, as directly.
#[tokio::test]
async fn a_function_call_held_behind_a_failing_execute_does_not_hang() {
    let fx = Fixture::start("", |_| {}).await;
    let abs: u32 = fx
        .direct
        .query_one("SELECT 'abs(int4)'::regprocedure::oid", &[])
        .await
        .unwrap()
        .get(0);
    let steps = [
        wire::query("BEGIN; SELECT 1/0"),
        [
            wire::sync(),
            wire::close(b'P', "p"),
            wire::execute("p", 0),
            wire::function_call(abs, &[Some(b"-2")]),
            wire::sync(),
        ]
        .concat(),
        wire::query("ROLLBACK"),
    ];
    replies_as_directly(&fx, "-c fencing.token=34 -c fencing.resource=fc", &steps);
}

/// A Query that the fast path rejects, sent inside an extended-protocol batch whose replies
/// are all in (the client flushed): PostgreSQL runs the Query in the batch's implicit
/// transaction, so its failure rolls back what the batch wrote, and the Sync after it
/// commits nothing. pgfence's rejection must leave the server in that state too: before, it
/// answered the Query itself, and the client's Sync then committed the batch's row, which
/// the client had been told was rolled back.
#[tokio::test]
async fn a_fast_path_rejection_inside_a_batch_rolls_it_back() {
    let fx = Fixture::start("CREATE TABLE fb (tag text);", |_| {}).await;
    // The fast path learns the fence from the leader's write through pgfence.
    fx.leader("fb", 34)
        .await
        .simple("INSERT INTO fb VALUES ('leader 34')")
        .await
        .unwrap();
    let batch = [
        wire::parse("w", "INSERT INTO fb VALUES ('batch')", &[]),
        wire::bind("", "w", &[]),
        wire::execute("", 0),
        wire::flush(),
    ]
    .concat();
    // Directly, any Query that fails there rolls the batch back.
    let mut direct = fx.raw_direct();
    direct.send(&batch);
    direct.until(|m| m.tag == b'C');
    direct.send(&wire::query("SELECT 1/0"));
    assert_eq!(first_error(&direct.until_ready()).as_deref(), Some("22012"));
    direct.send(&wire::sync());
    direct.until_ready();
    assert_eq!(fx.count("fb WHERE tag = 'batch'").await, 0);

    let mut conn = fx.raw_session("");
    conn.send(&batch);
    conn.until(|m| m.tag == b'C');
    conn.send(&wire::query(
        "/* fencing_token=33 fencing_resource=fb */ INSERT INTO fb VALUES ('query')",
    ));
    let replies = conn.until_ready();
    assert_stale(&replies);
    conn.send(&wire::sync());
    let replies = conn.until_ready();
    assert_eq!(first_error(&replies), None, "{replies:?}");
    assert_eq!(
        fx.count("fb WHERE tag <> 'leader 34'").await,
        0,
        "the rejected Query's batch committed"
    );
}

/// A SQL `EXECUTE` runs within its transaction unless its name may stand for transaction
/// control parsed in the extended protocol: the transaction's comment token goes on past it.
/// pgfence took every `EXECUTE` for a possible `COMMIT`, checked before it and then dropped
/// the comment directives, so a block commented with a stale token wrote through a statement
/// prepared in SQL and committed unchecked (two reviews found it, older than stop 51), and a
/// current leader whose token came in a comment got FN002 at its `COMMIT`.
#[tokio::test]
async fn a_sql_execute_keeps_its_transactions_comment_token() {
    let (fx, _) = Fixture::after_leader_34("exq", |c| c.fence.fast_path = false).await;
    let c33 = "/* fencing_token=33 fencing_resource=exq */";
    let prepare = "PREPARE upd AS INSERT INTO exq VALUES ('stale'); PREPARE noop AS SELECT 1";
    let stale = fx.session(SUPERUSER, None).await;
    stale.simple(prepare).await.unwrap();
    for statements in [
        &["BEGIN", &format!("{c33} SELECT 1"), "EXECUTE upd", "COMMIT"][..],
        &[&format!("BEGIN; {c33} SELECT 1; EXECUTE upd; COMMIT")],
        &[&format!(
            "BEGIN; {c33} SELECT 1; EXECUTE noop; INSERT INTO exq VALUES ('stale after'); COMMIT"
        )],
        &[&format!("{c33} EXECUTE upd")],
    ] {
        let (last, before) = statements.split_last().unwrap();
        for sql in before {
            stale.simple(sql).await.unwrap();
        }
        let committed = stale.simple(last).await;
        assert_eq!(
            sqlstate(&committed).as_deref(),
            Some("FN001"),
            "{statements:?}"
        );
    }
    // Over the extended protocol, in a block.
    let mut raw = fx.raw_session("");
    raw.send(&wire::query(prepare));
    raw.until_ready();
    assert_stale(&batch_in_a_block(
        &mut raw,
        &[&format!("{c33} SELECT 1"), "EXECUTE upd"],
    ));
    assert_eq!(
        fx.count("exq WHERE tag <> 'leader 34'").await,
        0,
        "a stale block wrote through EXECUTE"
    );

    // The current leader, its resource from the session and its token from a comment.
    let leader = fx.session(SUPERUSER, Some("-c fencing.resource=exq")).await;
    leader.simple(prepare).await.unwrap();
    leader
        .simple(
            "BEGIN; INSERT INTO exq VALUES ('leader 35') /* fencing_token=35 */; \
             EXECUTE noop; COMMIT",
        )
        .await
        .unwrap();
    assert_eq!(fx.fence("exq").await, Some(35));
}

/// The comment directives of a statement parsed in the extended protocol count where a SQL
/// `EXECUTE` runs it (or `EXPLAIN ANALYZE EXECUTE`), as at an Execute of it. Those in the
/// text of a SQL `PREPARE` do not (README, Known limitations): pgfence would have to follow
/// the `PREPARE` to its reply. A review of a first version that took them when the
/// `PREPARE` was sent made a stale `EXECUTE` commit with the current token of a `PREPARE`
/// that failed, the name keeping its statement.
#[tokio::test]
async fn a_comment_of_a_statement_parsed_under_a_name_counts_at_its_sql_execute() {
    let (fx, _) = Fixture::after_leader_34("pp", |c| c.fence.fast_path = false).await;
    let c33 = "/* fencing_token=33 fencing_resource=pp */";
    let mut raw = fx.raw_session("");
    raw.send(
        &[
            wire::parse(
                "pw",
                format!("INSERT INTO pp VALUES ('stale pw') {c33}"),
                &[],
            ),
            wire::sync(),
        ]
        .concat(),
    );
    raw.until_ready();
    for bytes in [
        wire::query("EXECUTE pw"),
        wire::query("BEGIN; EXECUTE pw; COMMIT"),
        wire::query("EXPLAIN ANALYZE EXECUTE pw"),
        [pbe("EXECUTE pw"), wire::sync()].concat(),
    ] {
        raw.send(&bytes);
        assert_stale(&raw.until_ready());
    }

    // A `PREPARE` that fails, the name taken, gives the name nothing of its text.
    let session = fx
        .session(
            SUPERUSER,
            Some("-c fencing.token=33 -c fencing.resource=pp"),
        )
        .await;
    session
        .simple("PREPARE s AS INSERT INTO pp VALUES ('stale s')")
        .await
        .unwrap();
    session
        .simple("PREPARE s AS SELECT 1 /* fencing_token=34 fencing_resource=pp */")
        .await
        .unwrap_err();
    assert_eq!(
        sqlstate(&session.simple("EXECUTE s").await).as_deref(),
        Some("FN001")
    );
    assert_eq!(
        fx.count("pp WHERE tag <> 'leader 34'").await,
        0,
        "a stale EXECUTE committed"
    );
}

/// PostgreSQL keys statements and portals by the first 63 bytes of their names: two longer
/// names that share them are one. pgfence took such a name for another statement than the
/// server's, and a stale block committed behind a `COMMIT` parsed under the other (a
/// review; older than stop 51).
#[tokio::test]
async fn names_are_compared_as_postgresql_keys_them() {
    let (fx, stale) = Fixture::after_leader_34("nk", |_| {}).await;
    let (one, two) = (
        format!("{}1", "a".repeat(63)),
        format!("{}2", "a".repeat(63)),
    );
    let mut conn = fx.raw_session(&stale);
    conn.send(&[wire::parse(&two, "SELECT 1", &[]), wire::sync()].concat());
    conn.until_ready();
    conn.send(&[wire::close(b'S', &one), wire::sync()].concat());
    conn.until_ready();
    conn.send(&[wire::parse(&one, "COMMIT", &[]), wire::sync()].concat());
    conn.until_ready();
    conn.send(&wire::query("BEGIN; INSERT INTO nk VALUES ('stale')"));
    conn.until_ready();
    conn.send(
        &[
            wire::bind("", &two, &[]),
            wire::execute("", 0),
            wire::sync(),
        ]
        .concat(),
    );
    assert_stale(&conn.until_ready());
    assert_eq!(fx.count("nk WHERE tag = 'stale'").await, 0);
}

/// The fast path answers for a Query of one statement only: a Query of several once lost,
/// with its stale write, what PostgreSQL runs before it (an earlier transaction's `COMMIT`,
/// a `SELECT`'s rows), since the rejection stood for the whole text (a review; older than
/// stop 51). The check rejects the stale write's transaction where it commits.
#[tokio::test]
async fn a_fast_path_rejection_keeps_the_rest_of_its_query() {
    let (fx, _) = Fixture::after_leader_34("fq", |_| {}).await;
    let mut leader = fx.raw_session("-c fencing.token=34 -c fencing.resource=fq");
    leader.send(&wire::query(
        "INSERT INTO fq VALUES ('first'); COMMIT; \
         /* fencing_token=33 */ INSERT INTO fq VALUES ('stale')",
    ));
    assert_stale(&leader.until_ready());
    leader.send(&wire::query(
        "SELECT 'rows'; /* fencing_token=33 */ INSERT INTO fq VALUES ('stale')",
    ));
    let replies = leader.until_ready();
    assert!(
        replies.iter().any(|m| m.tag == b'D'),
        "the SELECT's row: {replies:?}"
    );
    assert_stale(&replies);
    assert_eq!(fx.count("fq WHERE tag = 'first'").await, 1);
    assert_eq!(fx.count("fq WHERE tag = 'stale'").await, 0);
}

/// `BEGIN`, then `statements` as one extended-protocol batch, then `COMMIT`, in one write:
/// the replies to the three.
fn batch_in_a_block(conn: &mut RawConn, statements: &[&str]) -> Vec<Msg> {
    let mut bytes = wire::query("BEGIN");
    for statement in statements {
        bytes.extend(pbe(statement));
    }
    bytes.extend(wire::sync());
    bytes.extend(wire::query("COMMIT"));
    conn.send(&bytes);
    (0..3).flat_map(|_| conn.until_ready()).collect()
}

/// The first error among `replies` is FN001, a stale token.
fn assert_stale(replies: &[Msg]) {
    assert_eq!(
        first_error(replies).as_deref(),
        Some("FN001"),
        "{replies:?}"
    );
}

/// The SQLSTATE of the first error among `msgs`, if any.
fn first_error(msgs: &[Msg]) -> Option<String> {
    msgs.iter().find(|m| m.tag == b'E').and_then(Msg::sqlstate)
}

/// A session whose question asked again gets no answer keeps checking its reads. After
/// `SET ROLE` to a role that may not call pgfence's functions, the question fails (42501,
/// which at a session's start means "reads skip the check as the classifier says"); a read
/// through a view calling a `SECURITY DEFINER` writer, created since, then fails with the
/// check, every time, rather than write unchecked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_question_asked_again_that_fails_keeps_reads_checked() {
    let fx = Fixture::start(
        "CREATE TABLE rr (tag text);
         CREATE FUNCTION rr_write(tag text, n int) RETURNS boolean LANGUAGE plpgsql
             SECURITY DEFINER AS $$ BEGIN INSERT INTO rr VALUES (tag); RETURN true; END $$;
         CREATE ROLE rr_reader;
         REVOKE EXECUTE ON ALL FUNCTIONS IN SCHEMA pgfence FROM PUBLIC;",
        |c| {
            c.admin.users = vec![SUPERUSER.into()];
            c.fence.fast_path = false;
        },
    )
    .await;
    let r = "asked_again_fails";
    fx.leader(r, 34)
        .await
        .simple("INSERT INTO rr VALUES ('leader')")
        .await
        .unwrap();
    // Reads skip the check (no view yet), so the SET ROLE is not checked either: a check
    // after it, as rr_reader, would fail.
    let stale_session = fx.leader(r, 33).await;
    stale_session.simple("SET ROLE rr_reader").await.unwrap();
    fx.direct
        .batch_execute(
            "CREATE VIEW rr_v AS SELECT rr_write('view', 0) AS w;
             GRANT SELECT ON rr_v TO rr_reader;",
        )
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(1200)).await;
    // The first read is checked while the question is in flight; the second one after its
    // answer.
    for n in 1..=2 {
        let result = stale_session.simple("SELECT * FROM rr_v").await;
        assert!(
            result.is_err(),
            "read {n} as rr_reader through the view was not checked"
        );
    }
    assert_eq!(
        fx.count("rr WHERE tag = 'view'").await,
        0,
        "a stale write landed unchecked"
    );
}

/// The read audit follows the schema: reads skip the check while it has no object through
/// which a read calls a function of its own; a session that starts after a view calling a
/// writer is created checks them (the stale one is rejected, nothing lands); once the view
/// is dropped, reads skip the check again (each a second after the DDL: sessions take
/// another session's answer for that long). On kept server connections (the answer comes
/// with the refresh before the client's login) and on new ones (the login's ReadyForQuery
/// waits for it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_read_audit_follows_the_schema() {
    for reuse_servers in [true, false] {
        let fx = Fixture::start(
            "CREATE TABLE ra (tag text);
             CREATE FUNCTION ra_write(tag text, n int) RETURNS boolean LANGUAGE plpgsql
                 AS $$ BEGIN INSERT INTO ra VALUES (tag); RETURN true; END $$;",
            |c| {
                c.admin.users = vec![SUPERUSER.into()];
                c.pool.reuse_servers = reuse_servers;
                c.fence.fast_path = false;
            },
        )
        .await;
        let r = "audited";
        fx.leader(r, 34)
            .await
            .simple("INSERT INTO ra VALUES ('leader')")
            .await
            .unwrap();
        let context = format!("reuse_servers = {reuse_servers}");
        let reads_skip = |when: &'static str| {
            let fx = &fx;
            let context = &context;
            async move {
                let before = fx.checks_done().await;
                let reader = fx.leader(r, 33).await;
                reader.simple("SELECT count(*) FROM ra").await.unwrap();
                reader
                    .client
                    .query("SELECT tag FROM ra", &[])
                    .await
                    .unwrap();
                drop(reader);
                assert_eq!(
                    fx.checks_done().await,
                    before,
                    "{context}: {when}: reads made pgfence run the check"
                );
            }
        };
        reads_skip("before the view").await;
        reads_skip("again, on a kept connection if any").await;
        fx.direct
            .batch_execute("CREATE VIEW ra_v AS SELECT ra_write('view', 0) AS w")
            .await
            .unwrap();
        // Sessions take another session's answer for a second.
        tokio::time::sleep(Duration::from_millis(1200)).await;
        for protocol in [Protocol::Simple, Protocol::Extended] {
            let mut stale_session = fx.leader(r, 33).await;
            stale_session
                .expect_rejection(
                    protocol,
                    &["SELECT * FROM ra_v"],
                    &stale(r, 33, 34),
                    &context,
                )
                .await;
        }
        assert_eq!(fx.count("ra WHERE tag = 'view'").await, 0, "{context}");
        // The current leader reads through it, and its write lands.
        fx.leader(r, 34)
            .await
            .simple("SELECT * FROM ra_v")
            .await
            .unwrap();
        assert_eq!(fx.count("ra WHERE tag = 'view'").await, 1, "{context}");
        fx.direct.batch_execute("DROP VIEW ra_v").await.unwrap();
        tokio::time::sleep(Duration::from_millis(1200)).await;
        reads_skip("after the view was dropped").await;
        if reuse_servers {
            let admin = harness::connect_to(&fx.proxy.connstr("pgfence")).await;
            let reused = admin
                .simple_query("SHOW STATS")
                .await
                .unwrap()
                .into_iter()
                .find_map(|m| match m {
                    SimpleQueryMessage::Row(row) if row.get(0) == Some("servers_reused") => {
                        row.get(1).map(|v| v.parse::<u64>().unwrap())
                    }
                    _ => None,
                });
            assert!(
                reused.unwrap() > 0,
                "no session ran on a kept connection: the kept path was not tested"
            );
        }
    }
}

/// What the read audit's question does at a login, on a new server connection: the
/// client's Query sent right behind its startup packet (before the login's ReadyForQuery)
/// waits for the answer and runs, as on PostgreSQL (pgfence once ended the session with
/// 08P01, found by a review, 2026-12-07); and the question's own notices (a
/// `log_statement` echo) are not the client's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_read_audit_is_invisible_at_login() {
    let fx = Fixture::start("", |c| c.pool.reuse_servers = false).await;
    let mut conn = RawConn::connect(fx.proxy.addr());
    let mut first = wire::startup_version(
        wire::PROTOCOL_3_0,
        &[
            ("user", SUPERUSER.as_bytes()),
            ("database", APP_DB.as_bytes()),
            (
                "options",
                b"-c client_min_messages=log -c log_statement=all",
            ),
        ],
    );
    first.extend_from_slice(&wire::query("SELECT 42"));
    conn.send(&first);
    let login = conn.until_ready();
    let answer = conn.until_ready();
    for m in login.iter().chain(&answer) {
        assert!(
            m.tag != b'N'
                || !m
                    .field(b'M')
                    .unwrap_or_default()
                    .contains("reads_may_write"),
            "the question's notice reached the client: {:?}",
            m.fields()
        );
        assert_ne!(m.tag, b'E', "{:?}", m.fields());
    }
    let rows: Vec<_> = answer.iter().filter_map(Msg::data_row).collect();
    assert_eq!(rows, vec![vec![Some(b"42".to_vec())]], "{answer:?}");
}

/// A question the database does not answer (here: `pgfence.read_audit` locked, which
/// makes `pgfence.reads_may_write()` give up after its lock timeout of a second) leaves the
/// answer unknown, and the session checks its reads, on a new server connection and on a
/// kept one. pgfence once skipped them (as for a schema without the function), so a
/// `statement_timeout` in the startup options let a stale read that writes through a
/// view commit (found by two reviews, 2026-12-07).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unanswered_read_audit_checks_reads() {
    for reuse_servers in [false, true] {
        let fx = Fixture::start("CREATE TABLE ua (tag text);", |c| {
            c.admin.users = vec![SUPERUSER.into()];
            c.pool.reuse_servers = reuse_servers;
        })
        .await;
        let r = "unanswered";
        // Leaves a kept connection for the reader's startup packet, when kept.
        let reader = fx.leader(r, 33).await;
        reader.simple("SELECT 1").await.unwrap();
        drop(reader);
        // Another session's answer is taken for a second: let it age.
        tokio::time::sleep(Duration::from_millis(1200)).await;
        let locker = fx.cluster.connect(APP_DB).await;
        locker
            .batch_execute("BEGIN; LOCK TABLE pgfence.read_audit IN ACCESS EXCLUSIVE MODE")
            .await
            .unwrap();
        let before = fx.checks_done().await;
        let reader = fx.leader(r, 33).await;
        reader.simple("SELECT count(*) FROM ua").await.unwrap();
        assert!(
            fx.checks_done().await > before,
            "reuse_servers = {reuse_servers}: a session whose question went unanswered \
             skipped its read's check"
        );
        locker.batch_execute("COMMIT").await.unwrap();
    }
}

/// A token set by a function whose text pgfence never sees (`set_config` in a stored
/// procedure): once the server commits with it, the fast path stops using the startup
/// token it believed the session had. It once rejected the leader's next writes with FN001
/// naming its old token (found by an adversarial review, 2026-12-06).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_set_by_a_function_replaces_the_startup_token_for_the_fast_path() {
    let setup = "
        CREATE TABLE lease (tag text);
        CREATE FUNCTION take_lease(t int) RETURNS text LANGUAGE sql
            AS $$ SELECT set_config('fencing.token', t::text, false) $$;";
    let fx = Fixture::start(setup, |_| {}).await;
    let r = "lease";
    let leader = fx.leader(r, 34).await;
    leader
        .simple("INSERT INTO lease VALUES ('34')")
        .await
        .unwrap();
    leader.simple("SELECT take_lease(35)").await.unwrap();
    for n in 1..=3 {
        leader
            .simple(&format!("INSERT INTO lease VALUES ('35 {n}')"))
            .await
            .unwrap_or_else(|e| panic!("write {n} with token 35: {e:?}"));
    }
    assert_eq!(fx.fence(r).await, Some(35));
    // And a session still on 34 is rejected, by the fast path or the database.
    let mut old = fx.leader(r, 34).await;
    old.expect_rejection(
        Protocol::Simple,
        &["INSERT INTO lease VALUES ('stale')"],
        &stale(r, 34, 35),
        "34",
    )
    .await;
    assert_eq!(fx.count("lease").await, 4);
}

/// The fast path reads the token PostgreSQL uses: a startup parameter `fencing.token`
/// comes after `options` (PostgreSQL's `process_startup_options`), the last of two
/// `options` parameters is the one PostgreSQL keeps, and `options` are read with getopt, so
/// `-ec fencing.token=34` sets it. pgfence once kept 33 from `options` in
/// both cases and rejected the leader with FN001 (found by an adversarial review,
/// 2026-12-06).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fast_path_reads_the_startup_token_postgres_uses() {
    let (fx, _) = Fixture::after_leader_34("startup_tok", |_| {}).await;
    let addr = fx.proxy.addr();
    let options = "-c fencing.resource=startup_tok -c fencing.token=33";
    let combined = format!("{options} -ec fencing.token=34");
    let later = "-c fencing.resource=startup_tok -c fencing.token=34";
    for (what, params) in [
        (
            "the last of two options parameters",
            vec![
                ("user", SUPERUSER.as_bytes()),
                ("database", APP_DB.as_bytes()),
                ("options", options.as_bytes()),
                ("options", later.as_bytes()),
            ],
        ),
        (
            "a startup parameter after options",
            vec![
                ("user", SUPERUSER.as_bytes()),
                ("database", APP_DB.as_bytes()),
                ("options", options.as_bytes()),
                ("fencing.token", b"34".as_slice()),
            ],
        ),
        (
            "combined switches",
            vec![
                ("user", SUPERUSER.as_bytes()),
                ("database", APP_DB.as_bytes()),
                ("options", combined.as_bytes()),
            ],
        ),
    ] {
        let mut leader = RawConn::login_with_params(addr, &params);
        leader.send(&wire::query(format!(
            "INSERT INTO startup_tok VALUES ('{what}')"
        )));
        let replies = leader.until_ready();
        assert!(replies.iter().all(|m| m.tag != b'E'), "{what}: {replies:?}");
        // (After the write: a statement that names `fencing` makes pgfence forget the
        // startup token.)
        leader.send(&wire::query("SHOW fencing.token"));
        let replies = leader.until_ready();
        let row = replies.iter().find_map(|m| m.data_row()).expect("a row");
        assert_eq!(row[0].as_deref(), Some(b"34".as_slice()), "{what}");
    }
    assert_eq!(fx.count("startup_tok").await, 4);
}

/// A `CALL` run by an Execute behind another Execute of its batch: PostgreSQL runs it
/// non-atomic there too (the implicit transaction is no block), so the procedure's
/// `COMMIT` commits what the batch wrote before it, and its own first writes. pgfence once
/// checked a `CALL` first only when it started its batch, and nothing else came before the
/// Sync: the stale rows committed (found by an adversarial review, 2026-12-06).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_behind_an_execute_of_its_batch_is_checked_before_it_runs() {
    // Without the fast path: it would stand in for the CALL's Execute of a token it knows.
    let fx = Fixture::start(&table_and_committing_procedure("cb"), |c| {
        c.fence.fast_path = false
    })
    .await;
    let r = "call_batch";
    let leader = fx.leader(r, 34).await;
    leader.simple("CALL cb_proc('leader')").await.unwrap();
    let call = |tag: &str| pbe(&format!("CALL cb_proc('stale {tag}')"));
    let cases: [(&str, Vec<u8>); 4] = [
        ("a SELECT", pbe("SELECT 1")),
        ("an INSERT", pbe("INSERT INTO cb VALUES ('stale insert')")),
        ("an empty statement", pbe("")),
        ("BEGIN and COMMIT", [pbe("BEGIN"), pbe("COMMIT")].concat()),
    ];
    for (what, before) in &cases {
        let mut stale = fx.raw_session(&format!("-c fencing.token=33 -c fencing.resource={r}"));
        stale.send(&[before.clone(), call(what), wire::sync()].concat());
        expect_raw_rejection(&mut stale, &format!("CALL behind {what}"));
    }
    // Behind a flushed Execute whose replies came back: the batch is still open.
    let mut stale = fx.raw_session(&format!("-c fencing.token=33 -c fencing.resource={r}"));
    stale.send(&[pbe("SELECT 1"), wire::flush()].concat());
    stale.until(|m| m.tag == b'C');
    stale.send(&[call("flushed"), wire::sync()].concat());
    expect_raw_rejection(&mut stale, "CALL behind a flushed Execute");
    // Without a token, where its resource requires one: FN002, not run.
    let mut tokenless = fx.raw_session(&format!("-c fencing.resource={r}"));
    tokenless.send(&[pbe("SELECT 1"), call("tokenless"), wire::sync()].concat());
    let replies = tokenless.until_ready();
    let error = replies.iter().find(|m| m.tag == b'E').expect("an error");
    wire::assert_error(error, "ERROR", "FN002");
    assert_eq!(fx.count("cb WHERE tag LIKE 'stale%'").await, 0);

    // The leader's, pipelined alike, land, each with what came before it.
    let mut current = fx.raw_session(&format!("-c fencing.token=34 -c fencing.resource={r}"));
    current.send(
        &[
            pbe("INSERT INTO cb VALUES ('current insert')"),
            pbe("CALL cb_proc('current')"),
            wire::sync(),
        ]
        .concat(),
    );
    let replies = current.until_ready();
    assert!(replies.iter().all(|m| m.tag != b'E'), "{replies:?}");
    assert_eq!(fx.count("cb WHERE tag LIKE 'current%'").await, 3);
    assert_eq!(fx.fence(r).await, Some(34));
}

/// A pre-check that fails stands for the batch it was held for: pgfence skips the rest of
/// it up to Sync, as PostgreSQL does after an error. A Terminate there still ends the
/// session, as it ends PostgreSQL's skipping (found by `protocol_random`'s stale run: the
/// session hung, its server connection with it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn terminate_after_a_failed_pre_check_ends_the_session() {
    let (fx, options) = Fixture::after_leader_34("pre_term", |_| {}).await;
    let mut stale = fx.raw_session(&options);
    stale.send(
        &[
            wire::parse("", "VACUUM pre_term", &[]),
            wire::bind("", "", &[]),
            wire::execute("", 0),
            wire::flush(),
        ]
        .concat(),
    );
    let replies = stale.until(|m| m.tag == b'E');
    wire::assert_error(replies.last().unwrap(), "ERROR", "FN001");
    stale.send(&wire::terminate());
    let after = stale.until_closed();
    assert!(after.is_empty(), "{after:?}");
}

/// The pre-check is forced: it rejects a stale token whether or not anything was written,
/// unlike the commit checks a session ran before it. pgfence keeps the check's message of
/// each kind per session and must not hand the pre-check a commit's (the fast path is off,
/// so that the pre-check alone decides).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pre_check_after_commit_checks_is_still_forced() {
    let fx = Fixture::start("CREATE TABLE pf (tag text);", |c| {
        c.fence.fast_path = false;
    })
    .await;
    let r = "forced";
    let vacuums = "pg_stat_user_tables WHERE relname = 'pf' AND vacuum_count > 0";
    for (token, protocol) in (1..).zip(PROTOCOLS) {
        let mut was_leader = fx.leader(r, token).await;
        // Writes that write nothing: checked before their Sync, and they pass.
        for _ in 0..2 {
            was_leader
                .extended("UPDATE pf SET tag = tag WHERE false")
                .await
                .unwrap();
        }
        fx.leader(r, token + 1)
            .await
            .simple("INSERT INTO pf VALUES ('next')")
            .await
            .unwrap();
        was_leader
            .expect_rejection(
                protocol,
                &["VACUUM pf"],
                &stale(r, token, token + 1),
                "after commit checks",
            )
            .await;
    }
    assert_eq!(fx.count(vacuums).await, 0, "a stale VACUUM ran");
}

/// A session that only sends simple Queries gets its autocommit writes checked by `EXECUTE`
/// of the guarded statement, which pgfence prepares right before the second check it would
/// send as SQL text. A client that drops that statement (`DEALLOCATE`, by name
/// or all, in its own Query, inside a `DO` block pgfence cannot read) or puts its own
/// statement under that name is still checked: a stale token set where pgfence cannot see it
/// is rejected every time, and the write whose check lost its statement fails rather than
/// commits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn simple_queries_execute_the_prepared_check_and_survive_its_loss() {
    let fx = Fixture::start("CREATE TABLE se (tag text);", |_| {}).await;
    let r = "executed";
    fx.leader(r, 20)
        .await
        .simple("INSERT INTO se VALUES ('leader 20')")
        .await
        .unwrap();
    let s = fx.session(SUPERUSER, None).await;
    async fn guarded_prepared(client: &Client) -> bool {
        let rows = client
            .simple_query(
                "SELECT count(*) FROM pg_prepared_statements WHERE name = 'pgfence_check_guarded'",
            )
            .await
            .unwrap();
        let row = rows.iter().find_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(row) => Some(row),
            _ => None,
        });
        row.expect("one row").get(0) == Some("1")
    }
    s.simple("INSERT INTO se VALUES ('unfenced 1')")
        .await
        .unwrap();
    assert!(
        !guarded_prepared(&s.client).await,
        "a session's first check as text prepares nothing"
    );
    s.simple("INSERT INTO se VALUES ('unfenced 2')")
        .await
        .unwrap();
    assert!(
        guarded_prepared(&s.client).await,
        "the second check as text makes pgfence prepare its statement"
    );
    s.simple(&format!(
        "SELECT set_config('fencing.resource', '{r}', false), set_config('fencing.token', '19', false)"
    ))
    .await
    .unwrap();
    let stale_write = "INSERT INTO se VALUES ('hidden 19')";
    for (losing, fails_once) in [
        ("SELECT 1", false),
        ("DEALLOCATE pgfence_check_guarded", false),
        ("DEALLOCATE ALL", false),
        (
            "DEALLOCATE ALL; PREPARE pgfence_check_guarded AS SELECT NULL::text",
            false,
        ),
        (
            "DO $$ BEGIN EXECUTE 'DEALLOCATE pgfence_check_guarded'; END $$",
            true,
        ),
    ] {
        let lost = s.simple(losing).await;
        if fails_once {
            // A DO block may write, so it is checked: behind its back, the check's own
            // statement is gone, and the block fails rather than commits.
            let e = lost.expect_err("a check whose statement is gone fails");
            assert_eq!(
                e.as_db_error().map(|e| e.code().code()),
                Some("26000"),
                "{losing:?}: {e:?}"
            );
        } else {
            lost.unwrap();
        }
        // The first two checks after the loss as text (the second prepares), then `EXECUTE`.
        // pgfence prepares only when nothing is in flight: simple Queries only (tokio-postgres
        // closes an extended query's statement after its reply came back), each answered up
        // to its ReadyForQuery (tokio-postgres returns an error as soon as it comes).
        for round in 1..=3 {
            let result = s.simple(stale_write).await;
            assert_rejected(
                &result,
                &stale(r, 19, 20),
                &format!("after {losing:?}, round {round}"),
            );
            s.simple("SELECT 1").await.unwrap();
        }
        assert!(
            guarded_prepared(&s.client).await,
            "prepared again after {losing:?}"
        );
    }
    assert_eq!(fx.count("se WHERE tag LIKE 'hidden%'").await, 0);
    assert_eq!(fx.count("se WHERE tag LIKE 'unfenced%'").await, 2);
}

/// A session that starts without any fencing setting gets the guarded check
/// (`fence_core::sql::guarded_check_sql`), which skips `pgfence.check` while the server
/// session has no fencing settings. Settings made where pgfence cannot see them
/// (`set_config()` inside a query) are the server's to read: a stale token set that way is
/// still rejected, in both protocols, and a newer one advances the fence. The guarded
/// statement carries the session's own arguments as literals: the client address reaches
/// the history, and the policy's lenient resources are allowed a write without a token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unfenced_looking_session_is_still_checked_by_the_server() {
    let fx = Fixture::start("CREATE TABLE ug (tag text);", |c| {
        c.fence.resources.insert(
            "guarded_lenient".into(),
            ResourcePolicy {
                on_missing_token: Some(OnMissingToken::Allow),
            },
        );
    })
    .await;
    let r = "guarded";
    fx.leader(r, 20)
        .await
        .simple("INSERT INTO ug VALUES ('leader 20')")
        .await
        .unwrap();
    let mut s = fx.session(SUPERUSER, None).await;
    for protocol in PROTOCOLS {
        s.run(protocol, &["INSERT INTO ug VALUES ('unfenced')"])
            .await
            .expect("an unfenced write commits");
    }
    let hidden = format!(
        "SELECT set_config('fencing.resource', '{r}', false), set_config('fencing.token', '19', false)"
    );
    s.client.query(hidden.as_str(), &[]).await.unwrap();
    for protocol in PROTOCOLS {
        s.expect_rejection(
            protocol,
            &["INSERT INTO ug VALUES ('hidden 19')"],
            &stale(r, 19, 20),
            "a token set by set_config() in a query",
        )
        .await;
        s.expect_rejection(
            protocol,
            &[
                "BEGIN",
                "INSERT INTO ug VALUES ('hidden 19 in a block')",
                "COMMIT",
            ],
            &stale(r, 19, 20),
            "a token set by set_config() in a query, explicit transaction",
        )
        .await;
    }
    s.client
        .query("SELECT set_config('fencing.token', '21', false)", &[])
        .await
        .unwrap();
    s.run(Protocol::Extended, &["INSERT INTO ug VALUES ('hidden 21')"])
        .await
        .expect("a newer token set by set_config() advances the fence");
    assert_eq!(fx.fence(r).await, Some(21));
    assert_eq!(fx.count("ug WHERE tag LIKE 'hidden 19%'").await, 0);
    assert_eq!(
        fx.count("ug WHERE tag IN ('unfenced', 'hidden 21')").await,
        3
    );
    let advanced_by: String = fx
        .direct
        .query_one(
            "SELECT client_addr FROM pgfence.history WHERE resource = $1 AND new_token = 21",
            &[&r],
        )
        .await
        .unwrap()
        .get(0);
    assert!(
        advanced_by.starts_with("127.0.0.1:"),
        "the history records the client that advanced the fence, not {advanced_by:?}"
    );

    // A resource set where pgfence cannot see it, without a token: the policy decides.
    for (resource, allowed) in [("guarded_lenient", true), ("guarded_strict", false)] {
        let mut session = fx.session(SUPERUSER, None).await;
        session
            .client
            .query(
                "SELECT set_config('fencing.resource', $1, false)",
                &[&resource],
            )
            .await
            .unwrap();
        for protocol in PROTOCOLS {
            let write = format!("INSERT INTO ug VALUES ('{resource}')");
            if allowed {
                session
                    .run(protocol, &[write.as_str()])
                    .await
                    .unwrap_or_else(|e| panic!("{resource} allows a write without a token: {e:?}"));
            } else {
                session
                    .expect_rejection(
                        protocol,
                        &[write.as_str()],
                        &missing(resource),
                        "a resource set by set_config() in a query, without a token",
                    )
                    .await;
            }
        }
    }
    assert_eq!(fx.count("ug WHERE tag = 'guarded_lenient'").await, 2);
    assert_eq!(fx.count("ug WHERE tag = 'guarded_strict'").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_check_statement_dropped_behind_pgfences_back_is_prepared_again() {
    let fx = Fixture::start("CREATE TABLE dropped (tag text);", |_| {}).await;
    let s = fx.session(SUPERUSER, None).await;
    s.run(
        Protocol::Extended,
        &["INSERT INTO dropped VALUES ('first')"],
    )
    .await
    .expect("the first write prepares the guarded check");
    // A DO block is not a DEALLOCATE pgfence can see. In a block that rolls back, nothing
    // is checked after it (a DO block that commits is, and fails: see
    // `simple_queries_execute_the_prepared_check_and_survive_its_loss`).
    s.client
        .batch_execute(
            "BEGIN; DO $$ BEGIN EXECUTE 'DEALLOCATE pgfence_check_guarded'; END $$; ROLLBACK",
        )
        .await
        .expect("the statement exists, so the DO block drops it");
    let err = s
        .run(Protocol::Extended, &["INSERT INTO dropped VALUES ('lost')"])
        .await
        .expect_err("the check's Bind finds no statement");
    let db = err.as_db_error().expect("a database error");
    assert_eq!(db.code().code(), "26000", "{db:?}");
    s.run(
        Protocol::Extended,
        &["INSERT INTO dropped VALUES ('again')"],
    )
    .await
    .expect("the next check prepares its statement again");
    assert_eq!(fx.count("dropped WHERE tag IN ('first', 'again')").await, 2);
    assert_eq!(fx.count("dropped WHERE tag = 'lost'").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deallocate_leaves_the_check_statements_usable() {
    let fx = Fixture::start("CREATE TABLE kept (tag text);", |_| {}).await;
    let s = fx.session(SUPERUSER, None).await;
    s.run(Protocol::Extended, &["INSERT INTO kept VALUES ('first')"])
        .await
        .expect("the first write prepares the guarded check");
    // pgfence cannot tell which statements a DEALLOCATE drops, nor whether it will
    // succeed: this one fails and drops nothing, the check's statement still exists.
    let err = s
        .client
        .batch_execute("DEALLOCATE no_such_statement")
        .await
        .expect_err("no such statement");
    assert_eq!(
        err.as_db_error().map(|e| e.code().code()),
        Some("26000"),
        "{err:?}"
    );
    for n in 0..3 {
        s.run(Protocol::Extended, &["INSERT INTO kept VALUES ('after')"])
            .await
            .unwrap_or_else(|e| panic!("write {n} after the failed DEALLOCATE: {e:?}"));
    }
    assert_eq!(fx.count("kept WHERE tag = 'after'").await, 3);
    // Nor does a DEALLOCATE that succeeds on another statement (an ORM's statement cache).
    s.client
        .batch_execute("PREPARE mine AS SELECT 1; DEALLOCATE mine")
        .await
        .expect("the client's own statement");
    s.run(Protocol::Extended, &["INSERT INTO kept VALUES ('later')"])
        .await
        .expect("a write after DEALLOCATE of the client's statement");
    assert_eq!(fx.count("kept WHERE tag = 'later'").await, 1);
}

/// The fast path's rejection inside a block runs pgfence's own statement upstream; the client
/// sees only the error, as if its statement had failed (node-postgres's COPY crashed on the
/// RowDescription of `pgfence.fast_reject` that once came first).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fast_rejection_in_a_block_shows_only_the_error() {
    let fx = Fixture::start("CREATE TABLE fastblock (tag text);", |_| {}).await;
    let r = "fastblock";
    fx.leader(r, 5)
        .await
        .simple("INSERT INTO fastblock VALUES ('leader 5')")
        .await
        .unwrap();
    let options = format!("-c fencing.token=4 -c fencing.resource={r}");
    let mut stale = fx.raw_session(&options);
    for (n, statement) in [
        "INSERT INTO fastblock VALUES ('stale 4')",
        "COPY fastblock FROM STDIN",
    ]
    .into_iter()
    .enumerate()
    {
        stale.send(&wire::query("BEGIN"));
        stale.until_ready();
        stale.send(&wire::query(statement));
        let replies = stale.until_ready();
        let tags: Vec<u8> = replies.iter().map(|m| m.tag).collect();
        assert_eq!(tags, b"EZ", "{n} {statement}: {replies:?}");
        wire::assert_error(&replies[0], "ERROR", "FN001");
        assert_eq!(replies[1].ready_status(), Some(b'E'), "{statement}");
        stale.send(&wire::query("ROLLBACK"));
        stale.until_ready();
    }
    assert_eq!(fx.count("fastblock WHERE tag LIKE 'stale%'").await, 0);
}

/// Parse, Bind and Execute of `sql` (unnamed statement and portal), no Sync.
fn pbe(sql: &str) -> Vec<u8> {
    [
        wire::parse("", sql, &[]),
        wire::bind("", "", &[]),
        wire::execute("", 0),
    ]
    .concat()
}

/// Bind of the prepared statement `name` to the unnamed portal, Execute, Sync.
fn run_statement(name: &str) -> Vec<u8> {
    [
        wire::bind("", name, &[]),
        wire::execute("", 0),
        wire::sync(),
    ]
    .concat()
}

/// Reads up to a ReadyForQuery, which must come after a stale-token rejection.
fn expect_raw_rejection(conn: &mut RawConn, context: &str) {
    let replies = conn.until_ready();
    let error = replies
        .iter()
        .find(|m| m.tag == b'E')
        .unwrap_or_else(|| panic!("{context}: no error in {replies:?}"));
    wire::assert_error(error, "ERROR", "FN001");
}

/// A client's Parse that the server refuses (the name exists: 42P05) or skips (an error
/// earlier in the batch) leaves the server's statement as it was: pgfence must not take the
/// new text for it. A stale session once wrote by parsing `SELECT 1` over its prepared
/// INSERT's name, then executing the name: pgfence saw a read, the server ran the INSERT.
/// Later (found by `protocol_random`'s stale run) the same with the Parse sent after the
/// error had come back, in a batch the client had flushed and not synced: nothing undid it;
/// with two such Parses in flight, whose second put back what the first had not done; and
/// with the name bound in the next batch, sent before the refusal came back; and after a
/// skipped Close of the name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_or_skipped_parse_does_not_change_what_pgfence_thinks_a_name_runs() {
    for fast_path in [true, false] {
        let (fx, options) = Fixture::after_leader_34("renamed", |c| {
            c.fence.fast_path = fast_path;
        })
        .await;
        let mut stale = fx.raw_session(&options);
        let insert = "INSERT INTO renamed VALUES ('stale 33')";
        // Refused: the name exists.
        stale.send(&[wire::parse("s1", insert, &[]), wire::sync()].concat());
        stale.until_ready();
        stale.send(&[wire::parse("s1", "SELECT 1", &[]), wire::sync()].concat());
        let replies = stale.until_ready();
        wire::assert_error(&replies[0], "ERROR", "42P05");
        // Skipped: the batch failed before the Close and the Parse.
        stale.send(&[wire::parse("s2", insert, &[]), wire::sync()].concat());
        stale.until_ready();
        stale.send(
            &[
                wire::parse("", "SELECT 1/0", &[]),
                wire::bind("", "", &[]),
                wire::execute("", 0),
                wire::close(b'S', "s2"),
                wire::parse("s2", "SELECT 1", &[]),
                wire::sync(),
            ]
            .concat(),
        );
        let replies = stale.until_ready();
        wire::assert_error(&replies[replies.len() - 2], "ERROR", "22012");
        // Skipped too, but sent after the error came back: the batch was flushed, not
        // synced, so the server skips up to the Sync that comes with the Parse.
        stale.send(&[wire::parse("s3", insert, &[]), wire::sync()].concat());
        stale.until_ready();
        stale.send(
            &[
                wire::parse("", "SELECT 1/0", &[]),
                wire::bind("", "", &[]),
                wire::execute("", 0),
                wire::flush(),
            ]
            .concat(),
        );
        let replies = stale.until(|m| m.tag == b'E');
        wire::assert_error(replies.last().unwrap(), "ERROR", "22012");
        stale.send(
            &[
                wire::close(b'S', "s3"),
                wire::parse("s3", "SELECT 1", &[]),
                wire::sync(),
            ]
            .concat(),
        );
        let replies = stale.until_ready();
        assert_eq!(replies.len(), 1, "all skipped: {replies:?}");
        // Refused twice in one write: the second Parse was sent as if the first had
        // happened, so what it puts back is what the first did.
        stale.send(&[wire::parse("s4", insert, &[]), wire::sync()].concat());
        stale.until_ready();
        let refused = [wire::parse("s4", "SELECT 1", &[]), wire::sync()].concat();
        stale.send(&refused.repeat(2));
        for _ in 0..2 {
            wire::assert_error(&stale.until_ready()[0], "ERROR", "42P05");
        }
        // Refused, with a Bind of the name in the next batch, sent before the refusal came
        // back (the error does not skip it): the Bind runs the INSERT.
        stale.send(&[wire::parse("s5", insert, &[]), wire::sync()].concat());
        stale.until_ready();
        stale.send(
            &[
                wire::parse("s5", "SELECT 1", &[]),
                wire::sync(),
                run_statement("s5"),
            ]
            .concat(),
        );
        wire::assert_error(&stale.until_ready()[0], "ERROR", "42P05");
        expect_raw_rejection(
            &mut stale,
            &format!("fast_path = {fast_path}, s5 pipelined"),
        );
        // The same with the Bind in the middle of its batch, where pgfence cannot wait for
        // the answer: a portal it cannot see.
        stale.send(&[wire::parse("s6", insert, &[]), wire::sync()].concat());
        stale.until_ready();
        stale.send(
            &[
                wire::parse("s6", "SELECT 1", &[]),
                wire::sync(),
                wire::describe(b'S', "s6"),
                run_statement("s6"),
            ]
            .concat(),
        );
        wire::assert_error(&stale.until_ready()[0], "ERROR", "42P05");
        expect_raw_rejection(
            &mut stale,
            &format!("fast_path = {fast_path}, s6 mid-batch"),
        );
        // The same with the unnamed statement, its Parse skipped: the server keeps the
        // INSERT parsed before the error.
        stale.send(
            &[
                wire::parse("", insert, &[]),
                wire::bind("", "nope", &[]),
                wire::parse("", "SELECT 1", &[]),
                wire::sync(),
                run_statement(""),
            ]
            .concat(),
        );
        wire::assert_error(&stale.until_ready()[1], "ERROR", "26000");
        expect_raw_rejection(&mut stale, &format!("fast_path = {fast_path}, unnamed"));
        // A Close of the name the server skipped (the batch failed before it): the name
        // still runs the INSERT, and a Parse of it is refused; a Bind in the next batch runs
        // the INSERT. Also with the Close in flight when the Bind is sent, and with two
        // refused Parses in flight (found by `protocol_random`'s stale run).
        let fails_then = |then: Vec<u8>| {
            [
                wire::parse("", "SELECT 1/0", &[]),
                wire::bind("", "", &[]),
                wire::execute("", 0),
                then,
                wire::sync(),
            ]
            .concat()
        };
        let refused = |name: &str| [wire::parse(name, "SELECT 1", &[]), wire::sync()].concat();
        for name in ["s7", "s8", "s9"] {
            stale.send(&[wire::parse(name, insert, &[]), wire::sync()].concat());
            stale.until_ready();
        }
        let failed = |replies: Vec<Msg>| {
            wire::assert_error(&replies[replies.len() - 2], "ERROR", "22012");
        };
        stale.send(&fails_then(wire::close(b'S', "s7")));
        failed(stale.until_ready());
        stale.send(&[refused("s7"), run_statement("s7")].concat());
        wire::assert_error(&stale.until_ready()[0], "ERROR", "42P05");
        expect_raw_rejection(&mut stale, &format!("fast_path = {fast_path}, s7"));
        stale.send(
            &[
                fails_then(wire::close(b'S', "s8")),
                refused("s8"),
                run_statement("s8"),
            ]
            .concat(),
        );
        failed(stale.until_ready());
        wire::assert_error(&stale.until_ready()[0], "ERROR", "42P05");
        expect_raw_rejection(&mut stale, &format!("fast_path = {fast_path}, s8"));
        stale.send(&[refused("s9"), refused("s9"), run_statement("s9")].concat());
        for _ in 0..2 {
            wire::assert_error(&stale.until_ready()[0], "ERROR", "42P05");
        }
        expect_raw_rejection(&mut stale, &format!("fast_path = {fast_path}, s9"));
        for name in ["s1", "s2", "s3", "s4", "s7", "s8", "s9"] {
            stale.send(&run_statement(name));
            expect_raw_rejection(&mut stale, &format!("fast_path = {fast_path}, {name}"));
        }
        assert_eq!(
            fx.count("renamed WHERE tag = 'stale 33'").await,
            0,
            "fast_path = {fast_path}"
        );
    }
}

/// A statement pgfence cannot see runs anything, a `COMMIT` included: SQL `EXECUTE` of a
/// statement parsed as `COMMIT` (it commits), the server's statement of a name whose SQL
/// `PREPARE` failed or succeeded (pgfence cannot tell which), or its statement of a name
/// whose Parse it refused (42P05 keeps the old one: pgfence puts back what it knew). A stale
/// session once committed its block unchecked with `EXECUTE` and after a refused Parse
/// (pgfence took them for a write inside the block), and wrote unchecked with an `INSERT`
/// prepared in SQL, after a `DEALLOCATE` or `DISCARD ALL`, under the name of a `SELECT` it
/// had seen parsed (pgfence took it for that `SELECT`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_statement_pgfence_cannot_know_is_checked_as_if_it_committed() {
    let (fx, options) = Fixture::after_leader_34("unknown_names", |c| {
        // The fast path would reject the stale writes before the server ran them.
        c.fence.fast_path = false;
    })
    .await;
    let insert = |tag: &str| format!("INSERT INTO unknown_names VALUES ('stale {tag}')");

    // The COMMIT behind a refused Parse, or a PREPARE in SQL that failed, with the block's
    // write before it.
    for (refused, tag) in [
        (
            [wire::parse("c", "SELECT 1", &[]), wire::sync()].concat(),
            "parse",
        ),
        (wire::query("PREPARE c AS SELECT 1"), "prepare"),
    ] {
        let mut stale = fx.raw_session(&options);
        stale.send(&[wire::parse("c", "COMMIT", &[]), wire::sync()].concat());
        stale.until_ready();
        stale.send(&refused);
        wire::assert_error(&stale.until_ready()[0], "ERROR", "42P05");
        stale.send(&wire::query(format!("BEGIN; {}", insert(tag))));
        assert_eq!(
            stale.until_ready().last().unwrap().ready_status(),
            Some(b'T')
        );
        stale.send(&run_statement("c"));
        expect_raw_rejection(&mut stale, &format!("COMMIT behind a refused {tag}"));
        stale.send(&wire::query("ROLLBACK"));
        stale.until_ready();
    }

    // The same COMMIT run by SQL `EXECUTE`, in a simple Query and parsed.
    for extended in [false, true] {
        let mut stale = fx.raw_session(&options);
        stale.send(&[wire::parse("c", "COMMIT", &[]), wire::sync()].concat());
        stale.until_ready();
        stale.send(&wire::query(format!("BEGIN; {}", insert("execute"))));
        stale.until_ready();
        if extended {
            stale.send(
                &[
                    wire::parse("", "EXECUTE c", &[]),
                    wire::bind("", "", &[]),
                    wire::execute("", 0),
                    wire::sync(),
                ]
                .concat(),
            );
        } else {
            stale.send(&wire::query("EXECUTE c"));
        }
        expect_raw_rejection(&mut stale, &format!("EXECUTE c, extended {extended}"));
        stale.send(&wire::query("ROLLBACK"));
        stale.until_ready();
    }

    // An INSERT prepared in SQL where pgfence had seen a SELECT parsed.
    for (forget, tag) in [("DEALLOCATE r", "deallocate"), ("DISCARD ALL", "discard")] {
        let mut stale = fx.raw_session(&options);
        stale.send(&[wire::parse("r", "SELECT 1", &[]), wire::sync()].concat());
        stale.until_ready();
        stale.send(&wire::query(forget));
        stale.until_ready();
        stale.send(&wire::query(format!("PREPARE r AS {}", insert(tag))));
        stale.until_ready();
        stale.send(&run_statement("r"));
        expect_raw_rejection(&mut stale, forget);
        // The same through the extended protocol: the SQL itself parsed and executed.
        stale.send(&[wire::parse("r2", "SELECT 1", &[]), wire::sync()].concat());
        stale.until_ready();
        for sql in [
            forget.replace(" r", " r2"),
            format!("PREPARE r2 AS {}", insert(tag)),
        ] {
            stale.send(
                &[
                    wire::parse("", &sql, &[]),
                    wire::bind("", "", &[]),
                    wire::execute("", 0),
                    wire::sync(),
                ]
                .concat(),
            );
            stale.until_ready();
        }
        stale.send(&run_statement("r2"));
        expect_raw_rejection(&mut stale, &format!("{forget}, extended"));
    }
    assert_eq!(fx.count("unknown_names WHERE tag LIKE 'stale%'").await, 0);
}

/// `standard_conforming_strings` decides where a literal holding `\'` ends, so where a
/// Query's statements end and what a statement calls. The server reads a Query or Parse
/// pipelined behind a change of it under the new setting, which pgfence learns only from
/// the ReadyForQuery after the change: it waits for it before it reads such a text. In the
/// middle of a batch none is owed, even once the client has flushed the batch and read its
/// replies: a Parse there is taken for a statement pgfence does not know (checked as if it
/// committed), a Query ends the session with an error that says why. A stale session once
/// committed a write this way (found by `protocol_random`'s stale run, seed 1263): pgfence
/// took `-- '; INSERT ...; COMMIT` for a comment, the server ran the INSERT and committed
/// it. And again (found 2026-12-03, by reading the code) behind a batch the client had
/// flushed and read: with nothing in flight, pgfence took the setting for settled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_pipelined_behind_a_change_of_standard_conforming_strings_is_read_as_the_server_reads_it(
) {
    let (fx, options) = Fixture::after_leader_34("scs", |c| {
        // The fast path would reject what it sees; here it must see what the server runs.
        c.fence.fast_path = false;
    })
    .await;
    fx.direct
        .batch_execute(
            "CREATE FUNCTION scs_w() RETURNS int LANGUAGE sql \
             AS $$ INSERT INTO scs VALUES ('stale via a call') RETURNING 1 $$",
        )
        .await
        .unwrap();
    // With `off`, one literal and a comment; with `on` (pgfence's view before the reply),
    // a literal, then a comment to the end.
    let hidden = "SELECT 'x\\'; SELECT 1; -- '; INSERT INTO scs VALUES ('stale'); COMMIT; SELECT 2";
    for set in [
        wire::query("SET standard_conforming_strings = off"),
        [
            wire::parse("", "SET standard_conforming_strings = off", &[]),
            wire::bind("", "", &[]),
            wire::execute("", 0),
            wire::sync(),
        ]
        .concat(),
    ] {
        let mut stale = fx.raw_session(&options);
        stale.send(&[set, wire::query(hidden)].concat());
        stale.until_ready();
        expect_raw_rejection(&mut stale, "the Query behind the SET");
    }
    // The other way round, in the middle of a batch: `off` known, then `RESET` and a Parse
    // that with `on` calls a function that writes (with `off` it is one literal).
    let mut stale = fx.raw_session(&options);
    stale.send(&wire::query("SET standard_conforming_strings = off"));
    stale.until_ready();
    stale.send(
        &[
            wire::parse("", "RESET standard_conforming_strings", &[]),
            wire::bind("", "", &[]),
            wire::execute("", 0),
            wire::parse("", "SELECT 'x\\' , scs_w() --'", &[]),
            wire::bind("", "", &[]),
            wire::execute("", 0),
            wire::sync(),
        ]
        .concat(),
    );
    expect_raw_rejection(&mut stale, "the Parse behind the RESET");
    // A Query right behind unsynced extended-protocol messages that may change the setting:
    // no ReadyForQuery would tell pgfence before the server reads it. The session ends.
    let mut stale = fx.raw_session(&options);
    stale.send(
        &[
            wire::parse("", "SET standard_conforming_strings = off", &[]),
            wire::bind("", "", &[]),
            wire::execute("", 0),
            wire::query(hidden),
        ]
        .concat(),
    );
    expect_lexing_refused(&mut stale);
    // The same with the batch flushed and its replies read first: nothing is in flight, and
    // still no ReadyForQuery has reported the new setting (pgfence took the text for one
    // literal, and the stale INSERT committed).
    let mut stale = fx.raw_session(&options);
    execute_flushed(&mut stale, "SET standard_conforming_strings = off");
    stale.send(&[wire::query(hidden), wire::sync()].concat());
    expect_lexing_refused(&mut stale);
    // And a Parse there, the other way round (`off` known, `RESET` flushed and read): taken
    // for a statement pgfence does not know, its portal is checked as if it committed.
    let mut stale = fx.raw_session(&options);
    stale.send(&wire::query("SET standard_conforming_strings = off"));
    stale.until_ready();
    execute_flushed(&mut stale, "RESET standard_conforming_strings");
    stale.send(&[pbe("SELECT 'x\\' , scs_w() --'"), wire::sync()].concat());
    expect_raw_rejection(&mut stale, "the Parse behind the flushed RESET");
    assert_eq!(fx.count("scs WHERE tag LIKE 'stale%'").await, 0);
}

/// The same for `client_encoding`: PostgreSQL reports a change only with the ReadyForQuery
/// of its request, and reads what follows in the new encoding. In SJIS, the second byte of
/// 表 (0x95 0x5C) is `\`: `E'表'` is one literal to the server, and was an unfinished one
/// to pgfence, which took the INSERT after it for part of the literal and let it commit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_pipelined_behind_a_change_of_client_encoding_is_not_misread() {
    let (fx, options) = Fixture::after_leader_34("enc", |c| c.fence.fast_path = false).await;
    fx.direct
        .batch_execute(
            "CREATE FUNCTION enc_w() RETURNS int LANGUAGE sql \
             AS $$ INSERT INTO enc VALUES ('stale via a call') RETURNING 1 $$",
        )
        .await
        .unwrap();
    let hidden: &[u8] = b"SELECT E'\x95\x5c'; INSERT INTO enc VALUES ('stale'); SELECT '--'";
    for set in [
        wire::query("SET client_encoding = 'SJIS'"),
        wire::query("SELECT set_config('client_encoding', 'SJIS', false)"),
    ] {
        // The session ends when pgfence learns the encoding; nothing may commit before.
        let mut stale = fx.raw_session(&options);
        stale.send(&[set, wire::query(hidden)].concat());
        let _ = stale.until_closed();
    }
    // Extended protocol, one batch: the SET, then a Parse that in SJIS calls a function
    // that writes (to pgfence in UTF-8, one literal and a comment). pgfence counts it as a
    // statement it does not know: checked, rejected, and the SET rolls back with the rest.
    let mut stale = fx.raw_session(&options);
    stale.send(
        &[
            pbe("SET client_encoding = 'SJIS'"),
            wire::parse("", b"SELECT E'\x95\x5c', enc_w() --'".as_slice(), &[]),
            wire::bind("", "", &[]),
            wire::execute("", 0),
            wire::sync(),
        ]
        .concat(),
    );
    expect_raw_rejection(&mut stale, "the Parse behind the SET");
    assert_eq!(fx.count("enc WHERE tag LIKE 'stale%'").await, 0);
}

/// Parse, Bind and Execute of `sql` and a Flush; reads their replies (ParseComplete,
/// BindComplete, CommandComplete), leaving the batch open.
fn execute_flushed(conn: &mut RawConn, sql: &str) {
    conn.send(&[pbe(sql), wire::flush()].concat());
    let tags: Vec<u8> = (0..3).map(|_| conn.recv().tag).collect();
    assert_eq!(tags, b"12C", "the replies to {sql}");
}

/// The session ends with pgfence's refusal of a Query it cannot read while a change of
/// `standard_conforming_strings` may be unreported.
fn expect_lexing_refused(conn: &mut RawConn) {
    let replies = conn.until_closed();
    let fatal = replies.iter().find(|m| m.tag == b'E').expect("an error");
    let text = wire::assert_error(fatal, "FATAL", "0A000");
    assert!(text.contains("send Sync before the Query"), "{text}");
}

/// `ROLLBACK TO SAVEPOINT` in a failed block revives it, with what it wrote before the
/// savepoint: a `COMMIT` after it commits that, so it is checked. A stale session once
/// committed such a block unchecked by sending both in one extended-protocol batch: pgfence
/// still took the block for failed, whose COMMIT only rolls back. Also with the `ROLLBACK
/// TO` under a name whose later Parse the server refused, in a simple Query, synced apart,
/// and (found by `protocol_random`'s stale run) in a Query of its own with the `COMMIT`
/// pipelined in the next: pgfence planned that one still taking the block for failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_block_revived_by_rollback_to_savepoint_is_checked_at_commit() {
    let (fx, options) = Fixture::after_leader_34("revived", |c| {
        c.fence.fast_path = false;
    })
    .await;
    let rollback_to_then_commit: [(&str, Vec<u8>); 5] = [
        (
            "one batch",
            [pbe("ROLLBACK TO SAVEPOINT s"), pbe("COMMIT"), wire::sync()].concat(),
        ),
        (
            "a name parsed again, refused",
            [
                wire::bind("", "rb", &[]),
                wire::execute("", 0),
                pbe("COMMIT"),
                wire::sync(),
            ]
            .concat(),
        ),
        (
            "a simple Query",
            wire::query("ROLLBACK TO SAVEPOINT s; COMMIT"),
        ),
        (
            "synced apart",
            [
                pbe("ROLLBACK TO SAVEPOINT s"),
                wire::sync(),
                pbe("COMMIT"),
                wire::sync(),
            ]
            .concat(),
        ),
        (
            "two simple Queries",
            [
                wire::query("ROLLBACK TO SAVEPOINT s; SELECT 1"),
                wire::query("COMMIT"),
            ]
            .concat(),
        ),
    ];
    for (how, send) in rollback_to_then_commit {
        let mut stale = fx.raw_session(&options);
        stale.send(
            &[
                wire::parse("rb", "ROLLBACK TO SAVEPOINT s", &[]),
                wire::sync(),
            ]
            .concat(),
        );
        stale.until_ready();
        stale.send(&[wire::parse("rb", "SELECT 1", &[]), wire::sync()].concat());
        wire::assert_error(&stale.until_ready()[0], "ERROR", "42P05");
        stale.send(&wire::query(format!(
            "BEGIN; INSERT INTO revived VALUES ('stale {how}'); SAVEPOINT s"
        )));
        stale.until_ready();
        stale.send(&wire::query("SELECT 1/0"));
        wire::assert_error(&stale.until_ready()[0], "ERROR", "22012");
        stale.send(&send);
        if matches!(how, "synced apart" | "two simple Queries") {
            stale.until_ready();
        }
        expect_raw_rejection(&mut stale, how);
    }
    assert_eq!(fx.count("revived WHERE tag LIKE 'stale%'").await, 0);
}

/// A write, then `BEGIN`, in one extended-protocol batch: the block holds the write, so
/// nothing commits at the batch's Sync (pgfence adds no check there: it would run in the
/// block, before the client's `SET TRANSACTION`) and the block's `COMMIT` is checked. A
/// batch whose `BEGIN` an error skipped opens no block: a write pipelined in the next batch
/// commits at its own Sync, checked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_before_begin_in_its_batch_is_checked_at_commit() {
    let (fx, options) = Fixture::after_leader_34("before_begin", |c| {
        c.fence.fast_path = false;
    })
    .await;
    let mut stale = fx.raw_session(&options);
    stale.send(
        &[
            pbe("INSERT INTO before_begin VALUES ('stale in the block')"),
            pbe("BEGIN"),
            wire::sync(),
        ]
        .concat(),
    );
    let replies = stale.until_ready();
    assert_eq!(
        replies.last().unwrap().ready_status(),
        Some(b'T'),
        "{replies:?}"
    );
    stale.send(&wire::query("COMMIT"));
    expect_raw_rejection(&mut stale, "COMMIT of the block");
    stale.send(
        &[
            pbe("SELECT 1/0"),
            pbe("BEGIN"),
            wire::sync(),
            pbe("INSERT INTO before_begin VALUES ('stale after the skipped BEGIN')"),
            wire::sync(),
        ]
        .concat(),
    );
    let replies = stale.until_ready();
    assert_eq!(
        replies.last().unwrap().ready_status(),
        Some(b'I'),
        "{replies:?}"
    );
    expect_raw_rejection(&mut stale, "write after a skipped BEGIN");
    assert_eq!(fx.count("before_begin WHERE tag LIKE 'stale%'").await, 0);
}

/// A Query or FunctionCall sent inside an extended-protocol batch, before its Sync, runs in
/// the batch's implicit transaction and commits it, with what the batch wrote before it.
/// pgfence checks there, in that transaction, before the message. `protocol_random`'s runs
/// with Queries inside batches found (2026-12-03) a FunctionCall there committing a stale
/// write; so did a lone `SET LOCAL` (a statement that alone writes nothing, so pgfence added
/// no check to it). A lone `VACUUM` there failed with another 25001 than PostgreSQL's
/// ("cannot run inside a transaction block": pgfence's check made the Query an implicit
/// block). A failed check there, behind which a Query held a `COMMIT`, hung the session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_query_or_function_call_inside_a_batch_is_checked_with_what_the_batch_wrote() {
    for fast_path in [false, true] {
        let (fx, options) = Fixture::after_leader_34("inside", |c| {
            c.fence.fast_path = fast_path;
        })
        .await;
        let abs: u32 = fx
            .direct
            .query_one("SELECT 'abs(int4)'::regprocedure::oid", &[])
            .await
            .unwrap()
            .get(0);
        let mut stale = fx.raw_session(&options);
        // Each message is answered as a Query or FunctionCall that fails is: the check's
        // error and a ReadyForQuery (the server skipped the message behind the failed check,
        // and pgfence ends that skipping with a Sync of its own: a client waiting for the
        // message's ReadyForQuery hung). What follows it in the batch runs.
        let inside = [
            (
                "a FunctionCall",
                wire::function_call(abs, &[Some(b"-5")]),
                1,
            ),
            (
                "SET LOCAL",
                wire::query("SET LOCAL application_name = 'x'"),
                1,
            ),
            ("DISCARD ALL", wire::query("DISCARD ALL"), 1),
            ("SAVEPOINT", wire::query("SAVEPOINT s"), 1),
            ("VACUUM", wire::query("VACUUM inside"), 1),
            ("a read", wire::query("SELECT 1"), 1),
            // The check before the first Query fails: pgfence must not take that failure for
            // the check before the second one's COMMIT, and wait for that Query (hung,
            // waiting, on the client's Sync it did not read). The second Query runs, and its
            // own write is rejected at its COMMIT.
            (
                "two Queries, the second with a COMMIT",
                [
                    wire::query("SELECT 1"),
                    wire::query(
                        "INSERT INTO inside VALUES ('stale in the second Query'); COMMIT; SELECT 3",
                    ),
                ]
                .concat(),
                2,
            ),
        ];
        for (what, message, messages) in inside {
            let context = format!("{what} inside a batch that wrote, fast path {fast_path}");
            stale.send(
                &[
                    pbe(&format!(
                        "INSERT INTO inside VALUES ('stale before {what}')"
                    )),
                    message,
                    wire::sync(),
                    wire::query("SELECT 'after'"),
                ]
                .concat(),
            );
            let first = stale.until_ready();
            let ran = first
                .iter()
                .any(|m| m.command_tag().is_some_and(|t| t.starts_with("INSERT")));
            if !ran {
                // The fast path rejected the INSERT's Execute (it knows the session's token):
                // the server skips the rest of the batch, as after any failed Execute. One
                // ReadyForQuery, the Sync's.
                assert!(fast_path, "{context}: the INSERT never ran: {first:?}");
                let error = first.iter().find(|m| m.tag == b'E');
                let error = error.unwrap_or_else(|| panic!("{context}: no error in {first:?}"));
                wire::assert_error(error, "ERROR", "FN001");
            } else {
                let mut replies = first;
                for n in 0..messages {
                    if n > 0 {
                        replies = stale.until_ready();
                    }
                    let tags: String = replies.iter().map(|m| m.tag as char).collect();
                    assert!(tags.ends_with("EZ"), "{context}, message {n}: {replies:?}");
                    wire::assert_error(&replies[replies.len() - 2], "ERROR", "FN001");
                }
                let sync = stale.until_ready();
                assert_eq!(sync.len(), 1, "{context}: the batch's Sync: {sync:?}");
            }
            let after = stale.until_ready();
            assert!(
                after.iter().all(|m| m.tag != b'E')
                    && after
                        .iter()
                        .any(|m| m.command_tag().as_deref() == Some("SELECT 1")),
                "{context}: the session is not usable after: {after:?}"
            );
        }
        assert_eq!(fx.count("inside WHERE tag LIKE 'stale%'").await, 0);
        // The leader's lone `VACUUM` inside a batch that wrote gets PostgreSQL's own answer
        // (not one of pgfence's making), and the write rolls back.
        let mut leader = fx.raw_session("-c fencing.token=34 -c fencing.resource=inside");
        leader.send(
            &[
                pbe("INSERT INTO inside VALUES ('leader before VACUUM')"),
                wire::query("VACUUM inside"),
                wire::sync(),
            ]
            .concat(),
        );
        let mut replies = leader.until_ready();
        replies.extend(leader.until_ready());
        let error = replies.iter().find(|m| m.tag == b'E').expect("an error");
        wire::assert_error(error, "ERROR", "25001");
        assert_eq!(
            error.field(b'M').as_deref(),
            Some("VACUUM cannot be executed within a pipeline"),
            "{replies:?}"
        );
        assert_eq!(
            fx.count("inside WHERE tag = 'leader before VACUUM'").await,
            0
        );
    }
}

/// A lone `VACUUM` inside a batch, behind only a Parse, Bind, Describe or Close of it (or an
/// Execute of an empty statement), runs on PostgreSQL in a transaction of its own (it ends
/// the one they started); so behind an Executed `COMMIT` of the batch, after which a new
/// transaction starts. pgfence sends a Flush, reads their replies (behind a `COMMIT`, then
/// sends a Sync of its own, to learn whether a block is open), and checks the token first
/// on its own, as before a `VACUUM` sent alone: a stale one is rejected and the batch goes
/// on, the leader's runs. Its check as an Execute in their transaction made PostgreSQL
/// refuse it "within a pipeline"; when one of them fails, the server skips the `VACUUM`, and
/// pgfence adds nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vacuum_inside_a_batch_behind_only_a_parse_is_checked_first_on_its_own() {
    let (fx, options) = Fixture::after_leader_34("vacuum_inside", |_| {}).await;
    let batch = |first: &str| {
        [
            wire::parse("", first, &[]),
            wire::bind("", "", &[]),
            wire::query("VACUUM vacuum_inside"),
            wire::sync(),
        ]
        .concat()
    };
    // An unnamed Parse, Bind and Execute of each statement, then the `VACUUM` and a Sync.
    let vacuum_behind = |statements: &[&str]| {
        let mut batch = Vec::new();
        for sql in statements {
            batch.extend(wire::parse("", sql, &[]));
            batch.extend(wire::bind("", "", &[]));
            batch.extend(wire::execute("", 0));
        }
        batch.extend(wire::query("VACUUM vacuum_inside"));
        batch.extend(wire::sync());
        batch
    };
    // Behind an Execute of an empty statement, which leaves PostgreSQL's pipelining flag
    // alone: the same.
    let behind_empty = vacuum_behind(&[""]);
    // Behind an Executed COMMIT of the batch (with no block open: a warning) and an empty
    // statement: PostgreSQL runs the `VACUUM` in a new transaction, and pgfence, once a Sync
    // of its own told it that no block is open, checks it first on its own.
    let behind_commit = vacuum_behind(&["COMMIT", ""]);
    let tags = |replies: &[Msg]| replies.iter().map(|m| m.tag as char).collect::<String>();
    let mut stale = fx.raw_session(&options);
    stale.send(&behind_commit);
    let vacuum = stale.until_ready();
    assert_eq!(tags(&vacuum), "12NC12IEZ", "{vacuum:?}");
    wire::assert_error(&vacuum[7], "ERROR", "FN001");
    assert_eq!(tags(&stale.until_ready()), "Z", "the batch's Sync");
    stale.send(&batch("SELECT 1"));
    let vacuum = stale.until_ready();
    assert_eq!(tags(&vacuum), "12EZ", "{vacuum:?}");
    wire::assert_error(&vacuum[2], "ERROR", "FN001");
    assert_eq!(tags(&stale.until_ready()), "Z", "the batch's Sync");
    stale.send(&behind_empty);
    let vacuum = stale.until_ready();
    assert_eq!(tags(&vacuum), "12IEZ", "{vacuum:?}");
    wire::assert_error(&vacuum[3], "ERROR", "FN001");
    assert_eq!(tags(&stale.until_ready()), "Z", "the batch's Sync");
    stale.send(&batch("SELEC 1"));
    let skipped = stale.until_ready();
    assert_eq!(tags(&skipped), "EZ", "{skipped:?}");
    wire::assert_error(&skipped[0], "ERROR", "42601");
    let mut leader = fx.raw_session("-c fencing.token=34 -c fencing.resource=vacuum_inside");
    leader.send(&batch("SELECT 1"));
    let vacuum = leader.until_ready();
    assert_eq!(tags(&vacuum), "12CZ", "{vacuum:?}");
    assert_eq!(
        vacuum[2].command_tag().as_deref(),
        Some("VACUUM"),
        "{vacuum:?}"
    );
    assert_eq!(tags(&leader.until_ready()), "Z", "the batch's Sync");
    leader.send(&behind_empty);
    let vacuum = leader.until_ready();
    assert_eq!(tags(&vacuum), "12ICZ", "{vacuum:?}");
    assert_eq!(tags(&leader.until_ready()), "Z", "the batch's Sync");
    leader.send(&behind_commit);
    let vacuum = leader.until_ready();
    assert_eq!(tags(&vacuum), "12NC12ICZ", "{vacuum:?}");
    assert_eq!(tags(&leader.until_ready()), "Z", "the batch's Sync");
    // Behind the COMMIT of a block that wrote: pgfence checks the COMMIT in the batch, and
    // the `VACUUM` after it on its own. The write commits, and the `VACUUM` runs.
    leader.send(&wire::query("BEGIN"));
    assert_eq!(tags(&leader.until_ready()), "CZ");
    leader.send(&vacuum_behind(&[
        "INSERT INTO vacuum_inside VALUES ('leader, then VACUUM')",
        "COMMIT",
    ]));
    let vacuum = leader.until_ready();
    assert_eq!(tags(&vacuum), "12C12CCZ", "{vacuum:?}");
    assert_eq!(
        vacuum[6].command_tag().as_deref(),
        Some("VACUUM"),
        "{vacuum:?}"
    );
    assert_eq!(tags(&leader.until_ready()), "Z", "the batch's Sync");
    assert_eq!(
        fx.count("vacuum_inside WHERE tag = 'leader, then VACUUM'")
            .await,
        1
    );
    // Behind a COMMIT that chains a new block, the `VACUUM` fails in it, as on PostgreSQL.
    leader.send(
        &[
            vacuum_behind(&["BEGIN", "COMMIT AND CHAIN"]),
            wire::query("ROLLBACK"),
        ]
        .concat(),
    );
    let vacuum = leader.until_ready();
    assert_eq!(tags(&vacuum), "12C12CEZ", "{vacuum:?}");
    wire::assert_error(&vacuum[6], "ERROR", "25001");
    let sync = leader.until_ready();
    assert_eq!(
        sync[0].ready_status(),
        Some(b'E'),
        "the batch's Sync: {sync:?}"
    );
    assert_eq!(tags(&leader.until_ready()), "CZ", "ROLLBACK");
}

/// A client that leaves in the middle of a batch it flushed and read, with nothing in
/// flight, leaves an implicit transaction open on the server: what the batch wrote must
/// roll back, not commit with pgfence's reset of the connection it keeps (`DISCARD ALL`
/// is a Query, which commits the transaction it arrives in if it runs; behind an Execute,
/// finished or suspended, PostgreSQL refuses it "within a pipeline", and pgfence closes
/// the connection instead of keeping it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_gone_in_the_middle_of_a_flushed_batch_commits_nothing() {
    let (fx, options) = Fixture::after_leader_34("gone_mid_batch", |c| {
        // The fast path would reject the INSERT before it runs.
        c.fence.fast_path = false;
    })
    .await;
    for (n, max_rows) in [1, 0].into_iter().enumerate() {
        let mut stale = fx.raw_session(&options);
        stale.send(
            &[
                wire::parse(
                    "",
                    format!(
                        "INSERT INTO gone_mid_batch VALUES ('stale {n} a'), ('stale {n} b') \
                         RETURNING tag"
                    ),
                    &[],
                ),
                wire::bind("", "", &[]),
                wire::execute("", max_rows),
                wire::flush(),
            ]
            .concat(),
        );
        let expected: &[u8] = if max_rows == 1 { b"12Ds" } else { b"12DDC" };
        let replies: Vec<u8> = (0..expected.len()).map(|_| stale.recv().tag).collect();
        assert_eq!(replies, expected, "max_rows {max_rows}");
        stale.send(&wire::terminate());
        drop(stale);
    }
    // The kept connection's reset (or the server's rollback) is done within a moment.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(fx.count("gone_mid_batch WHERE tag LIKE 'stale%'").await, 0);
}

/// `COMMIT PREPARED` and `ROLLBACK PREPARED` finish a transaction checked at its `PREPARE
/// TRANSACTION`: they are not checked again. A check before them, in a transaction of its
/// own, waited for the prepared transaction's locks on its fence, held until the very
/// `COMMIT PREPARED` it held back: a new fence, or an advanced one, never committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prepared_transactions_finish_with_a_token() {
    let fx = Fixture::start("CREATE TABLE twophase (tag text);", |_| {}).await;
    let r = "twophase";
    let within = |what: &'static str| {
        move |result: Result<Result<(), tokio_postgres::Error>, tokio::time::error::Elapsed>| {
            result
                .unwrap_or_else(|_| panic!("{what}: no answer within 10 s"))
                .unwrap_or_else(|e| panic!("{what}: {e:?}"))
        }
    };
    let ten = Duration::from_secs(10);
    // A new fence, simple protocol.
    let s = fx.leader(r, 5).await;
    s.simple("BEGIN; INSERT INTO twophase VALUES ('5'); PREPARE TRANSACTION 'new_fence'")
        .await
        .unwrap();
    within("COMMIT PREPARED of a new fence")(
        tokio::time::timeout(ten, s.simple("COMMIT PREPARED 'new_fence'")).await,
    );
    assert_eq!(fx.fence(r).await, Some(5));
    // An advance, extended protocol.
    let s = fx.leader(r, 6).await;
    s.simple("BEGIN").await.unwrap();
    s.extended("INSERT INTO twophase VALUES ('6')")
        .await
        .unwrap();
    s.extended("PREPARE TRANSACTION 'advance'").await.unwrap();
    within("COMMIT PREPARED of an advance")(
        tokio::time::timeout(ten, s.extended("COMMIT PREPARED 'advance'")).await,
    );
    assert_eq!(fx.fence(r).await, Some(6));
    // Rolled back: neither the row nor the advance.
    let s = fx.leader(r, 7).await;
    s.simple("BEGIN; INSERT INTO twophase VALUES ('7'); PREPARE TRANSACTION 'dropped'")
        .await
        .unwrap();
    within("ROLLBACK PREPARED")(
        tokio::time::timeout(ten, s.simple("ROLLBACK PREPARED 'dropped'")).await,
    );
    assert_eq!(fx.fence(r).await, Some(6));
    assert_eq!(fx.count("twophase").await, 2);
    assert_eq!(fx.count("pg_prepared_xacts").await, 0);
}

/// The fast path acts only on fences that committed: a token a check accepted in a
/// transaction that then failed at COMMIT (a deferred constraint) or was prepared and rolled
/// back never became the fence, and a lower token the database accepts is not rejected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fast_path_learns_only_committed_fences() {
    let fx = Fixture::start(
        "CREATE TABLE learned (id int UNIQUE DEFERRABLE INITIALLY DEFERRED);",
        |_| {},
    )
    .await;
    for (n, protocol) in PROTOCOLS.into_iter().enumerate() {
        let r = format!("learned_{n}");
        fx.leader(&r, 30)
            .await
            .simple(&format!("INSERT INTO learned VALUES ({})", 300 + n))
            .await
            .unwrap();
        let s = fx.leader(&r, 40).await;
        let result = s
            .run(
                protocol,
                &[
                    "BEGIN",
                    "INSERT INTO learned VALUES (1)",
                    "INSERT INTO learned VALUES (1)",
                    "COMMIT",
                ],
            )
            .await;
        let code = result
            .expect_err("the deferred constraint fails at COMMIT")
            .as_db_error()
            .map(|e| e.code().code().to_owned());
        assert_eq!(code.as_deref(), Some("23505"), "{protocol:?}");
        assert_eq!(fx.fence(&r).await, Some(30), "{protocol:?}");
        fx.leader(&r, 35)
            .await
            .run(
                protocol,
                &[&format!("INSERT INTO learned VALUES ({})", 350 + n)],
            )
            .await
            .unwrap_or_else(|e| panic!("{protocol:?}: 35 after 40 failed to commit: {e:?}"));
        assert_eq!(fx.fence(&r).await, Some(35), "{protocol:?}");
    }
    let r = "learned_prepared";
    let s = fx.leader(r, 50).await;
    s.simple("BEGIN; INSERT INTO learned VALUES (50); PREPARE TRANSACTION 'learned'")
        .await
        .unwrap();
    s.simple("ROLLBACK PREPARED 'learned'").await.unwrap();
    fx.leader(r, 36)
        .await
        .simple("INSERT INTO learned VALUES (36)")
        .await
        .expect("36 after 50 was rolled back");
    assert_eq!(fx.fence(r).await, Some(36));
}

/// The fast path rejects only with fences the session's database holds. Two reviews found
/// it rejecting a leader the database accepts, with a fence learnt in another database (each
/// holds its own), from an FN001 any statement may raise, from the transaction's own advance
/// that its rejection rolled back, and for the configured default resource where `ALTER
/// ROLE ... SET fencing.resource` names the session's (older than stop 51).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fast_path_knows_only_fences_the_database_holds() {
    let fx = Fixture::start("CREATE TABLE known (tag text);", |c| {
        c.fence.defaults.push(DefaultResource {
            database: APP_DB.into(),
            user: Some("known_role".into()),
            resource: "known_default".into(),
        })
    })
    .await;
    fx.direct
        .batch_execute("CREATE DATABASE known_other")
        .await
        .unwrap();
    let other = fx.cluster.connect("known_other").await;
    install(&other).await;
    other
        .batch_execute("CREATE TABLE known (tag text)")
        .await
        .unwrap();
    let insert = |tag: &str| format!("INSERT INTO known VALUES ('{tag}')");
    let in_other = |options: &str| {
        let connstr = format!(
            "{} options={}",
            fx.proxy.connstr_as("known_other", SUPERUSER, None),
            quote_conn_value(options)
        );
        async move { connect_with_notices(&connstr).await.0 }
    };

    // A fence of another database.
    fx.leader("perdb", 50)
        .await
        .simple(&insert("perdb 50"))
        .await
        .unwrap();
    in_other("-c fencing.resource=perdb -c fencing.token=20")
        .await
        .batch_execute(&insert("perdb 20 in the other database"))
        .await
        .expect("token 20 in a database whose fence is not 50");

    // An FN001 a statement of the client's raised.
    fx.session(SUPERUSER, None)
        .await
        .simple(
            "DO $$ BEGIN RAISE EXCEPTION USING ERRCODE = 'FN001', MESSAGE = \
             'stale fencing token 1 for resource \"victim\": token 999 was already accepted'; \
             END $$",
        )
        .await
        .unwrap_err();
    fx.leader("victim", 5)
        .await
        .simple(&insert("victim 5"))
        .await
        .expect("a fence no check reported");

    // The transaction's own advance: the check before an `EXECUTE` that may be a `COMMIT`
    // (here a `BEGIN` parsed in the extended protocol) accepts the session's 60, and the
    // check at COMMIT, with 50, is rejected for it.
    fx.leader("own", 50)
        .await
        .simple(&insert("own 50"))
        .await
        .unwrap();
    let mut raw = fx.raw_session("-c fencing.resource=own -c fencing.token=50");
    raw.send(&[wire::parse("b", "BEGIN", &[]), wire::sync()].concat());
    raw.until_ready();
    raw.send(&wire::query(format!(
        "BEGIN; SET LOCAL fencing.token = 60; {}; EXECUTE b; SET LOCAL fencing.token = 50; \
         {}; COMMIT",
        insert("own 60"),
        insert("own 50 again")
    )));
    assert_stale(&raw.until_ready());
    assert_eq!(fx.fence("own").await, Some(50));
    fx.leader("own", 50)
        .await
        .simple(&insert("own 50, last"))
        .await
        .expect("a fence the rejection rolled back");

    // The default resource, where the role names another.
    let role_writes = |setup: &'static str, token: i64| {
        let fx = &fx;
        async move {
            fx.direct.batch_execute(setup).await.unwrap();
            fx.session("known_role", Some(&format!("-c fencing.token={token}")))
                .await
                .simple(&format!("INSERT INTO known VALUES ('role {token}')"))
                .await
        }
    };
    role_writes(
        "CREATE ROLE known_role LOGIN; GRANT ALL ON known TO known_role;",
        50,
    )
    .await
    .unwrap();
    assert_eq!(fx.fence("known_default").await, Some(50));
    role_writes(
        "ALTER ROLE known_role SET fencing.resource = 'known_own'",
        6,
    )
    .await
    .expect("token 6 for the role's resource");
    assert_eq!(fx.fence("known_own").await, Some(6));
}

/// With `skip_read_only = false` every statement counts as a write, but `DISCARD ALL` cannot
/// run in a transaction block: a check appended to it would make it fail. It writes nothing
/// a fence protects (its only writes drop the session's temporary objects).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn discard_all_runs_when_reads_are_checked() {
    let fx = Fixture::start("CREATE TABLE discarded (tag text);", |c| {
        c.fence.skip_read_only = false;
    })
    .await;
    let s = fx.leader("discarded", 3).await;
    for protocol in PROTOCOLS {
        s.run(protocol, &["DISCARD ALL"])
            .await
            .unwrap_or_else(|e| panic!("{protocol:?}: {e:?}"));
        s.run(protocol, &["INSERT INTO discarded VALUES ('after')"])
            .await
            .unwrap_or_else(|e| panic!("{protocol:?}: write after DISCARD ALL: {e:?}"));
    }
    assert_eq!(fx.count("discarded").await, 2);
}

/// A COMMIT of a block that already failed, with more statements after it in the same Query
/// or batch, sent before the failure was read: PostgreSQL answers the COMMIT with ROLLBACK
/// and runs the rest. pgfence waits for the replies in flight before it places its check,
/// so it knows the block failed and adds none: the same happens through it. So does a batch
/// whose first messages (a Close) are already upstream when the COMMIT comes: pgfence
/// waits for the ReadyForQuery before that batch, which the server sends at once (before,
/// its check met the failed block and the client got `25P02`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn statements_after_the_commit_of_a_failed_block_run_as_on_postgresql() {
    let fx = Fixture::start("CREATE TABLE afterfail (tag text);", |_| {}).await;
    let mut conn = fx.raw_session("-c fencing.token=3 -c fencing.resource=afterfail");
    // (name, what follows the failed block)
    let cases = [
        (
            "simple",
            [
                wire::query("SELECT 1/0"),
                wire::query("COMMIT; INSERT INTO afterfail VALUES ('simple')"),
            ]
            .concat(),
        ),
        (
            "extended",
            [
                pbe("SELECT 1/0"),
                wire::sync(),
                pbe("COMMIT"),
                pbe("INSERT INTO afterfail VALUES ('extended')"),
                wire::sync(),
            ]
            .concat(),
        ),
        (
            "prepared COMMIT, chained",
            [
                wire::parse("c", "COMMIT AND CHAIN", &[]),
                wire::sync(),
                pbe("SELECT 1/0"),
                wire::sync(),
                wire::bind("", "c", &[]),
                wire::execute("", 0),
                pbe("INSERT INTO afterfail VALUES ('prepared COMMIT, chained')"),
                wire::sync(),
                wire::query("COMMIT"),
            ]
            .concat(),
        ),
        (
            "half sent",
            [
                pbe("SELECT 1/0"),
                wire::sync(),
                wire::close(b'S', "nothing"),
                pbe("COMMIT"),
                pbe("INSERT INTO afterfail VALUES ('half sent')"),
                wire::sync(),
            ]
            .concat(),
        ),
    ];
    for (name, batch) in cases {
        conn.send(&wire::query(
            "BEGIN; INSERT INTO afterfail VALUES ('in the block')",
        ));
        conn.until_ready();
        conn.send(&batch);
        if name.starts_with("prepared") {
            conn.until_ready();
        }
        let first = conn.until_ready();
        assert_eq!(
            first.last().and_then(|m| m.ready_status()),
            Some(b'E'),
            "{name}: {first:?}"
        );
        let second = conn.until_ready();
        // Counted once the session has answered everything it was sent (the chained case
        // commits its INSERT with a COMMIT pipelined after it).
        let count = format!("afterfail WHERE tag = '{name}'");
        // As from PostgreSQL: the COMMIT reports ROLLBACK, then the INSERT runs.
        let tags: Vec<u8> = second.iter().map(|m| m.tag).collect();
        let expected: &[u8] = match name {
            "simple" => b"CCZ",
            "extended" => b"12C12CZ",
            "half sent" => b"312C12CZ",
            _ => b"2C12CZ",
        };
        assert_eq!(tags, expected, "{name}: {second:?}");
        let rollback = second.iter().find(|m| m.tag == b'C');
        assert_eq!(
            rollback.map(|m| m.body.as_slice()),
            Some(&b"ROLLBACK\0"[..]),
            "{name}: {second:?}"
        );
        if name.starts_with("prepared") {
            // AND CHAIN opened the next block, which the INSERT ran in.
            assert_eq!(second.last().and_then(|m| m.ready_status()), Some(b'T'));
            let committed = conn.until_ready();
            assert_eq!(committed.last().and_then(|m| m.ready_status()), Some(b'I'));
        }
        assert_eq!(
            fx.count(&count).await,
            1,
            "{name}: the INSERT after the COMMIT did not run"
        );
        conn.send(&wire::query("INSERT INTO afterfail VALUES ('usable')"));
        let replies = conn.until_ready();
        assert_eq!(
            replies.last().and_then(|m| m.ready_status()),
            Some(b'I'),
            "{name}: {replies:?}"
        );
    }
    assert_eq!(fx.count("afterfail WHERE tag = 'in the block'").await, 0);
    assert_eq!(fx.count("afterfail WHERE tag = 'usable'").await, 4);
}

/// An empty query pipelined after a write whose block pgfence cannot yet tell open or not
/// is answered with EmptyQueryResponse, as from PostgreSQL (a check added to it took it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_query_stays_empty() {
    let fx = Fixture::start("CREATE TABLE empty_q (tag text);", |_| {}).await;
    let (mut conn, _) = RawConn::login(fx.proxy.addr(), SUPERUSER, APP_DB);
    conn.send(
        &[
            wire::query("BEGIN; INSERT INTO empty_q VALUES ('x')"),
            wire::query(""),
        ]
        .concat(),
    );
    conn.until_ready();
    let replies = conn.until_ready();
    let tags: Vec<u8> = replies.iter().map(|m| m.tag).collect();
    assert_eq!(tags, b"IZ", "{replies:?}");
    conn.send(&wire::query("COMMIT"));
    conn.until_ready();
    assert_eq!(fx.count("empty_q").await, 1);
}

/// A transaction made read-only after it wrote cannot take the fence's row lock, so
/// pgfence's check fails (25006) and the writes roll back: never committed unchecked (a
/// known limitation, README). Both with `SET TRANSACTION READ ONLY` in a block and with
/// writes followed by `BEGIN READ ONLY` in one Query.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_made_read_only_after_it_wrote_does_not_commit_unchecked() {
    let fx = Fixture::start("CREATE TABLE ro_after (tag text);", |_| {}).await;
    let leader = fx.leader("ro_after", 5).await;
    for (n, script) in [
        "BEGIN; INSERT INTO ro_after VALUES ('a'); SET TRANSACTION READ ONLY; COMMIT",
        "INSERT INTO ro_after VALUES ('b'); BEGIN READ ONLY; COMMIT",
    ]
    .into_iter()
    .enumerate()
    {
        let result = leader.simple(script).await;
        assert_eq!(
            sqlstate(&result).as_deref(),
            Some("25006"),
            "{n} {script}: {result:?}"
        );
        leader.simple("ROLLBACK").await.unwrap();
    }
    assert_eq!(fx.count("ro_after").await, 0);
    // Directly, PostgreSQL commits both: the difference is pgfence's.
    for script in [
        "BEGIN; INSERT INTO ro_after VALUES ('a'); SET TRANSACTION READ ONLY; COMMIT",
        "INSERT INTO ro_after VALUES ('b'); BEGIN READ ONLY; COMMIT",
    ] {
        fx.direct.batch_execute(script).await.expect(script);
    }
    assert_eq!(fx.count("ro_after").await, 2);
}

/// A prepared transaction rolled back does not leave the session unable to write: the
/// check records a per-backend hint (`pgfence.accepted`) as a session setting, which
/// PostgreSQL keeps at `PREPARE TRANSACTION`; once the prepared transaction was rolled
/// back, the hint claimed a fence the database did not have, and every later write of the
/// session with that token failed with 40001 (found by `protocol_random`). pgfence resets
/// the hint after a prepared transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prepared_transaction_rolled_back_leaves_the_session_writable() {
    let fx = Fixture::start("CREATE TABLE prep_rb (tag text);", |_| {}).await;
    for (n, extended) in [false, true].into_iter().enumerate() {
        let r = format!("prep_rb_{n}");
        let leader = fx.leader(&r, 7).await;
        let run = |sql: String| {
            let leader = &leader;
            async move {
                if extended {
                    leader.extended(&sql).await
                } else {
                    leader.simple(&sql).await
                }
            }
        };
        for round in 0..2 {
            run("BEGIN".into()).await.unwrap();
            run(format!(
                "INSERT INTO prep_rb VALUES ('{r} prepared {round}')"
            ))
            .await
            .unwrap();
            run(format!("PREPARE TRANSACTION '{r}_{round}'"))
                .await
                .unwrap();
            run(format!("ROLLBACK PREPARED '{r}_{round}'"))
                .await
                .unwrap();
        }
        assert_eq!(fx.fence(&r).await, None, "{r}: nothing committed yet");
        run(format!("INSERT INTO prep_rb VALUES ('{r} after')"))
            .await
            .unwrap_or_else(|e| panic!("{r}: write after a rolled back PREPARE: {e:?}"));
        assert_eq!(fx.fence(&r).await, Some(7), "{r}");
        // And after one committed, the next write takes the hinted path again.
        run("BEGIN".into()).await.unwrap();
        run(format!("INSERT INTO prep_rb VALUES ('{r} prepared')"))
            .await
            .unwrap();
        run(format!("PREPARE TRANSACTION '{r}_c'")).await.unwrap();
        run(format!("COMMIT PREPARED '{r}_c'")).await.unwrap();
        run(format!("INSERT INTO prep_rb VALUES ('{r} last')"))
            .await
            .unwrap();
    }
    assert_eq!(fx.count("prep_rb WHERE tag LIKE '%prepared _'").await, 0);
    assert_eq!(fx.count("prep_rb").await, 6);
}

/// A portal pgfence does not know may run a `CALL` that commits inside: here the name of a
/// `CALL` parsed in the extended protocol is one that a later SQL `PREPARE` tried to take
/// (it failed, but pgfence cannot tell from the text, and forgets the name). The Execute of
/// such a portal, outside a block, gets the forced check a `CALL` gets: before, a check
/// that passes while the transaction has written nothing went before it, and the `CALL`'s
/// own `COMMIT` committed a stale session's write. Found by `random_stale` seed 116012;
/// older than stop 51.
#[tokio::test]
async fn a_portal_pgfence_does_not_know_is_checked_as_a_call() {
    let fx = committing_procedure_after_leader_34().await;
    let steps = [
        [wire::parse("a", "CALL cp(2)", &[]), wire::sync()].concat(),
        wire::query("PREPARE a AS INSERT INTO cr VALUES (1, 0)"),
        [
            wire::parse("", "SELECT 1", &[]),
            wire::bind("", "", &[]),
            wire::execute("", 0),
            wire::bind("p", "a", &[]),
            wire::execute("p", 0),
            wire::sync(),
        ]
        .concat(),
    ];
    let direct = run_steps(&mut fx.raw_direct(), &steps);
    assert_eq!(fx.count("cr WHERE v = 2").await, 1, "directly the CALL ran");
    let current = run_steps(
        &mut fx.raw_session("-c fencing.token=34 -c fencing.resource=cr"),
        &steps,
    );
    assert_eq!(current, direct, "the current leader's session as directly");
    assert_eq!(fx.count("cr WHERE v = 4").await, 1);
    let stale = run_steps(
        &mut fx.raw_session("-c fencing.token=33 -c fencing.resource=cr"),
        &steps,
    );
    assert_eq!(
        first_error(&stale[2]).as_deref(),
        Some("FN001"),
        "{stale:?}"
    );
    assert_eq!(
        fx.count("cr WHERE v = 4").await,
        1,
        "the stale session's CALL committed"
    );
}

/// Table `cr` (row 2 at 0), procedure `cp(k)` that adds 1 to row k, commits, and adds 1
/// again, and resource `cr` whose leader wrote with token 34; the fast path off.
async fn committing_procedure_after_leader_34() -> Fixture {
    let fx = Fixture::start(
        "CREATE TABLE cr (id int PRIMARY KEY, v int);
         INSERT INTO cr VALUES (2, 0);
         CREATE PROCEDURE cp(k int) LANGUAGE plpgsql AS $$ BEGIN
             UPDATE cr SET v = v + 1 WHERE id = k;
             COMMIT;
             UPDATE cr SET v = v + 1 WHERE id = k;
         END $$;",
        |c| c.fence.fast_path = false,
    )
    .await;
    fx.leader("cr", 34)
        .await
        .simple("UPDATE cr SET v = v WHERE id = 2")
        .await
        .unwrap();
    fx
}

/// Runs `steps` directly, then through pgfence in a session with these startup
/// `options`, and asserts the same replies.
fn replies_as_directly(fx: &Fixture, options: &str, steps: &[Vec<u8>]) {
    let direct = run_steps(&mut fx.raw_direct(), steps);
    let through = run_steps(&mut fx.raw_session(options), steps);
    assert_eq!(through, direct, "{options}: not as directly");
}

/// Sends each step in one write, and reads its replies up to its last ReadyForQuery (one
/// per Sync or Query in it).
fn run_steps(conn: &mut RawConn, steps: &[Vec<u8>]) -> Vec<Vec<Msg>> {
    steps
        .iter()
        .map(|step| {
            conn.send(step);
            let ends = wire::split_messages(step)
                .iter()
                .filter(|m| matches!(m.tag, b'S' | b'Q'))
                .count();
            (0..ends).flat_map(|_| conn.until_ready()).collect()
        })
        .collect()
}

/// The server runs a statement other than the one pgfence last saw parsed under a name:
/// the Parse that would replace it is refused (42P05: the name is in use), and a Bind in
/// the next batch binds the old one. pgfence takes the Bind for the old statement, unless
/// both are alike for the fence, which compares whether each commits inside (a `DO` with a
/// `COMMIT` is no `UPDATE`; a `CALL` is no `VACUUM`, though neither runs in a block). And a
/// SQL `EXECUTE` of a `PREPARE` parsed in the extended protocol prepares a name, which
/// pgfence forgets. Before, each of these let a stale session's write commit (a review
/// found them; older than stop 51).
#[tokio::test]
async fn a_name_the_server_holds_for_another_statement_is_not_trusted() {
    let fx = committing_procedure_after_leader_34().await;
    let do_commit = "DO $$BEGIN UPDATE cr SET v = v + 1 WHERE id = 2; COMMIT; END$$";
    let cases: [(&str, Vec<Vec<u8>>); 3] = [
        (
            "a DO taken for an UPDATE",
            vec![
                [wire::parse("s", do_commit, &[]), wire::sync()].concat(),
                [
                    wire::parse("s", "UPDATE cr SET v = v WHERE id = 2", &[]),
                    wire::sync(),
                    wire::bind("", "s", &[]),
                    wire::execute("", 0),
                    wire::sync(),
                ]
                .concat(),
            ],
        ),
        (
            "a CALL taken for a VACUUM",
            vec![
                [
                    wire::parse("s", "CALL cp(2)", &[]),
                    wire::parse("k", "SELECT 1", &[]),
                    wire::sync(),
                ]
                .concat(),
                [
                    wire::parse("s", "VACUUM cr", &[]),
                    wire::sync(),
                    wire::bind("", "k", &[]),
                    wire::execute("", 0),
                    wire::bind("p", "s", &[]),
                    wire::execute("p", 0),
                    wire::sync(),
                ]
                .concat(),
            ],
        ),
        (
            "a name prepared by a SQL EXECUTE",
            vec![
                [
                    wire::parse(
                        "y",
                        "PREPARE x AS UPDATE cr SET v = v + 1 WHERE id = 2",
                        &[],
                    ),
                    wire::sync(),
                ]
                .concat(),
                wire::query("EXECUTE y"),
                [
                    wire::parse("x", "BEGIN", &[]),
                    wire::sync(),
                    wire::bind("", "x", &[]),
                    wire::execute("", 0),
                    wire::sync(),
                ]
                .concat(),
            ],
        ),
    ];
    for (case, steps) in &cases {
        let direct = run_steps(&mut fx.raw_direct(), steps);
        assert_eq!(
            fx.count("cr WHERE v = 0").await,
            0,
            "{case}: directly it writes: {direct:?}"
        );
        fx.direct
            .batch_execute("UPDATE cr SET v = 0")
            .await
            .unwrap();
        let stale = run_steps(
            &mut fx.raw_session("-c fencing.token=33 -c fencing.resource=cr"),
            steps,
        );
        assert!(
            stale
                .iter()
                .flatten()
                .any(|m| m.sqlstate().as_deref() == Some("FN001")),
            "{case}: no FN001: {stale:?}"
        );
        assert_eq!(
            fx.count("cr WHERE v = 0").await,
            1,
            "{case}: the stale session's write committed: {stale:?}"
        );
    }
}
