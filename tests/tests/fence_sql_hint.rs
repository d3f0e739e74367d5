//! The per-backend hint `pgfence.accepted` (schema version 3): a backend that already
//! accepted a token goes straight to the share lock. The hint must never make a stale or a
//! too-new token commit: a forged hint gives a retryable 40001, and a real one still rejects
//! a token that became stale.

use fence_core::sql::install_sql;
use harness::PgCluster;

const CHECK: &str = "SELECT pgfence.check('{}', '{}', 'billing', '{}', 'hint-test', false)";

async fn write_and_check(client: &tokio_postgres::Client) -> Result<(), tokio_postgres::Error> {
    client
        .batch_execute("BEGIN; INSERT INTO w VALUES (1)")
        .await?;
    let checked = client.query_one(CHECK, &[]).await;
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

#[tokio::test(flavor = "multi_thread")]
async fn the_accepted_hint_never_lets_a_wrong_token_commit() {
    let cluster = PgCluster::start();
    let admin = cluster.connect("postgres").await;
    admin
        .batch_execute("CREATE DATABASE hint")
        .await
        .expect("create database");
    let setup = cluster.connect("hint").await;
    setup
        .batch_execute(&install_sql(None))
        .await
        .expect("install schema");
    setup
        .batch_execute("CREATE TABLE w (x int)")
        .await
        .expect("create table");

    // Leader A creates the fence with 5, accepts 5 again (which records the hint), and a
    // third time through the hinted path.
    let a = cluster.connect("hint").await;
    a.batch_execute("SET fencing.token = 5")
        .await
        .expect("set token");
    write_and_check(&a).await.expect("first write with 5");
    write_and_check(&a).await.expect("second write with 5");
    let hint: String = a
        .query_one("SHOW pgfence.accepted", &[])
        .await
        .expect("show")
        .get(0);
    assert_eq!(hint, "billing=5");
    write_and_check(&a).await.expect("hinted write with 5");

    // B advances to 6; A's hint still says 5, and A must now be rejected (FN001).
    let b = cluster.connect("hint").await;
    b.batch_execute("SET fencing.token = 6")
        .await
        .expect("set token");
    write_and_check(&b).await.expect("write with 6");
    let err = write_and_check(&a)
        .await
        .expect_err("stale token 5 after the advance");
    assert_eq!(err.code().map(|c| c.code()), Some("FN001"), "{err}");

    // A forged hint for a token above the fence: never accepted without an advance.
    let c = cluster.connect("hint").await;
    c.batch_execute("SET fencing.token = 9; SET pgfence.accepted = 'billing=9'")
        .await
        .expect("forge hint");
    let err = write_and_check(&c)
        .await
        .expect_err("forged hint must not accept 9");
    assert_eq!(err.code().map(|c| c.code()), Some("40001"), "{err}");
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
