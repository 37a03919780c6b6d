//! LISTEN on the outbox's channel, for a relay to wake on.
//!
//! diesel-async has no notification stream, so this holds one plain
//! tokio-postgres connection (the driver under diesel-async, already in the
//! build) outside the pool: LISTEN belongs to a session, and a pooled
//! connection would be handed to someone else.

use inbox_api::InboxError;
use tokio::sync::mpsc;
use tokio_postgres::AsyncMessage;

use crate::SchemaName;

/// Wake-ups from the outbox's trigger: one after each commit of a
/// transaction that enqueued messages (several that come together may
/// arrive as one).
///
/// It does not reconnect: after a lost connection [`OutboxListener::next`]
/// returns `None`, and a relay falls back to polling.
#[derive(Debug)]
pub struct OutboxListener {
    // Kept so that the session, and with it the LISTEN, lives as long as
    // the listener.
    _client: tokio_postgres::Client,
    wakeups: mpsc::Receiver<()>,
}

impl OutboxListener {
    /// Connects to `url` and LISTENs on `schema`'s outbox channel
    /// ([`SchemaName::outbox_channel`]).
    ///
    /// # Errors
    /// [`InboxError::Connection`] (retryable) when the database cannot be
    /// reached or refuses the LISTEN.
    pub async fn connect(url: &str, schema: &SchemaName) -> Result<Self, InboxError> {
        let connection_error = |e: tokio_postgres::Error| InboxError::Connection {
            source: Box::new(e),
        };
        let (client, mut connection) = tokio_postgres::connect(url, tokio_postgres::NoTls)
            .await
            .map_err(connection_error)?;
        // Room for one: a wake-up already waiting covers any that follow.
        let (wake, wakeups) = mpsc::channel(1);
        tokio::spawn(async move {
            loop {
                match std::future::poll_fn(|cx| connection.poll_message(cx)).await {
                    Some(Ok(AsyncMessage::Notification(_))) => {
                        if wake.is_closed() {
                            return;
                        }
                        let _ = wake.try_send(());
                    }
                    Some(Ok(_)) => {}
                    Some(Err(error)) => {
                        tracing::warn!(error = %error, "outbox LISTEN connection failed");
                        return;
                    }
                    None => return,
                }
            }
        });
        client
            .batch_execute(&format!("LISTEN {}", quote(&schema.outbox_channel())))
            .await
            .map_err(connection_error)?;
        Ok(Self {
            _client: client,
            wakeups,
        })
    }

    /// Waits for the next wake-up; `None` once the connection is gone.
    pub async fn next(&mut self) -> Option<()> {
        self.wakeups.recv().await
    }
}

/// `name` as a quoted identifier (a channel name is ASCII letters, digits
/// and '_', so nothing needs escaping; quoted all the same).
fn quote(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}
