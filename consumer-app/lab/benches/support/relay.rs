//! The outbox relay's publish rate against a bare lapin publisher with
//! confirms (issue 13's target: the relay at least 0.8 × the bare rate).
//!
//! Each cell publishes `messages` Parcel events (the same JSON bodies, the
//! same AMQP properties: message id, type, persistent, `mandatory`) to one
//! durable queue through a direct exchange of the run's own, and is timed
//! from its start (the AMQP connection included, for both) to the last
//! confirm:
//!
//! - bare: one confirm-mode channel, `batch` messages published, then all
//!   their confirms awaited, then the next `batch`: the relay's window;
//! - the relay (`inbox_runtime::relay::Relay`, batch size `batch`, up to `depth`
//!   batches unsettled: its pipeline) over the sqlx and over the diesel
//!   outbox, the messages enqueued beforehand in
//!   transactions of 500 (not timed); the cell ends when the relay has
//!   marked the last message published.
//!
//! The three alternate, in a rotated order, for `reps` repetitions; each
//! repetition's ratio is taken within it. The queue is purged and the
//! published rows deleted before each cell, so every cell starts alike.

use std::num::NonZeroU32;
use std::time::{Duration, Instant};

use chrono::Utc;
use consumer_app::parcel::events::{EVENT_TYPE, ParcelCreatedEvent, ROUTING_KEY};
use futures::future::join_all;
use inbox_api::{
    InboxTransaction as _, MessageId, OutboxStore, OutboxStoreExt as _, OutboxTransaction as _,
    OutgoingMessage,
};
use inbox_runtime::amqp::{close_bounded, connect, no_args};
use inbox_runtime::relay::{Relay, RelayConfig};
use lapin::options::{
    BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions, ExchangeDeleteOptions,
    QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions, QueuePurgeOptions,
};
use lapin::{BasicProperties, Channel, ExchangeKind};

use super::e2e::{AMQP_URL, BoxError};
use super::spread::Spread;

/// Who publishes a cell.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Publisher {
    Bare,
    RelaySqlx,
    RelayDiesel,
}

impl Publisher {
    const ALL: [Self; 3] = [Self::Bare, Self::RelaySqlx, Self::RelayDiesel];

    fn label(self) -> &'static str {
        match self {
            Self::Bare => "bare lapin publisher, confirms, same window",
            Self::RelaySqlx => "outbox relay (sqlx outbox)",
            Self::RelayDiesel => "outbox relay (diesel outbox)",
        }
    }
}

/// What the relay cells measured: messages/s per repetition, per
/// [`Publisher::ALL`].
#[derive(Debug)]
pub(crate) struct RelayRates {
    pub(crate) messages: usize,
    pub(crate) batch: NonZeroU32,
    pub(crate) depth: NonZeroU32,
    pub(crate) rates: [Vec<f64>; 3],
}

/// The run's exchange and queue, on the node the connection reaches.
pub(crate) struct Target {
    connection: lapin::Connection,
    channel: Channel,
    pub(crate) exchange: String,
    queue: String,
}

impl Target {
    /// Declares `<prefix>relay` and its durable queue on the node at
    /// `amqp_url`.
    pub(crate) async fn open(amqp_url: &str, prefix: &str) -> Result<Self, BoxError> {
        let connection = connect(amqp_url, "inbox bench relay setup").await?;
        let channel = connection.create_channel().await?;
        let target = Self {
            connection,
            channel,
            exchange: format!("{prefix}relay"),
            queue: format!("{prefix}relay.q"),
        };
        declare(&target).await?;
        Ok(target)
    }

    /// Empties the queue: every cell starts alike.
    pub(crate) async fn purge(&self) -> Result<(), BoxError> {
        self.channel
            .queue_purge(self.queue.as_str().into(), QueuePurgeOptions::default())
            .await?;
        Ok(())
    }

    /// Deletes the queue and the exchange, best effort, and closes the
    /// connection.
    pub(crate) async fn close(self) {
        let _ = self
            .channel
            .queue_delete(self.queue.as_str().into(), QueueDeleteOptions::default())
            .await;
        let _ = self
            .channel
            .exchange_delete(
                self.exchange.as_str().into(),
                ExchangeDeleteOptions::default(),
            )
            .await;
        close_bounded(&self.connection, "bye").await;
    }
}

/// Runs the relay cells: `reps` repetitions of the three publishers.
pub(crate) async fn run<S, D>(
    sqlx: &S,
    diesel: &D,
    prefix: &str,
    messages: usize,
    batch: NonZeroU32,
    depth: NonZeroU32,
    reps: usize,
) -> Result<RelayRates, BoxError>
where
    S: OutboxStore + Clone + 'static,
    D: OutboxStore + Clone + 'static,
{
    let target = Target::open(AMQP_URL, prefix).await?;
    let mut rates: [Vec<f64>; 3] = Default::default();
    let result = async {
        for rep in 0..reps {
            let mut order = Publisher::ALL;
            order.rotate_left(rep % Publisher::ALL.len());
            for publisher in order {
                let batch_of = events(messages, &target.exchange)?;
                target.purge().await?;
                let rate = match publisher {
                    Publisher::Bare => bare(&target, &batch_of, batch).await?,
                    Publisher::RelaySqlx => {
                        relayed(AMQP_URL, sqlx, &batch_of, batch, depth).await?
                    }
                    Publisher::RelayDiesel => {
                        relayed(AMQP_URL, diesel, &batch_of, batch, depth).await?
                    }
                };
                eprintln!("relay rep {rep}, {publisher:?}: {rate:.0} messages/s");
                let i = Publisher::ALL
                    .iter()
                    .position(|p| *p == publisher)
                    .unwrap_or(0);
                rates[i].push(rate);
            }
        }
        Ok::<(), BoxError>(())
    }
    .await;
    target.close().await;
    result?;
    Ok(RelayRates {
        messages,
        batch,
        depth,
        rates,
    })
}

async fn declare(target: &Target) -> Result<(), BoxError> {
    target
        .channel
        .exchange_declare(
            target.exchange.as_str().into(),
            ExchangeKind::Direct,
            ExchangeDeclareOptions::default(),
            no_args(),
        )
        .await?;
    target
        .channel
        .queue_declare(
            target.queue.as_str().into(),
            QueueDeclareOptions {
                durable: true,
                ..QueueDeclareOptions::default()
            },
            no_args(),
        )
        .await?;
    target
        .channel
        .queue_bind(
            target.queue.as_str().into(),
            target.exchange.as_str().into(),
            ROUTING_KEY.into(),
            QueueBindOptions::default(),
            no_args(),
        )
        .await?;
    Ok(())
}

/// `n` Parcel events for `exchange`, each with a new id.
pub(crate) fn events(n: usize, exchange: &str) -> Result<Vec<OutgoingMessage>, BoxError> {
    (0..n)
        .map(|i| {
            let body = serde_json::to_vec(&ParcelCreatedEvent {
                parcel_id: format!("P-{i}"),
                tracking_number: format!("TN{i}"),
                destination: "Lyon".to_owned(),
            })?;
            Ok(OutgoingMessage::new(
                MessageId::new_v7(),
                exchange,
                ROUTING_KEY,
                EVENT_TYPE,
                body,
            )?)
        })
        .collect()
}

/// The properties the relay gives a message (its id, type, persistent),
/// written out here so that the baseline uses lapin alone.
fn properties(message: &OutgoingMessage) -> BasicProperties {
    BasicProperties::default()
        .with_message_id(message.id().to_string().into())
        .with_type(message.message_type().into())
        .with_headers(lapin::types::FieldTable::default())
        .with_delivery_mode(2)
}

/// The baseline: lapin with confirms, `batch` publishes in flight, then
/// their confirms; messages/s.
async fn bare(
    target: &Target,
    messages: &[OutgoingMessage],
    batch: NonZeroU32,
) -> Result<f64, BoxError> {
    let started = Instant::now();
    let connection = connect(AMQP_URL, "inbox bench bare publisher").await?;
    let channel = connection.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    let options = BasicPublishOptions {
        mandatory: true,
        ..BasicPublishOptions::default()
    };
    let window = usize::try_from(batch.get()).unwrap_or(100);
    for chunk in messages.chunks(window) {
        let mut confirms = Vec::with_capacity(chunk.len());
        for message in chunk {
            confirms.push(
                channel
                    .basic_publish(
                        target.exchange.as_str().into(),
                        message.routing_key().into(),
                        options,
                        message.body(),
                        properties(message),
                    )
                    .await?,
            );
        }
        for confirmation in join_all(confirms).await {
            let confirmation = confirmation?;
            if !confirmation.is_ack() || confirmation.take_message().is_some() {
                return Err("the bare publisher's message was not confirmed".into());
            }
        }
    }
    let elapsed = started.elapsed();
    close_bounded(&connection, "bye").await;
    Ok(messages.len() as f64 / elapsed.as_secs_f64())
}

/// The relay over `store` to the broker at `amqp_url`: `messages`
/// enqueued, then a relay started and timed until it has marked them all
/// published; messages/s.
pub(crate) async fn relayed<S: OutboxStore + Clone + 'static>(
    amqp_url: &str,
    store: &S,
    messages: &[OutgoingMessage],
    batch: NonZeroU32,
    depth: NonZeroU32,
) -> Result<f64, BoxError> {
    // Rows of earlier cells out of the way; pending ones would be a bug.
    store
        .purge_published_before(
            Utc::now() + chrono::Duration::minutes(1),
            NonZeroU32::new(10_000).unwrap_or(NonZeroU32::MIN),
        )
        .await?;
    if store.pending_count().await? != 0 {
        return Err("the outbox holds pending rows before the relay cell".into());
    }
    for chunk in messages.chunks(500) {
        let mut tx = store.begin().await?;
        for message in chunk {
            if tx.enqueue(message).await? != inbox_api::EnqueueOutcome::Enqueued {
                return Err("a new message id was already in the outbox".into());
            }
        }
        tx.commit().await?;
    }
    let mut config = RelayConfig::new(amqp_url, "inbox bench relay");
    config.batch_size = batch;
    config.pipeline_depth = depth;
    let relay = Relay::new(store.clone(), config)?;
    let n = messages.len() as u64;
    // Generous: far below 100 messages/s is a broken run, not a result.
    let limit = Duration::from_secs(30 + n / 100);
    let started = Instant::now();
    let handle = relay.spawn();
    while handle.tally.marked() < n {
        if started.elapsed() > limit {
            handle.shutdown();
            let _ = handle.join().await;
            return Err(format!("the relay did not publish {n} messages within {limit:?}").into());
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let elapsed = started.elapsed();
    handle.shutdown();
    handle.join().await?;
    Ok(n as f64 / elapsed.as_secs_f64())
}

impl RelayRates {
    /// The Markdown section: rates and each relay's ratio to the bare
    /// publisher, with their spread over the repetitions.
    pub(crate) fn markdown(&self) -> String {
        use std::fmt::Write as _;
        let reps = self.rates[0].len();
        let mut out = format!(
            "### Outbox relay publish rate\n\n\
             {} Parcel events per cell to one durable queue, persistent, `mandatory`, \
             publisher confirms, batches of {}: the bare publisher publishes a batch, then \
             awaits its confirms; the relay publishes the next batch while up to {} earlier \
             ones await their confirms and marks (its pipeline depth). The relay's messages \
             enqueued beforehand, timed from the relay's start to its mark of the last one. \
             {reps} repetitions, the three publishers alternated in a rotated order; \
             median (lowest–highest repetition).\n\n\
             | publisher | messages/s | ratio to bare | target |\n|---|---:|---:|---|\n",
            self.messages,
            self.batch,
            self.depth.get() - 1
        );
        for (i, publisher) in Publisher::ALL.iter().enumerate() {
            let rate = super::spread::cell(Spread::of(self.rates[i].iter().copied()), 0);
            let (ratio, target) = if i == 0 {
                (String::new(), String::new())
            } else {
                let r = Spread::ratios(&self.rates[i], &self.rates[0]);
                (
                    super::spread::cell(r, 2),
                    format!("≥ 0.8: {}", super::spread::verdict(r, 0.8)),
                )
            };
            let _ = writeln!(
                out,
                "| {} | {rate} | {ratio} | {target} |",
                publisher.label()
            );
        }
        out
    }
}
