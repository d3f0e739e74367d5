//! The PostgreSQL wire protocol as pgfence needs it: framing, tags, and the few messages it
//! builds or inspects. No I/O here: functions take buffers and return values or
//! "incomplete", so the framing layer can be tested (and fuzzed) with plain byte slices.
//!
//! pgfence forwards the client's bytes as they came; decoding is for inspection only.

pub mod frame;
pub mod message;
pub mod startup;

#[cfg(test)]
mod tests;

pub use frame::{next_frame, FrameError};
pub use message::{Backend, Frontend};
