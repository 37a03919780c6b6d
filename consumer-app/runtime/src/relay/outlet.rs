//! What the relay needs of a broker, so that its loop (take, publish,
//! settle, mark, back off, reconnect) is written once above every broker:
//! a connection that publishes a batch and says, per message, whether the
//! broker took it.

use std::future::Future;
use std::time::Duration;

use futures::future::BoxFuture;
use inbox_api::OutgoingMessage;

use crate::AppError;
use crate::broker::ConnectOptions;

/// One connection of the relay's to its broker.
pub(crate) trait Outlet: Sized + Send + Sync + 'static {
    /// What one batch in flight has to itself until every publish of it
    /// is settled (RabbitMQ: a confirm-mode channel, whose returns and
    /// confirms are then only that batch's).
    type Lane: Send + 'static;

    /// The broker's name in log lines.
    const NAME: &'static str;

    /// Opens one connection named `name` to the broker at `url`.
    fn connect(
        url: &str,
        name: &str,
        options: ConnectOptions,
    ) -> impl Future<Output = Result<Self, AppError>> + Send;

    /// Whether the connection still stands: a lost one is replaced.
    fn is_open(&self) -> bool;

    /// A lane for the next batch, on which `exchanges` exist: an idle one,
    /// or a new one.
    fn lane(
        &mut self,
        exchanges: &[String],
    ) -> impl Future<Output = Result<Self::Lane, AppError>> + Send;

    /// Publishes `messages` on `lane` (`mandatory`: an unroutable message
    /// comes back instead of being dropped) and returns what settles them:
    /// one result per message, in order, within `timeout` from now in all.
    /// The future owns what it needs: it is awaited on the batch's own task
    /// while the relay publishes the next batch.
    fn publish(
        lane: &Self::Lane,
        messages: &[OutgoingMessage],
        mandatory: bool,
        timeout: Duration,
    ) -> impl Future<Output = BoxFuture<'static, Vec<Result<(), PublishFailure>>>> + Send;

    /// Takes back the lanes of settled batches, for the next ones.
    fn give_back(&mut self, lanes: Vec<Self::Lane>);

    /// Closes a lane that must not carry another batch (its connection
    /// failed, or a publish of it was never settled).
    fn retire(lane: Self::Lane) -> impl Future<Output = ()> + Send;

    /// Closes the connection, bounded.
    fn close(self) -> impl Future<Output = ()> + Send;
}

/// Why the broker did not confirm one message.
#[derive(Debug, thiserror::Error)]
pub(crate) enum PublishFailure {
    /// The broker refused it (AMQP: a nack, e.g. its queue is full and
    /// rejects publishes).
    #[error("nacked by the broker")]
    #[cfg_attr(not(feature = "rabbitmq"), allow(dead_code))]
    Nack,
    /// No queue or stream takes it (AMQP: returned unroutable).
    #[error("returned unroutable: {0}")]
    Returned(String),
    /// The lane or its connection failed under it.
    #[error("channel failed: {0}")]
    Channel(#[source] inbox_api::BoxError),
    /// No answer in time.
    #[error("no confirm within {0:?}")]
    Timeout(Duration),
}

impl PublishFailure {
    /// The `reason` label of `outbox_publish_failures_total`.
    pub(crate) fn reason(&self) -> &'static str {
        match self {
            Self::Nack => "nack",
            Self::Returned(_) => "returned",
            Self::Channel(_) => "channel",
            Self::Timeout(_) => "timeout",
        }
    }

    /// Whether the lane must be retired: an answer it still owes could
    /// reach the next batch.
    pub(crate) fn breaks_channel(&self) -> bool {
        matches!(self, Self::Channel(_) | Self::Timeout(_))
    }

    /// Whether the broker refused this message for its own sake, so that
    /// the refusal counts toward its dead-letter limit. A closed channel or
    /// a missing confirm is the broker's or the network's state, shared by
    /// every message in flight: never charged.
    pub(crate) fn is_refusal(&self) -> bool {
        matches!(self, Self::Nack | Self::Returned(_))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failures_that_break_the_channel_reopen_it() {
        assert!(PublishFailure::Timeout(Duration::ZERO).breaks_channel());
        assert!(!PublishFailure::Nack.breaks_channel());
        // Only the message's own refusals are charged to it.
        assert!(PublishFailure::Nack.is_refusal());
        assert!(PublishFailure::Returned("312 NO_ROUTE".into()).is_refusal());
        assert!(!PublishFailure::Timeout(Duration::ZERO).is_refusal());
        assert_eq!(PublishFailure::Returned(String::new()).reason(), "returned");
    }
}
