//! Running a child process with a deadline, so a hung psql or python script fails its test
//! with its output instead of hanging the whole test run.

use std::io::{Read, Write};
use std::process::{Command, ExitStatus, Stdio};
use std::thread;
use std::time::{Duration, Instant};

/// What a finished (or killed) child printed.
pub struct Outcome {
    /// `None` when the child was killed at the deadline.
    pub status: Option<ExitStatus>,
    pub stdout: String,
    pub stderr: String,
}

impl Outcome {
    /// True when the child exited by itself with status 0.
    pub fn success(&self) -> bool {
        self.status.is_some_and(|s| s.success())
    }

    /// How the child ended, for panic messages.
    pub fn describe(&self) -> String {
        match self.status {
            Some(s) => s.to_string(),
            None => "killed at the deadline".to_string(),
        }
    }
}

/// Runs `cmd` with `stdin` as its standard input, killing it at `timeout`.
///
/// Panics only if the program cannot be started at all.
pub fn run(cmd: &mut Command, stdin: Option<&[u8]>, timeout: Duration) -> Outcome {
    cmd.stdin(if stdin.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    })
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    let mut child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("could not start {:?}: {e}", cmd.get_program()));

    let writer = match (stdin, child.stdin.take()) {
        (Some(input), Some(mut pipe)) => {
            let input = input.to_vec();
            // A child that exits early closes the pipe; its exit status tells the story.
            Some(thread::spawn(move || {
                let _ = pipe.write_all(&input);
            }))
        }
        _ => None,
    };
    let stdout = child.stdout.take().map(reader);
    let stderr = child.stderr.take().map(reader);

    let deadline = Instant::now() + timeout;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break Some(status),
            Ok(None) if Instant::now() >= deadline => {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
            Ok(None) => thread::sleep(Duration::from_millis(10)),
            Err(e) => panic!("waiting for {:?}: {e}", cmd.get_program()),
        }
    };
    if let Some(w) = writer {
        let _ = w.join();
    }
    let collect = |h: Option<thread::JoinHandle<Vec<u8>>>| {
        h.and_then(|h| h.join().ok())
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default()
    };
    Outcome {
        status,
        stdout: collect(stdout),
        stderr: collect(stderr),
    }
}

fn reader(mut pipe: impl Read + Send + 'static) -> thread::JoinHandle<Vec<u8>> {
    thread::spawn(move || {
        let mut buf = Vec::new();
        let _ = pipe.read_to_end(&mut buf);
        buf
    })
}
