//! The per-statement state of [`analyze`](super::analyze): the token-by-token facts, the
//! call detection, and the classification by a statement's first words.

use super::{words, Statement, StatementKind};
use crate::lexer::{is_keyword, Tok, TokKind};

/// How many top-level words of a statement are kept for classifying it by its head.
const MAX_WORDS: usize = 6;

/// The longest word compared with the word lists; longer words match none of them.
pub(super) const MAX_WORD_LEN: usize = 32;

/// The longest word that sets a fact a query's kind depends on (`insert`, `delete`,
/// `update`; see [`Scan::feed_query`]).
const QUERY_WORD_LEN: usize = 6;

/// Facts about a statement's text, gathered token by token; each is independent.
#[derive(Debug, Clone, Copy, Default)]
struct Seen {
    /// A call to a function that is not on the allowlist.
    call: bool,
    /// A function in a `SELECT`'s `FROM` clause (see [`Scan::note_clause`]).
    from_function: bool,
    /// A qualified name, `a.b` (a column, or attribute notation's call `f(a)`).
    qualified: bool,
    into: bool,
    /// `INSERT`, `UPDATE`, `DELETE` or `MERGE`.
    dml: bool,
    /// `FOR SHARE`, `FOR KEY SHARE`, `FOR NO KEY UPDATE` (`FOR UPDATE` counts as `UPDATE`).
    lock: bool,
    analyze: bool,
    concurrently: bool,
    tablespace: bool,
    publication: bool,
    /// `TO STDOUT` outside parentheses (`COPY ... TO STDOUT`).
    to_stdout: bool,
    /// `FROM` outside parentheses (`COPY ... FROM`).
    top_from: bool,
    /// `WITH HOLD` outside parentheses (`DECLARE name CURSOR WITH HOLD`; a `WITH` query
    /// named `hold` sets it too, which only keeps pgfence's check).
    with_hold: bool,
}

/// One bit per parenthesis depth below 64 (deeper counts as every bit set).
#[derive(Debug, Clone, Copy, Default)]
struct Depths(u64);

impl Depths {
    fn set(&mut self, depth: u32) {
        if depth < 64 {
            self.0 |= 1 << depth;
        }
    }

    fn clear(&mut self, depth: u32) {
        if depth < 64 {
            self.0 &= !(1 << depth);
        }
    }

    fn has(self, depth: u32) -> bool {
        depth >= 64 || self.0 & (1 << depth) != 0
    }

    /// Forgets the depths deeper than `depth` (their parentheses closed).
    fn close_above(&mut self, depth: u32) {
        if depth < 63 {
            self.0 &= (1 << (depth + 1)) - 1;
        }
    }
}

/// Deciding whether `name(...)` was a call or the column list of a `WITH` query:
/// `name(a, b) AS [[NOT] MATERIALIZED] (`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum MaybeColumns {
    No,
    /// Inside the parentheses, which opened at this depth.
    List {
        depth: u32,
    },
    AfterList,
    AfterAs,
    AfterNot,
    AfterMaterialized,
    /// After `AS [[NOT] MATERIALIZED] (`: a `WITH` query's body starts with a query, a
    /// function's column definition list (`, f() AS (a int)` in `FROM`) does not.
    AfterOpen,
}

/// The state of one statement while its tokens go by.
pub(super) struct Scan<'a> {
    sql: &'a [u8],
    /// Range of the tokens seen, comments included.
    span: Option<(usize, usize)>,
    /// First directive index of this segment.
    pub(super) directives_from: usize,
    /// The first top-level words; a parenthesised group counts as one word `(`.
    words: [Tok; MAX_WORDS],
    n_words: usize,
    /// Non-comment tokens so far.
    n_tokens: usize,
    depth: u32,
    /// Nesting of `BEGIN ATOMIC` (and `CASE` inside it) in a routine body.
    atomic_depth: u32,
    /// The last three non-comment tokens, a ring: the latest at `prev_at`, the one before at
    /// `prev_at - 1` (mod 4). Cheaper than shifting three tokens along at every token.
    prev: [Option<Tok>; 4],
    prev_at: usize,
    seen: Seen,
    columns: MaybeColumns,
    /// Depths with a `SELECT`, and those inside its `FROM` clause (until a `WHERE`,
    /// `GROUP`, ... at that depth): a call there is a function in `FROM` (see
    /// [`Self::note_lparen`]).
    selects: Depths,
    from_clauses: Depths,
    /// The first word alone decides the kind (see [`head_decides`]): the rest of the
    /// statement is only followed for where it ends.
    head_decides: bool,
    /// A query (`SELECT`, `VALUES`, `TABLE`, `WITH`, `DECLARE`, `(`): its kind follows from
    /// [`Seen`] alone, not from its words after the first (see [`Self::feed_query`]).
    query: bool,
    /// Its first word, if one of those that may make [`Statement::block_sensitive`].
    block_head: BlockHead,
}

/// First words whose statements may fail or warn outside a transaction block, and
/// `PREPARE` (see [`Scan::prepares_in_sql`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BlockHead {
    Other,
    Lock,
    Declare,
    Set,
    Discard,
    Prepare,
}

const NO_TOK: Tok = Tok {
    kind: TokKind::Other,
    start: 0,
    end: 0,
};

impl<'a> Scan<'a> {
    pub(super) fn new(sql: &'a [u8], directives_from: usize) -> Self {
        Scan {
            sql,
            span: None,
            directives_from,
            words: [NO_TOK; MAX_WORDS],
            n_words: 0,
            n_tokens: 0,
            depth: 0,
            atomic_depth: 0,
            prev: [None; 4],
            prev_at: 0,
            seen: Seen::default(),
            columns: MaybeColumns::No,
            selects: Depths::default(),
            from_clauses: Depths::default(),
            head_decides: false,
            query: false,
            block_head: BlockHead::Other,
        }
    }

    /// Ready for the next segment, keeping the buffers (cheaper than a new `Scan`).
    pub(super) fn reset(&mut self, directives_from: usize) {
        self.span = None;
        self.directives_from = directives_from;
        self.n_words = 0;
        self.n_tokens = 0;
        self.depth = 0;
        self.atomic_depth = 0;
        self.prev = [None; 4];
        self.seen = Seen::default();
        self.columns = MaybeColumns::No;
        self.selects = Depths::default();
        self.from_clauses = Depths::default();
        self.head_decides = false;
        self.query = false;
        self.block_head = BlockHead::Other;
    }

    /// The first top-level words recorded.
    fn words(&self) -> &[Tok] {
        &self.words[..self.n_words.min(MAX_WORDS)]
    }

    /// Whether the statement is inside a `BEGIN ATOMIC` body (see
    /// [`super::Analysis::body_in_doubt`]).
    pub(super) fn in_atomic_body(&self) -> bool {
        self.atomic_depth > 0
    }

    /// After `AS` or `.`, a word is a name or label, never a keyword.
    fn after_label_lead(&self) -> bool {
        self.prev_is_byte(0, b".") || self.prev_is_keyword(0, "as")
    }

    pub(super) fn at_top_level(&self) -> bool {
        self.depth == 0 && self.atomic_depth == 0
    }

    /// Whether the first word alone decided the kind (see [`head_decides`]).
    pub(super) fn head_decides(&self) -> bool {
        self.head_decides
    }

    /// Whether the statement is a query (see [`Self::feed_query`]).
    pub(super) fn is_query(&self) -> bool {
        self.query
    }

    /// Extends the statement to `end` (past plain tokens that were skipped).
    pub(super) fn extend_to(&mut self, end: usize) {
        if let Some((_, e)) = &mut self.span {
            *e = end;
        }
    }

    pub(super) fn extend(&mut self, tok: Tok) {
        self.span = Some(match self.span {
            None => (tok.start, tok.end),
            Some((start, _)) => (start, tok.end),
        });
    }

    fn text(&self, tok: Tok) -> &'a [u8] {
        tok.text(self.sql)
    }

    fn word(&self, i: usize) -> &'a [u8] {
        self.words().get(i).map_or(b"", |&t| self.text(t))
    }

    fn word_is(&self, i: usize, keyword: &str) -> bool {
        is_keyword(self.word(i), keyword)
    }

    #[inline]
    pub(super) fn feed(&mut self, tok: Tok) {
        self.extend(tok);
        if self.head_decides {
            // Only where the statement ends matters now: parentheses hide a `;`.
            match tok.kind {
                TokKind::LParen => self.depth += 1,
                TokKind::RParen => self.depth = self.depth.saturating_sub(1),
                _ => {}
            }
            self.n_tokens += 1;
        } else {
            self.feed_words(tok);
        }
    }

    /// [`Self::feed`] while the words matter.
    #[inline]
    fn feed_words(&mut self, tok: Tok) {
        let mut buf = [0u8; MAX_WORD_LEN];
        let lower = match tok.kind {
            TokKind::Ident => lower(self.text(tok), &mut buf),
            _ => &[],
        };
        if self.n_tokens == 0 {
            self.block_head = match lower {
                b"lock" => BlockHead::Lock,
                b"declare" => BlockHead::Declare,
                b"set" => BlockHead::Set,
                b"discard" => BlockHead::Discard,
                b"prepare" => BlockHead::Prepare,
                _ => BlockHead::Other,
            };
        }
        if self.n_tokens == 0 && tok.kind == TokKind::Ident && head_decides(lower) {
            self.head_decides = true;
            self.words[0] = tok;
            self.n_words = 1;
            self.n_tokens = 1;
            return;
        }
        if self.n_tokens == 0 {
            self.query = match tok.kind {
                TokKind::LParen => true,
                TokKind::Ident => matches!(
                    lower,
                    b"select" | b"values" | b"table" | b"with" | b"declare"
                ),
                _ => false,
            };
        }
        self.note(tok, lower);
        if self.depth == 0 && tok.kind != TokKind::RParen {
            if self.n_words < MAX_WORDS {
                self.words[self.n_words] = tok;
            }
            self.n_words += 1;
        }
        self.advance(tok);
    }

    /// [`Self::feed`] after the first token of a query, whose kind only [`Seen::call`],
    /// [`Seen::into`], [`Seen::dml`] and [`Seen::lock`] decide: the words after the first
    /// are not kept, and a word is only compared with the word lists when it is short
    /// enough to be one that sets those facts (or while a `WITH` column list is pending).
    #[inline]
    pub(super) fn feed_query(&mut self, tok: Tok) {
        self.extend(tok);
        let mut buf = [0u8; MAX_WORD_LEN];
        let lower = match tok.kind {
            TokKind::Ident
                if tok.end - tok.start <= QUERY_WORD_LEN || self.columns != MaybeColumns::No =>
            {
                lower(self.text(tok), &mut buf)
            }
            _ => &[],
        };
        self.note(tok, lower);
        self.advance(tok);
    }

    /// The facts `tok` carries (`lower`: its text in lower case, if it is a word that
    /// matters) and the `WITH` column-list decision.
    #[inline]
    fn note(&mut self, tok: Tok, lower: &[u8]) {
        self.advance_columns(tok, lower);
        match tok.kind {
            TokKind::Ident => {
                if self.prev_is_byte(0, b".") {
                    self.note_qualified();
                } else {
                    self.note_clause(tok, lower);
                }
                self.note_word(lower);
            }
            TokKind::QuotedIdent if self.prev_is_byte(0, b".") => self.note_qualified(),
            TokKind::LParen => self.note_lparen(),
            _ => {}
        }
    }

    /// A name after a `.`. After `).`, `].` or `$1.` it selects a field, or calls a
    /// function of one argument of any type: `(1).f` is `f(1)` (PostgreSQL's attribute
    /// notation). After a name, it is a column or a call on a whole row (`t.f` is `f(t)`);
    /// or on a scalar, where `t` names a function in `FROM` (see [`Self::note_clause`]).
    /// The read audit leaves these calls to the classifier, but for functions that can take
    /// a relation's whole row.
    #[cold]
    fn note_qualified(&mut self) {
        match self.prev(1).map(|t| t.kind) {
            Some(TokKind::RParen | TokKind::Param) => self.seen.call = true,
            // `U&"g" UESCAPE '!'.f`: a name, whatever it is.
            Some(TokKind::String) if self.prev_is_keyword(2, "uescape") => self.seen.call = true,
            Some(TokKind::Other) if self.prev_is_byte(1, b"]") => self.seen.call = true,
            Some(TokKind::Ident | TokKind::QuotedIdent) => self.seen.qualified = true,
            _ => {}
        }
    }

    /// Follows the `FROM` clauses of `SELECT`s. A function in `FROM` that returns a scalar
    /// makes its alias that scalar (`FROM generate_series(1, 2) AS g`), so `g.f` calls
    /// `f(integer)`: attribute notation again. A statement with both a function in `FROM`
    /// and a qualified name is taken to call a function.
    #[inline]
    fn note_clause(&mut self, tok: Tok, w: &[u8]) {
        let value_function = self.from_clauses.has(self.depth) && is_value_function(self.text(tok));
        if !value_function && !is_clause_word(w) {
            return;
        }
        // `AS where`: a label (after a `.`, [`Self::note_qualified`] has it). (The words
        // below are reserved, but `values`: nothing else.) `t.as where` is no label.
        if self.prev_is_word(0, "as") {
            return;
        }
        if value_function {
            // `FROM current_date AS g`: a function without parentheses.
            self.seen.from_function = true;
        }
        match w {
            b"select" => {
                self.selects.set(self.depth);
                self.from_clauses.clear(self.depth);
            }
            // `FROM (VALUES (1), (2)) AS v(a)`: rows of expressions, not of `FROM` items
            // (but `FROM t values, f() g`: an alias).
            b"values" if self.prev(0).is_some_and(|t| t.kind == TokKind::LParen) => {
                self.from_clauses.clear(self.depth);
            }
            // `ROWS FROM (f(), g())`: functions in `FROM`, inside parentheses of their own.
            b"from" if self.prev_is_keyword(0, "rows") => self.seen.from_function = true,
            // Not `extract(x FROM y)`, `substring(x FROM 2)` (no `SELECT` at their depth),
            // nor `a IS [NOT] DISTINCT FROM b` (but `1 AS distinct FROM`).
            b"from"
                if self.selects.has(self.depth)
                    && !(self.prev_is_keyword(0, "distinct")
                        && (self.prev_is_word(1, "is") || self.prev_is_word(1, "not"))) =>
            {
                self.from_clauses.set(self.depth);
            }
            b"where" | b"group" | b"having" | b"window" | b"order" | b"limit" | b"offset"
            | b"fetch" | b"for" | b"union" | b"except" => self.from_clauses.clear(self.depth),
            _ => {}
        }
    }

    /// Moves past `tok`: the nesting, the end of a `WITH` column list, the last tokens.
    #[inline]
    fn advance(&mut self, tok: Tok) {
        match tok.kind {
            TokKind::LParen => self.depth += 1,
            TokKind::RParen => {
                self.depth = self.depth.saturating_sub(1);
                self.selects.close_above(self.depth);
                self.from_clauses.close_above(self.depth);
                if self.columns == (MaybeColumns::List { depth: self.depth }) {
                    self.columns = MaybeColumns::AfterList;
                }
            }
            _ => {}
        }
        self.prev_at = (self.prev_at + 1) % 4;
        self.prev[self.prev_at] = Some(tok);
        self.n_tokens += 1;
    }

    /// Facts carried by a word anywhere in the statement.
    fn note_word(&mut self, w: &[u8]) {
        match w {
            b"into" => self.seen.into = true,
            b"insert" | b"delete" | b"merge" => self.seen.dml = true,
            // `UPDATE` also ends `FOR UPDATE` and `FOR NO KEY UPDATE`.
            b"update" => self.seen.dml = true,
            b"share" | b"key" | b"no" if self.prev_is_keyword(0, "for") => self.seen.lock = true,
            b"analyze" | b"analyse" => self.seen.analyze = true,
            b"concurrently" => self.seen.concurrently = true,
            b"tablespace" => self.seen.tablespace = true,
            b"publication" => self.seen.publication = true,
            b"stdout" if self.depth == 0 && self.prev_is_keyword(0, "to") => {
                self.seen.to_stdout = true;
            }
            b"from" if self.depth == 0 => self.seen.top_from = true,
            b"hold"
                if self.block_head == BlockHead::Declare
                    && self.depth == 0
                    && self.prev_is_keyword(0, "with") =>
            {
                self.seen.with_hold = true;
            }
            b"atomic"
                if self.depth == 0
                    && self.prev_is_keyword(0, "begin")
                    && self.is_create_routine() =>
            {
                self.atomic_depth += 1;
            }
            // Not a label (`AS case`, `t.end`); a bare label (`SELECT 1 case`) still counts,
            // and leaves the body open at the end: `Analysis::body_in_doubt`.
            b"case" if self.depth == 0 && self.atomic_depth > 0 && !self.after_label_lead() => {
                self.atomic_depth += 1;
            }
            b"end" if self.depth == 0 && self.atomic_depth > 0 && !self.after_label_lead() => {
                self.atomic_depth -= 1;
            }
            _ => {}
        }
    }

    /// The `i`-th latest non-comment token (0: the latest), for `i` < 3.
    fn prev(&self, i: usize) -> Option<Tok> {
        debug_assert!(i < 3);
        self.prev[(self.prev_at + 4 - i) % 4]
    }

    fn prev_is_keyword(&self, i: usize, keyword: &str) -> bool {
        self.prev(i)
            .is_some_and(|t| t.kind == TokKind::Ident && is_keyword(self.text(t), keyword))
    }

    /// `prev(i)` is `keyword`, and not a name after a `.` (`t.as`), for `i` < 2.
    fn prev_is_word(&self, i: usize, keyword: &str) -> bool {
        self.prev_is_keyword(i, keyword) && !self.prev_is_byte(i + 1, b".")
    }

    fn prev_is_byte(&self, i: usize, text: &[u8]) -> bool {
        self.prev(i)
            .is_some_and(|t| t.kind == TokKind::Other && self.text(t) == text)
    }

    /// `CREATE [OR REPLACE] FUNCTION|PROCEDURE`, whose `BEGIN ATOMIC` body holds `;`.
    fn is_create_routine(&self) -> bool {
        let routine = |i| self.word_is(i, "function") || self.word_is(i, "procedure");
        self.word_is(0, "create")
            && (routine(1) || (self.word_is(1, "or") && self.word_is(2, "replace") && routine(3)))
    }

    /// A `(`: decides whether the token before it makes a function call.
    fn note_lparen(&mut self) {
        let Some(name) = self.prev(0) else {
            return;
        };
        // A statement never starts with a call: `EXPLAIN (`, `VACUUM (`, `VALUES (`.
        // `PREPARE name(int, text) AS` declares parameter types.
        if self.n_tokens == 1 || (self.n_tokens == 2 && self.word_is(0, "prepare")) {
            return;
        }
        // Outside its query, `COPY` has parentheses only around columns and options, and
        // inside its options only around column lists (`FORCE_QUOTE (a)`). Its query is
        // the group at its second word; while inside it, the words are `COPY (`.
        if self.word_is(0, "copy") {
            let in_query =
                self.depth > 0 && self.n_words == 2 && self.words[1].kind == TokKind::LParen;
            if !in_query {
                return;
            }
        }
        if self.from_clauses.has(self.depth) {
            self.note_from_lparen(name);
        }
        let call = match name.kind {
            TokKind::Ident => self.ident_call(name),
            TokKind::QuotedIdent => self.quoted_call(name),
            // `U&"f" UESCAPE '!'(1)`: PostgreSQL's name `f` (the lexer leaves the escape
            // clause apart from the name).
            TokKind::String if self.prev_is_keyword(1, "uescape") => Call::Unknown,
            _ => Call::Grammar,
        };
        match call {
            Call::Grammar | Call::Allowed => {}
            Call::Unknown => self.seen.call = true,
            Call::MaybeColumns => match self.columns {
                MaybeColumns::No => self.columns = MaybeColumns::List { depth: self.depth },
                _ => self.seen.call = true,
            },
        }
    }

    /// A `(` after `name` in a `FROM` clause (see [`Self::note_clause`]). After a word,
    /// it is a function in `FROM` (any: `coalesce(1)`, `cast(1 AS int)` and `position('a'
    /// IN 'b')` are grammar, not calls, and make a scalar alias too), or a column list
    /// (`t g(a)`) or `TABLESAMPLE` method, which only cost a check; but for the reserved
    /// words that open a subquery, a group of joins, a column list after `AS` or part of an
    /// `ON` condition: the parentheses go on with the clause (until a `SELECT` or `VALUES`
    /// in them starts rows of their own).
    fn note_from_lparen(&mut self, name: Tok) {
        let group = match name.kind {
            TokKind::Ident => {
                let text = self.text(name);
                [
                    "from", "join", "lateral", "using", "as", "on", "and", "or", "not", "in",
                    "any", "all", "some", "exists",
                ]
                .iter()
                .any(|k| is_keyword(text, k))
                    || self.prev_is_keyword(1, "as")
            }
            TokKind::QuotedIdent => self.prev_is_keyword(1, "as"),
            _ => true,
        };
        if group {
            self.from_clauses.set(self.depth + 1);
        } else {
            self.seen.from_function = true;
        }
    }

    fn ident_call(&self, name: Tok) -> Call {
        let mut buf = [0u8; MAX_WORD_LEN];
        let w = lower(self.text(name), &mut buf);
        if let Some(call) = self.qualified_call(words::is_allowed_function(w)) {
            return call;
        }
        if self.prev_is_byte(1, b"::") || self.prev_is_keyword(1, "as") {
            return Call::Grammar; // a type modifier or a column list
        }
        if words::is_reserved(w) || words::is_col_name_keyword(w) {
            return Call::Grammar;
        }
        let mut before_buf = [0u8; MAX_WORD_LEN];
        let before: &[u8] = match self.prev(1) {
            Some(t) if t.kind == TokKind::RParen => b")",
            Some(t) if t.kind == TokKind::Ident => lower(self.text(t), &mut before_buf),
            _ => b"",
        };
        // `GROUP BY ROLLUP(`, `AS NOT MATERIALIZED (`: grammar only there (`ORDER BY
        // rollup(`, `NOT materialized(` call a function).
        let context = match (before, w) {
            (b"by", _) => self.prev_is_keyword(2, "group"),
            (b"not", b"materialized") => self.prev_is_keyword(2, "as"),
            _ => true,
        };
        if context && words::is_grammar_after(before, w) {
            return Call::Grammar;
        }
        // `a LIKE (`, `a NOT LIKE (`, `a JOIN (`, `a LEFT JOIN (`.
        let infix = words::is_infix_keyword(w)
            && (self.follows_operand(1)
                || (before == b"not"
                    && matches!(w, b"like" | b"ilike")
                    && self.follows_operand(2))
                || (w == b"join" && words::is_join_lead(before)));
        if infix {
            return Call::Grammar;
        }
        if words::is_allowed_function(w) {
            return Call::Allowed;
        }
        self.unknown_or_columns()
    }

    fn quoted_call(&self, name: Tok) -> Call {
        let text = self.text(name);
        // `"count"` is count; `U&"..."` and `"a""b"` are never on the list.
        let allowed = text
            .strip_prefix(b"\"")
            .and_then(|t| t.strip_suffix(b"\""))
            .is_some_and(|inner| !inner.contains(&b'"') && words::is_allowed_function(inner));
        if let Some(call) = self.qualified_call(allowed) {
            return call;
        }
        if self.prev_is_byte(1, b"::") || self.prev_is_keyword(1, "as") {
            return Call::Grammar;
        }
        if allowed {
            return Call::Allowed;
        }
        self.unknown_or_columns()
    }

    /// For `qualifier.name(`: allowed only for `pg_catalog` and a listed name.
    fn qualified_call(&self, allowed_name: bool) -> Option<Call> {
        if !self.prev_is_byte(1, b".") {
            return None;
        }
        let pg_catalog = self.prev(2).is_some_and(|q| match q.kind {
            TokKind::Ident => is_keyword(self.text(q), "pg_catalog"),
            TokKind::QuotedIdent => self.text(q) == b"\"pg_catalog\"",
            _ => false,
        });
        Some(if pg_catalog && allowed_name {
            Call::Allowed
        } else {
            Call::Unknown
        })
    }

    /// Whether `prev(i)` ends an operand, so that a keyword after it is infix.
    fn follows_operand(&self, i: usize) -> bool {
        self.prev(i).is_some_and(|t| match t.kind {
            TokKind::Number | TokKind::String | TokKind::Param | TokKind::QuotedIdent => true,
            TokKind::RParen => true,
            TokKind::Other => self.text(t) == b"]",
            TokKind::Ident => {
                let mut buf = [0u8; MAX_WORD_LEN];
                !words::is_reserved(lower(self.text(t), &mut buf))
            }
            _ => false,
        })
    }

    /// After `WITH`, `RECURSIVE` or `,` a `name(` may be a `WITH` query's column list.
    fn unknown_or_columns(&self) -> Call {
        if self.prev_is_keyword(1, "with")
            || self.prev_is_keyword(1, "recursive")
            || self.prev_is_byte(1, b",")
        {
            Call::MaybeColumns
        } else {
            Call::Unknown
        }
    }

    /// Moves the `WITH` column-list decision along; whatever breaks the pattern was a call.
    fn advance_columns(&mut self, tok: Tok, w: &[u8]) {
        use MaybeColumns::*;
        let next = match self.columns {
            No => return,
            List { .. } => match tok.kind {
                TokKind::Ident | TokKind::QuotedIdent | TokKind::RParen => return,
                TokKind::Other if self.text(tok) == b"," => return,
                _ => None,
            },
            AfterList => (w == b"as").then_some(AfterAs),
            AfterAs => match (tok.kind, w) {
                (TokKind::LParen, _) => Some(AfterOpen),
                (_, b"materialized") => Some(AfterMaterialized),
                (_, b"not") => Some(AfterNot),
                _ => None,
            },
            AfterNot => (w == b"materialized").then_some(AfterMaterialized),
            AfterMaterialized => (tok.kind == TokKind::LParen).then_some(AfterOpen),
            AfterOpen => {
                let query = tok.kind == TokKind::LParen
                    || (tok.kind == TokKind::Ident
                        && matches!(
                            w,
                            b"select"
                                | b"values"
                                | b"table"
                                | b"with"
                                | b"insert"
                                | b"update"
                                | b"delete"
                                | b"merge"
                        ));
                query.then_some(No)
            }
        };
        self.columns = next.unwrap_or_else(|| {
            self.seen.call = true;
            No
        });
    }

    /// The statement, or `None` if there was nothing but comments.
    pub(super) fn finish(&mut self, directives_end: usize) -> Option<Statement> {
        let (start, end) = self.span?;
        if self.n_tokens == 0 {
            return None;
        }
        if self.columns != MaybeColumns::No || (self.seen.from_function && self.seen.qualified) {
            self.seen.call = true;
        }
        Some(Statement {
            start,
            end,
            kind: self.kind(),
            directives: self.directives_from..directives_end,
            block_sensitive: self.block_sensitive(),
            prepares_in_sql: self.prepares_in_sql(),
            may_commit_inside: self.word_is(0, "do") || self.word_is(0, "call"),
            commits_at_once: self.commits_at_once(),
            runs_in_block: ["analyze", "analyse", "reindex", "cluster"]
                .iter()
                .any(|w| self.word_is(0, w))
                && !self.seen.concurrently,
            changes_schema: self.changes_schema(),
        })
    }

    /// See [`Statement::changes_schema`]. A statement whose object type is past the words
    /// kept counts.
    fn changes_schema(&self) -> bool {
        if self.word_is(0, "alter") {
            return true;
        }
        if !self.word_is(0, "create") {
            return false;
        }
        let mut i = 1;
        if self.word_is(1, "or") && self.word_is(2, "replace") {
            i = 3;
        }
        const MODIFIERS: [&str; 6] = ["temp", "temporary", "local", "global", "unlogged", "unique"];
        while MODIFIERS.iter().any(|m| self.word_is(i, m)) {
            i += 1;
        }
        if self.word_is(i, "sequence") {
            return false;
        }
        let table = self.word_is(i, "table");
        if !table && !self.word_is(i, "index") {
            return true;
        }
        // A table or index of the session's own may be temporary, which the read audit
        // leaves out: one that may call a function counts (a `CHECK` constraint, an index
        // expression or predicate, a partition key: the planner runs their `IMMUTABLE`
        // functions for a plain `SELECT`; a child of a parent with such a constraint).
        let Some((start, end)) = self.span else {
            return true;
        };
        table_or_index_calls(&self.sql[start..end], table)
    }

    fn kind(&self) -> StatementKind {
        use StatementKind::*;
        if self.head_decides {
            return MayWrite;
        }
        let Some(&head) = self.words().first() else {
            return MayWrite; // starts with `)`
        };
        if head.kind == TokKind::LParen {
            return self.select_rules();
        }
        if head.kind != TokKind::Ident {
            return MayWrite;
        }
        let mut buf = [0u8; MAX_WORD_LEN];
        match lower(self.text(head), &mut buf) {
            b"select" | b"values" | b"table" | b"with" | b"declare" => self.select_rules(),
            b"show" | b"set" | b"reset" | b"listen" | b"unlisten" | b"close" => ReadOnly,
            b"explain" => self.explain(),
            b"prepare" => self.prepare(),
            b"copy" => self.copy(),
            b"begin" => Begin,
            b"start" if self.word_is(1, "transaction") => Begin,
            b"commit" if self.word_is(1, "prepared") => FinishPrepared,
            b"commit" | b"end" => Commit,
            b"rollback" if self.word_is(1, "prepared") => FinishPrepared,
            b"rollback" => {
                let work = self.word_is(1, "work") || self.word_is(1, "transaction");
                if self.word_is(1, "to") || (work && self.word_is(2, "to")) {
                    RollbackToSavepoint
                } else {
                    Rollback
                }
            }
            b"abort" => Rollback,
            b"savepoint" | b"release" => Savepoint,
            b"discard" if self.word_is(1, "all") || self.word_is(1, "plans") => Discard,
            b"deallocate" => Discard,
            // DO is an ordinary statement: when pgfence adds its check after it, a DO that
            // COMMITs inside fails ("invalid transaction termination") instead of committing
            // unfenced writes, so its writes are fenced atomically.
            // `ANALYZE`, `REINDEX` and `CLUSTER` too, in every form: outside a block they
            // commit a transaction per relation where they act on several (a partitioned
            // table, `ANALYZE` of two tables or of all), which the text cannot tell, and with
            // it what the functions of an index expression wrote; a check at the Sync came
            // too late (review I, stop 54: a stale `REINDEX TABLE` of a partitioned table
            // committed the writes of its index expression's function).
            b"vacuum" | b"call" | b"analyze" | b"analyse" | b"reindex" | b"cluster" => {
                NonTransactional
            }
            b"execute" => Execute,
            b"create" | b"drop" => self.create_or_drop(),
            b"alter" => self.alter(),
            // Keep in step with `head_decides`: a word listed here must be listed there.
            _ => MayWrite,
        }
    }

    /// See [`Statement::block_sensitive`].
    fn block_sensitive(&self) -> bool {
        match self.block_head {
            BlockHead::Other | BlockHead::Prepare => false,
            BlockHead::Lock => true,
            BlockHead::Declare => !self.seen.with_hold,
            BlockHead::Set => {
                self.word_is(1, "local")
                    || self.word_is(1, "transaction")
                    || self.word_is(1, "constraints")
            }
            BlockHead::Discard => self.word_is(1, "all"),
        }
    }

    /// See [`Statement::commits_at_once`]: the non-transactional statements that always
    /// refuse a block and run in one transaction (`CREATE`/`DROP DATABASE`, `ALTER DATABASE
    /// ... SET TABLESPACE`, `CREATE`/`DROP TABLESPACE`, `ALTER SYSTEM`), and `DISCARD ALL`.
    /// Not `CALL`, `ANALYZE`, `REINDEX` or `CLUSTER` (which a block may hold), nor those
    /// that commit transactions of their own (`VACUUM`, `CREATE`/`DROP INDEX CONCURRENTLY`,
    /// `DETACH PARTITION ... CONCURRENTLY`), nor the subscription commands, which refuse a
    /// block only with some options (`CREATE SUBSCRIPTION ... WITH (connect = false)` runs
    /// in one): taken for one that commits at once where it did not, a statement after it
    /// ran in a new transaction and pgfence committed what PostgreSQL rolls back (review
    /// I). Where it is not known, the batch goes on as pipelined: PostgreSQL may run a
    /// `VACUUM` Query after it that pgfence makes fail "within a pipeline".
    fn commits_at_once(&self) -> bool {
        match self.kind() {
            StatementKind::NonTransactional => {
                let first = |words: &[&str]| words.iter().any(|w| self.word_is(0, w));
                let second = |words: &[&str]| words.iter().any(|w| self.word_is(1, w));
                (first(&["create", "drop"]) && second(&["database", "tablespace"]))
                    || (first(&["alter"]) && second(&["database", "system"]))
            }
            StatementKind::Discard => self.block_sensitive(),
            _ => false,
        }
    }

    /// `RESET ALL` and `DISCARD ALL` reset `fencing.token` without naming it.
    /// SQL `PREPARE name ...` (not `PREPARE TRANSACTION`).
    fn prepares_in_sql(&self) -> bool {
        self.block_head == BlockHead::Prepare && !self.prepares_transaction()
    }

    /// `PREPARE TRANSACTION 'gid'` (a statement may be named `transaction`), once its first
    /// word is known to be `PREPARE`.
    fn prepares_transaction(&self) -> bool {
        let gid = self
            .words()
            .get(2)
            .is_some_and(|t| t.kind == TokKind::String);
        self.word_is(1, "transaction") && gid
    }

    pub(super) fn resets_all_settings(&self) -> bool {
        (self.word_is(0, "reset") || self.word_is(0, "discard")) && self.word_is(1, "all")
    }

    fn select_rules(&self) -> StatementKind {
        let Seen {
            call,
            into,
            dml,
            lock,
            ..
        } = self.seen;
        if call || into || dml || lock {
            StatementKind::MayWrite
        } else {
            StatementKind::ReadOnly
        }
    }

    /// `EXPLAIN` of a query that reads by [`Self::select_rules`], without `ANALYZE`, only
    /// plans it. Anything else may write: `ANALYZE` runs the statement, and PostgreSQL takes
    /// any identifier, quoted ones too (`("analyze")`, `(U&"analyze")`), for an option
    /// name, which this cannot follow; so the statement explained must itself read
    /// (`EXPLAIN INSERT`, `EXECUTE`, `CREATE TABLE ... AS` and words past the first ones
    /// are `MayWrite`, whatever the options).
    fn explain(&self) -> StatementKind {
        let inner = self.words().iter().skip(1).find(|t| {
            let w = self.text(**t);
            t.kind != TokKind::LParen
                && !["verbose", "analyze", "analyse"]
                    .iter()
                    .any(|k| is_keyword(w, k))
        });
        let reads = inner.is_some_and(|&t| {
            ["select", "values", "table", "with"]
                .iter()
                .any(|k| is_keyword(self.text(t), k))
        });
        if !reads || self.seen.analyze {
            StatementKind::MayWrite
        } else {
            self.select_rules()
        }
    }

    /// `COPY table [(columns)] TO STDOUT ...` reads, and so does `COPY (query) TO STDOUT
    /// ...` when its query does by [`Self::select_rules`]. `COPY ... FROM` writes; `COPY ...
    /// TO` a server file or program has effects outside the database that pgfence cannot
    /// see: both are `MayWrite`.
    fn copy(&self) -> StatementKind {
        if self.seen.to_stdout && !self.seen.top_from {
            self.select_rules()
        } else {
            StatementKind::MayWrite
        }
    }

    fn prepare(&self) -> StatementKind {
        let words = self.words();
        if self.prepares_transaction() {
            return StatementKind::PrepareTransaction;
        }
        let inner = (2..words.len().saturating_sub(1))
            .find(|&i| self.word_is(i, "as"))
            .map(|i| words[i + 1]);
        let select_like = inner.is_some_and(|t| {
            t.kind == TokKind::LParen
                || ["select", "values", "table", "with"]
                    .iter()
                    .any(|k| is_keyword(self.text(t), k))
        });
        if select_like {
            self.select_rules()
        } else {
            StatementKind::MayWrite
        }
    }

    fn create_or_drop(&self) -> StatementKind {
        let index =
            self.word_is(1, "index") || (self.word_is(1, "unique") && self.word_is(2, "index"));
        let whole_object = ["database", "tablespace", "subscription"]
            .iter()
            .any(|k| self.word_is(1, k));
        if whole_object || (index && self.seen.concurrently) {
            StatementKind::NonTransactional
        } else {
            StatementKind::MayWrite
        }
    }

    fn alter(&self) -> StatementKind {
        let non_transactional = self.word_is(1, "system")
            || (self.word_is(1, "database") && self.seen.tablespace)
            || (self.word_is(1, "subscription") && self.seen.publication)
            || (self.word_is(1, "table") && self.seen.concurrently);
        if non_transactional {
            StatementKind::NonTransactional
        } else {
            StatementKind::MayWrite
        }
    }
}

/// Whether a statement starting with the word `w` (in lower case) is
/// [`StatementKind::MayWrite`] whatever follows: every first word except those that
/// [`Scan::kind`] looks beyond (or, for `reset` and `discard`,
/// [`Scan::resets_all_settings`]). `INSERT`, `UPDATE`, `DELETE`, `MERGE`,
/// `TRUNCATE`, ...: most statements an application writes with skip the call detection and
/// the word lists.
/// The words [`Scan::note_clause`] follows `FROM` clauses by.
#[inline]
fn is_clause_word(w: &[u8]) -> bool {
    matches!(
        w,
        b"select"
            | b"values"
            | b"from"
            | b"where"
            | b"group"
            | b"having"
            | b"window"
            | b"order"
            | b"limit"
            | b"offset"
            | b"fetch"
            | b"for"
            | b"union"
            | b"except"
    )
}

/// The SQL value functions, called without parentheses (`current_date`), and `collation`
/// of `COLLATION FOR (x)` (whose `FOR` would end a `FROM` clause): in `FROM`, functions.
fn is_value_function(text: &[u8]) -> bool {
    if !matches!(text.len(), 4..=17)
        || !matches!(text[0].to_ascii_lowercase(), b'c' | b'l' | b's' | b'u')
    {
        return false;
    }
    [
        "current_date",
        "current_time",
        "current_timestamp",
        "localtime",
        "localtimestamp",
        "current_role",
        "current_user",
        "session_user",
        "system_user",
        "user",
        "current_catalog",
        "current_schema",
        "collation",
    ]
    .iter()
    .any(|k| is_keyword(text, k))
}

/// Whether the text of a `CREATE TABLE` (`table`) or `CREATE INDEX` may give a read a way
/// to call a function: a table's `CHECK`, `EXCLUDE`, `INHERITS` or `PARTITION`; an index's
/// expression (parentheses inside its column list) or `WHERE`. Read with the default lexer
/// options (the statement's own are not at hand), so a backslash, which another setting of
/// `standard_conforming_strings` reads otherwise, counts.
fn table_or_index_calls(text: &[u8], table: bool) -> bool {
    if text.contains(&b'\\') {
        return true;
    }
    let mut depth = 0usize;
    for tok in crate::lexer::Lexer::new(text) {
        match tok.kind {
            TokKind::LParen => {
                depth += 1;
                if !table && depth >= 2 {
                    return true;
                }
            }
            TokKind::RParen => depth = depth.saturating_sub(1),
            TokKind::Ident => {
                let word = tok.text(text);
                let words: &[&str] = if table {
                    &["check", "exclude", "inherits", "partition"]
                } else {
                    &["where"]
                };
                if words.iter().any(|w| is_keyword(word, w)) {
                    return true;
                }
            }
            _ => {}
        }
    }
    false
}

fn head_decides(w: &[u8]) -> bool {
    // The list as a `match`: a jump on the length, then few comparisons.
    !matches!(
        w,
        b"" | b"select"
            | b"values"
            | b"table"
            | b"with"
            | b"declare"
            | b"show"
            | b"set"
            | b"reset"
            | b"listen"
            | b"unlisten"
            | b"close"
            | b"explain"
            | b"prepare"
            | b"copy"
            | b"begin"
            | b"start"
            | b"commit"
            | b"end"
            | b"rollback"
            | b"abort"
            | b"savepoint"
            | b"release"
            | b"discard"
            | b"deallocate"
            | b"execute"
            | b"vacuum"
            | b"call"
            | b"create"
            | b"drop"
            | b"alter"
            | b"reindex"
            | b"cluster"
            | b"analyze"
            | b"analyse"
    )
}

/// What `name(` turned out to be.
enum Call {
    /// Syntax, a type modifier or a column list.
    Grammar,
    Allowed,
    Unknown,
    /// A call unless it is `WITH name(columns) AS (`.
    MaybeColumns,
}

/// `text` in ASCII lower case, in `buf`; empty if it is too long to be a listed word.
pub(super) fn lower<'b>(text: &[u8], buf: &'b mut [u8; MAX_WORD_LEN]) -> &'b [u8] {
    let Some(out) = buf.get_mut(..text.len()) else {
        return &[];
    };
    for (o, &b) in out.iter_mut().zip(text) {
        *o = b.to_ascii_lowercase();
    }
    out
}
