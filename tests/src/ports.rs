//! Free TCP ports on 127.0.0.1 for servers that must be told their port before they bind
//! (PostgreSQL, the `pgfence` binary).
//!
//! A port picked here can still be taken by someone else before the server binds it, so
//! the callers retry a start that failed with "address in use".

use std::collections::BTreeSet;
use std::net::TcpListener;
use std::ops::Range;
use std::sync::Mutex;

use rand::Rng;

/// Picked below Linux's ephemeral range (32768..61000): the local ends of the many client
/// connections tests open are taken from that range and could steal a port picked there.
const PORTS: Range<u16> = 20_000..32_000;

/// Ports this process already handed out, so two clusters started at once never get one.
static HANDED_OUT: Mutex<BTreeSet<u16>> = Mutex::new(BTreeSet::new());

/// A TCP port on 127.0.0.1 that nothing listens on right now and that this process has not
/// handed out before.
pub fn free_port() -> u16 {
    let mut handed_out = HANDED_OUT.lock().unwrap_or_else(|e| e.into_inner());
    let mut rng = rand::thread_rng();
    for _ in 0..1000 {
        let port = rng.gen_range(PORTS);
        if handed_out.contains(&port) {
            continue;
        }
        if TcpListener::bind((crate::HOST, port)).is_ok() {
            handed_out.insert(port);
            return port;
        }
    }
    // The range is exhausted (a busy machine): let the kernel choose.
    let listener = TcpListener::bind((crate::HOST, 0)).expect("bind 127.0.0.1:0 for a free port");
    let port = listener
        .local_addr()
        .expect("local address of a bound socket")
        .port();
    handed_out.insert(port);
    port
}
