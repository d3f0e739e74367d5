//! The benchmark runner, end to end and kept short: `pgfence-bench` starts its own
//! PostgreSQL, pgfence (the debug binary `scripts/test.sh` builds) and PgBouncer when it is
//! installed, runs both workloads at one client for a second each, the stale writer and the
//! idle-session memory, then writes its report. What these tests check is that the runner
//! works from a clean clone and says what it measured, not any figure: the figures are the
//! runs' in docs/benchmarks.md.

use std::fs;
use std::io::{BufRead, BufReader};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde_json::Value;

const RUNNER: &str = env!("CARGO_BIN_EXE_pgfence-bench");

/// The pgfence binary beside the runner's (`target/<profile>/pgfence`).
fn pgfence_binary() -> PathBuf {
    let path = Path::new(RUNNER).with_file_name("pgfence");
    assert!(
        path.exists(),
        "the pgfence binary is missing at {}: run `cargo build -p pgfence` first \
         (scripts/test.sh does)",
        path.display()
    );
    path
}

/// A directory the runner can give to the `postgres` OS user when it runs as root: the
/// server must be able to reach it through this one.
fn shared_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("a temporary directory");
    fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o755)).expect("chmod 755");
    dir
}

/// The runner on `args`, with the pgfence binary of this build, its work directory in `work`
/// and its results in `out`.
fn runner(args: &[&str], work: &Path, out: &Path) -> Command {
    let mut cmd = Command::new(RUNNER);
    cmd.args(args)
        .args(["--no-build", "--pgfence-bin"])
        .arg(pgfence_binary())
        .arg("--work-dir")
        .arg(work)
        .arg("--out-dir")
        .arg(out)
        .env_remove("RUST_LOG");
    cmd
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn a_short_run_measures_every_configuration_and_writes_its_report() {
    let out = shared_dir();
    let work = shared_dir();
    // Both workloads at one client, -M simple, one round of one second.
    let args = "--scale 1 --modes simple --clients 1 --duration 1 --rounds 1 --warmup 0 \
                --stale-duration 1 --idle-sessions 20";
    let args: Vec<&str> = args.split_whitespace().collect();
    let output = runner(&args, work.path(), out.path())
        .output()
        .expect("run pgfence-bench");
    let (stdout, stderr) = (text(&output.stdout), text(&output.stderr));
    assert!(
        output.status.success(),
        "pgfence-bench failed ({}):\n{stdout}\n{stderr}",
        output.status
    );

    // One directory of results, named after the start time; the work directory is gone.
    let runs: Vec<PathBuf> = fs::read_dir(out.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(runs.len(), 1, "{runs:?}");
    let dir = &runs[0];
    let leftovers: Vec<_> = fs::read_dir(work.path()).unwrap().collect();
    assert!(
        leftovers.is_empty(),
        "the work directory was left: {leftovers:?}"
    );
    assert!(
        stdout.contains(&format!("Written: {}", dir.join("results.md").display())),
        "{stdout}"
    );

    let results: Value =
        serde_json::from_str(&fs::read_to_string(dir.join("results.json")).unwrap())
            .expect("results.json is JSON");
    let mut expected = vec![
        "direct",
        "no-fence",
        "no-token",
        "session-token",
        "sqlcommenter",
    ];
    // PgBouncer is compared when it is installed (scripts/install-deps.sh installs it).
    if !results["environment"]["pgbouncer"].is_null() {
        expected.insert(1, "pgbouncer");
    }
    let cells = results["cells"].as_array().expect("cells");
    let labels: Vec<&str> = cells.iter().map(|c| c["label"].as_str().unwrap()).collect();
    assert_eq!(
        labels,
        [
            "select-only, simple, 1 client",
            "tpcb-like, simple, 1 client"
        ]
    );
    for cell in cells {
        let setups = cell["setups"].as_array().expect("setups");
        let names: Vec<&str> = setups
            .iter()
            .map(|s| s["setup"].as_str().unwrap())
            .collect();
        assert_eq!(names, expected, "{}", cell["label"]);
        for setup in setups {
            let runs = setup["runs"].as_array().expect("runs");
            assert_eq!(runs.len(), 1, "{setup}");
            let r = &runs[0];
            let what = format!("{} / {}", cell["label"], setup["setup"]);
            assert!(r["tps"].as_f64().unwrap() > 0.0, "{what}: {r}");
            assert!(r["transactions"].as_u64().unwrap() > 0, "{what}: {r}");
            assert_eq!(r["failed"].as_u64(), Some(0), "{what}: {r}");
            assert!(r["mean_ms"].as_f64().unwrap() > 0.0, "{what}: {r}");
            assert!(r["p99_ms"].as_f64().unwrap() > 0.0, "{what}: {r}");
            assert!(r["cpu_us"].as_f64().unwrap() > 0.0, "{what}: {r}");
            // The proxy's own CPU is measured for the proxies, and only for them.
            assert_eq!(
                r["proxy_cpu_us"].is_null(),
                setup["setup"] == "direct",
                "{what}: {r}"
            );
        }
    }

    // The stale writer: writes with the current token commit, stale ones are rejected with
    // FN001 on both paths, and nothing else happened.
    let stale = results["stale"].as_array().expect("stale");
    assert_eq!(stale.len(), 8, "{stale:?}");
    for s in stale {
        assert!(s["writes"].as_u64().unwrap() > 0, "{s}");
        assert_eq!(s["unexpected"].as_u64(), Some(0), "{s}");
        let scenario = s["scenario"].as_str().unwrap();
        let expected = if scenario.starts_with("stale write") {
            "rejected (FN001)"
        } else {
            "committed"
        };
        assert_eq!(s["expected"], expected, "{s}");
    }
    let tokens = &results["stale_tokens"];
    assert!(
        tokens["stale"].as_i64() < tokens["current"].as_i64(),
        "{tokens}"
    );

    let memory = &results["memory"];
    assert_eq!(memory["sessions"].as_u64(), Some(20), "{memory}");
    assert!(
        memory["per_session_kib"].as_f64().unwrap() > 0.0,
        "{memory}"
    );

    // The Markdown report holds the command that repeats the run, the table and the
    // targets; the chart is an SVG image with every configuration in its legend.
    let md = fs::read_to_string(dir.join("results.md")).unwrap();
    let command = results["command"].as_str().unwrap();
    assert!(command.starts_with("cargo run --release -p pgfence-benches -- "));
    for needle in [
        command,
        "select-only, simple, 1 client",
        "stale write, pgfence fast path",
        "Targets",
        "chart.svg",
    ] {
        assert!(md.contains(needle), "results.md lacks {needle:?}:\n{md}");
    }
    let svg = fs::read_to_string(dir.join("chart.svg")).unwrap();
    assert!(svg.starts_with("<svg "), "{}", &svg[..svg.len().min(200)]);
    assert!(svg.trim_end().ends_with("</svg>"));
    for setup in cells[0]["setups"].as_array().unwrap() {
        let label = setup["label"].as_str().unwrap();
        assert!(
            svg.contains(&format!(">{label}<")),
            "chart.svg lacks {label:?}"
        );
    }
}

/// Ctrl-C in the middle of a run stops every process the runner started and removes its
/// work directory; the runner says it was interrupted and exits with a failure.
#[test]
fn an_interrupted_run_leaves_nothing_behind() {
    let work = shared_dir();
    let out = shared_dir();
    let mut child = runner(
        &["--scale", "1", "--duration", "2", "--warmup", "0"],
        work.path(),
        out.path(),
    )
    .stdout(Stdio::null())
    .stderr(Stdio::piped())
    .spawn()
    .expect("start pgfence-bench");
    // The measuring has begun once the first run is reported (on stderr): by then
    // PostgreSQL, both pgfences and PgBouncer are up.
    let mut progress = BufReader::new(child.stderr.take().unwrap()).lines();
    let mut seen = String::new();
    for line in progress.by_ref() {
        let line = line.unwrap();
        seen.push_str(&line);
        seen.push('\n');
        if line.contains("round 1/") {
            break;
        }
    }
    let running = processes_under(work.path());
    assert!(
        running.len() >= 3,
        "PostgreSQL and two pgfences should be running in {}: {running:?}\n{seen}",
        work.path().display()
    );
    let kill = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    for line in progress {
        seen.push_str(&line.unwrap());
        seen.push('\n');
    }
    let status = child.wait().unwrap();
    assert!(!status.success(), "{seen}");
    assert!(
        seen.contains("interrupted, stopping what was started"),
        "{seen}"
    );
    let leftovers: Vec<_> = fs::read_dir(work.path()).unwrap().collect();
    assert!(
        leftovers.is_empty(),
        "the work directory was left: {leftovers:?}"
    );
    let running = processes_under(work.path());
    assert!(running.is_empty(), "still running: {running:?}");
}

/// The processes whose command line names a path under `dir` (pid, command line).
fn processes_under(dir: &Path) -> Vec<(u32, String)> {
    let needle = dir.to_str().unwrap();
    fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| {
            let e = e.ok()?;
            let pid: u32 = e.file_name().to_str()?.parse().ok()?;
            let cmdline = fs::read(e.path().join("cmdline")).ok()?;
            let cmdline = text(&cmdline).replace('\0', " ");
            cmdline.contains(needle).then_some((pid, cmdline))
        })
        .collect()
}

#[test]
fn bad_options_are_refused_before_anything_starts() {
    for (args, says) in [
        (
            &["--duration", "0"][..],
            "--duration must be at least 1 second",
        ),
        (
            &["--clients", "1,0"],
            "every client count must be at least 1",
        ),
        (
            &["--pg-setting", "synchronous_commit"],
            "expected NAME=VALUE",
        ),
        (&["--workloads", "tpcc"], "tpcc"),
    ] {
        let output = Command::new(RUNNER).args(args).output().unwrap();
        let stderr = text(&output.stderr);
        assert!(!output.status.success(), "{args:?} was accepted");
        assert!(stderr.contains(says), "{args:?}: {stderr}");
        assert!(
            output.stdout.is_empty(),
            "{args:?}: {}",
            text(&output.stdout)
        );
    }
}
