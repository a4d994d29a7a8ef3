//! The one write path: every API write Rulebook makes goes through a [`writer::Writer`],
//! under a write gate enforced three times.
//!
//! - [`writer`]: child applies (each with a precondition), status applies, deletions,
//!   patches and events; asks the gate first and counts each write;
//! - [`gate`]: the write gate ([`gate::WriteGate`]; the lease's [`gate::LeaseGate`]) and
//!   [`gate::GateLayer`], which refuses a write in the API client on a closed gate;
//! - [`gate_body`]: the gate's last check, in each write's request body, where hyper
//!   writes its bytes;
//! - [`recorder`]: Events with kube-runtime's series semantics at a bounded cost, sent
//!   through the process's bounded [`outbox`];
//! - `send`: a request sent through an `Api`'s client and read in part (the writer's
//!   applies, the recorder's creates).
//!
//! Imports run one way: `writer` → `gate`, `recorder` and `send`; `recorder` → `outbox`
//! and `send`; `gate_body` → `gate` (the recorder no longer reaches back into the writer
//! for `send_as`). A write's answer is decoded as the caches decode a watched object
//! ([`crate::cache::wire`]). The operator's shard gate (its `shard`
//! module) is one more `WriteGate`, built on [`gate::LeaseGate`].

pub mod gate;
pub mod gate_body;
pub mod outbox;
pub mod recorder;
mod send;
pub mod writer;
