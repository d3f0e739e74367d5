//! Running the psycopg (and asyncpg) scripts in `tests/python/` (see its README for their
//! convention).
//!
//! psycopg and asyncpg are installed by `scripts/install-deps.sh`. Outside CI a test may skip
//! (loudly) when one is missing; with env `CI` set, [`python_or_skip`] and
//! [`python_module_or_skip`] fail the test instead.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use crate::{drivers, process};

/// Deadline of one script run.
const SCRIPT_TIMEOUT: Duration = Duration::from_secs(180);

/// True when running in CI (env `CI` set to anything but empty, `0` or `false`).
pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "0" && !v.eq_ignore_ascii_case("false"))
}

/// A python3 that can `import psycopg`: env `PGFENCE_PYTHON`, else `python3` on `PATH`, else
/// `/usr/bin/python3`. `None` if none can.
pub fn python() -> Option<PathBuf> {
    static FOUND: OnceLock<Option<PathBuf>> = OnceLock::new();
    FOUND.get_or_init(find_python).clone()
}

fn find_python() -> Option<PathBuf> {
    let mut candidates: Vec<PathBuf> = Vec::new();
    if let Some(p) = std::env::var_os("PGFENCE_PYTHON") {
        candidates.push(PathBuf::from(p));
    }
    if let Some(path) = std::env::var_os("PATH") {
        candidates.extend(
            std::env::split_paths(&path)
                .map(|d| d.join("python3"))
                .filter(|p| p.is_file()),
        );
    }
    candidates.push(PathBuf::from("/usr/bin/python3"));
    candidates.into_iter().find(|py| {
        let mut cmd = Command::new(py);
        cmd.args(["-c", "import psycopg"]);
        py.is_file() && process::run(&mut cmd, None, Duration::from_secs(60)).success()
    })
}

/// [`python`], or, when there is none: outside CI `None` after a loud SKIP line for `test`;
/// in CI a panic (CI installs psycopg, so its absence is a bug).
pub fn python_or_skip(test: &str) -> Option<PathBuf> {
    if let Some(py) = python() {
        return Some(py);
    }
    if in_ci() {
        panic!("{test}: no python3 with psycopg, and CI must have it (scripts/install-deps.sh)");
    }
    eprintln!(
        "SKIP {test}: no python3 with psycopg found; run scripts/install-deps.sh \
         (or `python3 -m pip install 'psycopg[binary]'`)"
    );
    None
}

/// Whether [`python`] can `import module` (cached per module).
pub fn python_has_module(module: &str) -> bool {
    static FOUND: Mutex<Vec<(String, bool)>> = Mutex::new(Vec::new());
    let Some(py) = python() else {
        return false;
    };
    let mut found = FOUND.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, has)) = found.iter().find(|(m, _)| m == module) {
        return *has;
    }
    let mut cmd = Command::new(&py);
    cmd.args(["-c", &format!("import {module}")]);
    let has = process::run(&mut cmd, None, Duration::from_secs(60)).success();
    found.push((module.to_string(), has));
    has
}

/// [`python_or_skip`], and `module` importable by that python (`pip_spec` is what
/// `scripts/install-deps.sh` installs for it): when it is not, outside CI `None` after a
/// loud SKIP line for `test`; in CI a panic.
pub fn python_module_or_skip(test: &str, module: &str, pip_spec: &str) -> Option<PathBuf> {
    let py = python_or_skip(test)?;
    if python_has_module(module) {
        return Some(py);
    }
    if in_ci() {
        panic!(
            "{test}: {} cannot import {module}, and CI must have it (scripts/install-deps.sh)",
            py.display()
        );
    }
    eprintln!(
        "SKIP {test}: {} cannot import {module}; run scripts/install-deps.sh \
         (or `python3 -m pip install '{pip_spec}'`)",
        py.display()
    );
    None
}

/// `tests/python/`.
pub fn python_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("python")
}

/// Runs `script` (a file name in `tests/python/`, or a path) with `env` added, killing it
/// after 3 minutes. Returns its stdout; panics with stdout and stderr when it fails, and
/// when there is no python with psycopg (check [`python_or_skip`] first).
pub fn run_python(script: &str, env: &[(&str, &str)]) -> String {
    try_run_python(script, env).unwrap_or_else(|failure| panic!("{failure}"))
}

/// [`run_python`], returning its failure (the command, how it ended, stdout and stderr)
/// instead of panicking, so a test can run a script several ways and report every failure.
/// Panics only when there is no python with psycopg (check [`python_or_skip`] first).
pub fn try_run_python(script: &str, env: &[(&str, &str)]) -> Result<String, String> {
    let py = python().unwrap_or_else(|| {
        panic!("run_python({script}): no python3 with psycopg; call python_or_skip first")
    });
    let path = python_dir().join(script);
    let mut cmd = Command::new(&py);
    cmd.arg(&path)
        .current_dir(python_dir())
        .env("PYTHONUNBUFFERED", "1")
        .env("PYTHONDONTWRITEBYTECODE", "1");
    drivers::run_script(cmd, &py, &path, env, SCRIPT_TIMEOUT)
}
