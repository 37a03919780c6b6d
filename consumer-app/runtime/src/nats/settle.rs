//! Settling JetStream deliveries: what each [`Frame`] is on JetStream, and
//! dead letters published to the exchange's dead-letter stream.
//!
//! | Frame | JetStream | why |
//! |---|---|---|
//! | `Ack` | `+ACK`, queued ([`ack_loop`]) | after the commit; one lost is a redelivery the inbox answers `Duplicate` |
//! | `Requeue`, `Release` | `-NAK` with [`REQUEUE_DELAY`] | not the message's fault: back soon |
//! | `RequeueFailed` | `-NAK` with the failure delay | the message failed: the in-process backoff's next step |
//! | `Reject` | `-NAK` with the failure delay | see below |
//!
//! **No dead-letter exchange.** JetStream has nothing like AMQP's
//! `x-dead-letter-exchange`: `+TERM` only stops redelivery, and on an
//! interest stream the message is then gone. So [`Frame::Reject`], the
//! fallback when the runtime's own dead-letter publish failed, is a `nak`
//! with a delay: nothing is lost, the message comes back, and the worker
//! dead-letters it again (the attempt ledger still says it is dead). A
//! message is `term`ed only after its dead letter was stored.
//!
//! JetStream counts every delivery, the message's fault or not, so the
//! consumer's `max_deliver` stays unlimited: the attempt ledger decides
//! when a message is poison, as on a classic RabbitMQ queue.

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::AckKind;
use async_nats::{HeaderMap, Subject};
use futures::future::BoxFuture;
use tokio::sync::{mpsc, watch};

use super::delivery::JetStreamDelivery;
use super::names::{
    DEAD_LETTER_SUBJECT, NATS_MSG_ID, ORIGINAL_MESSAGE_ID, dead_letter_msg_id, dead_letter_subject,
};
use super::progress::InProgress;
use super::publish::send;
use crate::AppError;
use crate::delivery::{DeadLetter, DeadLetterField, Delivery as _, Frame, Settler};

/// The redelivery delay of a delivery handed back through no fault of its
/// own (a store outage, a shutdown mid-way, a lock held elsewhere): soon,
/// but not in a hot loop while the cause lasts.
pub(crate) const REQUEUE_DELAY: Duration = Duration::from_secs(1);

/// The longest redelivery delay of a failed message.
const MAX_FAILED_DELAY: Duration = Duration::from_secs(30);

/// The redelivery delay of a message that failed every in-process attempt:
/// the step the in-process backoff would have taken next
/// (`retry_base_delay × 2^retry_attempts`), between [`REQUEUE_DELAY`]'s
/// tenth and [`MAX_FAILED_DELAY`].
pub(crate) fn failed_delay(retry_base_delay: Duration, retry_attempts: u32) -> Duration {
    retry_base_delay
        .saturating_mul(2_u32.saturating_pow(retry_attempts.min(16)))
        .clamp(REQUEUE_DELAY / 10, MAX_FAILED_DELAY)
}

/// The JetStream [`Settler`] of one queue's subscription.
pub(crate) struct JetStreamSettler {
    pub(crate) client: async_nats::Client,
    pub(crate) js: async_nats::jetstream::Context,
    /// The exchange the queue is bound to: its dead letters' subject.
    pub(crate) exchange: String,
    /// Where committed deliveries' acks wait for [`ack_loop`].
    pub(crate) acks: mpsc::UnboundedSender<Subject>,
    /// The deliveries still being handled, for the in-progress signal.
    pub(crate) in_progress: Arc<InProgress>,
    /// The delay of a `nak` for a failed message.
    pub(crate) failed_delay: Duration,
}

impl JetStreamSettler {
    /// The ack subject of `delivery`, no longer in progress.
    fn take(&self, delivery: &JetStreamDelivery) -> Result<Subject, AppError> {
        let subject = delivery.ack_subject().ok_or_else(|| {
            AppError::broker(
                "settle a JetStream delivery",
                "the delivery has no ack subject",
            )
        })?;
        self.in_progress.settled(subject);
        Ok(subject.clone())
    }

    async fn send(&self, delivery: &JetStreamDelivery, kind: AckKind) -> Result<(), AppError> {
        let subject = self.take(delivery)?;
        self.client
            .publish(subject, kind.into())
            .await
            .map_err(|e| AppError::broker(format!("{kind:?} of a JetStream delivery"), e))
    }
}

impl Settler for JetStreamSettler {
    type Delivery = JetStreamDelivery;

    /// Queues the acks for [`ack_loop`], in order. JetStream's ack is a
    /// plain publish to the delivery's ack subject, unconfirmed: one lost
    /// (the connection dropped first) means the server redelivers after
    /// `ack_wait`, and the inbox answers that copy `Duplicate`.
    fn ack_later(&self, deliveries: &[&JetStreamDelivery]) {
        for delivery in deliveries {
            match self.take(delivery) {
                Ok(subject) => {
                    if self.acks.send(subject).is_err() {
                        tracing::warn!(
                            "ack after the subscription closed; the redelivery will be a duplicate"
                        );
                    }
                }
                Err(error) => tracing::warn!(error = %crate::error::chain(&error),
                    "cannot ack; the redelivery will be a duplicate"),
            }
        }
    }

    fn settle<'a>(
        &'a self,
        delivery: &'a JetStreamDelivery,
        frame: Frame,
    ) -> BoxFuture<'a, Result<(), AppError>> {
        Box::pin(async move {
            match frame {
                Frame::Ack => {
                    self.ack_later(&[delivery]);
                    Ok(())
                }
                Frame::Requeue | Frame::Release => {
                    self.send(delivery, AckKind::Nak(Some(REQUEUE_DELAY))).await
                }
                Frame::RequeueFailed | Frame::Reject => {
                    self.send(delivery, AckKind::Nak(Some(self.failed_delay)))
                        .await
                }
            }
        })
    }

    /// Publishes the dead letter to `dlq.{exchange}.{queue}` and waits for
    /// the dead-letter stream's ack, then `term`s the delivery; if the
    /// publish is not acked, `nak`s it instead (see the module's note on
    /// [`Frame::Reject`]).
    fn dead_letter<'a>(
        &'a self,
        delivery: &'a JetStreamDelivery,
        letter: &'a DeadLetter<'a>,
    ) -> BoxFuture<'a, Result<(), AppError>> {
        Box::pin(async move {
            let subject = dead_letter_subject(&self.exchange, letter.queue);
            let headers = dead_letter_headers(delivery, letter);
            let published =
                send(&self.js, subject, headers, delivery.message.payload.clone()).await;
            match published {
                Ok(_) => {
                    if let Err(error) = self.send(delivery, AckKind::Term).await {
                        // Stored but not terminated: the redelivery is
                        // dead-lettered again, and the dead-letter stream
                        // drops that copy (same `Nats-Msg-Id`).
                        tracing::warn!(error = %crate::error::chain(&error),
                            "term after the dead-letter publish failed");
                    }
                    Ok(())
                }
                Err(error) => {
                    tracing::warn!(error = %error, reason = letter.reason,
                        "dead-letter publish failed; the message comes back after a delay and is dead-lettered again");
                    self.settle(delivery, Frame::Reject).await
                }
            }
        })
    }
}

/// A dead letter's headers: the message's own without JetStream's
/// (`Nats-*`: they describe the original publish, and its `Nats-Msg-Id`
/// would collide in the dead-letter stream's duplicate window), the
/// original id in [`ORIGINAL_MESSAGE_ID`], the subject it was published
/// to, `letter`'s fields ([`DeadLetter::fields`], counts as decimal text),
/// and an id of its own, one per stored message
/// ([`dead_letter_msg_id`]).
pub(crate) fn dead_letter_headers(
    delivery: &JetStreamDelivery,
    letter: &DeadLetter<'_>,
) -> HeaderMap {
    let mut headers = HeaderMap::new();
    if let Some(original) = &delivery.message.headers {
        for (name, values) in original.iter() {
            let text: &str = name.as_ref();
            if text.len() >= 5 && text[..5].eq_ignore_ascii_case("nats-") {
                continue;
            }
            for value in values {
                headers.append(name.clone(), value.clone());
            }
        }
    }
    let id = delivery.message_id();
    if let Some(id) = id {
        headers.insert(ORIGINAL_MESSAGE_ID, id);
    }
    headers.insert(DEAD_LETTER_SUBJECT, delivery.message.subject.as_str());
    for (name, value) in letter.fields() {
        match value {
            DeadLetterField::Text(text) => headers.insert(name, text.as_ref()),
            DeadLetterField::Count(count) => headers.insert(name, count.to_string()),
        }
    }
    headers.insert(
        NATS_MSG_ID,
        dead_letter_msg_id(id, &delivery.stream, delivery.stream_sequence),
    );
    headers
}

/// Sends the queued acks in order until `stop`, then those still queued:
/// the subscription stops it only once every delivery settled, so none is
/// left behind.
pub(crate) async fn ack_loop(
    client: async_nats::Client,
    mut acks: mpsc::UnboundedReceiver<Subject>,
    mut stop: watch::Receiver<bool>,
) {
    let ack = |subject: Subject| {
        let client = client.clone();
        async move {
            if let Err(error) = client.publish(subject, AckKind::Ack.into()).await {
                tracing::warn!(error = %error,
                    "ack failed after commit; the redelivery will be a duplicate");
            }
        }
    };
    loop {
        let next = tokio::select! {
            biased;
            next = acks.recv() => next,
            _ = stop.wait_for(|stop| *stop) => break,
        };
        match next {
            Some(subject) => ack(subject).await,
            None => return,
        }
    }
    while let Ok(subject) = acks.try_recv() {
        ack(subject).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::delivery::{DEAD_LETTER_REASON, INBOX_ATTEMPTS};
    use crate::nats::delivery::lookup;
    use crate::nats::delivery::tests::delivery;

    #[test]
    fn a_dead_letter_keeps_the_message_and_adds_why() {
        let d = delivery(
            &[
                ("Nats-Msg-Id", "m-1"),
                ("Nats-Expected-Stream", "shop"),
                ("Inbox-Message-Type", "order.placed"),
                ("traceparent", "00-t-s-01"),
            ],
            4,
        );
        let letter = DeadLetter {
            reason: "retries_exhausted",
            detail: "boom",
            consumer: "payments",
            queue: "payments",
            failure: Some((3, "boom")),
            traceparent: None,
        };
        let headers = dead_letter_headers(&d, &letter);
        let get = |name| lookup(&headers, name);
        assert_eq!(get(ORIGINAL_MESSAGE_ID), Some("m-1"));
        assert_eq!(get(NATS_MSG_ID), Some("m-1/shop/7"));
        assert_eq!(get("Nats-Expected-Stream"), None);
        assert_eq!(get("Inbox-Message-Type"), Some("order.placed"));
        assert_eq!(get("traceparent"), Some("00-t-s-01"));
        assert_eq!(get(DEAD_LETTER_REASON), Some("retries_exhausted"));
        assert_eq!(get(INBOX_ATTEMPTS), Some("3"));
        assert_eq!(get(DEAD_LETTER_SUBJECT), Some("shop.order.placed"));
    }

    #[test]
    fn a_failed_message_waits_the_backoffs_next_step() {
        assert_eq!(
            failed_delay(Duration::from_millis(100), 3),
            Duration::from_millis(800)
        );
        assert_eq!(failed_delay(Duration::ZERO, 3), REQUEUE_DELAY / 10);
        assert_eq!(failed_delay(Duration::from_secs(10), 30), MAX_FAILED_DELAY);
    }
}
