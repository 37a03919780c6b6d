//! RabbitMQ plumbing: connecting with backoff, a confirming publisher, and
//! lapin's delivery read as a [`crate::delivery::Delivery`].
//!
//! Every publish waits for the broker's confirm: a message the broker did
//! not take is an error here, never a silent loss.

use std::borrow::Cow;
use std::collections::VecDeque;

use lapin::message::Delivery;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, PublisherConfirm};
use tokio::sync::watch;

use serde::Serialize;

use crate::AppError;
use crate::delivery::{HeaderValue, Headers};
use crate::redact::redact_url;
use crate::shutdown::bounded;

pub use crate::broker::{CONNECT_TIMEOUT, ConnectOptions, DEFAULT_HEARTBEAT, OnRefusal};

/// Opens one connection, named so that `rabbitmqctl list_connections
/// user_provided_name` shows which instance it is, with the default
/// [`ConnectOptions`].
///
/// # Errors
/// As [`connect_with`].
pub async fn connect(url: &str, name: &str) -> Result<Connection, AppError> {
    connect_with(url, name, ConnectOptions::default()).await
}

/// [`connect`] with `options`.
///
/// `amqps://` URLs connect over TLS (the `tls` feature), verifying the
/// broker's certificate and host name against the system's roots, or
/// against the CA file of `cacertfile`; `certfile` and `keyfile` present a
/// client certificate (with `auth_mechanism=external`, it is the login).
///
/// # Errors
/// [`AppError::CredentialsRefused`] when the broker refuses the login;
/// [`AppError::Config`] when the URL is unusable (TLS files that cannot be
/// read, `amqps://` without the `tls` feature); [`AppError::Broker`] when the
/// broker cannot be reached or refuses otherwise (a TLS handshake that fails
/// names its cause); [`AppError::Unavailable`] when it does not answer
/// within the timeout.
pub async fn connect_with(
    url: &str,
    name: &str,
    options: ConnectOptions,
) -> Result<Connection, AppError> {
    let target = crate::rabbitmq::url::Target::parse(url, options.heartbeat)?;
    let properties = ConnectionProperties::default().with_connection_name(name.into());
    let timeout = options.timeout;
    let connecting = target.connect(properties);
    match tokio::time::timeout(timeout, connecting).await {
        Ok(Ok(connection)) => Ok(connection),
        Ok(Err(error)) if crate::rabbitmq::url::is_login_refused(&error) => {
            Err(AppError::CredentialsRefused {
                url: redact_url(url),
                source: error.into(),
            })
        }
        Ok(Err(error)) => {
            let hint = crate::rabbitmq::url::hint(url, &error);
            Err(AppError::broker(
                format!("connect to {}{hint}", redact_url(url)),
                error,
            ))
        }
        Err(_) => Err(AppError::Unavailable(format!(
            "connect to {}: no AMQP answer within {timeout:?} (something accepts the \
             connection but does not speak AMQP, or the broker is hung)",
            redact_url(url)
        ))),
    }
}

/// Opens a channel on `connection` within [`CONNECT_TIMEOUT`]; `what`
/// names it in the error.
///
/// # Errors
/// [`AppError::Broker`] when the broker refuses; [`AppError::Unavailable`]
/// when it does not answer in time.
pub async fn open_channel(connection: &Connection, what: &str) -> Result<Channel, AppError> {
    match tokio::time::timeout(CONNECT_TIMEOUT, connection.create_channel()).await {
        Ok(opened) => opened.map_err(|e| AppError::broker(format!("open {what}"), e)),
        Err(_) => Err(AppError::Unavailable(format!(
            "open {what}: no answer from the broker within {CONNECT_TIMEOUT:?}"
        ))),
    }
}

/// Connects with `options`, retrying with the reconnect backoff until it
/// works, `attempts` run out (`None`: forever), the broker refuses the login
/// and `on_refusal` says [`OnRefusal::Fail`], or `shutdown` turns true,
/// which ends an attempt in progress too. Each failure's cause goes to
/// `last_error` (for a readiness check that says why), and `None` once
/// connected.
///
/// # Errors
/// The last connection error, or [`AppError::Unavailable`] on shutdown.
pub async fn connect_with_backoff(
    url: &str,
    name: &str,
    options: ConnectOptions,
    attempts: Option<u32>,
    on_refusal: OnRefusal,
    shutdown: &mut watch::Receiver<bool>,
    last_error: Option<&watch::Sender<Option<String>>>,
) -> Result<Connection, AppError> {
    let retrying = crate::broker::Retrying {
        attempts,
        on_refusal,
        last_error,
    };
    crate::broker::connect_with_backoff(
        url,
        "RabbitMQ",
        || connect_with(url, name, options),
        retrying,
        shutdown,
    )
    .await
}

/// A message to publish.
#[derive(Clone, Debug)]
pub struct Outgoing {
    /// The AMQP `message_id` (`None`: unset, for bad-input tests).
    pub message_id: Option<String>,
    /// The AMQP `type` (`None`: unset).
    pub kind: Option<String>,
    /// The body.
    pub body: Vec<u8>,
}

impl Outgoing {
    /// A well-formed message: `body` as JSON, with its id and its AMQP
    /// `type`. The producer must reuse the id when it publishes the same
    /// message again: the id is what the consumers' inboxes deduplicate on.
    ///
    /// # Errors
    /// [`AppError::Config`] when `body` does not serialise.
    pub fn json<T: Serialize>(
        message_id: &inbox_api::MessageId,
        kind: &str,
        body: &T,
    ) -> Result<Self, AppError> {
        let body = serde_json::to_vec(body)
            .map_err(|e| AppError::Config(format!("cannot serialise the message: {e}")))?;
        Ok(Self {
            message_id: Some(message_id.to_string()),
            kind: Some(kind.to_owned()),
            body,
        })
    }

    fn properties(&self) -> BasicProperties {
        let mut properties = BasicProperties::default()
            .with_delivery_mode(2)
            .with_content_type("application/json".into());
        if let Some(id) = &self.message_id {
            properties = properties.with_message_id(id.as_str().into());
        }
        if let Some(kind) = &self.kind {
            properties = properties.with_type(kind.as_str().into());
        }
        properties
    }
}

/// Publishes to one exchange with one routing key, on a channel in confirm
/// mode.
pub struct Publisher {
    channel: Channel,
    exchange: String,
    routing_key: String,
}

impl Publisher {
    /// A publisher to `exchange` with `routing_key` on a new channel of
    /// `connection`, with confirms on.
    ///
    /// # Errors
    /// Broker errors.
    pub async fn new(
        connection: &Connection,
        exchange: &str,
        routing_key: &str,
    ) -> Result<Self, AppError> {
        let channel = open_channel(connection, "publisher channel").await?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(|e| AppError::broker("enable publisher confirms", e))?;
        Ok(Self {
            channel,
            exchange: exchange.to_owned(),
            routing_key: routing_key.to_owned(),
        })
    }

    /// The channel, e.g. to declare the topology on.
    pub fn channel(&self) -> &Channel {
        &self.channel
    }

    async fn send(&self, message: &Outgoing) -> Result<PublisherConfirm, AppError> {
        self.channel
            .basic_publish(
                self.exchange.as_str().into(),
                self.routing_key.as_str().into(),
                BasicPublishOptions {
                    mandatory: true,
                    ..BasicPublishOptions::default()
                },
                &message.body,
                message.properties(),
            )
            .await
            .map_err(|e| AppError::broker("publish", e))
    }

    /// Publishes one message and waits for the broker's confirm.
    ///
    /// # Errors
    /// [`AppError::NotConfirmed`] on a nack or an unroutable message.
    pub async fn publish(&self, message: &Outgoing) -> Result<(), AppError> {
        let confirm = self.send(message).await?;
        check_confirm(confirm).await
    }

    /// Publishes many messages, keeping up to `window` confirms outstanding,
    /// and calls `progress` after each confirmed one.
    ///
    /// # Errors
    /// The first unconfirmed publish.
    pub async fn publish_all(
        &self,
        messages: &[Outgoing],
        window: usize,
        mut progress: impl FnMut(usize),
    ) -> Result<(), AppError> {
        let mut pending = VecDeque::with_capacity(window);
        let mut confirmed = 0;
        for message in messages {
            if pending.len() >= window.max(1)
                && let Some(confirm) = pending.pop_front()
            {
                check_confirm(confirm).await?;
                confirmed += 1;
                progress(confirmed);
            }
            pending.push_back(self.send(message).await?);
        }
        while let Some(confirm) = pending.pop_front() {
            check_confirm(confirm).await?;
            confirmed += 1;
            progress(confirmed);
        }
        Ok(())
    }

    /// Publishes `message` to `exchange` with `routing_key` and extra
    /// `properties`, and waits for the confirm (the dead-letter path).
    ///
    /// # Errors
    /// As [`Publisher::publish`].
    pub async fn publish_raw(
        channel: &Channel,
        exchange: &str,
        routing_key: &str,
        body: &[u8],
        properties: BasicProperties,
    ) -> Result<(), AppError> {
        let confirm = channel
            .basic_publish(
                exchange.into(),
                routing_key.into(),
                BasicPublishOptions {
                    mandatory: true,
                    ..BasicPublishOptions::default()
                },
                body,
                properties,
            )
            .await
            .map_err(|e| AppError::broker(format!("publish to {exchange}"), e))?;
        check_confirm(confirm).await
    }

    /// Closes the channel (bounded).
    pub async fn close(self) {
        close_channel_bounded(&self.channel, "publisher done").await;
    }
}

async fn check_confirm(confirm: PublisherConfirm) -> Result<(), AppError> {
    let confirmation = confirm
        .await
        .map_err(|e| AppError::broker("wait for publisher confirm", e))?;
    if !confirmation.is_ack() {
        return Err(AppError::NotConfirmed(
            "the broker nacked the message".into(),
        ));
    }
    if let Some(returned) = confirmation.take_message() {
        return Err(AppError::NotConfirmed(format!(
            "the message was returned unroutable ({} {})",
            returned.reply_code, returned.reply_text
        )));
    }
    Ok(())
}

/// Closes `connection`, giving up after
/// [`crate::shutdown::TEARDOWN_LIMIT`] with a log line: lapin's
/// close can wait for ever for a close-ok that never comes once the socket
/// is gone, and a caller that is only tidying up must not hang on it.
pub async fn close_bounded(connection: &Connection, reason: &str) {
    let close = connection.close(200, reason.into());
    if let Some(Err(error)) = bounded("close the AMQP connection", close).await {
        tracing::debug!(reason, error = %error, "closing the AMQP connection failed");
    }
}

/// Closes `channel`, bounded like [`close_bounded`].
pub async fn close_channel_bounded(channel: &Channel, reason: &str) {
    let close = channel.close(200, reason.into());
    if let Some(Err(error)) = bounded("close the AMQP channel", close).await {
        tracing::debug!(reason, error = %error, "closing the AMQP channel failed");
    }
}

/// An empty argument table.
pub fn no_args() -> FieldTable {
    FieldTable::default()
}

/// A string as an AMQP header or argument value.
pub(crate) fn long_string(text: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(text.as_bytes().to_vec()))
}

/// An AMQP header value as the runtime reads headers: text, or an integer
/// of any width (a producer in another language picks its own; a
/// timestamp is a count of seconds).
fn header_value(value: &AMQPValue) -> HeaderValue<'_> {
    match value {
        AMQPValue::LongString(s) => HeaderValue::Text(String::from_utf8_lossy(s.as_bytes())),
        AMQPValue::ShortString(s) => HeaderValue::Text(Cow::Borrowed(s.as_str())),
        AMQPValue::ShortShortInt(v) => HeaderValue::Integer(i128::from(*v)),
        AMQPValue::ShortShortUInt(v) => HeaderValue::Integer(i128::from(*v)),
        AMQPValue::ShortInt(v) => HeaderValue::Integer(i128::from(*v)),
        AMQPValue::ShortUInt(v) => HeaderValue::Integer(i128::from(*v)),
        AMQPValue::LongInt(v) => HeaderValue::Integer(i128::from(*v)),
        AMQPValue::LongUInt(v) => HeaderValue::Integer(i128::from(*v)),
        AMQPValue::LongLongInt(v) => HeaderValue::Integer(i128::from(*v)),
        AMQPValue::Timestamp(v) => HeaderValue::Integer(i128::from(*v)),
        _ => HeaderValue::Other,
    }
}

impl Headers for FieldTable {
    fn header(&self, name: &str) -> Option<HeaderValue<'_>> {
        self.inner().get(name).map(header_value)
    }
}

impl Headers for Delivery {
    fn header(&self, name: &str) -> Option<HeaderValue<'_>> {
        self.properties.headers().as_ref()?.header(name)
    }
}

impl crate::delivery::Delivery for Delivery {
    fn message_id(&self) -> Option<&str> {
        self.properties.message_id().as_ref().map(|id| id.as_str())
    }

    fn kind(&self) -> Option<&str> {
        self.properties.kind().as_ref().map(|kind| kind.as_str())
    }

    fn body(&self) -> &[u8] {
        &self.data
    }

    fn redelivered(&self) -> bool {
        self.redelivered
    }

    fn earlier_deliveries(&self) -> u64 {
        earlier_deliveries(self)
    }
}

/// `x-delivery-count`, which quorum queues set on a redelivery (classic
/// queues count nothing).
fn earlier_deliveries(headers: &impl Headers) -> u64 {
    headers
        .header("x-delivery-count")
        .and_then(|count| count.as_count())
        .unwrap_or(0)
}

#[cfg(test)]
mod delivery_tests {
    use super::*;

    #[test]
    fn delivery_counts_read_every_integer_width() {
        for (value, expected) in [
            (AMQPValue::LongInt(3), 3),
            (AMQPValue::LongLongInt(7), 7),
            (AMQPValue::ShortShortUInt(2), 2),
            (AMQPValue::LongInt(-1), 0),
            (long_string("4"), 0),
        ] {
            let mut headers = FieldTable::default();
            headers.insert("x-delivery-count".into(), value.clone());
            assert_eq!(earlier_deliveries(&headers), expected, "{value:?}");
        }
        assert_eq!(earlier_deliveries(&FieldTable::default()), 0);
    }
}
