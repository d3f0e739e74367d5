//! Pure fencing logic for pgfence: no I/O, no async runtime.
//!
//! - [`token`]: fencing tokens and resource names, validated as SPEC section 1 says.
//! - [`lexer`]: a byte-level SQL lexer that knows literals, quoted identifiers, dollar quotes
//!   and nested comments (SQL that is not UTF-8 is lexed, never rejected).
//! - [`directive`]: `fencing_token` / `fencing_resource` found in top-level comments.
//! - [`classify`]: splits a query string into statements and classifies each one
//!   conservatively (unknown means "may write").
//! - [`sql`]: the schema installed in the upstream database and the check call.
//! - [`rejection`]: the FN001/FN002/FN003 errors as the client sees them.
#![forbid(unsafe_code)]

pub mod classify;
pub mod directive;
pub mod lexer;
pub mod rejection;
pub mod sql;
pub mod token;
