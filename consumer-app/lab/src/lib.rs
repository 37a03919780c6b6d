//! The Parcel Tracking service under test: what the chaos harness and the
//! benchmark need that the production crate must not carry.
//!
//! - [`broken`]: the conformance suite's deliberately broken stores as
//!   Parcel stores, so that the chaos harness can show it catches a broken
//!   inbox.
//! - [`relay_faults`]: crash points for the outbox relay, as a store
//!   decorator (`parcel-lab-relay`);
//! - the binaries: `parcel-chaos` (the harness) and `parcel-lab-consume`
//!   (the service's consume path with fault injection, which the harness
//!   spawns), and `parcel-lab-relay` (the relay with crash points);
//! - `cargo bench -p parcel-lab --bench report`: the benchmark report.
#![deny(missing_docs)]

pub mod broken;
pub mod relay_faults;
