//! The load generator: distinct events plus copies that reuse their ids.
//!
//! A copy is what a producer retrying a publish sends: the same message id
//! and body again. The inbox must drop each copy, for each consumer.

use std::io::{IsTerminal, Write};
use std::time::Instant;

use inbox_api::MessageId;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::parcel::events::{ParcelCreatedEvent, ROUTING_KEY, outgoing};
use crate::parcel::topology::Topology;
use inbox_runtime::AppError;
use inbox_runtime::amqp::{ConnectOptions, Outgoing, Publisher, close_bounded, connect_with};

/// What will be published.
#[derive(Clone, Debug)]
pub struct Plan {
    /// Every message, copies included, in publishing order.
    pub messages: Vec<Outgoing>,
    /// The distinct message ids (one per parcel), in creation order.
    pub ids: Vec<MessageId>,
    /// How many copies (extra publishes of an already planned id).
    pub copies: usize,
}

impl Plan {
    /// `count` distinct events for parcels `{tag}-000001`… and
    /// `round(count × duplicate_rate)` copies of randomly chosen ones at
    /// random places, reproducibly from `seed` (rand's `StdRng`: the same
    /// seed gives the same tracking numbers, destinations and copy
    /// placement under the locked rand version; the ids are fresh v7 ids).
    ///
    /// # Errors
    /// [`AppError::Config`] for a rate outside `0..=10`.
    pub fn new(count: usize, duplicate_rate: f64, seed: u64, tag: &str) -> Result<Self, AppError> {
        if !(0.0..=10.0).contains(&duplicate_rate) {
            return Err(AppError::Config(format!(
                "duplicate rate {duplicate_rate} is outside 0..=10"
            )));
        }
        let mut rng = StdRng::seed_from_u64(seed);
        let destinations = ["Lyon", "Porto", "Gdansk", "Utrecht", "Bologna", "Ghent"];
        let mut ids = Vec::with_capacity(count);
        let mut messages = Vec::with_capacity(count);
        for i in 0..count {
            let id = MessageId::new_v7();
            let event = ParcelCreatedEvent {
                parcel_id: format!("{tag}-{:06}", i + 1),
                tracking_number: format!("TN{:010}", rng.random_range(0..10_000_000_000_u64)),
                destination: destinations[rng.random_range(..destinations.len())].to_owned(),
            };
            messages.push(outgoing(&id, &event)?);
            ids.push(id);
        }
        #[expect(
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss,
            clippy::cast_precision_loss,
            reason = "a count times a small rate, rounded"
        )]
        let copies = if count == 0 {
            0
        } else {
            (count as f64 * duplicate_rate).round() as usize
        };
        for _ in 0..copies {
            let original = messages[rng.random_range(..count)].clone();
            let at = rng.random_range(..=messages.len());
            messages.insert(at, original);
        }
        Ok(Self {
            messages,
            ids,
            copies,
        })
    }
}

/// Declares the topology and publishes every message of `plan` with
/// publisher confirms, showing progress on stderr when `progress` is set.
///
/// # Errors
/// Broker errors, or a message the broker did not confirm.
pub async fn publish(
    amqp_url: &str,
    topology: &Topology,
    messages: &[Outgoing],
    progress: bool,
) -> Result<(), AppError> {
    publish_with(
        amqp_url,
        ConnectOptions::default(),
        topology,
        messages,
        progress,
    )
    .await
}

/// [`publish`], the connection opened with `connection` (its timeout also
/// bounds the channel's opening).
///
/// # Errors
/// As [`publish`].
pub async fn publish_with(
    amqp_url: &str,
    connection: ConnectOptions,
    topology: &Topology,
    messages: &[Outgoing],
    progress: bool,
) -> Result<(), AppError> {
    let connection = connect_with(amqp_url, "parcel-inbox publisher", connection).await?;
    let publisher = Publisher::new(&connection, &topology.exchange(), ROUTING_KEY).await?;
    topology.declare(publisher.channel()).await?;
    let total = messages.len();
    let started = Instant::now();
    let mut bar = Progress::new(total, progress);
    publisher
        .publish_all(messages, 256, |done| bar.update(done))
        .await?;
    bar.finish();
    tracing::info!(published = total, elapsed = ?started.elapsed(), exchange = %topology.exchange(),
        "published with confirms");
    publisher.close().await;
    close_bounded(&connection, "published").await;
    Ok(())
}

/// A progress line on stderr: redrawn in place on a terminal, every 10 %
/// otherwise.
struct Progress {
    total: usize,
    enabled: bool,
    terminal: bool,
    last_decile: usize,
    started: Instant,
}

impl Progress {
    fn new(total: usize, enabled: bool) -> Self {
        Self {
            total,
            enabled,
            terminal: std::io::stderr().is_terminal(),
            last_decile: 0,
            started: Instant::now(),
        }
    }

    fn update(&mut self, done: usize) {
        if !self.enabled || self.total == 0 {
            return;
        }
        let mut err = std::io::stderr().lock();
        if self.terminal {
            let width = 30;
            let filled = done * width / self.total;
            let _ = write!(
                err,
                "\r[{}{}] {done}/{} confirmed",
                "#".repeat(filled),
                "-".repeat(width - filled),
                self.total
            );
        } else {
            let decile = done * 10 / self.total;
            if decile > self.last_decile {
                self.last_decile = decile;
                let _ = writeln!(err, "published {done}/{} (confirmed)", self.total);
            }
        }
    }

    fn finish(&self) {
        if self.enabled && self.terminal {
            let _ = writeln!(
                std::io::stderr(),
                "\npublished {} messages in {:.2?}",
                self.total,
                self.started.elapsed()
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    #[test]
    fn a_plan_has_its_copies_and_reuses_ids() {
        let plan = Plan::new(100, 0.25, 7, "P").unwrap();
        assert_eq!(plan.ids.len(), 100);
        assert_eq!(plan.copies, 25);
        assert_eq!(plan.messages.len(), 125);
        let mut per_id: HashMap<&str, usize> = HashMap::new();
        for m in &plan.messages {
            *per_id.entry(m.message_id.as_deref().unwrap()).or_default() += 1;
        }
        assert_eq!(per_id.len(), 100);
        assert_eq!(per_id.values().map(|n| n - 1).sum::<usize>(), 25);
        assert!(Plan::new(1, -1.0, 1, "P").is_err());
    }

    #[test]
    fn the_same_seed_plans_the_same_run() {
        let bodies = |seed| -> Vec<Vec<u8>> {
            let plan = Plan::new(50, 0.5, seed, "P").unwrap();
            plan.messages.into_iter().map(|m| m.body).collect()
        };
        assert_eq!(bodies(3), bodies(3));
        assert_ne!(bodies(3), bodies(4));
    }
}
