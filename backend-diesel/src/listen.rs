//! LISTEN on the outbox's channel, for a relay to wake on.
//!
//! diesel-async has no notification stream, so this holds one plain
//! tokio-postgres connection (the driver under diesel-async, already in the
//! build) outside the pool: LISTEN belongs to a session, and a pooled
//! connection would be handed to someone else.
//!
//! The session is supervised: when it ends (a database restart, a killed
//! backend, a dropped network), a task reconnects with backoff and LISTENs
//! again, then sends one wake-up for whatever committed while nobody
//! listened. Without that, a relay would fall back to its poll interval for
//! the rest of its life after the first lost connection.

use std::time::Duration;

use inbox_api::InboxError;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_postgres::AsyncMessage;

use crate::tls::Target;

use crate::SchemaName;

/// The `application_name` of the listener's session when the URL sets
/// none: what `pg_stat_activity` shows an operator (and a test looking for
/// it).
pub const LISTENER_APPLICATION_NAME: &str = "inbox-outbox-listener";

/// The first pause before reconnecting; doubled per failed attempt.
const RECONNECT_BASE: Duration = Duration::from_millis(100);
/// The longest pause between reconnect attempts.
const RECONNECT_MAX: Duration = Duration::from_secs(5);

/// Wake-ups from the outbox's trigger: one after each commit of a
/// transaction that enqueued messages (several that come together may
/// arrive as one), and one after each reconnect.
///
/// After a lost connection it reconnects by itself, with backoff (100 ms
/// doubling to 5 s), for as long as the listener lives; notifications sent
/// while it was away are lost, which the wake-up after the reconnect
/// covers. Dropping it closes the session.
#[derive(Debug)]
pub struct OutboxListener {
    wakeups: mpsc::Receiver<()>,
    _supervisor: AbortOnDrop,
}

/// A task that ends with its owner.
#[derive(Debug)]
struct AbortOnDrop(JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// One LISTENing session: the client (whose drop ends the session) and the
/// task that drives its connection, ending when the connection does.
struct Session {
    _client: tokio_postgres::Client,
    driver: JoinHandle<Option<tokio_postgres::Error>>,
}

impl OutboxListener {
    /// Connects to `url` and LISTENs on `schema`'s outbox channel
    /// ([`SchemaName::outbox_channel`]); reconnects by itself later.
    ///
    /// # Errors
    /// [`InboxError::Connection`] (retryable) when the database cannot be
    /// reached or refuses the LISTEN now; [`InboxError::InvalidArgument`] for a URL
    /// that does not parse.
    pub async fn connect(url: &str, schema: &SchemaName) -> Result<Self, InboxError> {
        let config = Target::parse(url).map_err(|e| InboxError::InvalidArgument {
            message: format!("database URL: {e}"),
        })?;
        let config = if config.config().get_application_name().is_none() {
            config.with_config(|c| {
                c.application_name(LISTENER_APPLICATION_NAME);
            })
        } else {
            config
        };
        let listen = format!("LISTEN {}", quote(&schema.outbox_channel()));
        // Room for one: a wake-up already waiting covers any that follow.
        let (wake, wakeups) = mpsc::channel(1);
        let session = open(&config, &listen, &wake)
            .await
            .map_err(|e| InboxError::Connection {
                source: Box::new(e),
            })?;
        let supervisor = tokio::spawn(supervise(config, listen, wake, session));
        Ok(Self {
            wakeups,
            _supervisor: AbortOnDrop(supervisor),
        })
    }

    /// Waits for the next wake-up. `None` only if the supervising task
    /// ended unexpectedly (it panicked).
    pub async fn next(&mut self) -> Option<()> {
        self.wakeups.recv().await
    }
}

/// Connects and LISTENs; the session's notifications go to `wake`.
async fn open(
    config: &Target,
    listen: &str,
    wake: &mpsc::Sender<()>,
) -> Result<Session, tokio_postgres::Error> {
    let (client, mut connection) = config.connect().await?;
    let wake = wake.clone();
    let driver = tokio::spawn(async move {
        loop {
            match std::future::poll_fn(|cx| connection.poll_message(cx)).await {
                Some(Ok(AsyncMessage::Notification(_))) => {
                    let _ = wake.try_send(());
                }
                Some(Ok(_)) => {}
                Some(Err(error)) => return Some(error),
                None => return None,
            }
        }
    });
    if let Err(error) = client.batch_execute(listen).await {
        driver.abort();
        return Err(error);
    }
    Ok(Session {
        _client: client,
        driver,
    })
}

/// Keeps a session LISTENing while the listener (the receiver of `wake`)
/// lives: waits for the session to end, then reopens it with backoff.
async fn supervise(config: Target, listen: String, wake: mpsc::Sender<()>, mut session: Session) {
    loop {
        tokio::select! {
            ended = &mut session.driver => {
                let error = match ended {
                    Ok(Some(error)) => error.to_string(),
                    Ok(None) => "closed by the server".to_owned(),
                    Err(error) => error.to_string(),
                };
                tracing::warn!(error, "outbox LISTEN connection lost; reconnecting");
            }
            () = wake.closed() => {
                session.driver.abort();
                return;
            }
        }
        let mut failures = 0_u32;
        session = loop {
            let delay = RECONNECT_BASE
                .saturating_mul(2_u32.saturating_pow(failures.min(16)))
                .min(RECONNECT_MAX);
            tokio::select! {
                () = tokio::time::sleep(delay) => {}
                () = wake.closed() => return,
            }
            match open(&config, &listen, &wake).await {
                Ok(session) => break session,
                Err(error) => {
                    failures = failures.saturating_add(1);
                    tracing::warn!(error = %error, failures, "outbox LISTEN reconnect failed");
                }
            }
        };
        tracing::info!("outbox LISTEN reconnected");
        // Whatever committed while nobody listened: one round finds it.
        let _ = wake.try_send(());
    }
}

/// `name` as a quoted identifier (a channel name is ASCII letters, digits
/// and '_', so nothing needs escaping; quoted all the same).
fn quote(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}
