//! Consuming one queue, whatever the broker: a worker's slot per
//! delivery (the concurrency), batches collected up to their size or wait,
//! the pause while the store circuit is open, and the graceful end (nothing
//! new, finish what runs, then close the subscription).

use std::sync::Arc;

use tokio::sync::{Semaphore, watch};
use tokio::task::JoinSet;
use tracing::Instrument as _;

use crate::config::BatchConfig;
use crate::delivery::Subscription;
use crate::handler::Handler;
use crate::shutdown::stopped;
use crate::worker::Worker;
use crate::{AppError, ServiceStore};

/// Consumes one queue until shutdown or a broker failure, pausing while the
/// store circuit is open.
pub(crate) async fn queue_loop<S, H, B>(
    mut current: B,
    worker: Worker<S, H, B::Settler>,
    mut shutdown: watch::Receiver<bool>,
) -> Result<(), AppError>
where
    S: ServiceStore,
    H: Handler<S::Transaction>,
    B: Subscription,
{
    let queue = worker.queue.clone();
    let mut available = worker.circuit.subscribe();
    let permits = Arc::new(Semaphore::new(worker.config.concurrency.max(1)));
    if let Some(batch) = worker.config.batch {
        let wanted = batch.size.saturating_mul(worker.config.concurrency.max(1));
        if usize::from(worker.config.prefetch) < wanted {
            tracing::warn!(%queue, prefetch = worker.config.prefetch, batch_size = batch.size,
                concurrency = worker.config.concurrency,
                "prefetch below batch size × concurrency: batches will run short");
        }
        tracing::info!(%queue, batch_size = batch.size, batch_wait = ?batch.wait, "batched mode");
    }
    let mut in_flight = JoinSet::new();

    let failure = loop {
        while let Some(done) = in_flight.try_join_next() {
            if let Err(error) = done {
                tracing::error!(%queue, error = %error, "delivery task failed");
            }
        }
        let step = tokio::select! {
            biased;
            () = stopped(&mut shutdown) => Step::Stop,
            Ok(_) = available.wait_for(|up| !*up) => Step::Pause,
            permit = Arc::clone(&permits).acquire_owned() => match permit {
                Ok(permit) => Step::Permit(permit),
                Err(_) => Step::Stop,
            },
        };
        // With a worker's slot, the next delivery; the pause and shutdown
        // are watched while waiting for either.
        let step = match step {
            Step::Permit(permit) => tokio::select! {
                biased;
                () = stopped(&mut shutdown) => Step::Stop,
                Ok(_) = available.wait_for(|up| !*up) => Step::Pause,
                next = current.next() => Step::Next(next, permit),
            },
            other => other,
        };
        let (next, permit) = match step {
            Step::Next(next, permit) => (next, permit),
            Step::Pause => {
                match pause(&worker, &mut current, &mut available, &mut shutdown).await {
                    Ok(true) => continue,
                    Ok(false) => break None,
                    Err(error) => break Some(error),
                }
            }
            Step::Stop | Step::Permit(_) => break None,
        };
        match next {
            Some(Ok(delivery)) => match worker.config.batch {
                Some(batch) => {
                    let (deliveries, failed) =
                        collect(delivery, &mut current, batch, &mut shutdown, &queue).await;
                    let span = crate::trace::process_span(
                        worker.handler.name().as_str(),
                        &queue,
                        &deliveries.iter().collect::<Vec<_>>(),
                    );
                    let worker = worker.clone();
                    let stop = shutdown.clone();
                    in_flight.spawn(
                        async move {
                            worker.process(deliveries, stop, permit).await;
                        }
                        .instrument(span),
                    );
                    if let Some(error) = failed {
                        break Some(error);
                    }
                }
                None => {
                    let span = crate::trace::process_span(
                        worker.handler.name().as_str(),
                        &queue,
                        &[&delivery],
                    );
                    let worker = worker.clone();
                    let stop = shutdown.clone();
                    in_flight.spawn(
                        async move {
                            worker.process(vec![delivery], stop, permit).await;
                        }
                        .instrument(span),
                    );
                }
            },
            Some(Err(error)) => break Some(error),
            None => {
                break Some(AppError::Unavailable(format!(
                    "the broker cancelled the consumer of {queue}"
                )));
            }
        }
    };

    if let Some(error) = failure {
        // The channel is gone: whatever is in flight cannot be acked, and the
        // broker redelivers it. Let those tasks end on their own (their
        // transactions commit or roll back; the inbox sorts out the
        // redelivery). Waiting acks cannot go out either: their deliveries
        // come back as duplicates.
        in_flight.detach_all();
        current.abandon();
        return Err(error);
    }

    // Graceful: nothing new, finish what runs, then close.
    current.stop().await;
    while in_flight.try_join_next().is_some() {}
    let running = in_flight.len();
    if running > 0 {
        tracing::info!(%queue, running, "waiting for in-flight deliveries");
    }
    while let Some(done) = in_flight.join_next().await {
        if let Err(error) = done {
            tracing::error!(%queue, error = %error, "delivery task failed");
        }
    }
    // Every delivery settled: what waits to go out goes out.
    current.close().await;
    tracing::info!(%queue, "consumer stopped");
    Ok(())
}

/// What the consuming loop does next.
// A local value moved once per delivery: not boxed, which would allocate
// per message.
enum Step<D> {
    Stop,
    Pause,
    Permit(tokio::sync::OwnedSemaphorePermit),
    Next(
        Option<Result<D, AppError>>,
        tokio::sync::OwnedSemaphorePermit,
    ),
}

/// Pauses one queue while the store circuit is open: cancels the
/// subscription so that the broker sends nothing more, hands back what it
/// had already sent (uncharged: the store is away, not the message at
/// fault), waits until the store answers again and subscribes anew.
/// Deliveries in flight finish on their own (released when the store
/// fails them). `Ok(false)` when shutdown came first.
async fn pause<S, H, B>(
    worker: &Worker<S, H, B::Settler>,
    current: &mut B,
    available: &mut watch::Receiver<bool>,
    shutdown: &mut watch::Receiver<bool>,
) -> Result<bool, AppError>
where
    S: ServiceStore,
    H: Handler<S::Transaction>,
    B: Subscription,
{
    let queue = &worker.queue;
    let sent = current.pause().await?;
    for delivery in &sent {
        worker.hand_back(delivery).await;
    }
    tracing::debug!(%queue, handed_back = sent.len(), "consumer paused");
    tokio::select! {
        biased;
        () = stopped(shutdown) => return Ok(false),
        resumed = available.wait_for(|up| *up) => if resumed.is_err() { return Ok(false) },
    }
    current.resume().await?;
    tracing::debug!(%queue, "consumer resumed");
    Ok(true)
}

/// Pulls deliveries after `first` until the batch is full, `wait` has
/// passed since the first, or shutdown. Returns the batch and the
/// consumer's failure, if it failed meanwhile (the batch is still to be
/// processed: its deliveries cannot be acked then, and come back).
async fn collect<B: Subscription>(
    first: B::Delivery,
    consumer: &mut B,
    config: BatchConfig,
    shutdown: &mut watch::Receiver<bool>,
    queue: &str,
) -> (Vec<B::Delivery>, Option<AppError>) {
    let mut batch = Vec::with_capacity(config.size);
    batch.push(first);
    let deadline = tokio::time::Instant::now() + config.wait;
    while batch.len() < config.size {
        let next = tokio::select! {
            biased;
            _ = shutdown.wait_for(|stop| *stop) => break,
            () = tokio::time::sleep_until(deadline) => break,
            next = consumer.next() => next,
        };
        match next {
            Some(Ok(delivery)) => batch.push(delivery),
            Some(Err(error)) => return (batch, Some(error)),
            None => {
                return (
                    batch,
                    Some(AppError::Unavailable(format!(
                        "the broker cancelled the consumer of {queue}"
                    ))),
                );
            }
        }
    }
    (batch, None)
}
