//! The Parcel Tracking service under test: what the chaos harness and the
//! benchmark need that the production crate must not carry.
//!
//! - [`broken`]: the conformance suite's deliberately broken stores as
//!   Parcel stores, so that the chaos harness can show it catches a broken
//!   inbox.
//! - the binaries: `parcel-chaos` (the harness) and `parcel-lab-consume`
//!   (the service's consume path with fault injection, which the harness
//!   spawns);
//! - `cargo bench -p parcel-lab --bench report`: the benchmark report.
#![deny(missing_docs)]

pub mod broken;
