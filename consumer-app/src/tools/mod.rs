//! The tools that exercise the runtime and the Parcel domain: the command
//! line's pieces, the demo, the load generator, store selection, and fault
//! injection for tests. Nothing here is on the message path of a
//! production service.
//!
//! - [`broker`]: the broker as the tools see it (publish, what is left
//!   in the queues, dead letters), on RabbitMQ or NATS JetStream.
//! - [`cli`]: flags and the `consume` path, shared by the binaries.
//! - [`dead`]: `parcel-inbox dead` and `replay`, the dead letters' tools.
//! - [`demo`]: `parcel-inbox demo`, the whole story in one checked command.
//! - [`publish`]: the load generator (events plus copies reusing their ids).
//! - [`stores`]: opening the store `--store` picks.
//! - [`faults`]: the fault-injecting handler decorator.
//! - [`producer`]: `POST /parcels` and a relay in one process, for the
//!   demo and the tests, and copies of outbox messages.
//! - [`logging`]: the `tracing` subscriber the binaries install.
//! - [`http`]: a one-request HTTP client, the demo's and the tests' caller
//!   of `POST /parcels`.

pub mod broker;
pub mod cli;
pub mod dead;
pub mod demo;
pub mod faults;
pub mod http;
pub mod logging;
pub mod producer;
pub mod publish;
pub mod stores;
