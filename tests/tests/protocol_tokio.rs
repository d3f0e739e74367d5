//! tokio-postgres through pgfence, against a real PostgreSQL: every test runs through a
//! proxy with the fence on (schema installed, the product as shipped) and one with the fence
//! off (pure protocol transparency), on one cluster.
//!
//! - [`prepared_statements_and_types`]: prepare once, run many times, typed parameters
//!   (binary), NULLs, a statement re-prepared after an error, unnamed statements.
//! - [`pipelined_queries_on_one_client`]: several futures joined on one client (tokio-postgres
//!   pipelines them on the wire), writes and reads mixed, an error in the middle.
//! - [`copy_in_and_out`]: `copy_in` (text and binary) and `copy_out`, an aborted `copy_in`,
//!   then the session goes on; the data arrives exactly.
//! - [`transactions_and_savepoints`]: commit, rollback, savepoints (rolled back and
//!   released), a failed transaction, dropped transaction objects.
//! - [`cancel_pg_sleep`]: `cancel_query` on a running `pg_sleep`: 57014, the session stays
//!   usable, and a second cancel of an idle session does nothing.
//! - [`a_cancels_late_second_signal_spares_the_next_statement`]: PostgreSQL's late second
//!   signal for one cancel (played by a relay) does not cancel the next statement through
//!   pgfence, nor the next client's on a kept connection, and does directly.
//! - [`notifications_notices_and_parameter_status`]: LISTEN/NOTIFY between two sessions
//!   (the notification arrives on the listener's message stream, also inside a
//!   transaction-delayed NOTIFY), RAISE NOTICE and WARNING, ParameterStatus after
//!   `SET application_name` / `SET TimeZone` and after a rolled-back SET.

use std::collections::HashMap;
use std::time::Duration;

use bytes::Bytes;
use futures_util::{pin_mut, SinkExt, TryStreamExt};
use harness::wire::{self, Msg, RawConn};
use harness::{connect_to, PgCluster, Proxy, APP_DB};
use tokio::sync::{mpsc, watch};
use tokio_postgres::binary_copy::{BinaryCopyInWriter, BinaryCopyOutStream};
use tokio_postgres::types::Type;
use tokio_postgres::{AsyncMessage, CancelToken, Client, NoTls};

/// How long a test waits for an asynchronous message.
const WAIT: Duration = Duration::from_secs(10);

/// One cluster with the fence schema, a fenced proxy and an unfenced one. Tests run their
/// scenario against PostgreSQL directly first (which checks the test's own expectations),
/// then through each proxy.
struct Setup {
    cluster: PgCluster,
    _proxies: Vec<Proxy>,
    /// `(mode, connection string)`.
    targets: Vec<(&'static str, String)>,
}

impl Setup {
    fn start() -> Setup {
        let cluster = PgCluster::start();
        cluster.psql(APP_DB, &fence_core::sql::install_sql(None));
        let fenced = Proxy::for_cluster(&cluster);
        let mut config = Proxy::config_for(&cluster);
        config.fence.enabled = false;
        let plain = Proxy::start(config);
        let targets = vec![
            ("direct", cluster.connstr(APP_DB)),
            ("fence on", fenced.connstr(APP_DB)),
            ("fence off", plain.connstr(APP_DB)),
        ];
        Setup {
            cluster,
            _proxies: vec![fenced, plain],
            targets,
        }
    }
}

/// A client whose connection's asynchronous messages (notifications, notices) and
/// parameter values are handed to the test.
struct Watched {
    client: Client,
    messages: mpsc::UnboundedReceiver<AsyncMessage>,
    params: watch::Receiver<HashMap<String, String>>,
}

const WATCHED_PARAMS: &[&str] = &["application_name", "TimeZone", "DateStyle"];

async fn connect_watched(connstr: &str) -> Watched {
    let (client, mut connection) = tokio_postgres::connect(connstr, NoTls)
        .await
        .unwrap_or_else(|e| panic!("connect {connstr}: {e}"));
    let (tx, messages) = mpsc::unbounded_channel();
    let (ptx, params) = watch::channel(HashMap::new());
    tokio::spawn(async move {
        let snapshot = |c: &tokio_postgres::Connection<_, _>| {
            WATCHED_PARAMS
                .iter()
                .filter_map(|&n| c.parameter(n).map(|v| (n.to_string(), v.to_string())))
                .collect::<HashMap<_, _>>()
        };
        ptx.send_replace(snapshot(&connection));
        loop {
            // A snapshot after every poll: ParameterStatus is handled inside the connection
            // and is not one of the messages poll_message returns.
            let next = futures_util::future::poll_fn(|cx| {
                let polled = connection.poll_message(cx);
                let now = snapshot(&connection);
                ptx.send_if_modified(|p| {
                    let changed = *p != now;
                    *p = now;
                    changed
                });
                polled
            })
            .await;
            match next {
                Some(Ok(m)) => {
                    let _ = tx.send(m);
                }
                Some(Err(e)) => {
                    eprintln!("connection error: {e}");
                    return;
                }
                None => return,
            }
        }
    });
    Watched {
        client,
        messages,
        params,
    }
}

/// Waits until the connection reports `name` = `value` (it learns it from ParameterStatus,
/// shortly after the statement's result reached the test).
async fn wait_param(w: &mut Watched, name: &str, value: &str, mode: &str) {
    let seen = tokio::time::timeout(
        WAIT,
        w.params
            .wait_for(|p| p.get(name).map(String::as_str) == Some(value)),
    )
    .await
    .is_ok_and(|r| r.is_ok());
    let now = w.params.borrow().get(name).cloned();
    assert!(seen, "{mode}: {name} never became {value:?}: {now:?}");
}

async fn next_message(w: &mut Watched) -> AsyncMessage {
    tokio::time::timeout(WAIT, w.messages.recv())
        .await
        .expect("an asynchronous message in time")
        .expect("the connection is still open")
}

fn sqlstate(e: &tokio_postgres::Error) -> String {
    e.code()
        .map(|c| c.code().to_string())
        .unwrap_or_else(|| panic!("not a server error: {e:?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prepared_statements_and_types() {
    let setup = Setup::start();
    for (n, (mode, connstr)) in setup.targets.iter().enumerate() {
        let c = connect_to(connstr).await;
        let t = format!("prep_{n}");
        c.batch_execute(&format!(
            "CREATE TABLE {t} (id int8 PRIMARY KEY, name text, score float8, raw bytea)"
        ))
        .await
        .unwrap();
        let insert = c
            .prepare_typed(
                &format!("INSERT INTO {t} VALUES ($1, $2, $3, $4)"),
                &[Type::INT8, Type::TEXT, Type::FLOAT8, Type::BYTEA],
            )
            .await
            .unwrap();
        for i in 0..50i64 {
            let name = (i % 7 != 0).then(|| format!("name {i} é"));
            let raw: Vec<u8> = (0..=u8::try_from(i).unwrap()).collect();
            let n = c
                .execute(&insert, &[&i, &name, &(i as f64 / 4.0), &raw])
                .await
                .unwrap();
            assert_eq!(n, 1, "{mode}");
        }
        let select = c
            .prepare(&format!(
                "SELECT id, name, score, raw FROM {t} WHERE id >= $1 ORDER BY id"
            ))
            .await
            .unwrap();
        assert_eq!(select.params(), &[Type::INT8]);
        assert_eq!(select.columns().len(), 4);
        let rows = c.query(&select, &[&45i64]).await.unwrap();
        assert_eq!(rows.len(), 5, "{mode}");
        assert_eq!(rows[3].get::<_, i64>(0), 48);
        assert_eq!(
            rows[3].get::<_, Option<String>>(1).as_deref(),
            Some("name 48 é")
        );
        assert_eq!(rows[3].get::<_, f64>(2), 12.0);
        assert_eq!(rows[3].get::<_, Vec<u8>>(3).len(), 49);
        assert_eq!(rows[3].get::<_, Vec<u8>>(3)[48], 48);
        assert_eq!(
            rows[4].get::<_, Option<String>>(1),
            None,
            "49 is a multiple of 7"
        );
        // id 49 is a multiple of 7: NULL name.
        let nulls: i64 = c
            .query_one(&format!("SELECT count(*) FROM {t} WHERE name IS NULL"), &[])
            .await
            .unwrap()
            .get(0);
        assert_eq!(nulls, 8, "{mode}");

        // An error on a prepared statement, then the same statement again.
        let e = c
            .execute(&insert, &[&1i64, &"dup", &0.0f64, &Vec::<u8>::new()])
            .await
            .unwrap_err();
        assert_eq!(sqlstate(&e), "23505", "{mode}");
        assert_eq!(
            c.execute(&insert, &[&100i64, &"ok", &0.0f64, &Vec::<u8>::new()])
                .await
                .unwrap(),
            1
        );

        // A parse error, and a statement with no result columns.
        let e = c.prepare("SELEC 1").await.unwrap_err();
        assert_eq!(sqlstate(&e), "42601", "{mode}");
        let stmt = c
            .prepare(&format!("DELETE FROM {t} WHERE id = $1"))
            .await
            .unwrap();
        assert!(stmt.columns().is_empty());
        assert_eq!(c.execute(&stmt, &[&100i64]).await.unwrap(), 1);
        // Unnamed statements (query_typed), many round trips.
        for i in 0..20i32 {
            let row = c
                .query_typed("SELECT $1::int4 * 2", &[(&i, Type::INT4)])
                .await
                .unwrap();
            assert_eq!(row[0].get::<_, i32>(0), i * 2);
        }
        let count: i64 = setup
            .cluster
            .connect(APP_DB)
            .await
            .query_one(&format!("SELECT count(*) FROM {t}"), &[])
            .await
            .unwrap()
            .get(0);
        assert_eq!(count, 50, "{mode}: the writes are committed upstream");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipelined_queries_on_one_client() {
    let setup = Setup::start();
    for (n, (mode, connstr)) in setup.targets.iter().enumerate() {
        let c = connect_to(connstr).await;
        let t = format!("pipe_{n}");
        c.batch_execute(&format!("CREATE TABLE {t} (id int PRIMARY KEY, v text)"))
            .await
            .unwrap();
        let insert = c
            .prepare(&format!("INSERT INTO {t} VALUES ($1, $2)"))
            .await
            .unwrap();
        let count = c
            .prepare(&format!("SELECT count(*) FROM {t}"))
            .await
            .unwrap();
        let sleep = c.prepare("SELECT pg_sleep(0.05)::text").await.unwrap();

        // Many requests in flight at once: tokio-postgres writes them back to back.
        let values: Vec<String> = (0..200).map(|i| format!("v{i}")).collect();
        let inserts = (0..200i32).map(|i| {
            let (c, insert, v) = (&c, &insert, &values[i as usize]);
            async move { c.execute(insert, &[&i, v]).await }
        });
        let results = futures_util::future::join_all(inserts).await;
        assert!(
            results.iter().all(|r| matches!(r, Ok(1))),
            "{mode}: {results:?}"
        );

        // Reads, a write, a slow statement and an error, joined.
        let first_ids = format!("SELECT id FROM {t} WHERE id < 3 ORDER BY id");
        let (a, b, d, e, f) = tokio::join!(
            c.query_one(&count, &[]),
            c.query(&first_ids, &[]),
            c.query_one(&sleep, &[]),
            c.execute(&insert, &[&0i32, &"duplicate"]),
            c.execute(&insert, &[&1000i32, &"after the error"]),
        );
        assert_eq!(a.unwrap().get::<_, i64>(0), 200, "{mode}");
        let ids: Vec<i32> = b.unwrap().iter().map(|r| r.get(0)).collect();
        assert_eq!(ids, vec![0, 1, 2]);
        assert_eq!(d.unwrap().get::<_, String>(0), "");
        assert_eq!(sqlstate(&e.unwrap_err()), "23505", "{mode}");
        assert_eq!(f.unwrap(), 1, "{mode}: the statement after the error runs");
        let total: i64 = c.query_one(&count, &[]).await.unwrap().get(0);
        assert_eq!(total, 201, "{mode}");

        // Simple-protocol statements interleaved with extended ones.
        let simple = format!("SELECT 'simple'; UPDATE {t} SET v = 'u' WHERE id = 1");
        let (s, q) = tokio::join!(
            c.simple_query(&simple),
            c.query_one("SELECT $1::text", &[&"extended"]),
        );
        let s = s.unwrap();
        assert_eq!(
            s.len(),
            4,
            "{mode}: row, select complete, update complete, ...: {s:?}"
        );
        assert_eq!(q.unwrap().get::<_, String>(0), "extended");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copy_in_and_out() {
    let setup = Setup::start();
    for (n, (mode, connstr)) in setup.targets.iter().enumerate() {
        let c = connect_to(connstr).await;
        let t = format!("copy_{n}");
        c.batch_execute(&format!("CREATE TABLE {t} (id int, v text)"))
            .await
            .unwrap();

        // Text format, in chunks that cut rows in the middle.
        let mut data = Vec::new();
        for i in 0..5000 {
            data.extend_from_slice(format!("{i}\trow {i} \\t ü\n").as_bytes());
        }
        let sink = c
            .copy_in(&format!("COPY {t} FROM STDIN"))
            .await
            .unwrap_or_else(|e| panic!("{mode}: copy_in: {e:?}"));
        pin_mut!(sink);
        for chunk in data.chunks(7919) {
            sink.send(Bytes::copy_from_slice(chunk)).await.unwrap();
        }
        let copied = sink
            .finish()
            .await
            .unwrap_or_else(|e| panic!("{mode}: finish: {e:?}"));
        assert_eq!(copied, 5000, "{mode}");
        let row = c
            .query_one(&format!("SELECT count(*), sum(id) FROM {t}"), &[])
            .await
            .unwrap_or_else(|e| panic!("{mode}: after copy_in: {e:?}"));
        assert_eq!(row.get::<_, i64>(0), 5000);
        assert_eq!(row.get::<_, i64>(1), 4999 * 5000 / 2);

        // Binary format.
        let sink = c
            .copy_in(&format!("COPY {t} (id, v) FROM STDIN (FORMAT binary)"))
            .await
            .unwrap();
        let writer = BinaryCopyInWriter::new(sink, &[Type::INT4, Type::TEXT]);
        pin_mut!(writer);
        for i in 10_000..10_100i32 {
            writer.as_mut().write(&[&i, &"binary"]).await.unwrap();
        }
        assert_eq!(writer.finish().await.unwrap(), 100, "{mode}");

        // Out, text and binary.
        let stream = c
            .copy_out(&format!(
                "COPY (SELECT id, v FROM {t} ORDER BY id) TO STDOUT"
            ))
            .await
            .unwrap();
        let chunks: Vec<Bytes> = stream.try_collect().await.unwrap();
        let out: Vec<u8> = chunks.concat();
        let mut expected = data.clone();
        for i in 10_000..10_100 {
            expected.extend_from_slice(format!("{i}\tbinary\n").as_bytes());
        }
        assert!(out == expected, "{mode}: COPY TO STDOUT differs");
        let stream = c
            .copy_out(&format!(
                "COPY (SELECT id FROM {t} WHERE id < 3 ORDER BY id) TO STDOUT (FORMAT binary)"
            ))
            .await
            .unwrap();
        let rows = BinaryCopyOutStream::new(stream, &[Type::INT4]);
        let ids: Vec<i32> = rows
            .map_ok(|r| r.get::<i32>(0))
            .try_collect()
            .await
            .unwrap();
        assert_eq!(ids, vec![0, 1, 2], "{mode}");

        // A COPY the server rejects (bad data), one the client abandons (CopyFail on drop):
        // each fails, the session goes on. (A COPY that cannot start is in the differential
        // test: tokio-postgres itself loses track of that case, also without pgfence.)
        let sink = c.copy_in(&format!("COPY {t} FROM STDIN")).await.unwrap();
        pin_mut!(sink);
        sink.send(Bytes::from_static(b"1\tok\nnot a number\tx\n"))
            .await
            .unwrap();
        let e = sink.finish().await.unwrap_err();
        assert_eq!(sqlstate(&e), "22P02", "{mode}");
        {
            let sink = c
                .copy_in::<_, Bytes>(&format!("COPY {t} FROM STDIN"))
                .await
                .unwrap();
            drop(sink);
        }
        let row = c
            .query_one(&format!("SELECT count(*) FROM {t}"), &[])
            .await
            .unwrap_or_else(|e| panic!("{mode}: after failed copies: {e:?}"));
        assert_eq!(row.get::<_, i64>(0), 5100, "{mode}");

        // COPY inside a transaction, rolled back.
        c.batch_execute("BEGIN").await.unwrap();
        let sink = c.copy_in(&format!("COPY {t} FROM STDIN")).await.unwrap();
        pin_mut!(sink);
        sink.send(Bytes::from_static(b"7\tseven\n")).await.unwrap();
        assert_eq!(sink.finish().await.unwrap(), 1);
        c.batch_execute("ROLLBACK").await.unwrap();
        let row = c
            .query_one(&format!("SELECT count(*) FROM {t}"), &[])
            .await
            .unwrap();
        assert_eq!(row.get::<_, i64>(0), 5100, "{mode}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transactions_and_savepoints() {
    let setup = Setup::start();
    let direct = setup.cluster.connect(APP_DB).await;
    for (n, (mode, connstr)) in setup.targets.iter().enumerate() {
        let mut c = connect_to(connstr).await;
        let t = format!("tx_{n}");
        c.batch_execute(&format!("CREATE TABLE {t} (id int PRIMARY KEY)"))
            .await
            .unwrap();
        // Commit.
        let tx = c.transaction().await.unwrap();
        tx.execute(&format!("INSERT INTO {t} VALUES (1)"), &[])
            .await
            .unwrap();
        assert_eq!(
            ids(&direct, &t).await,
            Vec::<i32>::new(),
            "{mode}: not yet visible"
        );
        tx.commit().await.unwrap();
        assert_eq!(ids(&direct, &t).await, vec![1], "{mode}");

        // Rollback, explicit and by drop.
        let tx = c.transaction().await.unwrap();
        tx.execute(&format!("INSERT INTO {t} VALUES (2)"), &[])
            .await
            .unwrap();
        tx.rollback().await.unwrap();
        {
            let tx = c.transaction().await.unwrap();
            tx.execute(&format!("INSERT INTO {t} VALUES (3)"), &[])
                .await
                .unwrap();
        }
        assert_eq!(ids(&direct, &t).await, vec![1], "{mode}");

        // Savepoints: one rolled back, one released, one after an error.
        let mut tx = c.transaction().await.unwrap();
        tx.execute(&format!("INSERT INTO {t} VALUES (10)"), &[])
            .await
            .unwrap();
        {
            let sp = tx.savepoint("a").await.unwrap();
            sp.execute(&format!("INSERT INTO {t} VALUES (11)"), &[])
                .await
                .unwrap();
            sp.rollback().await.unwrap();
        }
        {
            let sp = tx.savepoint("b").await.unwrap();
            sp.execute(&format!("INSERT INTO {t} VALUES (12)"), &[])
                .await
                .unwrap();
            sp.commit().await.unwrap();
        }
        {
            let sp = tx.savepoint("c").await.unwrap();
            let e = sp
                .execute(&format!("INSERT INTO {t} VALUES (10)"), &[])
                .await
                .unwrap_err();
            assert_eq!(sqlstate(&e), "23505");
            sp.rollback().await.unwrap();
        }
        tx.execute(&format!("INSERT INTO {t} VALUES (13)"), &[])
            .await
            .unwrap();
        tx.commit().await.unwrap();
        assert_eq!(ids(&direct, &t).await, vec![1, 10, 12, 13], "{mode}");

        // A failed transaction: every statement fails until it ends; COMMIT rolls back.
        c.batch_execute("BEGIN").await.unwrap();
        c.execute(&format!("INSERT INTO {t} VALUES (20)"), &[])
            .await
            .unwrap();
        let e = c.execute("SELECT 1/0", &[]).await.unwrap_err();
        assert_eq!(sqlstate(&e), "22012");
        let e = c.execute("SELECT 1", &[]).await.unwrap_err();
        assert_eq!(sqlstate(&e), "25P02", "{mode}");
        let msgs = c.simple_query("COMMIT").await.unwrap();
        let tag = msgs.iter().find_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::CommandComplete(n) => Some(*n),
            _ => None,
        });
        assert_eq!(tag, Some(0), "{mode}: {msgs:?}");
        assert_eq!(ids(&direct, &t).await, vec![1, 10, 12, 13], "{mode}");

        // Transaction control in one simple query, and a multi-statement implicit
        // transaction that fails half way (nothing of it commits).
        c.batch_execute(&format!(
            "BEGIN; INSERT INTO {t} VALUES (30); COMMIT; BEGIN; INSERT INTO {t} VALUES (31); ROLLBACK"
        ))
        .await
        .unwrap();
        let e = c
            .batch_execute(&format!(
                "INSERT INTO {t} VALUES (40); INSERT INTO {t} VALUES (1); INSERT INTO {t} VALUES (41)"
            ))
            .await
            .unwrap_err();
        assert_eq!(sqlstate(&e), "23505");
        assert_eq!(ids(&direct, &t).await, vec![1, 10, 12, 13, 30], "{mode}");
        let row = c.query_one("SELECT 'done'::text", &[]).await.unwrap();
        assert_eq!(row.get::<_, String>(0), "done");
    }
}

/// The ids in table `t`, in order, read directly from PostgreSQL.
async fn ids(direct: &Client, t: &str) -> Vec<i32> {
    let sql = format!("SELECT coalesce(array_agg(id ORDER BY id), '{{}}') FROM {t}");
    direct.query_one(&sql, &[]).await.unwrap().get(0)
}

/// Runs `query`, cancelling it through `token` after 300 ms, then every second until it
/// ends: a cancel that arrives before the query started is lost (as with PostgreSQL itself),
/// so one may not do. When more than one went out, a later one may still be on its way to
/// the backend when the query ends (tokio-postgres does not wait for the server to close
/// the cancel connection, as libpq does): it is given two seconds to land while the session
/// is idle, where a cancel does nothing, rather than on the next query. (With 300 ms
/// between cancels and half a second to land, a loaded CI machine once had a late cancel
/// hit the next statement. PostgreSQL may also deliver one cancel as two signals, the
/// second late: see [`a_cancels_late_second_signal_spares_the_next_statement`].)
async fn cancelled<T>(
    token: &CancelToken,
    query: impl std::future::Future<Output = Result<T, tokio_postgres::Error>>,
) -> Result<T, tokio_postgres::Error> {
    tokio::pin!(query);
    let mut sent = 0;
    loop {
        tokio::select! {
            r = &mut query => {
                if sent > 1 {
                    tokio::time::sleep(Duration::from_secs(2)).await;
                }
                return r;
            }
            () = tokio::time::sleep(Duration::from_millis(if sent == 0 { 300 } else { 1000 })) => {
                token.cancel_query(NoTls).await.expect("cancel_query");
                sent += 1;
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_pg_sleep() {
    let setup = Setup::start();
    for (mode, connstr) in &setup.targets {
        let c = connect_to(connstr).await;
        let token = c.cancel_token();
        let started = std::time::Instant::now();
        let result = cancelled(&token, c.simple_query("SELECT pg_sleep(30)")).await;
        let e = result.unwrap_err();
        assert_eq!(sqlstate(&e), "57014", "{mode}: {e:?}");
        assert!(started.elapsed() < Duration::from_secs(10), "{mode}");

        // The session is still usable, also for the extended protocol and a write.
        let row = c.query_one("SELECT 'still here'::text", &[]).await.unwrap();
        assert_eq!(row.get::<_, String>(0), "still here");
        c.batch_execute(
            "CREATE TEMP TABLE after_cancel (x int); INSERT INTO after_cancel VALUES (1)",
        )
        .await
        .unwrap();

        // Cancel inside a transaction (extended protocol): the transaction fails.
        c.batch_execute("BEGIN").await.unwrap();
        let result = cancelled(&token, c.query("SELECT pg_sleep(30)", &[])).await;
        assert_eq!(sqlstate(&result.unwrap_err()), "57014", "{mode}");
        let e = c.query("SELECT 1", &[]).await.unwrap_err();
        assert_eq!(sqlstate(&e), "25P02", "{mode}");
        c.batch_execute("ROLLBACK").await.unwrap();

        // A cancel while idle does nothing to the next query.
        token.cancel_query(NoTls).await.unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
        let row = c
            .query_one("SELECT pg_sleep(0.2)::text || 'done'", &[])
            .await
            .unwrap();
        assert_eq!(row.get::<_, String>(0), "done", "{mode}");

        // Each client's token cancels its own session only.
        let other = connect_to(connstr).await;
        let (a, b) = tokio::join!(
            cancelled(&token, c.simple_query("SELECT pg_sleep(30)")),
            other.simple_query("SELECT pg_sleep(1)"),
        );
        assert_eq!(sqlstate(&a.unwrap_err()), "57014");
        assert!(b.is_ok(), "{mode}: the other session was cancelled: {b:?}");
    }
}

/// A relay on a free port in front of PostgreSQL's `upstream` port that passes sessions
/// through, and plays each cancel request as PostgreSQL (up to 16 at least) can deliver it
/// on a loaded machine: it signals the backend once (the request goes to the server), then
/// again `late` after that (a second request), and only then closes the requester's
/// connection. PostgreSQL's `signal_child` signals the backend and then its process group,
/// the backend again: descheduled in between, it sends the second signal late.
async fn late_double_cancel_relay(upstream: u16, late: Duration) -> u16 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};
    /// Length 16, then code 80877102: a CancelRequest.
    const CANCEL_HEAD: [u8; 8] = [0, 0, 0, 16, 0x04, 0xd2, 0x16, 0x2e];
    let listener = TcpListener::bind((harness::HOST, 0)).await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((mut client, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut head = [0u8; 8];
                if client.read_exact(&mut head).await.is_err() {
                    return;
                }
                let server = TcpStream::connect((harness::HOST, upstream));
                let mut server = server.await.expect("relay: connect to PostgreSQL");
                if head != CANCEL_HEAD {
                    server.write_all(&head).await.unwrap();
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                    return;
                }
                let mut request = head.to_vec();
                request.resize(16, 0);
                client.read_exact(&mut request[8..]).await.unwrap();
                for delay in [Duration::ZERO, late] {
                    tokio::time::sleep(delay).await;
                    if delay != Duration::ZERO {
                        server = TcpStream::connect((harness::HOST, upstream)).await.unwrap();
                    }
                    server.write_all(&request).await.unwrap();
                    // The server closes the connection once it has signalled the backend.
                    let _ = server.read(&mut [0u8; 1]).await;
                }
                // `client` is dropped, so closed, only now.
            });
        }
    });
    port
}

/// Runs `SELECT pg_sleep(30)` on `c` and cancels it after 300 ms: its error. tokio-postgres
/// does not wait for the cancel's connection to close, so `c` sees the error as soon as the
/// first signal lands.
async fn cancel_a_sleep(c: &Client) -> tokio_postgres::Error {
    let token = c.cancel_token();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(300)).await;
        token.cancel_query(NoTls).await.expect("cancel_query");
    });
    c.simple_query("SELECT pg_sleep(30)").await.unwrap_err()
}

/// A cancel's late second signal (see [`late_double_cancel_relay`]): directly, it cancels
/// the statement the client sent after it saw the first one's error; through pgfence, which
/// holds that statement until the server has closed the cancel's connection, it lands on an
/// idle session and does nothing. Nor does it reach a kept server connection's next client:
/// a session's server connection goes back to the pool only after its cancels are done.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancels_late_second_signal_spares_the_next_statement() {
    let late = Duration::from_millis(500);
    let next = "SELECT pg_sleep(1.5)";
    let cluster = PgCluster::start();
    cluster.psql(APP_DB, &fence_core::sql::install_sql(None));
    let relay = late_double_cancel_relay(cluster.port(), late).await;
    let mut config = Proxy::config_for(&cluster);
    config.upstream.port = relay;
    let fenced = Proxy::start(config.clone());
    config.fence.enabled = false;
    let plain = Proxy::start(config);
    let direct = cluster.connstr(APP_DB).replace(
        &format!("port={}", cluster.port()),
        &format!("port={relay}"),
    );
    let targets = [
        ("direct", direct),
        ("fence on", fenced.connstr(APP_DB)),
        ("fence off", plain.connstr(APP_DB)),
    ];
    for (mode, connstr) in &targets {
        let c = connect_to(connstr).await;
        let e = cancel_a_sleep(&c).await;
        assert_eq!(sqlstate(&e), "57014", "{mode}: {e:?}");
        let after = c.simple_query(next).await;
        if *mode == "direct" {
            // The relay does reproduce the race: a check that cannot fail proves nothing.
            let e = after.expect_err("direct: the late signal should cancel the next statement");
            assert_eq!(sqlstate(&e), "57014", "direct: {e:?}");
            continue;
        }
        after.unwrap_or_else(|e| panic!("{mode}: the late signal cancelled the next one: {e}"));
    }
    // A client that leaves as soon as it has its error, without Terminate; the next one,
    // with the same startup packet, takes its kept server connection if it is parked.
    for proxy in [&fenced, &plain] {
        let addr = proxy.addr();
        tokio::task::spawn_blocking(move || {
            let (mut c, hello) = RawConn::login(addr, harness::SUPERUSER, APP_DB);
            let k = hello
                .iter()
                .find(|m| m.tag == b'K')
                .expect("BackendKeyData");
            let pid = i32::from_be_bytes(k.body[0..4].try_into().unwrap());
            let key = i32::from_be_bytes(k.body[4..8].try_into().unwrap());
            c.send(&wire::query("SELECT pg_sleep(30)"));
            std::thread::sleep(Duration::from_millis(300));
            let mut cancel = std::net::TcpStream::connect(addr).unwrap();
            std::io::Write::write_all(&mut cancel, &wire::cancel_request(pid, key)).unwrap();
            let replies = c.until_ready();
            let error = replies.iter().find(|m| m.tag == b'E');
            assert_eq!(
                error.and_then(Msg::sqlstate).as_deref(),
                Some("57014"),
                "{replies:?}"
            );
            drop(c);
            // Long enough for the connection to be reset and parked, were it not held.
            std::thread::sleep(Duration::from_millis(100));
            let (mut d, _) = RawConn::login(addr, harness::SUPERUSER, APP_DB);
            d.send(&wire::query(next));
            let replies = d.until_ready();
            assert!(
                replies.iter().all(|m| m.tag != b'E'),
                "the late signal cancelled the next client's statement: {replies:?}"
            );
        })
        .await
        .unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notifications_notices_and_parameter_status() {
    let setup = Setup::start();
    for (n, (mode, connstr)) in setup.targets.iter().enumerate() {
        let mut listener = connect_watched(connstr).await;
        let notifier = connect_to(connstr).await;
        let channel = format!("ch_{n}");
        listener
            .client
            .batch_execute(&format!("LISTEN {channel}"))
            .await
            .unwrap();
        let listener_pid: i32 = listener
            .client
            .query_one("SELECT pg_backend_pid()", &[])
            .await
            .unwrap()
            .get(0);
        let notifier_pid: i32 = notifier
            .query_one("SELECT pg_backend_pid()", &[])
            .await
            .unwrap()
            .get(0);

        notifier
            .batch_execute(&format!("NOTIFY {channel}, 'hello'"))
            .await
            .unwrap();
        // Delivered while the listener is idle: on its message stream, without a query.
        // Through pgfence the sender is named by the pid its client was given (its
        // BackendKeyData, which tokio-postgres keeps to itself; the psycopg test compares
        // with it), not by its real pid.
        let named = |n: &tokio_postgres::Notification, real: i32| {
            if *mode == "direct" {
                assert_eq!(n.process_id(), real, "{mode}");
            } else {
                assert_ne!(n.process_id(), real, "{mode}: named by its real pid");
            }
            n.process_id()
        };
        let notifier_named = match next_message(&mut listener).await {
            AsyncMessage::Notification(n) => {
                assert_eq!(n.channel(), channel);
                assert_eq!(n.payload(), "hello");
                named(&n, notifier_pid)
            }
            other => panic!("{mode}: expected a notification, got {other:?}"),
        };

        // Inside a transaction, sent at commit; pg_notify through the extended protocol.
        let tx_payloads = ["in tx 1", "in tx 2"];
        notifier.batch_execute("BEGIN").await.unwrap();
        for p in tx_payloads {
            notifier
                .execute("SELECT pg_notify($1, $2)", &[&channel, &p])
                .await
                .unwrap();
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(
            listener.messages.try_recv().is_err(),
            "{mode}: notification before commit"
        );
        notifier.batch_execute("COMMIT").await.unwrap();
        for p in tx_payloads {
            match next_message(&mut listener).await {
                AsyncMessage::Notification(n) => {
                    assert_eq!(n.payload(), p, "{mode}");
                    assert_eq!(n.process_id(), notifier_named, "{mode}");
                }
                other => panic!("{mode}: expected a notification, got {other:?}"),
            }
        }
        // A rolled-back NOTIFY is never delivered; a self-notification is.
        notifier
            .batch_execute(&format!("BEGIN; NOTIFY {channel}, 'never'; ROLLBACK"))
            .await
            .unwrap();
        listener
            .client
            .batch_execute(&format!("NOTIFY {channel}, 'self'"))
            .await
            .unwrap();
        match next_message(&mut listener).await {
            AsyncMessage::Notification(n) => {
                assert_eq!(n.payload(), "self", "{mode}");
                assert_ne!(named(&n, listener_pid), notifier_named, "{mode}");
            }
            other => panic!("{mode}: expected a notification, got {other:?}"),
        }

        // Notices: RAISE NOTICE and WARNING, from a DO block and from a function in a
        // prepared statement.
        listener
            .client
            .batch_execute("DO $$ BEGIN RAISE NOTICE 'note %', 1; RAISE WARNING 'careful'; END $$")
            .await
            .unwrap();
        let mut notices = Vec::new();
        for _ in 0..2 {
            match next_message(&mut listener).await {
                AsyncMessage::Notice(n) => notices.push((
                    n.severity().to_string(),
                    n.message().to_string(),
                    n.code().code().to_string(),
                )),
                other => panic!("{mode}: expected a notice, got {other:?}"),
            }
        }
        assert_eq!(
            notices,
            vec![
                (
                    "NOTICE".to_string(),
                    "note 1".to_string(),
                    "00000".to_string()
                ),
                (
                    "WARNING".to_string(),
                    "careful".to_string(),
                    "01000".to_string()
                ),
            ],
            "{mode}"
        );
        listener
            .client
            .batch_execute(
                "CREATE OR REPLACE FUNCTION pg_temp.shout(t text) RETURNS int LANGUAGE plpgsql \
                 AS $$ BEGIN RAISE NOTICE 'shout %', t; RETURN length(t); END $$",
            )
            .await
            .unwrap();
        let row = listener
            .client
            .query_one("SELECT pg_temp.shout($1)", &[&"abc"])
            .await
            .unwrap();
        assert_eq!(row.get::<_, i32>(0), 3);
        match next_message(&mut listener).await {
            AsyncMessage::Notice(n) => assert_eq!(n.message(), "shout abc", "{mode}"),
            other => panic!("{mode}: expected a notice, got {other:?}"),
        }

        // ParameterStatus: the connection's view follows SET, SET in a rolled-back
        // transaction, and RESET.
        // ParameterStatus: the connection's view follows SET, a SET in a rolled-back
        // transaction, set_config() in the extended protocol, and RESET.
        let param = |w: &Watched, name: &str| w.params.borrow().get(name).cloned();
        assert_eq!(param(&listener, "application_name").as_deref(), Some(""));
        listener
            .client
            .batch_execute("SET TimeZone = 'Asia/Tokyo'; SET application_name = 'pgfence-test'")
            .await
            .unwrap();
        wait_param(&mut listener, "application_name", "pgfence-test", mode).await;
        assert_eq!(param(&listener, "TimeZone").as_deref(), Some("Asia/Tokyo"));
        listener
            .client
            .batch_execute("BEGIN; SET TimeZone = 'UTC'; ROLLBACK; SET application_name = 'next'")
            .await
            .unwrap();
        wait_param(&mut listener, "application_name", "next", mode).await;
        assert_eq!(
            param(&listener, "TimeZone").as_deref(),
            Some("Asia/Tokyo"),
            "{mode}: the SET was rolled back"
        );
        listener
            .client
            .execute("SELECT set_config('DateStyle', 'German', false)", &[])
            .await
            .unwrap();
        wait_param(&mut listener, "DateStyle", "German, DMY", mode).await;
        listener.client.batch_execute("RESET ALL").await.unwrap();
        wait_param(&mut listener, "application_name", "", mode).await;
        let tz: String = listener
            .client
            .query_one("SHOW TimeZone", &[])
            .await
            .unwrap()
            .get(0);
        assert_eq!(param(&listener, "TimeZone"), Some(tz), "{mode}");
        if let Ok(m) = listener.messages.try_recv() {
            panic!("{mode}: unexpected asynchronous message {m:?}");
        }
    }
}
