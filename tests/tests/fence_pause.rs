//! A deposed leader that wakes up from a pause is stopped at the database (SPEC section 1),
//! with real OS processes stopped by SIGSTOP mid-transaction:
//!
//! - [`paused_psycopg_process_is_rejected`]: `tests/python/pause_client.py` (psycopg, token
//!   N in its startup options) writes inside a transaction and is stopped before its
//!   COMMIT; a new leader advances to N+1 and writes; the script is resumed with SIGCONT and
//!   commits: FN001, its write is not in the table, its connection is idle and usable.
//! - [`paused_psql_process_is_rejected`]: the same with a psql process (simple protocol,
//!   token from `SET`), fed its statements through a pipe.
//!
//! Both run through a pgfence with the fast path off as well as on: the rejection must come
//! from the database check, not from pgfence remembering the new fence.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::Duration;

use harness::fence::{install, stale};
use harness::{python_dir, python_or_skip, PgCluster, Proxy, Signal, APP_DB};
use nix::sys::signal::kill;
use nix::unistd::Pid;

const TOKEN: i64 = 41;
/// Longest wait for a line from a child process.
const LINE_TIMEOUT: Duration = Duration::from_secs(30);

/// A child process whose stdout lines arrive on a channel; killed on drop.
struct Proc {
    child: Child,
    lines: mpsc::Receiver<String>,
}

impl Proc {
    fn spawn(mut cmd: Command) -> Proc {
        cmd.stdout(Stdio::piped());
        let mut child = cmd.spawn().expect("start the paused client");
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::channel();
        thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Proc { child, lines }
    }

    fn line(&self, what: &str) -> String {
        self.lines
            .recv_timeout(LINE_TIMEOUT)
            .unwrap_or_else(|e| panic!("waiting for {what} from the paused client: {e}"))
    }

    fn signal(&self, signal: Signal) {
        let pid = Pid::from_raw(self.child.id() as i32);
        kill(pid, signal).unwrap_or_else(|e| panic!("kill -{signal}: {e}"));
    }

    /// The process state letter from /proc (`T` when stopped).
    fn state(&self) -> char {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.child.id()))
            .expect("read /proc/<pid>/stat");
        // The state follows the parenthesised command name.
        let after = &stat[stat.rfind(')').expect("stat has (comm)") + 2..];
        after.chars().next().unwrap()
    }

    fn wait_success(mut self) {
        let status = self.child.wait().unwrap();
        assert!(status.success(), "the paused client exited with {status}");
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A cluster with the fence installed and the table `paused`.
async fn setup() -> PgCluster {
    let cluster = PgCluster::start();
    let db = cluster.connect(APP_DB).await;
    install(&db).await;
    db.batch_execute("CREATE TABLE paused (tag text, token bigint)")
        .await
        .unwrap();
    cluster
}

/// The new leader: advances the fence of `resource` to TOKEN + 1 and writes.
async fn new_leader_writes(proxy: &Proxy, resource: &str, tag: &str) {
    let connstr = format!(
        "{} options='-c fencing.token={} -c fencing.resource={resource}'",
        proxy.connstr(APP_DB),
        TOKEN + 1
    );
    let b = harness::connect_to(&connstr).await;
    // Not blocked by the paused transaction: it holds no fence lock before its COMMIT.
    tokio::time::timeout(
        Duration::from_secs(10),
        b.execute(
            "INSERT INTO paused (tag, token) VALUES ($1, $2)",
            &[&tag, &(TOKEN + 1)],
        ),
    )
    .await
    .expect("the new leader's write must not wait for the paused leader")
    .expect("the new leader's write");
}

async fn tags(cluster: &PgCluster) -> Vec<String> {
    cluster
        .connect(APP_DB)
        .await
        .query("SELECT tag FROM paused ORDER BY tag", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paused_psycopg_process_is_rejected() {
    let Some(py) = python_or_skip("paused_psycopg_process_is_rejected") else {
        return;
    };
    let cluster = setup().await;
    for fast_path in [false, true] {
        let mut config = Proxy::config_for(&cluster);
        config.fence.fast_path = fast_path;
        let proxy = Proxy::start(config);
        let resource = format!("pause_py_{fast_path}");

        let mut cmd = Command::new(&py);
        cmd.arg(python_dir().join("pause_client.py"))
            .env("PGFENCE_DSN", proxy.connstr(APP_DB))
            .env("TOKEN", TOKEN.to_string())
            .env("RESOURCE", &resource)
            .env("TAG", format!("old {fast_path}"))
            // Long enough that it is surely stopped before it commits by itself.
            .env("SLEEP", "2")
            .env("PYTHONUNBUFFERED", "1");
        let old = Proc::spawn(cmd);
        assert_eq!(old.line("`written`"), "written");
        old.signal(Signal::SIGSTOP);
        while old.state() != 'T' {
            thread::sleep(Duration::from_millis(5));
        }

        new_leader_writes(&proxy, &resource, &format!("new {fast_path}")).await;
        // Paused for longer than the script would have slept: when it wakes up, it commits.
        tokio::time::sleep(Duration::from_millis(2200)).await;
        assert_eq!(old.state(), 'T', "still stopped");
        old.signal(Signal::SIGCONT);

        let outcome: serde_json::Value = serde_json::from_str(&old.line("the outcome")).unwrap();
        let expected = stale(&resource, TOKEN, TOKEN + 1);
        assert_eq!(
            outcome,
            serde_json::json!({
                "committed": false,
                "sqlstate": expected.code,
                "severity": "ERROR",
                "message": expected.message,
                "detail": expected.detail,
                "hint": expected.hint,
            }),
            "fast path {fast_path}"
        );
        let after: serde_json::Value = serde_json::from_str(&old.line("the status")).unwrap();
        assert_eq!(after, serde_json::json!({"status": "IDLE", "works": true}));
        old.wait_success();
        assert_eq!(
            tags(&cluster)
                .await
                .iter()
                .filter(|t| t.ends_with(&format!(" {fast_path}")))
                .collect::<Vec<_>>(),
            vec![&format!("new {fast_path}")],
            "the paused leader's write must not be in the table"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paused_psql_process_is_rejected() {
    let cluster = setup().await;
    for fast_path in [false, true] {
        let mut config = Proxy::config_for(&cluster);
        config.fence.fast_path = fast_path;
        let proxy = Proxy::start(config);
        let resource = format!("pause_psql_{fast_path}");

        let mut cmd = proxy.psql_cmd();
        cmd.args(["-At", "-v", "VERBOSITY=verbose", "-d", APP_DB])
            .stdin(Stdio::piped())
            .env("PSQL_PAGER", "")
            .env("PAGER", "");
        cmd.stderr(Stdio::piped());
        let mut old = Proc::spawn(cmd);
        let mut stdin = old.child.stdin.take().unwrap();
        let stderr = old.child.stderr.take().unwrap();
        let stderr = thread::spawn(move || {
            let mut s = String::new();
            std::io::Read::read_to_string(&mut BufReader::new(stderr), &mut s).unwrap();
            s
        });
        writeln!(
            stdin,
            "SET fencing.token = {TOKEN};\nSET fencing.resource = '{resource}';\nBEGIN;\n\
             INSERT INTO paused VALUES ('old {fast_path}', {TOKEN});\n\\echo written"
        )
        .unwrap();
        stdin.flush().unwrap();
        for expected in ["SET", "SET", "BEGIN", "INSERT 0 1", "written"] {
            assert_eq!(old.line(expected), expected);
        }
        old.signal(Signal::SIGSTOP);
        while old.state() != 'T' {
            thread::sleep(Duration::from_millis(5));
        }
        // The COMMIT is already waiting in the pipe when the process is stopped.
        writeln!(stdin, "COMMIT;\nROLLBACK;\nSELECT 'usable';").unwrap();
        stdin.flush().unwrap();
        drop(stdin);

        new_leader_writes(&proxy, &resource, &format!("new {fast_path}")).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        old.signal(Signal::SIGCONT);

        // The rejected COMMIT prints no tag; the ROLLBACK that follows finds no transaction.
        assert_eq!(old.line("ROLLBACK"), "ROLLBACK");
        assert_eq!(old.line("usable"), "usable");
        let stderr = {
            let child = &mut old.child;
            assert!(child.wait().unwrap().success());
            stderr.join().unwrap()
        };
        harness::fence::assert_psql_rejection(
            &stderr,
            &stale(&resource, TOKEN, TOKEN + 1),
            &format!("psql, fast path {fast_path}"),
        );
        assert!(
            stderr.contains("WARNING:  25P01: there is no transaction in progress"),
            "{stderr}"
        );
        assert!(
            !tags(&cluster).await.contains(&format!("old {fast_path}")),
            "the paused leader's write must not be in the table"
        );
    }
}
