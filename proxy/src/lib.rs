//! pgfence: a fencing-aware PostgreSQL proxy.
//!
//! [`run`] serves clients on an already-bound listener until a shutdown future completes;
//! the `pgfence` binary is a thin wrapper around it (flags, signals, logging).
#![forbid(unsafe_code)]

pub mod admin;
pub mod cancel;
mod deadline;
pub mod error;
mod failpoint;
pub mod install;
pub mod metrics;
pub mod net;
pub mod pool;
pub mod protocol;
mod server;
mod session;
pub mod sharded;
pub mod state;
pub mod tls;

pub use server::{run, run_with, ShutdownMode, Workers};
