//! A byte-level PostgreSQL lexer: just enough of `scan.l` to know where comments, literals,
//! quoted identifiers and dollar-quoted bodies begin and end.
//!
//! It yields top-level tokens with byte ranges and skips white space. It never allocates,
//! never fails and never panics: SQL that is not valid UTF-8 is lexed like any other bytes
//! (every byte >= 0x80 is an identifier character, as in PostgreSQL), and an unterminated
//! comment, literal or quoted identifier runs to the end of the input.
//!
//! What it follows from PostgreSQL's scanner:
//! - `--` comments end at `\n` or `\r`; `/* */` comments nest.
//! - An operator stops before `--` or `/*` (so `1+/* c */2` has a comment).
//! - `'..'` with `''`; `E'..'` also with backslash escapes; `N'..'` and `U&'..'` like `'..'`;
//!   `B'..'` and `X'..'` end at the first `'`.
//! - `".."` with `""`, and `U&".."`.
//! - `$tag$..$tag$` where the tag is an identifier without `$` (it cannot start with a digit);
//!   `$1` is a parameter; a `$` inside an identifier (`a$b`) is part of it.
//!
//! Assumptions the caller must keep:
//! - `standard_conforming_strings` is `on` (the default since PostgreSQL 9.1) unless
//!   [`LexOptions`] says otherwise. With it `off`, backslashes escape in every `'..'` literal,
//!   and lexing with the wrong setting puts literal boundaries in the wrong place.
//! - The client encoding is ASCII-safe (UTF8, LATIN*, EUC_*, WIN125x, ...). In SJIS, BIG5,
//!   GBK, UHC, GB18030 and JOHAB the second byte of a character can be `\` (0x5C), so an
//!   `E'..'` literal ends elsewhere for the server than for this lexer. The proxy must not
//!   rely on this lexer for those client encodings.

/// What kind of token a [`Tok`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokKind {
    /// A keyword or unquoted identifier (ASCII letters, `_`, digits, `$`, bytes >= 0x80).
    Ident,
    /// `"..."` or `U&"..."`.
    QuotedIdent,
    /// A string literal in any form, dollar-quoted bodies included.
    String,
    /// A numeric literal.
    Number,
    /// A positional parameter: `$1`.
    Param,
    /// An operator: a run of `+-*/<>=~!@#%^&|`?`.
    Op,
    /// `;`
    Semicolon,
    /// `(`
    LParen,
    /// `)`
    RParen,
    /// A comment; the range includes the delimiters.
    Comment { block: bool },
    /// Anything else: `,` `.` `[` `]` `:` `::` and any stray byte; one byte (two for `::`).
    Other,
}

/// One token: its kind and its byte range `start..end` in the input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tok {
    pub kind: TokKind,
    pub start: usize,
    pub end: usize,
}

impl Tok {
    /// The bytes of this token in `sql` (the input it came from).
    pub fn text<'a>(&self, sql: &'a [u8]) -> &'a [u8] {
        &sql[self.start..self.end]
    }
}

/// Session settings that change how literals are lexed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LexOptions {
    /// The server's `standard_conforming_strings` (reported in ParameterStatus). When `false`,
    /// backslashes escape inside every `'..'` literal, not only `E'..'`.
    pub standard_conforming_strings: bool,
}

impl Default for LexOptions {
    fn default() -> Self {
        LexOptions {
            standard_conforming_strings: true,
        }
    }
}

/// An iterator over the top-level tokens of some SQL.
#[derive(Debug, Clone)]
pub struct Lexer<'a> {
    sql: &'a [u8],
    pos: usize,
    options: LexOptions,
}

impl<'a> Lexer<'a> {
    /// Lexes with the default [`LexOptions`].
    pub fn new(sql: &'a [u8]) -> Self {
        Self::with_options(sql, LexOptions::default())
    }

    /// Lexes with explicit session settings.
    pub fn with_options(sql: &'a [u8], options: LexOptions) -> Self {
        Lexer {
            sql,
            pos: 0,
            options,
        }
    }

    fn peek(&self, offset: usize) -> Option<u8> {
        self.sql.get(self.pos + offset).copied()
    }

    fn starts_with(&self, prefix: &[u8]) -> bool {
        self.sql[self.pos..].starts_with(prefix)
    }

    /// Scans the token starting at `self.pos` (not white space) and returns its kind.
    fn scan(&mut self) -> TokKind {
        let b = self.sql[self.pos];
        match b {
            b'-' if self.peek(1) == Some(b'-') => self.line_comment(),
            b'/' if self.peek(1) == Some(b'*') => self.block_comment(),
            b'\'' => {
                self.pos += 1;
                self.quoted(b'\'', !self.options.standard_conforming_strings);
                TokKind::String
            }
            b'"' => {
                self.pos += 1;
                self.quoted(b'"', false);
                TokKind::QuotedIdent
            }
            b'$' => self.dollar(),
            b';' => self.one(TokKind::Semicolon),
            b'(' => self.one(TokKind::LParen),
            b')' => self.one(TokKind::RParen),
            b':' if self.peek(1) == Some(b':') => {
                self.pos += 2;
                TokKind::Other
            }
            b'0'..=b'9' => self.number(),
            b'.' if self.peek(1).is_some_and(|c| c.is_ascii_digit()) => self.number(),
            _ if is_ident_start(b) => self.ident_or_prefixed_literal(),
            _ if is_op_char(b) => self.operator(),
            _ => self.one(TokKind::Other),
        }
    }

    fn one(&mut self, kind: TokKind) -> TokKind {
        self.pos += 1;
        kind
    }

    // Comments, dollar quotes and operators are scanned out of line (`#[inline(never)]`):
    // inlined, they made `next` save and restore more registers for every token. Callgrind,
    // 2,000 x pgbench's TPC-B statements: -3.7% instructions for `analyze`.
    #[inline(never)]
    fn line_comment(&mut self) -> TokKind {
        self.pos = memchr2(b'\n', b'\r', self.sql, self.pos).unwrap_or(self.sql.len());
        TokKind::Comment { block: false }
    }

    #[inline(never)]
    fn block_comment(&mut self) -> TokKind {
        self.pos += 2;
        let mut depth = 1usize;
        while self.pos < self.sql.len() {
            if self.starts_with(b"/*") {
                depth += 1;
                self.pos += 2;
            } else if self.starts_with(b"*/") {
                self.pos += 2;
                depth -= 1;
                if depth == 0 {
                    break;
                }
            } else {
                self.pos += 1;
            }
        }
        TokKind::Comment { block: true }
    }

    /// Scans to just past the closing `quote` (doubled quotes stay inside); `self.pos` is just
    /// after the opening one. A string literal goes on after white space with a newline and
    /// another `'` (see [`continuation`]), in the same mode (`E'a'` then `'\'x'` on the next
    /// line is one literal, `a'x`).
    fn quoted(&mut self, quote: u8, backslash_escapes: bool) {
        let sql = self.sql;
        let mut i = self.pos;
        while i < sql.len() {
            let b = sql[i];
            if b == quote {
                if sql.get(i + 1) == Some(&quote) {
                    i += 2;
                    continue;
                }
                if quote == b'\'' {
                    if let Some(next) = continuation(sql, i + 1) {
                        i = next;
                        continue;
                    }
                }
                self.pos = i + 1;
                return;
            }
            i += if b == b'\\' && backslash_escapes {
                2
            } else {
                1
            };
        }
        self.pos = sql.len();
    }

    /// `$1`, `$tag$...$tag$`, `$$...$$`, or a lone `$`.
    #[inline(never)]
    fn dollar(&mut self) -> TokKind {
        let sql = self.sql;
        let start = self.pos;
        let mut i = start + 1;
        if sql.get(i).is_some_and(u8::is_ascii_digit) {
            while sql.get(i).is_some_and(u8::is_ascii_digit) {
                i += 1;
            }
            self.pos = i;
            return TokKind::Param;
        }
        if sql.get(i).is_some_and(|&b| is_ident_start(b)) {
            while sql.get(i).is_some_and(|&b| is_dollar_tag_cont(b)) {
                i += 1;
            }
        }
        if sql.get(i) != Some(&b'$') {
            // Not a dollar quote (`$abc` without a closing `$`): PostgreSQL returns the `$`
            // alone and lexes the rest again.
            self.pos = start + 1;
            return TokKind::Other;
        }
        let delimiter = &sql[start..=i];
        let body = i + 1;
        self.pos = match find(&sql[body..], delimiter) {
            Some(at) => body + at + delimiter.len(),
            None => sql.len(),
        };
        TokKind::String
    }

    /// A numeric literal. Letters after it are left for the next token, as PostgreSQL before
    /// 15 did (`SELECT 1into t` is `SELECT 1 INTO t` there, and an error since).
    fn number(&mut self) -> TokKind {
        let sql = self.sql;
        let digit_at = |i: usize| sql.get(i).is_some_and(u8::is_ascii_digit);
        let mut i = self.pos;
        if sql[i] == b'0'
            && matches!(
                sql.get(i + 1),
                Some(b'x' | b'X' | b'o' | b'O' | b'b' | b'B')
            )
        {
            // 0x1F, 0o17, 0b101 (PostgreSQL 16).
            i += 2;
            while sql
                .get(i)
                .is_some_and(|&b| b.is_ascii_alphanumeric() || b == b'_')
            {
                i += 1;
            }
            self.pos = i;
            return TokKind::Number;
        }
        let digits = |mut i: usize| {
            while digit_at(i) || (sql.get(i) == Some(&b'_') && digit_at(i + 1)) {
                i += 1;
            }
            i
        };
        i = digits(i);
        if sql.get(i) == Some(&b'.') && sql.get(i + 1) != Some(&b'.') {
            i = digits(i + 1);
        }
        if matches!(sql.get(i), Some(b'e' | b'E')) {
            if digit_at(i + 1) {
                i = digits(i + 1);
            } else if matches!(sql.get(i + 1), Some(b'+' | b'-')) && digit_at(i + 2) {
                i = digits(i + 2);
            }
        }
        self.pos = i;
        TokKind::Number
    }

    fn ident_or_prefixed_literal(&mut self) -> TokKind {
        let b = self.sql[self.pos];
        // Most identifiers: no quote or `&` after their first letter.
        if !matches!(self.peek(1), Some(b'\'' | b'&')) {
            return self.ident_from(self.pos + 1);
        }
        match (b.to_ascii_lowercase(), self.peek(1), self.peek(2)) {
            (b'e', Some(b'\''), _) => {
                self.pos += 2;
                self.quoted(b'\'', true);
                return TokKind::String;
            }
            (b'n', Some(b'\''), _) => {
                self.pos += 2;
                self.quoted(b'\'', !self.options.standard_conforming_strings);
                return TokKind::String;
            }
            (b'b' | b'x', Some(b'\''), _) => {
                // No doubled quotes inside, but continuation lines as for any literal.
                let mut from = self.pos + 2;
                self.pos = loop {
                    let Some(close) = memchr(b'\'', self.sql, from) else {
                        break self.sql.len();
                    };
                    match continuation(self.sql, close + 1) {
                        Some(next) => from = next,
                        None => break close + 1,
                    }
                };
                return TokKind::String;
            }
            (b'u', Some(b'&'), Some(b'\'')) => {
                self.pos += 3;
                self.quoted(b'\'', false);
                return TokKind::String;
            }
            (b'u', Some(b'&'), Some(b'"')) => {
                self.pos += 3;
                self.quoted(b'"', false);
                return TokKind::QuotedIdent;
            }
            _ => {}
        }
        self.ident_from(self.pos + 1)
    }

    /// An identifier whose bytes up to `from` were scanned.
    fn ident_from(&mut self, from: usize) -> TokKind {
        let sql = self.sql;
        let mut i = from;
        while i < sql.len() && is_ident_cont(sql[i]) {
            i += 1;
        }
        self.pos = i;
        TokKind::Ident
    }

    #[inline(never)]
    fn operator(&mut self) -> TokKind {
        self.pos += 1;
        while let Some(b) = self.peek(0) {
            if !is_op_char(b) || self.starts_with(b"--") || self.starts_with(b"/*") {
                break;
            }
            self.pos += 1;
        }
        TokKind::Op
    }
}

impl<'a> Lexer<'a> {
    /// Skips what can only lex as plain tokens (identifiers, keywords, numbers, operators,
    /// punctuation, white space), up to the first byte that may begin anything else: a quote,
    /// `$`, `;`, a parenthesis, `--` or `/*`. For a caller that only needs to know where a
    /// statement ends and what its comments say: the plain tokens are not made. The words
    /// the classifier looks for in them (`fencing`, `set_config`) end in `g`, so `at_g`
    /// sees the text skipped up to each `g` or `G`, that letter included.
    ///
    /// A quote or `$` right after identifier bytes may belong to them (`E'..'`, `U&".."`,
    /// `a$b`), and where a number ends depends on what came before it (`1e-5e'..'` is a
    /// number, an identifier `e5e` and a plain string). So the lexer then goes on from the
    /// last place a token surely begins: where skipping began, or after white space or a comma.
    ///
    /// Returns the end of the last byte skipped that is not white space, if any was.
    ///
    /// One table load and test per byte: where white space and commas were is only looked
    /// for when it matters, backwards from where skipping stopped.
    #[inline(never)]
    pub fn skip_plain(&mut self, mut at_g: impl FnMut(&'a [u8])) -> Option<usize> {
        let sql = self.sql;
        let start = self.pos;
        let mut i = start;
        loop {
            let Some(n) = sql[i..]
                .iter()
                .position(|&b| CLASSES[usize::from(b)] & LOOK != 0)
            else {
                i = sql.len();
                break;
            };
            i += n;
            let b = sql[i];
            match b {
                b'g' | b'G' => at_g(&sql[start..=i]),
                b'-' | b'/' if !stops(b, sql.get(i + 1).copied()) => {}
                b'\'' | b'"' | b'$' if i > start && CLASSES[usize::from(sql[i - 1])] & RUN != 0 => {
                    // Back to the last place a token surely begins: after the last white
                    // space or comma (identifier bytes are neither).
                    return match sql[start..i]
                        .iter()
                        .rposition(|&b| b == b',' || is_space(b))
                        .map(|k| start + k)
                    {
                        Some(comma) if sql[comma] == b',' => {
                            self.pos = comma + 1;
                            Some(comma + 1)
                        }
                        Some(space) => {
                            self.pos = space + 1;
                            last_not_space(sql, start, space)
                        }
                        None => {
                            self.pos = start;
                            None
                        }
                    };
                }
                _ => break,
            }
            i += 1;
        }
        self.pos = i;
        last_not_space(sql, start, i)
    }
}

/// The end of the last byte of `sql[start..end]` that is not white space, if any is.
fn last_not_space(sql: &[u8], start: usize, end: usize) -> Option<usize> {
    sql[start..end]
        .iter()
        .rposition(|&b| !is_space(b))
        .map(|k| start + k + 1)
}

/// Whether `b` (followed by `next`) may begin a token that is not plain (see
/// [`Lexer::skip_plain`]).
#[inline]
fn stops(b: u8, next: Option<u8>) -> bool {
    CLASSES[usize::from(b)] & STOP != 0
        || (b == b'-' && next == Some(b'-'))
        || (b == b'/' && next == Some(b'*'))
}

impl Iterator for Lexer<'_> {
    type Item = Tok;

    #[inline]
    fn next(&mut self) -> Option<Tok> {
        while self.sql.get(self.pos).is_some_and(|&b| is_space(b)) {
            self.pos += 1;
        }
        if self.pos >= self.sql.len() {
            return None;
        }
        let start = self.pos;
        let kind = self.scan();
        debug_assert!(self.pos > start && self.pos <= self.sql.len());
        Some(Tok {
            kind,
            start,
            end: self.pos,
        })
    }
}

impl std::iter::FusedIterator for Lexer<'_> {}

/// Byte classes, looked up in [`CLASSES`] (one table load instead of a chain of compares).
const SPACE: u8 = 1;
const IDENT_START: u8 = 2;
const IDENT_CONT: u8 = 4;
const TAG_CONT: u8 = 8;
const OP: u8 = 16;
/// Identifier bytes but `$`, and `&` (of `U&'..'`): see [`Lexer::skip_plain`].
const RUN: u8 = 32;
/// Bytes that begin a token other than a plain one: see [`Lexer::skip_plain`].
const STOP: u8 = 64;
/// Bytes [`Lexer::skip_plain`] must look at: [`STOP`], the first bytes of `--` and `/*`, and
/// the `g` that ends the words it reports.
const LOOK: u8 = 128;

const CLASSES: [u8; 256] = {
    let mut table = [0u8; 256];
    let mut b = 0;
    while b < 256 {
        let c = b as u8;
        let mut class = 0;
        // PostgreSQL's white space: space, \t, \n, \r, \f, \v.
        if matches!(c, b' ' | b'\t' | b'\n' | b'\r' | b'\x0b' | b'\x0c') {
            class |= SPACE;
        }
        // Identifiers start with a letter, `_` or any byte >= 0x80, and go on with digits
        // and `$` too; dollar-quote tags go on with digits but not `$`.
        if c.is_ascii_alphabetic() || c == b'_' || c >= 0x80 {
            class |= IDENT_START | IDENT_CONT | TAG_CONT;
        }
        if c.is_ascii_digit() {
            class |= IDENT_CONT | TAG_CONT;
        }
        if c == b'$' {
            class |= IDENT_CONT;
        }
        if (c.is_ascii_alphanumeric() || c == b'_' || c >= 0x80) || c == b'&' {
            class |= RUN;
        }
        if matches!(c, b'\'' | b'"' | b'$' | b';' | b'(' | b')') {
            class |= STOP | LOOK;
        }
        if matches!(c, b'-' | b'/' | b'g' | b'G') {
            class |= LOOK;
        }
        if matches!(
            c,
            b'+' | b'-'
                | b'*'
                | b'/'
                | b'<'
                | b'>'
                | b'='
                | b'~'
                | b'!'
                | b'@'
                | b'#'
                | b'%'
                | b'^'
                | b'&'
                | b'|'
                | b'`'
                | b'?'
        ) {
            class |= OP;
        }
        table[b] = class;
        b += 1;
    }
    table
};

/// Where a string literal that closed just before `at` goes on: past white space that holds
/// a newline (and any `--` comments) and the `'` after it, as PostgreSQL's scanner reads
/// `'a'` newline `'b'` as `'ab'` (its `quotecontinue`, which keeps the first part's mode:
/// backslash escapes go on after `E'...'`). `None` if the literal ends at `at`.
fn continuation(sql: &[u8], at: usize) -> Option<usize> {
    let mut i = at;
    let mut newline = false;
    while i < sql.len() {
        match sql[i] {
            b'\n' | b'\r' => newline = true,
            // `\x0b` too: PostgreSQL 16 counts it as white space (15 rejects it, so the
            // statement does not run at all).
            b' ' | b'\t' | b'\x0c' | b'\x0b' => {}
            b'-' if sql.get(i + 1) == Some(&b'-') => {
                i = memchr2(b'\n', b'\r', sql, i).unwrap_or(sql.len());
                continue;
            }
            b'\'' if newline => return Some(i + 1),
            _ => return None,
        }
        i += 1;
    }
    None
}

fn is_space(b: u8) -> bool {
    CLASSES[usize::from(b)] & SPACE != 0
}

fn is_ident_start(b: u8) -> bool {
    CLASSES[usize::from(b)] & IDENT_START != 0
}

fn is_ident_cont(b: u8) -> bool {
    CLASSES[usize::from(b)] & IDENT_CONT != 0
}

fn is_dollar_tag_cont(b: u8) -> bool {
    CLASSES[usize::from(b)] & TAG_CONT != 0
}

fn is_op_char(b: u8) -> bool {
    CLASSES[usize::from(b)] & OP != 0
}

/// Whether `text` is the keyword `keyword` (given in lower case), ignoring ASCII case as
/// PostgreSQL does for keywords.
pub fn is_keyword(text: &[u8], keyword: &str) -> bool {
    text.eq_ignore_ascii_case(keyword.as_bytes())
}

/// Whether `haystack` contains `needle` (given in lower case), ignoring ASCII case.
pub fn contains_ignore_ascii_case(haystack: &[u8], needle: &[u8]) -> bool {
    let Some((&first, rest)) = needle.split_first() else {
        return true;
    };
    let upper = first.to_ascii_uppercase();
    let mut from = 0;
    while let Some(i) = memchr2(first, upper, haystack, from) {
        let tail = &haystack[i + 1..];
        if tail.len() >= rest.len() && tail[..rest.len()].eq_ignore_ascii_case(rest) {
            return true;
        }
        from = i + 1;
    }
    false
}

/// Position of `needle` in `haystack` (exact bytes).
pub fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    let (&first, rest) = needle.split_first()?;
    let mut from = 0;
    while let Some(i) = memchr(first, haystack, from) {
        if haystack[i + 1..].starts_with(rest) {
            return Some(i);
        }
        from = i + 1;
    }
    None
}

fn memchr(needle: u8, haystack: &[u8], from: usize) -> Option<usize> {
    haystack
        .get(from..)?
        .iter()
        .position(|&b| b == needle)
        .map(|i| from + i)
}

fn memchr2(a: u8, b: u8, haystack: &[u8], from: usize) -> Option<usize> {
    haystack
        .get(from..)?
        .iter()
        .position(|&c| c == a || c == b)
        .map(|i| from + i)
}

#[cfg(test)]
mod tests;
