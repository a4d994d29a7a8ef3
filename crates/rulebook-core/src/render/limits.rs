//! The bounds on one rule's templates and expressions, and on one parent's whole render
//! and status: a leaf that the environment (`env.rs`) and the per-parent budget
//! (`budget.rs`) both read, so neither has to import the other for it.

use std::time::Duration;

/// Bounds on one rule's templates and expressions.
#[derive(Clone, Debug, PartialEq)]
pub struct Limits {
    /// minijinja fuel (instructions) for one template render or expression evaluation.
    pub fuel: u64,
    /// Maximum nesting of macro calls and includes.
    pub recursion: usize,
    /// Maximum bytes one template may render.
    pub max_output_bytes: usize,
    /// Maximum items of one `forEach`.
    pub max_for_each: usize,
    /// Fuel for one parent: the sum over every template render and expression
    /// evaluation of its render and status.
    pub parent_fuel: u64,
    /// Bytes for one parent: everything its templates print plus what string- and
    /// list-building filters produce, across its render and status.
    pub parent_output_bytes: usize,
    /// Wall-clock time for one parent's render and status, checked between evaluations,
    /// at every print and filter call, and on every 16th piece of literal output.
    pub parent_time: Duration,
    /// Bytes of referenced objects (content and metadata, as cached or read) one parent's
    /// reconcile may read: a selector may match a thousand objects of a megabyte each.
    pub parent_reference_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            fuel: 1_000_000,
            recursion: 64,
            max_output_bytes: 1 << 20,
            max_for_each: 1000,
            parent_fuel: 10_000_000,
            parent_output_bytes: 16 << 20,
            parent_time: Duration::from_secs(5),
            parent_reference_bytes: 16 << 20,
        }
    }
}
