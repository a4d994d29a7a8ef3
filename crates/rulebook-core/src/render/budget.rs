//! The render budget of one parent. Parents are written by tenants, and the per-template
//! limits alone let one parent cost up to `forEach` × (fuel, output) of a single
//! template: a big parent through an ordinary template took seconds and gigabytes.
//! A [`ParentBudget`] bounds the whole of one parent's render and status evaluation:
//! total fuel, total bytes built (output plus what string-building filters produce),
//! and wall-clock time.
//!
//! Renders run synchronously on one thread, so while a parent is being rendered its
//! budget sits in a thread-local where the filters, the value formatter and the output
//! writer can charge it and refuse work before allocating. Outside a render (no active
//! budget) the checks fall back to a fresh default budget's bounds.

use std::cell::RefCell;
use std::time::{Duration, Instant};

use minijinja::{Error, ErrorKind};

use super::Limits;

/// What one parent may still spend. Create one per parent (per reconcile) with
/// [`ParentBudget::new`] or [`CompiledRule::budget`](super::CompiledRule::budget) and
/// pass it to both [`render_within`](super::CompiledRule::render_within) and
/// [`status_within`](super::CompiledRule::status_within).
#[derive(Clone, Debug)]
pub struct ParentBudget {
    fuel_limit: u64,
    output_limit: usize,
    time_limit: Duration,
    /// Time spent rendering with this budget (between renders — API calls of the
    /// reconcile, waiting for a render slot — the clock does not run).
    spent: Duration,
    /// When the current render with this budget started.
    entered_at: Option<Instant>,
    fuel_used: u64,
    output_used: usize,
    /// The first bound that was hit: once set, every later check fails with it.
    exceeded: Option<String>,
    /// Fuel reported by the probe at the end of the last expression evaluation.
    probe: Option<u64>,
    /// Charges so far: the clock is read on every 16th piece of template output (a
    /// template writes many small pieces); filter charges, fuel checkpoints and
    /// evaluations read it every time.
    charges: u32,
    /// Whether this is a first attempt within a slice ([`Self::slice`]): evaluations then
    /// use the rule's slice environment, whose fuel per evaluation is the slice's.
    slice: bool,
}

impl ParentBudget {
    /// A full budget; its clock runs only while a render uses it.
    pub fn new(limits: &Limits) -> ParentBudget {
        ParentBudget {
            fuel_limit: limits.parent_fuel,
            output_limit: limits.parent_output_bytes,
            time_limit: limits.parent_time,
            spent: Duration::ZERO,
            entered_at: None,
            fuel_used: 0,
            output_used: 0,
            exceeded: None,
            probe: None,
            charges: 0,
            slice: false,
        }
    }

    /// Fuel spent so far by finished template renders and expression evaluations.
    pub fn fuel_used(&self) -> u64 {
        self.fuel_used
    }

    /// Bytes charged so far: rendered output plus string-building filter results.
    pub fn output_used(&self) -> usize {
        self.output_used
    }

    /// Time spent rendering with this budget.
    pub fn elapsed(&self) -> Duration {
        self.spent + self.entered_at.map_or(Duration::ZERO, |t| t.elapsed())
    }

    /// The message of the bound that was hit, if one was.
    pub fn exceeded(&self) -> Option<&str> {
        self.exceeded.as_deref()
    }

    /// A short first attempt with this budget: a copy that may spend at most `time`,
    /// `output` bytes and `fuel` more than this budget has spent (less where this budget
    /// has less left). An attempt that trips any bound ([`Self::exceeded`]) is dropped and
    /// the work done again with this budget; one that does not becomes this budget again,
    /// with what it spent, through [`Self::rejoin`].
    pub fn slice(&self, time: Duration, output: usize, fuel: u64) -> ParentBudget {
        let mut s = self.clone();
        s.time_limit = s.time_limit.min(self.spent.saturating_add(time));
        s.output_limit = s.output_limit.min(self.output_used.saturating_add(output));
        s.fuel_limit = s.fuel_limit.min(self.fuel_used.saturating_add(fuel));
        s.slice = true;
        s
    }

    /// Whether this is a slice ([`Self::slice`]).
    pub fn is_slice(&self) -> bool {
        self.slice
    }

    /// A slice of `whole` ([`Self::slice`]) that tripped no bound, with `whole`'s bounds
    /// again and what the slice spent.
    pub fn rejoin(mut self, whole: &ParentBudget) -> ParentBudget {
        self.time_limit = whole.time_limit;
        self.output_limit = whole.output_limit;
        self.fuel_limit = whole.fuel_limit;
        self.slice = whole.slice;
        self
    }

    /// Makes this budget the active one on this thread until the guard is dropped.
    pub(super) fn enter(&mut self) -> Entered<'_> {
        let mut active = self.clone();
        active.entered_at = Some(Instant::now());
        let previous = ACTIVE.with(|a| a.borrow_mut().replace(active));
        Entered {
            budget: self,
            previous,
        }
    }

    fn trip(&mut self, message: String) -> String {
        self.exceeded.get_or_insert(message).clone()
    }

    fn check_time(&mut self) -> Result<(), String> {
        let took = self.elapsed();
        if took > self.time_limit {
            return Err(self.trip(format!(
                "parent exceeds the render budget: rendering took {} ms (limit {} ms per parent)",
                took.as_millis(),
                self.time_limit.as_millis()
            )));
        }
        Ok(())
    }

    fn check_fuel(&mut self, extra: u64) -> Result<(), String> {
        let total = self.fuel_used.saturating_add(extra);
        if total > self.fuel_limit {
            return Err(self.trip(format!(
                "parent exceeds the render budget: {total} fuel (limit {} per parent)",
                self.fuel_limit
            )));
        }
        Ok(())
    }

    /// Everything that is checked before an evaluation starts.
    fn check_all(&mut self) -> Result<(), String> {
        if let Some(e) = &self.exceeded {
            return Err(e.clone());
        }
        self.check_time()?;
        if self.fuel_used >= self.fuel_limit {
            return Err(self.trip(format!(
                "parent exceeds the render budget: its {} fuel are spent (limit per parent)",
                self.fuel_limit
            )));
        }
        Ok(())
    }

    fn remaining_output(&self) -> usize {
        self.output_limit.saturating_sub(self.output_used)
    }

    fn charge(&mut self, what: Charge<'_>, bytes: usize) -> Result<(), String> {
        let output_piece = matches!(what, Charge::Output);
        if let Some(e) = &self.exceeded {
            return Err(e.clone());
        }
        if bytes > self.remaining_output() {
            let message = match what {
                Charge::Output => format!(
                    "parent exceeds the render budget: {} of output (limit {} per parent)",
                    human_bytes(self.output_used.saturating_add(bytes)),
                    human_bytes(self.output_limit)
                ),
                Charge::Filter(name) => format!(
                    "parent exceeds the render budget: `{name}` would build {}, more than the {} \
                     left of {} per parent",
                    human_bytes(bytes),
                    human_bytes(self.remaining_output()),
                    human_bytes(self.output_limit)
                ),
            };
            return Err(self.trip(message));
        }
        self.output_used += bytes;
        self.charges = self.charges.wrapping_add(1);
        // A filter's charge precedes work whose size it charges: the clock is read then.
        if output_piece && !self.charges.is_multiple_of(16) {
            return Ok(());
        }
        self.check_time()
    }
}

/// What bytes are charged for.
#[derive(Clone, Copy, Debug)]
pub(super) enum Charge<'a> {
    /// Rendered template output.
    Output,
    /// The result of a filter or function, by name.
    Filter(&'a str),
}

thread_local! {
    static ACTIVE: RefCell<Option<ParentBudget>> = const { RefCell::new(None) };
}

/// The budget active on this thread; copied back into the caller's budget on drop.
pub(super) struct Entered<'a> {
    budget: &'a mut ParentBudget,
    previous: Option<ParentBudget>,
}

impl Drop for Entered<'_> {
    fn drop(&mut self) {
        let previous = self.previous.take();
        if let Some(mut state) = ACTIVE.with(|a| std::mem::replace(&mut *a.borrow_mut(), previous))
        {
            state.spent = state.elapsed();
            state.entered_at = None;
            *self.budget = state;
        }
    }
}

/// Runs `f` on the active budget, or on a fresh default one when none is active.
fn with_active<R>(f: impl FnOnce(&mut ParentBudget) -> R) -> R {
    ACTIVE.with(|a| match a.borrow_mut().as_mut() {
        Some(b) => f(b),
        None => f(&mut ParentBudget::new(&Limits::default())),
    })
}

fn budget_error(message: String) -> Error {
    Error::new(ErrorKind::InvalidOperation, message)
}

/// Before a template render or an expression evaluation: no bound hit yet, time left,
/// fuel left. Clears the expression fuel probe.
pub(super) fn before_evaluation() -> Result<(), String> {
    with_active(|b| {
        b.probe = None;
        b.check_all()
    })
}

/// After an evaluation that consumed `fuel`.
pub(super) fn add_fuel(fuel: u64) -> Result<(), String> {
    with_active(|b| {
        b.check_fuel(fuel)?;
        b.fuel_used += fuel;
        b.check_time()
    })
}

/// Fuel the probe saw at the end of the last expression evaluation.
pub(super) fn take_probe() -> Option<u64> {
    with_active(|b| b.probe.take())
}

/// Called by the expression probe filter with the evaluation's fuel so far.
pub(super) fn set_probe(consumed: u64) {
    with_active(|b| b.probe = Some(consumed));
}

/// A checkpoint inside a running evaluation that has consumed `consumed` fuel so far:
/// fails once the parent's fuel or time is spent.
pub(super) fn checkpoint(consumed: Option<u64>) -> Result<(), Error> {
    with_active(|b| {
        if let Some(e) = &b.exceeded {
            return Err(e.clone());
        }
        b.check_fuel(consumed.unwrap_or(0))?;
        b.check_time()
    })
    .map_err(budget_error)
}

/// Charges `bytes` to the output budget, failing before they are built or written.
pub(super) fn charge(what: Charge<'_>, bytes: usize) -> Result<(), Error> {
    with_active(|b| b.charge(what, bytes)).map_err(budget_error)
}

/// Bytes left in the output budget.
pub(super) fn remaining_output() -> usize {
    with_active(|b| b.remaining_output())
}

/// Records that a per-evaluation bound (a template's output cap) was hit, so the parent
/// fails as over budget.
pub(super) fn trip(message: String) {
    with_active(|b| {
        b.trip(message);
    });
}

/// The bound that was hit on the active budget, if any.
pub(super) fn exceeded() -> Option<String> {
    ACTIVE.with(|a| a.borrow().as_ref().and_then(|b| b.exceeded.clone()))
}

/// Whether the budget active on this thread is a slice ([`ParentBudget::slice`]).
pub(super) fn in_slice() -> bool {
    ACTIVE.with(|a| a.borrow().as_ref().is_some_and(|b| b.slice))
}

/// `16 MiB`, `1.5 MiB`, `900 KiB`, `300 bytes`.
pub fn human_bytes(n: usize) -> String {
    const KIB: usize = 1 << 10;
    const MIB: usize = 1 << 20;
    const GIB: usize = 1 << 30;
    let unit = |u: usize, name: &str| {
        if n.is_multiple_of(u) {
            format!("{} {name}", n / u)
        } else {
            format!("{:.1} {name}", n as f64 / u as f64)
        }
    };
    if n >= GIB {
        unit(GIB, "GiB")
    } else if n >= MIB {
        unit(MIB, "MiB")
    } else if n >= KIB {
        unit(KIB, "KiB")
    } else {
        format!("{n} bytes")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small() -> Limits {
        Limits {
            parent_fuel: 100,
            parent_output_bytes: 1000,
            parent_time: Duration::from_secs(60),
            ..Limits::default()
        }
    }

    #[test]
    fn a_slice_trips_at_its_own_bounds_and_rejoins_with_what_it_spent() {
        let mut whole = ParentBudget::new(&small());
        {
            let _g = whole.enter();
            assert!(charge(Charge::Output, 100).is_ok());
        }
        // Past the slice's 50 bytes (but within the whole's 900 left): the slice trips.
        let mut slice = whole.slice(Duration::from_secs(1), 50, 10);
        {
            let _g = slice.enter();
            assert!(charge(Charge::Output, 60).is_err());
        }
        assert!(slice.exceeded().is_some());
        assert!(whole.exceeded().is_none(), "the whole budget is untouched");
        // Within it: it spends, and rejoins with the whole's bounds.
        let mut slice = whole.slice(Duration::from_secs(1), 50, 10);
        {
            let _g = slice.enter();
            assert!(charge(Charge::Output, 40).is_ok());
            assert!(add_fuel(5).is_ok());
        }
        let mut back = slice.rejoin(&whole);
        assert_eq!((back.output_used(), back.fuel_used()), (140, 5));
        let _g = back.enter();
        assert!(
            charge(Charge::Output, 800).is_ok(),
            "the whole's bounds again"
        );
        assert!(add_fuel(90).is_ok());
        assert!(add_fuel(10).is_err(), "100 fuel in all, the whole's limit");
    }

    #[test]
    fn a_slice_never_widens_a_budget() {
        let whole = ParentBudget::new(&small());
        let mut slice = whole.slice(Duration::from_secs(3600), 1 << 30, u64::MAX);
        let _g = slice.enter();
        assert!(charge(Charge::Output, 1001).is_err());
    }

    #[test]
    fn output_is_charged_across_evaluations_and_refused_past_the_limit() {
        let mut budget = ParentBudget::new(&small());
        {
            let _g = budget.enter();
            assert!(charge(Charge::Output, 600).is_ok());
            assert_eq!(remaining_output(), 400);
        }
        assert_eq!(budget.output_used(), 600);
        let _g = budget.enter();
        let e = charge(Charge::Filter("indent"), 500).unwrap_err();
        let msg = e.detail().unwrap_or_default().to_string();
        assert!(msg.starts_with("parent exceeds the render budget"), "{msg}");
        assert!(msg.contains("`indent` would build 500 bytes"), "{msg}");
        // Once exceeded, everything fails with the first message.
        assert!(charge(Charge::Output, 1).is_err());
        assert_eq!(before_evaluation().unwrap_err(), msg);
        assert_eq!(exceeded(), Some(msg));
    }

    #[test]
    fn fuel_adds_up_and_checkpoints_see_the_running_evaluation() {
        let mut budget = ParentBudget::new(&small());
        let _g = budget.enter();
        assert!(before_evaluation().is_ok());
        assert!(add_fuel(60).is_ok());
        assert!(checkpoint(Some(30)).is_ok());
        let e = checkpoint(Some(50)).unwrap_err();
        assert!(
            e.to_string().contains("110 fuel (limit 100 per parent)"),
            "{e}"
        );
        assert!(before_evaluation().is_err());
    }

    #[test]
    fn fuel_exactly_spent_refuses_the_next_evaluation() {
        let mut budget = ParentBudget::new(&small());
        let _g = budget.enter();
        assert!(add_fuel(100).is_ok());
        let e = before_evaluation().unwrap_err();
        assert!(e.contains("its 100 fuel are spent"), "{e}");
    }

    #[test]
    fn the_deadline_is_checked() {
        let limits = Limits {
            parent_time: Duration::ZERO,
            ..small()
        };
        let mut budget = ParentBudget::new(&limits);
        std::thread::sleep(Duration::from_millis(2));
        let _g = budget.enter();
        let e = before_evaluation().unwrap_err();
        assert!(e.contains("rendering took"), "{e}");
        assert!(e.contains("(limit 0 ms per parent)"), "{e}");
    }

    #[test]
    fn a_spent_deadline_stops_output_within_16_pieces_and_a_filter_at_once() {
        let limits = Limits {
            parent_time: Duration::ZERO,
            parent_output_bytes: 1 << 20,
            ..small()
        };
        let mut budget = ParentBudget::new(&limits);
        let _g = budget.enter();
        std::thread::sleep(Duration::from_millis(2));
        let pieces = (1..=16)
            .find(|_| charge(Charge::Output, 1).is_err())
            .expect("the clock is read within 16 pieces of output");
        assert!(pieces <= 16);
        assert!(exceeded().is_some_and(|e| e.contains("rendering took")));

        let mut budget = ParentBudget::new(&limits);
        let _g = budget.enter();
        std::thread::sleep(Duration::from_millis(2));
        let e = charge(Charge::Filter("indent"), 1).unwrap_err();
        assert!(e.to_string().contains("rendering took"), "{e}");
    }

    #[test]
    fn nested_entries_restore_the_outer_budget() {
        let mut outer = ParentBudget::new(&small());
        let _g = outer.enter();
        charge(Charge::Output, 10).unwrap();
        {
            let mut inner = ParentBudget::new(&small());
            let _i = inner.enter();
            assert_eq!(remaining_output(), 1000);
        }
        assert_eq!(remaining_output(), 990);
    }

    #[test]
    fn without_an_active_budget_the_default_bounds_apply() {
        let limit = Limits::default().parent_output_bytes;
        assert!(charge(Charge::Filter("x"), limit).is_ok());
        assert!(charge(Charge::Filter("x"), limit + 1).is_err());
    }

    #[test]
    fn sizes_read_well() {
        assert_eq!(human_bytes(300), "300 bytes");
        assert_eq!(human_bytes(4 << 20), "4 MiB");
        assert_eq!(human_bytes(1536 << 10), "1.5 MiB");
        assert_eq!(human_bytes(900 << 10), "900 KiB");
        assert_eq!(human_bytes(1 << 30), "1 GiB");
    }
}
