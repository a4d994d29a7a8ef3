//! The first, short attempt at a render or status evaluation: its bounds, its
//! environment, and the gate on its inputs.
//!
//! Handing each render to tokio's blocking pool and back costs more CPU than most renders
//! (the benchmark rule's render and status take about 40 µs together; a handoff is two
//! thread wake-ups, twice per reconcile). So `reconcile::offload` first runs each one on
//! the async runtime within a slice of its parent's budget, and on the pool only when it
//! trips the slice. For that to be safe the slice must bound *everything* the attempt can
//! do, not only what the parent's budget checks at its checkpoints:
//!
//! - the time and bytes of the slice ([`SLICE_TIME`], [`SLICE_OUTPUT`]), checked where the
//!   parent's budget is checked (output, filter results, evaluations);
//! - only rules of straight-line code get a first attempt ([`straight_line`],
//!   [`straight_template`]): no loops, macros, `set`, `with`, `namespace`, `range` or
//!   `*`, and no JSONPath that descends or filters. A loop body reaches no check of the
//!   clock unless it prints or calls a guarded filter, a string grown by `~` in a loop is
//!   copied each turn (quadratic in the turns), and `set` lets a value be doubled line
//!   after line; no fuel bound keeps those to a millisecond. Straight-line code runs each
//!   instruction once, over values no bigger than its inputs times its text;
//! - a long straight-line template still reaches no check until it prints: the rule is
//!   compiled a second time in an environment whose fuel per evaluation is
//!   [`SLICE_FUEL`] (the first attempt runs in it), not the template's million;
//! - converting the parent, its live children and its referenced objects to template
//!   values happens before any check, and grows with them: the attempt is made only when
//!   they weigh at most [`SLICE_INPUT`] ([`weighs_at_most`], which stops as soon as they
//!   do not, so a large parent costs the gate no more than a small one).
//!
//! What is left is one filter call over the inputs (a `replace` or `sort` over a 64 KiB
//! parent) before the next check, and what a tripped attempt spent, which the pool run
//! does not charge to the parent's budget (at most the slice and that one call). The
//! caller catches a panic and runs the work again on the pool.

use std::time::Duration;

use serde_json::Value as Json;

use super::*;

/// How long a first attempt may run on the async runtime.
pub const SLICE_TIME: Duration = Duration::from_millis(1);
/// How many bytes it may print and build.
pub const SLICE_OUTPUT: usize = 64 << 10;
/// Fuel per evaluation in the slice environment, and in all for the attempt.
pub const SLICE_FUEL: u64 = 20_000;
/// How much its inputs may weigh ([`weighs_at_most`]).
pub const SLICE_INPUT: usize = 64 << 10;

/// What makes a template or an expression more than straight-line code: loops, macros
/// and call blocks (a loop body or a recursive macro runs as often as the inputs say,
/// between checks of the clock), `set` and `with` (a stored value can be reused: `{% set
/// b = a ~ a %}{% set c = b ~ b %}` doubles with each line, and `~` is minijinja's own,
/// charged only when printed), `namespace` (what lets a loop accumulate), `range` (a list
/// of up to 100,000 items from one number), and `*` (a string or list repeated up to
/// 100 MB in one instruction). Matched anywhere in a tag or an expression, string
/// literals included: a false match only sends the rule's renders to the pool, as
/// before.
static UNBOUNDED: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"\b(?:for|macro|call|set|with|namespace|range|recursive)\b|\*")
        .expect("static regex")
});

/// Whether `text` (a template tag or an expression) is straight-line code: then every
/// value it builds is at most as big as the inputs it names, times how often its text
/// names them, and each of its instructions runs once. A rule whose templates (included
/// ones too: [`straight_template`]) and expressions all are, and whose status JSONPaths
/// neither descend (`..`, whose paths grow with nesting, not weight) nor filter (`?`, a
/// query per item, nested ones per item of each), is the only kind whose renders get a
/// first attempt on the runtime.
pub(super) fn straight_line(text: &str) -> bool {
    !UNBOUNDED.is_match(text)
}

/// Whether every tag of template `source` (`{{ }}`, `{% %}`; comments `{# #}` do not
/// count) is [`straight_line`]. A tag ends at the first `}}` or `%}` outside a string
/// literal, as minijinja reads it, so a `"}}"` in a literal cannot hide the rest of the
/// tag from the check; an unterminated tag runs to the end of the source.
pub(super) fn straight_template(source: &str) -> bool {
    let b = source.as_bytes();
    let mut i = 0;
    while i + 1 < b.len() {
        let (close, comment) = match (b[i], b[i + 1]) {
            (b'{', b'{') => (b'}', false),
            (b'{', b'%') => (b'%', false),
            (b'{', b'#') => (b'#', true),
            _ => {
                i += 1;
                continue;
            }
        };
        let start = i + 2;
        let mut j = start;
        let mut quote: Option<u8> = None;
        let end = loop {
            if j + 1 >= b.len() {
                break b.len();
            }
            match quote {
                Some(_) if b[j] == b'\\' => j += 1,
                Some(q) if b[j] == q => quote = None,
                Some(_) => {}
                None if !comment && (b[j] == b'"' || b[j] == b'\'') => quote = Some(b[j]),
                None if b[j] == close && b[j + 1] == b'}' => break j,
                None => {}
            }
            j += 1;
        };
        // `start` and `end` sit next to ASCII bytes (or at the end): char boundaries.
        if !comment && !straight_line(source.get(start..end).unwrap_or("*")) {
            return false;
        }
        i = end.saturating_add(2);
    }
    true
}

/// What one value costs the gate besides its text: about what converting it takes.
const NODE: usize = 16;

/// Whether `values` together weigh at most `limit`: [`NODE`] per value, plus the length
/// of each string and object key. Stops as soon as they weigh more, before looking at the
/// rest: a list or an object is charged for its length before its items are visited.
pub fn weighs_at_most<'a>(values: impl IntoIterator<Item = &'a Json>, limit: usize) -> bool {
    walk(values, limit).0
}

/// [`weighs_at_most`], and how many values it looked at.
fn walk<'a>(values: impl IntoIterator<Item = &'a Json>, limit: usize) -> (bool, usize) {
    let mut left = limit;
    let mut seen = 0usize;
    let mut spend = |n: usize| match left.checked_sub(n) {
        Some(l) => {
            left = l;
            true
        }
        None => false,
    };
    // Only values with something inside or text are pushed: numbers, booleans and nulls
    // are charged with the list or object that holds them.
    let deeper = |x: &&Json| x.is_array() || x.is_object() || x.is_string();
    let mut stack: Vec<&Json> = Vec::new();
    for v in values {
        stack.push(v);
        while let Some(v) = stack.pop() {
            seen += 1;
            let fits = match v {
                Json::String(s) => spend(NODE.saturating_add(s.len())),
                Json::Array(a) => {
                    spend(NODE.saturating_mul(a.len().saturating_add(1))) && {
                        stack.extend(a.iter().filter(deeper));
                        true
                    }
                }
                Json::Object(m) => {
                    spend(NODE.saturating_mul(m.len().saturating_add(1)))
                        && spend(m.keys().map(String::len).sum())
                        && {
                            stack.extend(m.values().filter(deeper));
                            true
                        }
                }
                _ => spend(NODE),
            };
            if !fits {
                return (false, seen);
            }
        }
    }
    (true, seen)
}

impl CompiledRule {
    /// Compiles a parsed rule against the template sources. Every problem is reported.
    /// A rule that compiles, and whose templates and expressions are straight-line code
    /// ([`straight_line`]), is compiled once more in an environment with the slice's
    /// fuel per evaluation; without it (or should that fail: it cannot fail where the
    /// first did not), every attempt goes to the pool ([`Self::can_slice`]).
    pub fn compile(
        sr: &SourcedRule,
        templates: &BTreeMap<String, (String, String)>,
        limits: &Limits,
    ) -> Result<CompiledRule, Vec<Diagnostic>> {
        let mut rule = Self::compile_once(sr, templates, limits)?;
        if !rule.straight_line {
            return Ok(rule);
        }
        let sliced = Limits {
            fuel: SLICE_FUEL.min(limits.fuel),
            ..limits.clone()
        };
        rule.slice = Self::compile_once(sr, templates, &sliced)
            .ok()
            .map(|r| r.compiled);
        Ok(rule)
    }

    /// Whether a first attempt may run within a slice: the rule has its slice
    /// environment.
    pub fn can_slice(&self) -> bool {
        self.slice.is_some()
    }

    /// Whether a first attempt over `parent` and `observed` (and `more`, such as the
    /// rendered children a status reads) may run within a slice: the rule has its slice
    /// environment, and the inputs weigh at most [`SLICE_INPUT`].
    pub fn fits_slice<'a>(
        &self,
        parent: &'a Json,
        observed: &'a Observed,
        more: impl IntoIterator<Item = &'a Json>,
    ) -> bool {
        self.can_slice()
            && weighs_at_most(
                std::iter::once(parent)
                    .chain(observed.children.values().flatten())
                    .chain(observed.refs.values())
                    .chain(more),
                SLICE_INPUT,
            )
    }

    /// The programs and environment an evaluation runs in: the slice's when the active
    /// budget is a slice ([`ParentBudget::slice`]), else the rule's own.
    pub(super) fn running(&self) -> &Compiled {
        match &self.slice {
            Some(s) if budget::in_slice() => s,
            _ => &self.compiled,
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn weight_counts_values_and_text_and_stops_at_the_limit() {
        let small = json!({"spec": {"name": "a", "replicas": 3}});
        assert!(weighs_at_most([&small], 1000));
        assert!(!weighs_at_most([&small], 40));
        let text = json!({"blob": "x".repeat(100_000)});
        assert!(!weighs_at_most([&text], SLICE_INPUT));
        assert!(weighs_at_most([&text], 200_000));
        // Many small values weigh as much as one long text.
        let many = json!({"items": vec![1; 10_000]});
        assert!(!weighs_at_most([&many], SLICE_INPUT));
        // So do many keys.
        let keys: serde_json::Map<String, Json> = (0..5_000)
            .map(|i| (format!("key-{i:08}"), Json::Null))
            .collect();
        assert!(!weighs_at_most([&Json::Object(keys)], SLICE_INPUT));
        // Several inputs count together.
        let half = json!({"blob": "x".repeat(40_000)});
        assert!(weighs_at_most([&half], SLICE_INPUT));
        assert!(!weighs_at_most([&half, &half], SLICE_INPUT));
    }

    #[test]
    fn a_big_list_is_refused_before_its_items_are_visited() {
        // A million-item list of nested objects: charged for its length first, so the
        // gate refuses it having looked at the list alone.
        let big = Json::Array(vec![json!({"a": {"b": "c"}}); 1_000_000]);
        assert_eq!(walk([&big], SLICE_INPUT), (false, 1));
        let small = Json::Array(vec![json!({"a": {"b": "c"}}); 10]);
        assert_eq!(walk([&small], SLICE_INPUT), (true, 1 + 10 * 3));
    }

    #[test]
    fn deep_nesting_is_walked_without_recursion() {
        // 100,000 levels: a recursive walk would overflow a test thread's 2 MiB stack. The
        // value is leaked, not dropped: serde_json drops it recursively.
        let mut v = json!("leaf");
        for _ in 0..100_000 {
            v = Json::Array(vec![v]);
        }
        assert!(weighs_at_most([&v], 1 << 22));
        assert!(!weighs_at_most([&v], 1000));
        std::mem::forget(v);
    }

    #[test]
    fn a_tag_ends_outside_string_literals() {
        assert!(straight_template("a: {{ x ~ \"}}\" }} b: {{ y | upper }}"));
        // The `*` after a literal `}}` is still inside the tag.
        assert!(!straight_template("a: {{ (\"}}\" ~ x) * 1000 }}"));
        assert!(!straight_template(
            "a: {{ ('%}' ~ x) }}{% for i in y %}{% endfor %}"
        ));
        assert!(!straight_template("{% set a = x ~ x %}{{ a }}"));
        // Comments and plain text do not count; an unterminated tag runs to the end.
        assert!(straight_template(
            "# for each range *\n{# for i in range(9) * 2 #}{{ x }}"
        ));
        assert!(!straight_template("{{ x * "));
        assert!(straight_template("{{ \"a\\\"}}\" }}"));
    }
}
