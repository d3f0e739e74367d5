//! The per-backend hint `pgfence.accepted` (schema version 3): a backend that already
//! accepted a token goes straight to the share lock. The hint must never make a stale or a
//! too-new token commit: a forged hint gives a retryable 40001, and a real one still rejects
//! a token that became stale.

use fence_core::directive::Directive;
use fence_core::sql::{check_call_literal, install_sql, CheckArgs};
use harness::PgCluster;

/// The check exactly as the proxy's simple-query rewrite sends it (no comment directives are
/// NULL arrays, which is what the hot paths look for).
fn check_sql(default_resource: Option<&str>, directives: &[Directive]) -> String {
    let mut sql = Vec::new();
    check_call_literal(
        &CheckArgs {
            directives,
            default_resource,
            allow_missing: &[],
            client: "hint-test",
            force: false,
        },
        &mut sql,
    );
    String::from_utf8(sql).expect("the literal is UTF-8")
}

/// With the configured default resource `billing`.
fn check() -> String {
    check_sql(Some("billing"), &[])
}

/// For a session without a configured default resource.
fn check_no_default() -> String {
    check_sql(None, &[])
}

/// One comment directive (`None`: the comment names no resource).
fn comment(resource: Option<&str>, token: &str) -> String {
    check_sql(
        None,
        &[Directive {
            resource: resource.map(|r| r.as_bytes().to_vec()),
            token: Some(token.as_bytes().to_vec()),
        }],
    )
}

async fn write_and_check(client: &tokio_postgres::Client) -> Result<(), tokio_postgres::Error> {
    write_and_check_with(client, &check()).await
}

async fn write_and_check_with(
    client: &tokio_postgres::Client,
    check: &str,
) -> Result<(), tokio_postgres::Error> {
    client
        .batch_execute("BEGIN; INSERT INTO public.w VALUES (1)")
        .await?;
    let checked = client.query_one(check, &[]).await;
    match checked {
        Ok(_) => client.batch_execute("COMMIT").await,
        Err(e) => {
            client
                .batch_execute("ROLLBACK")
                .await
                .expect("rollback after a failed check");
            Err(e)
        }
    }
}

/// The check failed with SQLSTATE `code`.
fn assert_sqlstate(result: Result<(), tokio_postgres::Error>, code: &str, context: &str) {
    let err = result.expect_err(context);
    assert_eq!(err.code().map(|c| c.code()), Some(code), "{context}: {err}");
}

/// A new session on database `db` with `settings` (SQL) applied.
async fn session(cluster: &PgCluster, db: &str, settings: &str) -> tokio_postgres::Client {
    let client = cluster.connect(db).await;
    client.batch_execute(settings).await.expect(settings);
    client
}

/// A new database `name` with schema pgfence installed and a table `w (x int)`; its client.
async fn database_with_fence(cluster: &PgCluster, name: &str) -> tokio_postgres::Client {
    let admin = cluster.connect("postgres").await;
    admin
        .batch_execute(&format!("CREATE DATABASE {name}"))
        .await
        .expect("create database");
    let setup = cluster.connect(name).await;
    setup
        .batch_execute(&install_sql(None))
        .await
        .expect("install schema");
    setup
        .batch_execute("CREATE TABLE w (x int)")
        .await
        .expect("create table");
    setup
}

#[tokio::test(flavor = "multi_thread")]
async fn the_accepted_hint_never_lets_a_wrong_token_commit() {
    let cluster = PgCluster::start();
    let setup = database_with_fence(&cluster, "hint").await;

    // Leader A creates the fence with 5, accepts 5 again (which records the hint), and a
    // third time through the hinted path.
    let a = session(&cluster, "hint", "SET fencing.token = 5").await;
    write_and_check(&a).await.expect("first write with 5");
    write_and_check(&a).await.expect("second write with 5");
    let hint: String = a
        .query_one("SHOW pgfence.accepted", &[])
        .await
        .expect("show")
        .get(0);
    assert_eq!(hint, "billing=5");
    write_and_check(&a).await.expect("hinted write with 5");
    // A transaction that wrote nothing has nothing to fence, hinted or not.
    a.batch_execute("BEGIN").await.expect("begin");
    let nothing: Option<String> = a
        .query_one(&check(), &[])
        .await
        .expect("check of a read-only transaction")
        .get(0);
    a.batch_execute("COMMIT").await.expect("commit");
    assert_eq!(
        nothing, None,
        "a transaction that wrote nothing accepts nothing"
    );

    // B advances to 6; A's hint still says 5, and A must now be rejected (FN001).
    let b = session(&cluster, "hint", "SET fencing.token = 6").await;
    write_and_check(&b).await.expect("write with 6");
    assert_sqlstate(
        write_and_check(&a).await,
        "FN001",
        "stale token 5 after the advance",
    );
    // A caller that passes empty arrays rather than NULL goes the general way: same answer.
    assert_sqlstate(
        write_and_check_with(
            &a,
            "SELECT pgfence.check('{}', '{}', 'billing', '{}', 'hint-test', false)",
        )
        .await,
        "FN001",
        "stale token 5, empty directive arrays",
    );

    // A forged hint for a token above the fence: never accepted without an advance.
    let c = session(
        &cluster,
        "hint",
        "SET fencing.token = 9; SET pgfence.accepted = 'billing=9'",
    )
    .await;
    assert_sqlstate(
        write_and_check(&c).await,
        "40001",
        "forged hint must not accept 9",
    );
    let fence: i64 = setup
        .query_one(
            "SELECT token FROM pgfence.fences WHERE resource = 'billing'",
            &[],
        )
        .await
        .expect("fence")
        .get(0);
    assert_eq!(fence, 6, "the forged hint advanced nothing");
    // Without the forged hint the same token advances the fence normally.
    c.batch_execute("RESET pgfence.accepted")
        .await
        .expect("reset hint");
    write_and_check(&c).await.expect("write with 9 after reset");
    let rows: i64 = setup
        .query_one("SELECT count(*) FROM w", &[])
        .await
        .expect("count")
        .get(0);
    assert_eq!(
        rows, 5,
        "5, 5, 5, 6 and 9 committed; the stale and forged writes did not"
    );
}

/// `pgfence.check` and its hot path run with the caller's rights and search_path (neither is
/// SECURITY DEFINER: that costs on every call). A client that puts its own `=`, `<>` and
/// `||` operators ahead of pg_catalog's must still be rejected when its token is stale.
#[tokio::test(flavor = "multi_thread")]
async fn a_clients_search_path_cannot_change_the_check() {
    let cluster = PgCluster::start();
    let setup = database_with_fence(&cluster, "hijack").await;
    setup
        .batch_execute(
            "CREATE SCHEMA evil;
             CREATE FUNCTION evil.yes(text, text) RETURNS boolean LANGUAGE sql IMMUTABLE AS 'SELECT true';
             CREATE FUNCTION evil.yes(int, int) RETURNS boolean LANGUAGE sql IMMUTABLE AS 'SELECT true';
             CREATE FUNCTION evil.no(int, int) RETURNS boolean LANGUAGE sql IMMUTABLE AS 'SELECT false';
             CREATE FUNCTION evil.cat(text, text) RETURNS text LANGUAGE sql IMMUTABLE AS 'SELECT ''billing=5''';
             CREATE OPERATOR evil.= (LEFTARG = text, RIGHTARG = text, FUNCTION = evil.yes);
             CREATE OPERATOR evil.= (LEFTARG = int, RIGHTARG = int, FUNCTION = evil.yes);
             CREATE OPERATOR evil.<> (LEFTARG = int, RIGHTARG = int, FUNCTION = evil.no);
             CREATE OPERATOR evil.|| (LEFTARG = text, RIGHTARG = text, FUNCTION = evil.cat);",
        )
        .await
        .expect("create the hijacking operators");

    // The leader with 6 writes; the deposed one (5) was accepted before it, so its backend
    // holds the hint `billing=5` and takes the hot path.
    let old = session(&cluster, "hijack", "SET fencing.token = 5").await;
    write_and_check(&old).await.expect("first write with 5");
    write_and_check(&old).await.expect("hinted write with 5");
    let new = session(&cluster, "hijack", "SET fencing.token = 6").await;
    write_and_check(&new).await.expect("write with 6");

    old.batch_execute("SET search_path = evil, pg_catalog, public")
        .await
        .expect("hijack the search path");
    let ok: bool = old
        .query_one("SELECT 1 = 2 AND 'a' = 'b'", &[])
        .await
        .expect("query with the evil operators")
        .get(0);
    assert!(ok, "the evil operators are in effect for this session");
    // Each case: (settings, check, the rejection expected whatever the search path).
    // With the configured default resource the proxy passes, the stale token; without one,
    // the session's own resource and token, then a resource without a token and a token
    // without a resource: none of them may look like an unfenced session to an evil `=`.
    let cases = [
        ("SET fencing.token = 5", check(), "FN001"),
        (
            "SET fencing.resource = 'billing'",
            check_no_default(),
            "FN001",
        ),
        ("RESET fencing.token", check_no_default(), "FN002"),
        (
            "RESET fencing.resource; SET fencing.token = 7",
            check_no_default(),
            "FN003",
        ),
    ];
    for (settings, check, code) in cases {
        old.batch_execute(settings).await.expect(settings);
        assert_sqlstate(write_and_check_with(&old, &check).await, code, settings);
    }
    let rows: i64 = setup
        .query_one("SELECT count(*) FROM public.w", &[])
        .await
        .expect("count")
        .get(0);
    assert_eq!(rows, 3, "5, 5 and 6 committed; the hijacked writes did not");
}

/// The check of one comment directive (schema version 5): after the general path accepted
/// `billing=t`, the same directive takes the hot path. It must still reject a token that
/// became stale, still advance for a newer one, and never skip the session's own resource
/// when the comment names another.
#[tokio::test(flavor = "multi_thread")]
async fn a_comment_directive_takes_the_hot_path_and_nothing_else() {
    let cluster = PgCluster::start();
    let setup = database_with_fence(&cluster, "comments").await;
    let fence = || async {
        let f: i64 = setup
            .query_one(
                "SELECT token FROM pgfence.fences WHERE resource = 'billing'",
                &[],
            )
            .await
            .expect("fence")
            .get(0);
        f
    };

    // A: no session settings; the general path accepts billing=5 and records the hint,
    // then the hot path accepts it.
    let a = cluster.connect("comments").await;
    let five = comment(Some("billing"), "5");
    write_and_check_with(&a, &five).await.expect("first 5");
    let hint: String = a
        .query_one("SHOW pgfence.accepted", &[])
        .await
        .expect("show")
        .get(0);
    assert_eq!(hint, "billing=5", "the general path records the hint");
    write_and_check_with(&a, &five).await.expect("hinted 5");

    // B advances to 6: A's hinted 5 is stale (FN001), not accepted by the hot path.
    let b = cluster.connect("comments").await;
    write_and_check_with(&b, &comment(Some("billing"), "6"))
        .await
        .expect("6");
    assert_sqlstate(
        write_and_check_with(&a, &five).await,
        "FN001",
        "stale 5 after the advance",
    );

    // A forged hint with a newer token: not accepted by the hot path (the fence is 6), but
    // a newer token is a new leader's: the general path advances the fence to it.
    let c = session(&cluster, "comments", "SET pgfence.accepted = 'billing=9'").await;
    write_and_check_with(&c, &comment(Some("billing"), "9"))
        .await
        .expect("9 advances");
    assert_eq!(fence().await, 9);

    // A comment without a resource applies to the session's: hot path once hinted.
    let d = session(&cluster, "comments", "SET fencing.resource = 'billing'").await;
    let nine = comment(None, "9");
    write_and_check_with(&d, &nine)
        .await
        .expect("9, session resource");
    write_and_check_with(&d, &nine)
        .await
        .expect("9 again, hinted");

    // The session's resource is another one, without a token: the comment's hint matches,
    // but the session's resource must still be checked (FN002), never skipped.
    let e = session(
        &cluster,
        "comments",
        "SET fencing.resource = 'other'; SET pgfence.accepted = 'billing=9'",
    )
    .await;
    assert_sqlstate(
        write_and_check_with(&e, &comment(Some("billing"), "9")).await,
        "FN002",
        "the session's own resource has no token",
    );

    let rows: i64 = setup
        .query_one("SELECT count(*) FROM w", &[])
        .await
        .expect("count")
        .get(0);
    assert_eq!(
        rows, 6,
        "5, 5, 6, 9, 9 and 9 committed; the stale and unfenced did not"
    );
}
