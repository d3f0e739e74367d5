//! Fault injection for tests, compiled into debug builds only: with
//! `PGFENCE_TEST_PANIC=<text>` in its environment, a debug build of pgfence panics in the
//! session that sends a Query of exactly that text, as a bug would. The tests check what
//! the client, the log and the other sessions see then. Release builds have no such hook.

/// Panics if `sql` is the text `PGFENCE_TEST_PANIC` names.
#[cfg(debug_assertions)]
pub(crate) fn panic_on_query(sql: &[u8]) {
    static TEXT: std::sync::OnceLock<Option<Vec<u8>>> = std::sync::OnceLock::new();
    let text = TEXT.get_or_init(|| {
        std::env::var_os("PGFENCE_TEST_PANIC").map(std::ffi::OsString::into_encoded_bytes)
    });
    if text.as_deref() == Some(sql) {
        panic!("PGFENCE_TEST_PANIC: a panic the test asked for");
    }
}

#[cfg(not(debug_assertions))]
#[inline(always)]
pub(crate) fn panic_on_query(_sql: &[u8]) {}
