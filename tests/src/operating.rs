//! Helpers of the operating tests (`tests/tests/operating_*.rs`, SPEC section 7): the JSON
//! log events of a `pgfence` process, `/metrics` fetched over plain HTTP and its exposition
//! text parsed, config files rewritten for a reload, and tokio-postgres connections whose
//! local address is known (the `client_addr` pgfence logs).

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::Command;
use std::str::FromStr;
use std::thread;
use std::time::{Duration, Instant};

use pgfence_config::Config;
use serde_json::{Map, Value};
use tokio_postgres::{Client, NoTls};

use crate::ProxyProcess;

/// How long a scrape, or a wait for a log line or a metric, may take.
pub const WAIT: Duration = Duration::from_secs(10);

/// One log event of `--log-format json`: the event's fields are at the top level, next to
/// `timestamp`, `level`, `target` and `message`.
pub type Event = Map<String, Value>;

/// Parses every non-empty line of `logs` as a JSON object; panics naming a line that is not
/// one (JSON mode must not mix in other output).
pub fn json_events(logs: &str) -> Vec<Event> {
    logs.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|line| match serde_json::from_str::<Value>(line) {
            Ok(Value::Object(event)) => event,
            Ok(other) => {
                panic!("log line is JSON but not an object: {other}\n--- logs ---\n{logs}")
            }
            Err(e) => panic!("log line is not JSON ({e}): {line}\n--- logs ---\n{logs}"),
        })
        .collect()
}

/// The `message` of an event (empty when it has none).
pub fn message(event: &Event) -> &str {
    event.get("message").and_then(Value::as_str).unwrap_or("")
}

/// The `level` of an event (`TRACE` .. `ERROR`).
pub fn level(event: &Event) -> &str {
    event.get("level").and_then(Value::as_str).unwrap_or("")
}

/// A string field of an event; panics (showing the event) when it is missing or not a string.
pub fn str_field<'a>(event: &'a Event, name: &str) -> &'a str {
    event
        .get(name)
        .and_then(Value::as_str)
        .unwrap_or_else(|| panic!("event has no string field {name:?}: {event:?}"))
}

/// An integer field of an event; panics (showing the event) when it is missing or not one.
pub fn int_field(event: &Event, name: &str) -> i64 {
    event
        .get(name)
        .and_then(Value::as_i64)
        .unwrap_or_else(|| panic!("event has no integer field {name:?}: {event:?}"))
}

/// Polls `probe` every 20 ms until it returns `Some`, for up to [`WAIT`]; panics with
/// `what` and the last `describe()` otherwise.
pub fn eventually<T>(
    what: &str,
    mut probe: impl FnMut() -> Option<T>,
    describe: impl Fn() -> String,
) -> T {
    let deadline = Instant::now() + WAIT;
    loop {
        if let Some(found) = probe() {
            return found;
        }
        if Instant::now() >= deadline {
            panic!("{what}: not within {WAIT:?}\n{}", describe());
        }
        thread::sleep(Duration::from_millis(20));
    }
}

/// Waits until the process's output contains `needle` (counting from byte `from`), returning
/// the whole output; panics with the output otherwise.
pub fn wait_for_log(proxy: &ProxyProcess, from: usize, needle: &str) -> String {
    eventually(
        &format!("pgfence logs {needle:?}"),
        || {
            let logs = proxy.logs();
            logs.get(from..)
                .is_some_and(|tail| tail.contains(needle))
                .then_some(logs)
        },
        || format!("--- logs ---\n{}", proxy.logs()),
    )
}

/// An HTTP response.
#[derive(Debug, Clone)]
pub struct HttpResponse {
    pub status: u16,
    /// Header names lower-cased.
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl HttpResponse {
    /// The first header called `name` (case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        let name = name.to_ascii_lowercase();
        self.headers
            .iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// Sends `request_line` (e.g. `GET /metrics HTTP/1.1`) to `addr` and reads the response to
/// the end of the connection.
pub fn http(addr: SocketAddr, request_line: &str) -> HttpResponse {
    let mut stream = TcpStream::connect_timeout(&addr, WAIT)
        .unwrap_or_else(|e| panic!("connect to the metrics endpoint {addr}: {e}"));
    stream
        .set_read_timeout(Some(WAIT))
        .expect("set a read timeout");
    let request = format!("{request_line}\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    stream
        .write_all(request.as_bytes())
        .unwrap_or_else(|e| panic!("send {request_line:?} to {addr}: {e}"));
    let mut raw = Vec::new();
    stream
        .read_to_end(&mut raw)
        .unwrap_or_else(|e| panic!("read the answer to {request_line:?} from {addr}: {e}"));
    let raw = String::from_utf8(raw).expect("the HTTP response is UTF-8");
    let (head, body) = raw
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("no end of headers in {raw:?}"));
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let status = status_line
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("bad status line {status_line:?}"));
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let response = HttpResponse {
        status,
        headers,
        body: body.to_string(),
    };
    if let Some(len) = response.header("content-length") {
        assert_eq!(
            len.parse::<usize>().ok(),
            Some(response.body.len()),
            "Content-Length of {request_line:?}: {response:?}"
        );
    }
    response
}

/// `GET /metrics` from `addr`, asserted to be a 200, parsed.
pub fn scrape(addr: SocketAddr) -> Exposition {
    let response = http(addr, "GET /metrics HTTP/1.1");
    assert_eq!(response.status, 200, "GET /metrics: {response:?}");
    Exposition::parse(&response.body)
}

/// Label set of one sample, sorted by name.
pub type Labels = BTreeMap<String, String>;

/// A parsed Prometheus / OpenMetrics text exposition.
#[derive(Debug, Clone, Default)]
pub struct Exposition {
    /// Family name -> type, from `# TYPE` lines.
    pub types: BTreeMap<String, String>,
    /// Family name -> help text, from `# HELP` lines.
    pub help: BTreeMap<String, String>,
    /// (sample name, labels) -> value.
    pub samples: BTreeMap<(String, Labels), f64>,
    /// The text ended with `# EOF` (OpenMetrics).
    pub eof: bool,
    pub text: String,
}

/// Sample-name suffixes that belong to a family of another name.
const SUFFIXES: &[&str] = &["_total", "_bucket", "_count", "_sum", "_created", "_info"];

impl Exposition {
    /// Parses `text`; panics on a line that is neither a comment nor a well-formed sample,
    /// on a duplicate sample, and on a sample of a family without `# TYPE`.
    pub fn parse(text: &str) -> Exposition {
        let mut out = Exposition {
            text: text.to_string(),
            ..Exposition::default()
        };
        for line in text.lines() {
            assert!(!out.eof, "text after # EOF: {line:?}\n{text}");
            if line == "# EOF" {
                out.eof = true;
            } else if let Some(rest) = line.strip_prefix("# TYPE ") {
                let (name, kind) = rest.split_once(' ').unwrap_or((rest, ""));
                out.types.insert(name.to_string(), kind.to_string());
            } else if let Some(rest) = line.strip_prefix("# HELP ") {
                let (name, help) = rest.split_once(' ').unwrap_or((rest, ""));
                out.help.insert(name.to_string(), help.to_string());
            } else if line.starts_with('#') || line.is_empty() {
            } else {
                let (name, labels, value) =
                    parse_sample(line).unwrap_or_else(|e| panic!("bad sample line {line:?}: {e}"));
                assert!(
                    out.family(&name).is_some(),
                    "sample {name} has no # TYPE line\n{text}"
                );
                let previous = out.samples.insert((name, labels), value);
                assert!(previous.is_none(), "duplicate sample {line:?}\n{text}");
            }
        }
        out
    }

    /// The family a sample name belongs to (itself, or without a known suffix), if typed.
    pub fn family(&self, sample: &str) -> Option<&str> {
        if let Some((name, _)) = self.types.get_key_value(sample) {
            return Some(name);
        }
        SUFFIXES.iter().find_map(|s| {
            let base = sample.strip_suffix(s)?;
            self.types
                .get_key_value(base)
                .map(|(name, _)| name.as_str())
        })
    }

    /// The value of sample `name` with exactly `labels`, if present.
    pub fn get(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        let labels: Labels = labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        self.samples.get(&(name.to_string(), labels)).copied()
    }

    /// Like [`Exposition::get`], 0 when absent (a labelled counter appears at its first
    /// increment).
    pub fn value(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.get(name, labels).unwrap_or(0.0)
    }

    /// Like [`Exposition::get`], panicking (with the text) when absent.
    pub fn must(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.get(name, labels)
            .unwrap_or_else(|| panic!("no sample {name}{labels:?} in\n{}", self.text))
    }

    /// Every sample called `name`, with its labels.
    pub fn series(&self, name: &str) -> Vec<(&Labels, f64)> {
        self.samples
            .iter()
            .filter(|((n, _), _)| n == name)
            .map(|((_, l), v)| (l, *v))
            .collect()
    }
}

/// `name{a="x",b="y"} value [timestamp]`.
fn parse_sample(line: &str) -> Result<(String, Labels, f64), String> {
    let mut chars = line.chars().peekable();
    let mut name = String::new();
    while let Some(c) = chars.next_if(|&c| c.is_ascii_alphanumeric() || c == '_' || c == ':') {
        name.push(c);
    }
    if name.is_empty() {
        return Err("no metric name".into());
    }
    let mut labels = Labels::new();
    if chars.next_if_eq(&'{').is_some() {
        loop {
            match chars.peek() {
                Some('}') => {
                    chars.next();
                    break;
                }
                Some(',') => {
                    chars.next();
                    continue;
                }
                None => return Err("unterminated label set".into()),
                Some(_) => {}
            }
            let mut key = String::new();
            loop {
                match chars.next() {
                    Some('=') => break,
                    Some(c) => key.push(c),
                    None => return Err("label without =".into()),
                }
            }
            if chars.next() != Some('"') {
                return Err(format!("value of label {key} is not quoted"));
            }
            let mut value = String::new();
            loop {
                match chars.next() {
                    Some('"') => break,
                    Some('\\') => match chars.next() {
                        Some('n') => value.push('\n'),
                        Some(c @ ('\\' | '"')) => value.push(c),
                        other => return Err(format!("bad escape {other:?}")),
                    },
                    Some(c) => value.push(c),
                    None => return Err("unterminated label value".into()),
                }
            }
            if labels.insert(key.clone(), value).is_some() {
                return Err(format!("label {key} twice"));
            }
        }
    }
    if chars.next() != Some(' ') {
        return Err("no space before the value".into());
    }
    let rest: String = chars.collect();
    let mut parts = rest.split(' ');
    let value = match parts.next().unwrap_or_default() {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        v => f64::from_str(v).map_err(|e| format!("bad value {v:?}: {e}"))?,
    };
    if parts.nth(1).is_some() {
        return Err("text after the timestamp".into());
    }
    Ok((name, labels, value))
}

/// What a command run by [`run_command`] did.
#[derive(Debug)]
pub struct CommandOutput {
    /// The exit code; `None` when killed (at the deadline, or by a signal).
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

impl CommandOutput {
    /// Exited by itself with status 0.
    pub fn success(&self) -> bool {
        self.code == Some(0)
    }
}

/// Runs `cmd` (psql, the `pgfence` binary) with `stdin`, killing it after 60 s, so that a
/// hung client fails its test instead of hanging the run.
pub fn run_command(cmd: &mut Command, stdin: Option<&[u8]>) -> CommandOutput {
    let out = crate::process::run(cmd, stdin, Duration::from_secs(60));
    CommandOutput {
        code: out.status.and_then(|s| s.code()),
        stdout: out.stdout,
        stderr: out.stderr,
    }
}

/// Reads the TOML config file at `path`, lets `edit` change it, and writes it back.
pub fn rewrite_config(path: &Path, edit: impl FnOnce(&mut Config)) {
    let text = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("read the config file {}: {e}", path.display()));
    let mut config: Config = toml::from_str(&text)
        .unwrap_or_else(|e| panic!("parse the config file {}: {e}", path.display()));
    edit(&mut config);
    let text = toml::to_string(&config).expect("serialize the config");
    std::fs::write(path, text)
        .unwrap_or_else(|e| panic!("write the config file {}: {e}", path.display()));
}

/// A tokio-postgres connection over a socket this function opens to `addr`, so that its
/// local address (what pgfence logs as `client_addr`) is known. Inside a tokio runtime.
pub async fn connect_from(addr: SocketAddr, connstr: &str) -> (Client, SocketAddr) {
    let config = tokio_postgres::Config::from_str(connstr)
        .unwrap_or_else(|e| panic!("bad connection string `{connstr}`: {e}"));
    let stream = tokio::net::TcpStream::connect(addr)
        .await
        .unwrap_or_else(|e| panic!("connect to {addr}: {e}"));
    let local = stream
        .local_addr()
        .expect("local address of the client socket");
    let (client, connection) = config
        .connect_raw(stream, NoTls)
        .await
        .unwrap_or_else(|e| panic!("could not connect with `{connstr}` over {local}: {e:?}"));
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            eprintln!("harness: connection closed with an error: {e}");
        }
    });
    (client, local)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_parse_with_and_without_labels() {
        let e = Exposition::parse(
            "# HELP a_total A.\n# TYPE a counter\na_total{x=\"1\",y=\"q\\\"\\\\\\n\"} 3\n\
             # TYPE g gauge\ng 7 123\n# TYPE h histogram\nh_bucket{le=\"+Inf\"} 2\n\
             h_count 2\n# EOF\n",
        );
        assert!(e.eof);
        assert_eq!(e.get("a_total", &[("x", "1"), ("y", "q\"\\\n")]), Some(3.0));
        assert_eq!(e.get("g", &[]), Some(7.0));
        assert_eq!(e.get("h_bucket", &[("le", "+Inf")]), Some(2.0));
        assert_eq!(e.value("h_count", &[]), 2.0);
        assert_eq!(e.value("a_total", &[("x", "2")]), 0.0);
        assert_eq!(e.family("a_total"), Some("a"));
    }

    #[test]
    #[should_panic(expected = "no # TYPE")]
    fn untyped_samples_are_refused() {
        Exposition::parse("x 1\n");
    }
}
