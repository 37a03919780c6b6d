//! One trace from the request to the last consumer: W3C trace context
//! (`traceparent`, `tracestate`) carried across the outbox, the relay and
//! the broker, and `tracing` spans named and attributed by OpenTelemetry's
//! messaging conventions.
//!
//! - An enqueued message ([`crate::Context::publish`], or any message
//!   passed through [`with_current_context`]) carries the current span's
//!   context in its headers; the outbox row keeps them and the relay sends
//!   them as AMQP headers.
//! - The relay publishes each message in a `publish` span (kind producer)
//!   whose parent is the context the message carries.
//! - The runtime handles a delivery in a `process` span (kind consumer)
//!   whose parent is the context the delivery carries; a batch's span links
//!   to each of its messages' contexts instead. The inbox's claim, the
//!   handler's work and the commit are spans inside it (`inbox.claim`,
//!   `inbox.work`, `inbox.commit`, at debug level); a duplicate or a
//!   conflict is an event on it, and so is each in-process retry (the
//!   retries of one delivery stay in its one span).
//! - What the runtime then does with the deliveries is a `settle` span
//!   inside it (`messaging.operation.type = settle`, at debug level) with a
//!   count per frame: acked, handed back, requeued, dead-lettered. A
//!   committed delivery's ack is only queued there: acks go out coalesced
//!   (see the ack tracker), so no span could time one ack.
//! - A dead letter keeps the message's own context and carries the
//!   failed attempt's in [`DEAD_LETTER_TRACEPARENT`];
//!   [`crate::replay::replay`] turns it into [`REPLAYED_FROM`], and the
//!   replayed delivery's `process` span, still a child of the producer's,
//!   links to the attempt that dead-lettered it. A delivery the broker
//!   redelivers (a requeue, a lost ack) carries what the producer sent and
//!   nothing else, so its span is a sibling of the failed one in the same
//!   trace, without a link: `basic.reject` cannot add a header.
//!
//! The spans exist whatever the build; the `otel` feature connects them
//! into one OpenTelemetry trace (a subscriber with
//! `tracing_opentelemetry::layer()` exports them). Without it, nothing is
//! written into a message's headers and nothing is read from them.

use std::collections::BTreeMap;

use inbox_api::{InboxError, OutgoingMessage};
use tracing::Span;

use crate::delivery::Delivery;
#[cfg(feature = "otel")]
use crate::message::header_text;

/// The level of the `request`, `publish` and `process` spans: info when
/// they are exported (`otel`), debug otherwise, so that a service's info
/// log lines do not carry span fields it has no use for.
const SPAN_LEVEL: tracing::Level = if cfg!(feature = "otel") {
    tracing::Level::INFO
} else {
    tracing::Level::DEBUG
};

/// The W3C header that names the parent span.
pub const TRACEPARENT: &str = "traceparent";

/// The W3C header that carries vendor state beside it.
pub const TRACESTATE: &str = "tracestate";

/// The header of a dead letter that names the span of the attempt that
/// dead-lettered it (a W3C `traceparent` value).
pub use crate::delivery::DEAD_LETTER_TRACEPARENT;

/// The header of a replayed dead letter that names the span of the attempt
/// that dead-lettered it: the replayed delivery's span links to it.
pub const REPLAYED_FROM: &str = "x-replayed-from-traceparent";

/// `span`'s `traceparent`, when it belongs to a trace (never without the
/// `otel` feature).
#[must_use]
pub fn traceparent_of(span: &Span) -> Option<String> {
    headers_of(span).remove(TRACEPARENT)
}

/// The current span's trace context as W3C headers; empty without the
/// `otel` feature, or when the current span belongs to no trace.
#[must_use]
pub fn current_headers() -> BTreeMap<String, String> {
    headers_of(&Span::current())
}

fn headers_of(span: &Span) -> BTreeMap<String, String> {
    #[cfg(feature = "otel")]
    {
        use opentelemetry::propagation::TextMapPropagator as _;
        use tracing_opentelemetry::OpenTelemetrySpanExt as _;
        let mut headers = std::collections::HashMap::new();
        opentelemetry_sdk::propagation::TraceContextPropagator::new()
            .inject_context(&span.context(), &mut headers);
        headers.into_iter().collect()
    }
    #[cfg(not(feature = "otel"))]
    {
        let _ = span;
        BTreeMap::new()
    }
}

/// `message` with the current span's trace context in its headers (see
/// [`current_headers`]), so that whoever handles it continues this trace.
///
/// # Errors
/// [`InboxError::InvalidArgument`] when a header does not fit the
/// message's limits (never for a well-formed context).
pub fn with_current_context(message: OutgoingMessage) -> Result<OutgoingMessage, InboxError> {
    current_headers()
        .into_iter()
        .try_fold(message, |message, (name, value)| {
            message.with_header(name, value)
        })
}

/// The span a relay publishes `message` in: its parent is the context the
/// message carries.
pub(crate) fn publish_span(message: &OutgoingMessage, system: &str) -> Span {
    let span = tracing::span!(
        SPAN_LEVEL,
        "publish",
        otel.name = %format!("{} publish", message.exchange()),
        otel.kind = "producer",
        messaging.system = %system,
        messaging.operation.type = "send",
        messaging.destination.name = %message.exchange(),
        messaging.rabbitmq.destination.routing_key = %message.routing_key(),
        messaging.message.id = %message.id(),
    );
    #[cfg(feature = "otel")]
    {
        let headers = message.headers();
        set_parent(&span, |name| headers.get(name).cloned());
    }
    span
}

/// The span an HTTP server handles a request to `route` in (kind server):
/// its parent is the context the request's headers carry (`get` reads a
/// header by its lower-case name), so a client's trace continues through
/// the outbox.
pub fn request_span(method: &str, route: &str, get: impl Fn(&str) -> Option<String>) -> Span {
    let span = tracing::span!(
        SPAN_LEVEL,
        "request",
        otel.name = %format!("{method} {route}"),
        otel.kind = "server",
        http.request.method = %method,
        http.route = %route,
    );
    #[cfg(feature = "otel")]
    set_parent(&span, get);
    #[cfg(not(feature = "otel"))]
    let _ = get;
    span
}

/// The span `consumer` handles deliveries from `queue` in: one delivery's
/// span continues the trace its headers carry; a batch's links to each.
pub(crate) fn process_span<D: Delivery>(consumer: &str, queue: &str, deliveries: &[&D]) -> Span {
    let span = tracing::span!(
        SPAN_LEVEL,
        "process",
        otel.name = %format!("{queue} process"),
        otel.kind = "consumer",
        messaging.system = "rabbitmq",
        messaging.operation.type = "process",
        messaging.destination.name = %queue,
        messaging.consumer.group.name = %consumer,
        messaging.batch.message_count = deliveries.len(),
        messaging.message.id = tracing::field::Empty,
    );
    if let [delivery] = deliveries
        && let Some(id) = delivery.message_id()
    {
        span.record("messaging.message.id", id);
    }
    #[cfg(feature = "otel")]
    {
        match deliveries {
            [delivery] => set_parent(&span, |name| header_text(*delivery, name)),
            batch => {
                for delivery in batch {
                    link(&span, |name| header_text(*delivery, name));
                }
            }
        }
        // A replayed dead letter links to the attempt that gave it up.
        for delivery in deliveries {
            if let Some(failed) = header_text(*delivery, REPLAYED_FROM) {
                link(&span, |name| (name == TRACEPARENT).then(|| failed.clone()));
            }
        }
    }
    span
}

/// The span `consumer` settles an attempt's deliveries from `queue` in:
/// how many went out with each frame. Opened once the attempt's outcomes
/// are decided, inside its `process` span.
pub(crate) fn settle_span(consumer: &str, queue: &str) -> Span {
    tracing::debug_span!(
        "settle",
        otel.name = %format!("{queue} settle"),
        otel.kind = "client",
        messaging.system = "rabbitmq",
        messaging.operation.type = "settle",
        messaging.destination.name = %queue,
        messaging.consumer.group.name = %consumer,
        acked = tracing::field::Empty,
        handed_back = tracing::field::Empty,
        requeued = tracing::field::Empty,
        released = tracing::field::Empty,
        dead_lettered = tracing::field::Empty,
    )
}

/// Adds a link from `span` to the context the headers `get` yields, if
/// they carry one.
#[cfg(feature = "otel")]
fn link(span: &Span, get: impl Fn(&str) -> Option<String>) {
    use opentelemetry::trace::TraceContextExt as _;
    use tracing_opentelemetry::OpenTelemetrySpanExt as _;
    let linked = extract(get).span().span_context().clone();
    if linked.is_valid() {
        span.add_link(linked);
    }
}

#[cfg(feature = "otel")]
fn set_parent(span: &Span, get: impl Fn(&str) -> Option<String>) {
    use opentelemetry::trace::TraceContextExt as _;
    use tracing_opentelemetry::OpenTelemetrySpanExt as _;
    let cx = extract(get);
    if cx.span().span_context().is_valid() {
        let _ = span.set_parent(cx);
    }
}

/// The remote context the headers `get` yields (W3C Trace Context), or
/// an empty one.
#[cfg(feature = "otel")]
fn extract(get: impl Fn(&str) -> Option<String>) -> opentelemetry::Context {
    use opentelemetry::propagation::TextMapPropagator as _;
    let headers: std::collections::HashMap<String, String> = [TRACEPARENT, TRACESTATE]
        .into_iter()
        .filter_map(|name| get(name).map(|value| (name.to_owned(), value)))
        .collect();
    opentelemetry_sdk::propagation::TraceContextPropagator::new().extract(&headers)
}
