//! All of sharding by namespace (`run --sharding namespace`), in one place, bottom up:
//!
//! - [`ranges`] and [`plan`] (pure): the hash the API server uses for `shardSelector`
//!   (64-bit FNV-1a of the namespace name, KEP-5866), sets of hash ranges and their wire
//!   form, and the coordinator's assignment of ranges to replicas;
//! - [`gate`]: the write gate of a sharded replica (its member Lease, its claimed ranges),
//!   a `WriteGate` of the kube layer;
//! - [`watch`]: what a sharded replica's caches go through (the `shardSelector` filter on
//!   their requests, and the same filter on every event);
//! - [`members`]: the membership of sharded replicas, each renewing a Lease, the smallest
//!   coordinating, every one applying its share and acknowledging it.
//!
//! What stays outside is where sharding meets the rest: `operator::shards` wires the
//! membership to the engine (the engine restarts its rules over a new share, so that
//! wiring sits above it), and the engine, the reconcile and `/status` read a share's
//! [`Ranges`] and hash. Nothing here imports the engine: the membership's load count is
//! handed the engine's discovery of a kind ([`members::ResolveKind`]).
//!
//! Why a range never goes from one replica straight to another: a move is two
//! generations of the assignment: first the old owner loses the range (and acknowledges
//! it has stopped writing there), then the new owner gets it. Together with "a new
//! generation only once every live member acknowledged the last one", no two live
//! replicas ever hold the same hash in generations they both act on.

pub mod gate;
pub mod members;
mod plan;
mod ranges;
pub mod watch;

pub use plan::{Assignment, Member, Plan, plan};
pub use ranges::{Ranges, ShardError, ShardStatus, TOP, fnv1a};
