//! How the runtime's names (an exchange, a routing key, a queue) become
//! JetStream's (a stream, a subject, a consumer): pure functions, so that
//! a producer in another language can derive the same names from this
//! table.
//!
//! | AMQP                        | JetStream                                   |
//! |-----------------------------|---------------------------------------------|
//! | exchange `shop.events`      | stream `shop_events`, subjects `shop.events.>` |
//! | publish with key `order.placed` | subject `shop.events.order.placed`      |
//! | queue `payments` bound `order.*` | durable consumer `payments`, filter `shop.events.order.*` |
//! | binding key `order.#`       | filter `shop.events.order.>`                |
//! | the queue's `.dlx`/`.dlq`   | stream `shop_events_DLQ`, subject `dlq.shop.events.payments` |
//!
//! Stream and consumer names may not contain `.`, `*`, `>`, spaces or path
//! separators: those become `_`. Two exchanges whose names differ only
//! there (`a.b` and `a_b`) would share a stream, and an exchange named
//! like a prefix of another's subjects (`a` and `a.b`) overlaps it, which
//! JetStream refuses: pick exchange names that stay apart.

/// The header that carries a message's type (AMQP's `type` property),
/// which picks the handler. A header of the runtime's own: NATS has no
/// such field, and a header name that says what it is keeps a producer in
/// another language from guessing.
pub const MESSAGE_TYPE: &str = "Inbox-Message-Type";

/// The header of a dead letter that keeps the original message's id:
/// the dead letter's own `Nats-Msg-Id` is another (see
/// [`dead_letter_msg_id`]), so that the dead-letter stream's duplicate
/// window cannot mistake two letters, yet a replay can restore the id
/// the consumers' inboxes know.
pub const ORIGINAL_MESSAGE_ID: &str = "Inbox-Message-Id";

/// The header of a dead letter that names the subject the message was
/// published to (its routing key, for a replay).
pub const DEAD_LETTER_SUBJECT: &str = "x-dead-letter-subject";

/// JetStream's own id header, which its duplicate window deduplicates on,
/// and which the runtime reads as the message id.
pub const NATS_MSG_ID: &str = "Nats-Msg-Id";

/// Replaces what a stream or consumer name may not contain with `_`.
fn name_token(name: &str) -> String {
    name.chars()
        .map(|c| match c {
            '.' | '*' | '>' | '/' | '\\' => '_',
            c if c.is_whitespace() || c.is_control() => '_',
            c => c,
        })
        .collect()
}

/// The stream of `exchange`'s messages.
#[must_use]
pub fn stream_name(exchange: &str) -> String {
    name_token(exchange)
}

/// The subjects `exchange`'s stream takes: every subject under it.
#[must_use]
pub fn stream_subjects(exchange: &str) -> String {
    format!("{exchange}.>")
}

/// The subject a message published to `exchange` with `routing_key` goes
/// to.
#[must_use]
pub fn subject(exchange: &str, routing_key: &str) -> String {
    format!("{exchange}.{routing_key}")
}

/// The filter subject of a queue bound to `exchange` with the AMQP topic
/// pattern `routing_key`: `*` (one word) stays `*`, a trailing `#` (any
/// number of words) becomes `>`.
///
/// JetStream's `>` matches one word or more where AMQP's `#` matches zero
/// or more: `order.#` also matches `order` on RabbitMQ, not here. A `#`
/// anywhere but at the end has no JetStream equivalent; it becomes `*`
/// (one word), the nearest narrower match, rather than a filter that
/// takes more than the binding said.
#[must_use]
pub fn filter_subject(exchange: &str, routing_key: &str) -> String {
    let words: Vec<&str> = routing_key.split('.').collect();
    let last = words.len().saturating_sub(1);
    let mapped: Vec<&str> = words
        .iter()
        .enumerate()
        .map(|(i, word)| match *word {
            "#" if i == last => ">",
            "#" => "*",
            other => other,
        })
        .collect();
    format!("{exchange}.{}", mapped.join("."))
}

/// The durable consumer of `queue`.
#[must_use]
pub fn consumer_name(queue: &str) -> String {
    name_token(queue)
}

/// The stream of `exchange`'s dead letters.
#[must_use]
pub fn dead_letter_stream(exchange: &str) -> String {
    format!("{}_DLQ", stream_name(exchange))
}

/// The subjects of `exchange`'s dead-letter stream.
#[must_use]
pub fn dead_letter_subjects(exchange: &str) -> String {
    format!("dlq.{exchange}.>")
}

/// The subject of `queue`'s dead letters. The queue is one word of it
/// (its `.` become `_`), so that one queue's letters are one subject.
#[must_use]
pub fn dead_letter_subject(exchange: &str, queue: &str) -> String {
    format!("dlq.{exchange}.{}", name_token(queue))
}

/// The `Nats-Msg-Id` of the dead letter of the message at `sequence` in
/// `stream`, whose own id was `message_id`: the same for every attempt to
/// dead-letter that one stored message (the dead-letter stream's
/// duplicate window then keeps one letter when a `term` after the publish
/// was lost and the redelivery is dead-lettered again), another for a
/// replayed copy (a new sequence).
#[must_use]
pub fn dead_letter_msg_id(message_id: Option<&str>, stream: &str, sequence: u64) -> String {
    format!("{}/{stream}/{sequence}", message_id.unwrap_or("-"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream_and_consumer_names_have_no_dots_or_wildcards() {
        assert_eq!(stream_name("shop.events"), "shop_events");
        assert_eq!(stream_name("a b*c>d/e"), "a_b_c_d_e");
        assert_eq!(stream_name("plain-name_1"), "plain-name_1");
        assert_eq!(consumer_name("payments.q"), "payments_q");
        assert_eq!(dead_letter_stream("shop.events"), "shop_events_DLQ");
    }

    #[test]
    fn subjects_are_the_exchange_then_the_routing_key() {
        assert_eq!(stream_subjects("shop.events"), "shop.events.>");
        assert_eq!(
            subject("shop.events", "order.placed"),
            "shop.events.order.placed"
        );
        assert_eq!(dead_letter_subjects("shop"), "dlq.shop.>");
        assert_eq!(
            dead_letter_subject("shop", "payments.q"),
            "dlq.shop.payments_q"
        );
    }

    #[test]
    fn topic_wildcards_map_to_subject_wildcards() {
        assert_eq!(filter_subject("shop", "order.placed"), "shop.order.placed");
        assert_eq!(filter_subject("shop", "order.*"), "shop.order.*");
        assert_eq!(filter_subject("shop", "*.placed"), "shop.*.placed");
        assert_eq!(filter_subject("shop", "order.#"), "shop.order.>");
        assert_eq!(filter_subject("shop", "#"), "shop.>");
        // Mid-pattern `#`: the narrower one-word match.
        assert_eq!(filter_subject("shop", "a.#.b"), "shop.a.*.b");
    }

    #[test]
    fn a_dead_letter_id_is_one_per_stored_message() {
        let first = dead_letter_msg_id(Some("m-1"), "shop", 7);
        assert_eq!(first, dead_letter_msg_id(Some("m-1"), "shop", 7));
        assert_ne!(first, dead_letter_msg_id(Some("m-1"), "shop", 8));
        assert_ne!(first, dead_letter_msg_id(Some("m-1"), "other", 7));
        assert_eq!(dead_letter_msg_id(None, "shop", 7), "-/shop/7");
    }
}
