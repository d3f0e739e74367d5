//! Reloading the configuration of the real `pgfence` binary (SIGHUP and the console's
//! `RELOAD`): new sessions use the new file, sessions already open keep what they started
//! with, a broken file changes nothing and says why, restart-only settings are reported and
//! kept.
//!
//! - [`new_sessions_follow_reloads`]: `fence.on_missing_token` from reject to allow (SIGHUP),
//!   then back with another default resource in `fence.defaults` (`RELOAD`), each observed by
//!   a new session while older ones keep theirs.
//! - [`broken_files_leave_the_old_config`]: a TOML syntax error (SIGHUP and `RELOAD`), an
//!   unknown key, an invalid value and a missing file: each logged and, for `RELOAD`, an
//!   error naming the file and the problem; behaviour and `SHOW CONFIG` unchanged; a good
//!   file afterwards reloads.
//! - [`restart_only_settings_are_reported`]: `listen` and `telemetry.log_format` changed in
//!   the file: logged as restart-only and kept, the rest of the file applied.

use std::fs;
use std::path::{Path, PathBuf};

use harness::fence::{self, assert_rejected};
use harness::operating::{rewrite_config, wait_for_log};
use harness::{
    free_port, quote_conn_value, PgCluster, Proxy, ProxyProcess, Signal, APP_DB, SUPERUSER,
};
use pgfence_config::{Config, DefaultResource, OnMissingToken};
use tokio_postgres::{Client, SimpleQueryMessage};

const CONSOLE: &str = "pgfence";
const RELOADED: &str = "configuration reloaded";
const RELOAD_FAILED: &str = "reload failed: the previous configuration stays in force";

/// A cluster with schema `pgfence` and table `ledger` in `app`.
async fn cluster() -> PgCluster {
    let cluster = PgCluster::start();
    let direct = cluster.connect(APP_DB).await;
    fence::install(&direct).await;
    direct
        .batch_execute("CREATE TABLE ledger (id int)")
        .await
        .expect("create table ledger");
    cluster
}

/// `app` fenced on `billing` by default, missing tokens rejected, console for `postgres`.
fn config(cluster: &PgCluster) -> Config {
    let mut config = Proxy::config_for(cluster);
    config.fence.defaults = vec![default_resource("billing")];
    config.fence.on_missing_token = OnMissingToken::Reject;
    config.admin.users = vec![SUPERUSER.into()];
    config
}

fn default_resource(resource: &str) -> DefaultResource {
    DefaultResource {
        database: APP_DB.into(),
        user: None,
        resource: resource.into(),
    }
}

fn config_path(proxy: &ProxyProcess) -> PathBuf {
    proxy.config_path().expect("the proxy has a config file")
}

/// A new `app` session without a token.
async fn session(proxy: &ProxyProcess, name: &str) -> Client {
    harness::connect_to(&format!(
        "{} application_name={}",
        proxy.connstr(APP_DB),
        quote_conn_value(name)
    ))
    .await
}

/// A write without a token by `client`: `Ok` when it committed.
async fn write(client: &Client) -> Result<(), tokio_postgres::Error> {
    client.batch_execute("INSERT INTO ledger VALUES (1)").await
}

async fn assert_missing(client: &Client, resource: &str, context: &str) {
    assert_rejected(&write(client).await, &fence::missing(resource), context);
}

/// `RELOAD` on a new console session.
async fn reload(proxy: &ProxyProcess) -> Result<(), tokio_postgres::Error> {
    let admin = proxy.connect(CONSOLE).await;
    let messages = admin.simple_query("RELOAD").await?;
    assert!(
        matches!(
            messages.as_slice(),
            [SimpleQueryMessage::CommandComplete(0)]
        ),
        "RELOAD answers with a command tag only"
    );
    Ok(())
}

/// `SHOW CONFIG`'s value of `key`.
async fn shown(proxy: &ProxyProcess, key: &str) -> String {
    let admin = proxy.connect(CONSOLE).await;
    admin
        .simple_query("SHOW CONFIG")
        .await
        .expect("SHOW CONFIG")
        .iter()
        .find_map(|m| match m {
            SimpleQueryMessage::Row(r) if r.get(0) == Some(key) => r.get(1).map(str::to_string),
            _ => None,
        })
        .unwrap_or_else(|| panic!("SHOW CONFIG has no {key}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_sessions_follow_reloads() {
    let cluster = cluster().await;
    let proxy = ProxyProcess::builder()
        .config(config(&cluster))
        .args(["--config", "{config}"])
        .start();
    let path = config_path(&proxy);

    let first = session(&proxy, "first").await;
    assert_missing(&first, "billing", "first, before any reload").await;

    // SIGHUP: missing tokens are allowed from now on, for new sessions.
    rewrite_config(&path, |c| c.fence.on_missing_token = OnMissingToken::Allow);
    let from = proxy.logs().len();
    proxy.signal(Signal::SIGHUP);
    let logs = wait_for_log(&proxy, from, RELOADED);
    // The file by name, under a key of its own (`path` is a rejection's fast or database).
    let line = logs[from..].lines().find(|l| l.contains(RELOADED)).unwrap();
    assert!(
        line.contains("config_file=") && !line.contains("Some(") && !line.contains(" path="),
        "{line}"
    );
    let second = session(&proxy, "second").await;
    write(&second)
        .await
        .expect("a session started after the reload writes without a token");
    assert_missing(&first, "billing", "first keeps its policy after SIGHUP").await;
    assert_eq!(shown(&proxy, "fence.on_missing_token").await, "allow");

    // RELOAD: missing tokens rejected again, and sessions of app default to orders.
    rewrite_config(&path, |c| {
        c.fence.on_missing_token = OnMissingToken::Reject;
        c.fence.defaults = vec![default_resource("orders")];
    });
    let from = proxy.logs().len();
    reload(&proxy).await.expect("RELOAD");
    wait_for_log(&proxy, from, RELOADED);
    let third = session(&proxy, "third").await;
    assert_missing(&third, "orders", "third, after RELOAD").await;
    write(&second)
        .await
        .expect("second keeps its policy after RELOAD");
    assert_missing(&first, "billing", "first keeps its default resource").await;
}

/// `RELOAD`'s error, which must say the old config stays and name the file and `problem`.
async fn assert_reload_fails(proxy: &ProxyProcess, path: &Path, problem: &str) {
    let from = proxy.logs().len();
    let err = reload(proxy)
        .await
        .expect_err("RELOAD of a broken file fails");
    let db = err.as_db_error().unwrap_or_else(|| panic!("{err:?}"));
    assert_eq!(db.severity(), "ERROR", "{db:?}");
    let message = db.message();
    for part in [
        "the previous configuration stays in force",
        &path.display().to_string(),
        problem,
    ] {
        assert!(message.contains(part), "{part:?} missing from: {message}");
    }
    let logs = wait_for_log(proxy, from, RELOAD_FAILED);
    let new = &logs[from..];
    let at = new.find(RELOAD_FAILED).expect("found by wait_for_log");
    // The event is one line: the error's own newlines (a TOML error shows the line of the
    // file and a caret) are escaped, so that line-based log shipping keeps it whole.
    let event = &new[new[..at].rfind('\n').map_or(0, |i| i + 1)..];
    let event = event.lines().next().unwrap_or(event);
    assert!(event.contains(" WARN "), "a warning: {event}");
    assert!(
        event.contains(&path.display().to_string()) && event.contains(problem),
        "the log names the file and {problem:?}: {event}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broken_files_leave_the_old_config() {
    let cluster = cluster().await;
    let proxy = ProxyProcess::builder()
        .config(config(&cluster))
        .args(["--config", "{config}"])
        .start();
    let path = config_path(&proxy);
    let good = fs::read_to_string(&path).expect("read the config file");

    // A syntax error, on SIGHUP: logged, nothing changes.
    fs::write(&path, "[fence]\non_missing_token = \"allow\"\n[limits\n").expect("write");
    let from = proxy.logs().len();
    proxy.signal(Signal::SIGHUP);
    let logs = wait_for_log(&proxy, from, RELOAD_FAILED);
    assert!(
        logs[from..].contains(&path.display().to_string()),
        "the log names the file:\n{}",
        &logs[from..]
    );
    assert!(!logs[from..].contains(RELOADED), "{}", &logs[from..]);
    assert_missing(
        &session(&proxy, "after-sighup").await,
        "billing",
        "after a broken file on SIGHUP",
    )
    .await;
    // The same file with RELOAD: an error naming the file and the problem.
    assert_reload_fails(&proxy, &path, "invalid table header").await;

    // An unknown key (a typo of on_missing_token).
    let typo = good.replace("[fence]\n", "[fence]\non_missing_tokn = \"allow\"\n");
    assert_ne!(typo, good, "the config file has a [fence] table:\n{good}");
    fs::write(&path, typo).expect("write");
    assert_reload_fails(&proxy, &path, "unknown field `on_missing_tokn`").await;

    // A value that parses but is not valid.
    let invalid = good.replace(
        "max_client_connections = 1000",
        "max_client_connections = 0",
    );
    assert_ne!(
        invalid, good,
        "the config file sets max_client_connections:\n{good}"
    );
    fs::write(&path, invalid).expect("write");
    assert_reload_fails(&proxy, &path, "max_client_connections must be at least 1").await;

    // No file at all.
    fs::remove_file(&path).expect("remove the config file");
    assert_reload_fails(&proxy, &path, "cannot read config file").await;

    // Nothing changed meanwhile.
    assert_missing(
        &session(&proxy, "after-reloads").await,
        "billing",
        "after broken files on RELOAD",
    )
    .await;
    assert_eq!(shown(&proxy, "fence.on_missing_token").await, "reject");
    assert_eq!(shown(&proxy, "limits.max_client_connections").await, "1000");

    // A good file reloads again.
    fs::write(&path, &good).expect("write");
    rewrite_config(&path, |c| c.fence.on_missing_token = OnMissingToken::Allow);
    reload(&proxy).await.expect("RELOAD of a good file");
    write(&session(&proxy, "after-fix").await)
        .await
        .expect("the fixed file is in force");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_only_settings_are_reported() {
    let cluster = cluster().await;
    // Without the harness's PGFENCE_LISTEN, which would override the file's listen.
    let proxy = ProxyProcess::builder()
        .program("env")
        .args(["-u", "PGFENCE_LISTEN"])
        .arg(ProxyProcess::binary().display().to_string())
        .args(["--config", "{config}"])
        .config(config(&cluster))
        .start();
    let path = config_path(&proxy);
    let old_listen = proxy.addr();
    let new_listen = format!("127.0.0.1:{}", free_port());

    rewrite_config(&path, |c| {
        c.listen = new_listen.parse().expect("an address");
        c.unix_socket_dir = Some(std::env::temp_dir().display().to_string());
        c.telemetry.log_format = pgfence_config::LogFormat::Json;
        c.fence.on_missing_token = OnMissingToken::Allow;
    });
    let from = proxy.logs().len();
    reload(&proxy).await.expect("RELOAD applies what it can");
    let logs = wait_for_log(&proxy, from, RELOADED);
    let line = logs[from..]
        .lines()
        .find(|l| l.contains("only change at restart"))
        .unwrap_or_else(|| panic!("no restart-only warning:\n{}", &logs[from..]));
    assert!(
        line.contains(" WARN ") && line.contains("listen") && line.contains("telemetry.log_format"),
        "{line}"
    );
    // Still text logs, still the old address; the policy changed.
    assert!(
        serde_json::from_str::<serde_json::Value>(line).is_err(),
        "{line}"
    );
    assert_eq!(shown(&proxy, "listen").await, old_listen.to_string());
    assert_eq!(shown(&proxy, "telemetry.log_format").await, "text");
    // SHOW CONFIG once showed the new directory, where nothing listened (review I, stop 54):
    // none is in force.
    let socket_dir = proxy
        .connect(CONSOLE)
        .await
        .simple_query("SHOW CONFIG")
        .await
        .expect("SHOW CONFIG")
        .iter()
        .find_map(|m| match m {
            SimpleQueryMessage::Row(r) if r.get(0) == Some("unix_socket_dir") => {
                r.get(1).map(str::to_string)
            }
            _ => None,
        });
    assert_eq!(socket_dir, None);
    write(&session(&proxy, "after-reload").await)
        .await
        .expect("on_missing_token = allow applied");
    assert!(
        std::net::TcpStream::connect(new_listen.as_str()).is_err(),
        "nothing listens at the new address before a restart"
    );
}
