//! The `pgfence` command line as an operator meets it first: `--help` names every flag and
//! its `PGFENCE_*` variable, a config file that cannot be used stops the binary with a
//! message naming the file and the problem, and the example file in the repository starts
//! the binary.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use harness::operating::{run_command, wait_for_log, CommandOutput};
use harness::{free_port, PgCluster, ProxyProcess, APP_DB};

/// Every flag of `pgfence` (serve): a new one must be added here, which is the reminder to
/// document it (README, example file).
const FLAGS: &[&str] = &[
    "--client-tls-ca-file",
    "--client-tls-cert-file",
    "--client-tls-key-file",
    "--client-tls-sslmode",
    "--config",
    "--help",
    "--listen",
    "--log-format",
    "--max-message-size",
    "--metrics-addr",
    "--no-fence",
    "--threads",
    "--unix-socket-dir",
    "--upstream",
    "--upstream-sslcert",
    "--upstream-sslkey",
    "--upstream-sslmode",
    "--upstream-sslrootcert",
    "--version",
];
/// The environment variable of each setting flag.
const ENV: &[&str] = &[
    "PGFENCE_CONFIG",
    "PGFENCE_LISTEN",
    "PGFENCE_UNIX_SOCKET_DIR",
    "PGFENCE_UPSTREAM",
    "PGFENCE_LOG_FORMAT",
    "PGFENCE_METRICS_ADDR",
    "PGFENCE_MAX_MESSAGE_SIZE",
    "PGFENCE_NO_FENCE",
    "PGFENCE_CLIENT_TLS_SSLMODE",
    "PGFENCE_CLIENT_TLS_CERT_FILE",
    "PGFENCE_CLIENT_TLS_KEY_FILE",
    "PGFENCE_CLIENT_TLS_CA_FILE",
    "PGFENCE_UPSTREAM_SSLMODE",
    "PGFENCE_UPSTREAM_SSLROOTCERT",
    "PGFENCE_UPSTREAM_SSLCERT",
    "PGFENCE_UPSTREAM_SSLKEY",
];
/// The flags of `pgfence install` besides the global ones.
const INSTALL_FLAGS: &[&str] = &["--database", "--user", "--password", "--grant-to"];

fn pgfence(args: &[&str]) -> CommandOutput {
    let mut cmd = Command::new(ProxyProcess::binary());
    cmd.args(args);
    // The settings come from the arguments only.
    for (key, _) in std::env::vars() {
        if key.starts_with("PGFENCE_") {
            cmd.env_remove(key);
        }
    }
    run_command(&mut cmd, None)
}

/// The `--long-flags` a help text mentions.
fn flags(help: &str) -> BTreeSet<String> {
    help.split(|c: char| !(c.is_ascii_alphanumeric() || c == '-'))
        .filter(|w| w.starts_with("--") && w.len() > 2)
        .map(str::to_string)
        .collect()
}

#[test]
fn help_names_every_flag() {
    let out = pgfence(&["--help"]);
    let help = out.stdout.clone();
    assert!(out.success(), "{out:?}");
    let expected: BTreeSet<String> = FLAGS.iter().map(|f| f.to_string()).collect();
    assert_eq!(flags(&help), expected, "pgfence --help:\n{help}");
    for var in ENV {
        assert!(help.contains(var), "{var} missing from --help:\n{help}");
    }
    assert!(help.contains("install"), "the install command:\n{help}");

    let out = pgfence(&["install", "--help"]);
    let help = out.stdout.clone();
    assert!(out.success(), "{out:?}");
    for flag in INSTALL_FLAGS {
        assert!(
            help.contains(flag),
            "{flag} missing from install --help:\n{help}"
        );
    }
    // Only what install uses: the proxy's own flags are not its options.
    for flag in [
        "--listen",
        "--threads",
        "--no-fence",
        "--client-tls-sslmode",
    ] {
        assert!(
            !flags(&help).contains(flag),
            "{flag} listed by install --help:\n{help}"
        );
    }

    let out = pgfence(&["--version"]);
    assert!(out.success(), "{out:?}");
    assert_eq!(
        out.stdout.clone().trim(),
        format!("pgfence {}", env!("CARGO_PKG_VERSION"))
    );
}

#[test]
fn bad_arguments_exit_non_zero() {
    for args in [
        &["--no-such-flag"][..],
        &["--log-format", "xml"],
        &["--listen", "not-an-address"],
    ] {
        let out = pgfence(args);
        assert_eq!(out.code, Some(2), "{args:?}: {out:?}");
        let stderr = out.stderr.clone();
        assert!(
            stderr.contains(args[0]) || stderr.contains(args[args.len() - 1]),
            "{args:?}: {stderr}"
        );
    }
}

/// Runs `pgfence --config <file with contents>` and returns its stderr, asserting it
/// exited at once with status 2 and named the file.
fn refused(dir: &Path, contents: Option<&str>) -> String {
    let path = dir.join("pgfence.toml");
    match contents {
        Some(c) => std::fs::write(&path, c).expect("write the config file"),
        None => {
            let _ = std::fs::remove_file(&path);
        }
    }
    let path_text = path.display().to_string();
    let out = pgfence(&[
        "--config",
        &path_text,
        "--listen",
        &format!("127.0.0.1:{}", free_port()),
    ]);
    let stderr = out.stderr.clone();
    assert_eq!(out.code, Some(2), "{contents:?}: {stderr}");
    assert!(
        stderr.starts_with("pgfence: ") && stderr.contains(&path_text),
        "{contents:?}: the message names the file: {stderr}"
    );
    stderr
}

#[test]
fn unusable_config_files_stop_the_binary() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let stderr = refused(dir.path(), Some("listen = [\n"));
    assert!(stderr.contains("line 1"), "{stderr}");
    let stderr = refused(dir.path(), Some("[fence]\non_missing_tokn = \"allow\"\n"));
    assert!(
        stderr.contains("unknown field `on_missing_tokn`"),
        "{stderr}"
    );
    let stderr = refused(dir.path(), Some("[fence]\non_missing_token = \"maybe\"\n"));
    assert!(stderr.contains("maybe"), "{stderr}");
    let stderr = refused(dir.path(), Some("[limits]\nmax_client_connections = 0\n"));
    assert!(
        stderr.contains("max_client_connections must be at least 1"),
        "{stderr}"
    );
    let stderr = refused(dir.path(), Some("[limits]\nconnect_timeout = \"10\"\n"));
    assert!(stderr.contains("connect_timeout"), "{stderr}");
    let stderr = refused(dir.path(), None);
    assert!(stderr.contains("cannot read config file"), "{stderr}");
}

#[test]
fn unusable_tls_settings_stop_the_binary() {
    let listen = format!("127.0.0.1:{}", free_port());
    let refused = |args: &[&str]| {
        let mut all = vec!["--listen", &listen];
        all.extend_from_slice(args);
        let out = pgfence(&all);
        assert_eq!(out.code, Some(2), "{args:?}: {out:?}");
        out.stderr.clone()
    };
    let stderr = refused(&["--upstream-sslmode", "allow"]);
    assert!(stderr.contains("allow"), "{stderr}");
    let stderr = refused(&["--upstream-sslmode", "verify-full"]);
    assert!(
        stderr.contains("upstream.sslmode = verify-full needs upstream.sslrootcert"),
        "{stderr}"
    );
    let stderr = refused(&[
        "--upstream-sslmode",
        "verify-ca",
        "--upstream-sslrootcert",
        "/nonexistent/root.crt",
    ]);
    assert!(
        stderr.contains("upstream.sslrootcert /nonexistent/root.crt: cannot read"),
        "{stderr}"
    );
    let stderr = refused(&[
        "--upstream-sslmode",
        "require",
        "--upstream-sslcert",
        "/c.pem",
    ]);
    assert!(
        stderr.contains("upstream.sslcert and upstream.sslkey go together"),
        "{stderr}"
    );
    let stderr = refused(&["--client-tls-sslmode", "sometimes"]);
    assert!(stderr.contains("sometimes"), "{stderr}");
    let stderr = refused(&["--client-tls-sslmode", "require"]);
    assert!(
        stderr.contains(
            "client_tls.sslmode = require needs client_tls.cert_file and client_tls.key_file"
        ),
        "{stderr}"
    );

    let certs = harness::tls::TestCerts::new("pgfence test CA");
    let other = harness::tls::TestCerts::new("another CA");
    let (cert, key) = (
        certs.cert_file.display().to_string(),
        certs.key_file.display().to_string(),
    );
    let missing = certs.dir().join("missing.crt").display().to_string();
    let tls = |cert: &str, key: &str| {
        refused(&[
            "--client-tls-sslmode",
            "allow",
            "--client-tls-cert-file",
            cert,
            "--client-tls-key-file",
            key,
        ])
    };
    let stderr = tls(&missing, &key);
    assert!(
        stderr.contains(&format!("client_tls.cert_file {missing}: cannot read")),
        "{stderr}"
    );
    // A key where the certificate belongs.
    let stderr = tls(&key, &key);
    assert!(stderr.contains("no certificate in the file"), "{stderr}");
    let stderr = tls(&cert, &other.key_file.display().to_string());
    assert!(
        stderr.contains("does not go with the certificate in") && stderr.contains(&cert),
        "{stderr}"
    );
    // The clients' CA: needed by the verify modes, and a file of CA certificates.
    let verify = |mode: &str, ca: Option<&str>| {
        let mut args = vec![
            "--client-tls-sslmode",
            mode,
            "--client-tls-cert-file",
            &cert,
            "--client-tls-key-file",
            &key,
        ];
        if let Some(ca) = ca {
            args.extend(["--client-tls-ca-file", ca]);
        }
        refused(&args)
    };
    let stderr = verify("verify-full", None);
    assert!(
        stderr.contains("client_tls.sslmode = verify-full needs client_tls.ca_file"),
        "{stderr}"
    );
    let stderr = verify("verify-ca", Some(&key));
    assert!(
        stderr.contains(&format!(
            "client_tls.ca_file {key}: no usable CA certificate"
        )),
        "{stderr}"
    );
}

#[test]
fn the_example_file_starts_the_binary() {
    let example: PathBuf = [env!("CARGO_MANIFEST_DIR"), "..", "pgfence.example.toml"]
        .iter()
        .collect();
    let dead_upstream = format!("127.0.0.1:{}", free_port());
    let mut proxy = ProxyProcess::start(&[
        "--config",
        &example.display().to_string(),
        "--listen",
        "{listen}",
        "--upstream",
        &dead_upstream,
    ]);
    wait_for_log(&proxy, 0, "pgfence started");
    assert!(proxy.try_status().is_none(), "{}", proxy.logs());
}

/// docker-compose.yml's file, `deploy/pgfence.toml`, against a real server: it installs the
/// schema into `app` at start, and its console shows that database's fences.
#[test]
fn the_docker_compose_file_installs_and_shows_fences() {
    let cluster = PgCluster::start();
    let config: PathBuf = [env!("CARGO_MANIFEST_DIR"), "..", "deploy", "pgfence.toml"]
        .iter()
        .collect();
    let upstream = format!("{}:{}", cluster.host(), cluster.port());
    let metrics = format!("127.0.0.1:{}", free_port());
    let mut proxy = ProxyProcess::start(&[
        "--config",
        &config.display().to_string(),
        "--listen",
        "{listen}",
        "--upstream",
        &upstream,
        "--metrics-addr",
        &metrics,
    ]);
    wait_for_log(&proxy, 0, "pgfence started");
    assert!(proxy.try_status().is_none(), "{}", proxy.logs());
    assert!(installed(&cluster, APP_DB), "{}", proxy.logs());
    let out = run_command(
        proxy.psql_cmd().args([
            "-U",
            "postgres",
            "-d",
            "pgfence",
            "-At",
            "-c",
            "SHOW FENCES",
        ]),
        None,
    );
    assert!(out.success(), "{out:?}\n{}", proxy.logs());
}

/// Whether `database` of `cluster` has schema pgfence.
fn installed(cluster: &PgCluster, database: &str) -> bool {
    cluster
        .psql(
            database,
            "SELECT count(*) FROM pg_namespace WHERE nspname = 'pgfence'",
        )
        .trim()
        == "1"
}

/// `pgfence install` says what the server said when it fails (tokio-postgres alone says
/// "db error"), once, and without `--database` installs where the config file's
/// `[fence.install]` says, not into database postgres.
#[test]
fn install_reports_the_servers_error_and_follows_the_config_file() {
    let cluster = PgCluster::start();
    let upstream = format!("{}:{}", cluster.host(), cluster.port());

    let out = pgfence(&["install", "--upstream", &upstream, "--database", "nope"]);
    assert_eq!(out.code, Some(1), "{out:?}");
    let stderr = out.stderr.clone();
    assert!(
        stderr.contains("3D000") && stderr.contains(r#"database \"nope\" does not exist"#)
            || stderr.contains(r#"database "nope" does not exist"#),
        "the server's error: {stderr}"
    );
    assert_eq!(
        stderr.matches("does not exist").count(),
        1,
        "said once: {stderr}"
    );

    let dir = tempfile::tempdir().expect("a temporary directory");
    let path = dir.path().join("pgfence.toml");
    std::fs::write(
        &path,
        format!(
            "[upstream]\nhost = \"{}\"\nport = {}\n[fence.install]\nuser = \"postgres\"\ndatabases = [\"{APP_DB}\"]\n",
            cluster.host(),
            cluster.port()
        ),
    )
    .expect("write the config file");
    let out = pgfence(&["install", "--config", &path.display().to_string()]);
    assert!(out.success(), "{out:?}");
    assert!(installed(&cluster, APP_DB), "{out:?}");
    assert!(
        !installed(&cluster, "postgres"),
        "installed into postgres: {out:?}"
    );

    // Objects through which reads may call the database's own functions are named once
    // the schema is installed (with fence.skip_read_only on, the default); a database
    // without them gets no warning.
    cluster.psql(
        APP_DB,
        "CREATE FUNCTION cli_check(i int) RETURNS boolean LANGUAGE sql AS 'SELECT i > 0'; \
         CREATE DOMAIN cli_positive AS int CHECK (cli_check(VALUE));",
    );
    // --database wins over the file, and may be repeated.
    let out = pgfence(&[
        "install",
        "--config",
        &path.display().to_string(),
        "--database",
        "postgres",
        "--database",
        APP_DB,
    ]);
    assert!(out.success(), "{out:?}");
    assert!(installed(&cluster, "postgres"), "{out:?}");
    let logs = format!("{}{}", out.stdout, out.stderr);
    let warnings: Vec<&str> = logs
        .lines()
        .filter(|l| l.contains("reads may call this database's own functions"))
        .collect();
    assert_eq!(warnings.len(), 1, "one warning, for {APP_DB}: {logs}");
    eprintln!("{}", warnings[0]);
    assert!(
        warnings[0].contains(APP_DB) && warnings[0].contains("domain public.cli_positive"),
        "{logs}"
    );
}
