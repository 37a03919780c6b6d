//! The time bounds every inbox connection sets on its PostgreSQL session:
//! [`SessionTimeouts`].

use std::time::Duration;

/// The time bounds every inbox connection sets on its PostgreSQL session.
///
/// A claim is a row lock held until the claiming transaction ends. A holder
/// that freezes (a paused VM, a process stopped with SIGSTOP, a network
/// partition) ends nothing: without bounds on the server side its lock
/// stays until TCP keepalive gives up, minutes to hours, and every
/// redelivery of the key waits on it. Three session settings bound that,
/// set once per connection when it opens (no extra round trip per message):
///
/// | setting | default | what it bounds |
/// |---|---|---|
/// | `lock_timeout` | 3 s | how long a claim (or any statement) waits for another transaction's lock: then SQLSTATE 55P03, [`inbox_api::InboxError::LockTimeout`], handed back uncharged |
/// | `idle_in_transaction_session_timeout` | 60 s | how long a session may sit inside a transaction without sending a statement: then the server ends the session and its claims are released. Keep it above the consumer's handle timeout, so that it only ever ends a holder that stopped |
/// | `client_connection_check_interval` | 1 s | how often a running statement checks that its client is still there: a transaction dropped mid-statement closes its connection, and the server then stops the statement within this interval instead of running it to the end with the claim held (PostgreSQL 14 or later, Linux and BSDs) |
///
/// Each driver applies [`SessionTimeouts::settings`] in its one connection
/// setup: as startup parameters (sqlx) or as [`SessionTimeouts::set_statements`]
/// right after connecting (diesel).
///
/// `None` leaves a setting at the server's (or role's) default,
/// `Some(Duration::ZERO)` turns it off.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SessionTimeouts {
    /// `lock_timeout`: how long a statement waits for a lock.
    pub lock_timeout: Option<Duration>,
    /// `idle_in_transaction_session_timeout`: how long a session may idle
    /// inside a transaction before the server ends it.
    pub idle_in_transaction: Option<Duration>,
    /// `client_connection_check_interval`: how often a running statement
    /// checks that its client is still connected. `None` for servers
    /// before PostgreSQL 14, which refuse the setting.
    pub client_check_interval: Option<Duration>,
}

impl Default for SessionTimeouts {
    fn default() -> Self {
        Self {
            lock_timeout: Some(Self::DEFAULT_LOCK_TIMEOUT),
            idle_in_transaction: Some(Self::DEFAULT_IDLE_IN_TRANSACTION),
            client_check_interval: Some(Duration::from_secs(1)),
        }
    }
}

impl SessionTimeouts {
    /// A few seconds: far above a healthy claim's wait (a concurrent copy
    /// of the message committing, milliseconds), far below a frozen
    /// holder's.
    pub const DEFAULT_LOCK_TIMEOUT: Duration = Duration::from_secs(3);

    /// Twice the consumer's default handle timeout (30 s): the consumer's
    /// own timeout ends a slow but live transaction first.
    pub const DEFAULT_IDLE_IN_TRANSACTION: Duration = Duration::from_secs(60);

    /// No setting at all: every session keeps the server's defaults.
    pub const SERVER_DEFAULTS: Self = Self {
        lock_timeout: None,
        idle_in_transaction: None,
        client_check_interval: None,
    };

    /// The settings to apply, as `(name, value)` pairs (values in
    /// milliseconds, PostgreSQL's unit for all three), the ones left at
    /// `None` omitted.
    pub fn settings(&self) -> Vec<(&'static str, String)> {
        [
            ("lock_timeout", self.lock_timeout),
            (
                "idle_in_transaction_session_timeout",
                self.idle_in_transaction,
            ),
            (
                "client_connection_check_interval",
                self.client_check_interval,
            ),
        ]
        .into_iter()
        .filter_map(|(name, value)| value.map(|value| (name, millis(value).to_string())))
        .collect()
    }

    /// `BEGIN` and the settings as `SET LOCAL`, as one simple-query text: a
    /// driver opens every inbox transaction with it, so the bounds hold on
    /// any pool (a user's, whose connections set nothing) and through
    /// PgBouncer in transaction mode (which cannot keep a session setting),
    /// in the one round trip BEGIN costs anyway. `SET LOCAL` ends with the
    /// transaction, so nothing leaks into the pool's next user.
    /// Set `client_check_interval` to `None` for a server before
    /// PostgreSQL 14, which refuses that setting (and so every BEGIN).
    pub fn begin_statement(&self) -> String {
        let set = self.set_local_statements();
        if set.is_empty() {
            "BEGIN".to_owned()
        } else {
            format!("BEGIN; {set}")
        }
    }

    /// The settings as `SET LOCAL` statements, `; `-separated (empty when
    /// there are none), for a driver that sends its own `BEGIN` text
    /// before them ([`SessionTimeouts::begin_statement`] is the plain
    /// case).
    pub fn set_local_statements(&self) -> String {
        self.settings()
            .into_iter()
            .map(|(name, value)| format!("SET LOCAL {name} = {value}"))
            .collect::<Vec<_>>()
            .join("; ")
    }

    /// The settings as `SET` statements, for a driver that applies them
    /// after connecting (empty when there are none). The values are
    /// integers this crate formats, so nothing reaches SQL from outside.
    pub fn set_statements(&self) -> String {
        self.settings()
            .into_iter()
            .map(|(name, value)| format!("SET {name} = {value};"))
            .collect::<Vec<_>>()
            .join(" ")
    }
}

/// How the connections of a store's pool reach PostgreSQL: what a store may
/// keep on a connection between two transactions.
///
/// A store never relies on session state for correctness: statements name
/// the schema ([`crate::Statements`]) and every transaction sets its own
/// bounds ([`SessionTimeouts::begin_statement`]). What remains session
/// state is a driver's named prepared statements and LISTEN, and those are
/// what this setting decides.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Pooling {
    /// Each pooled connection is one PostgreSQL session (a direct
    /// connection, or PgBouncer in session mode): statements are prepared
    /// once per connection and kept, and the outbox's listener LISTENs on
    /// a pool connection. The default.
    #[default]
    Session,
    /// A pooler in transaction mode (PgBouncer `pool_mode = transaction`)
    /// between the pool and PostgreSQL: consecutive transactions of one
    /// client connection may run on different server sessions. So no named
    /// prepared statement is kept (one prepared on one server session is
    /// missing on the next), and LISTEN (which belongs to a session) only
    /// goes through a direct URL the configuration names; without one,
    /// relays poll.
    Transaction,
}

impl Pooling {
    /// The name used in configuration: `session` or `transaction`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Session => "session",
            Self::Transaction => "transaction",
        }
    }
}

impl std::str::FromStr for Pooling {
    type Err = inbox_api::InboxError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text {
            "session" => Ok(Self::Session),
            "transaction" => Ok(Self::Transaction),
            other => Err(inbox_api::InboxError::InvalidArgument {
                message: format!("unknown pooling {other:?}: expected session or transaction"),
            }),
        }
    }
}

impl std::fmt::Display for Pooling {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Milliseconds as PostgreSQL takes them: an `int` GUC, at most `i32::MAX`
/// (about 24 days); longer is clamped.
fn millis(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis())
        .unwrap_or(i64::MAX)
        .min(i64::from(i32::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_bound_locks_idle_transactions_and_vanished_clients() {
        let defaults = SessionTimeouts::default();
        assert_eq!(
            defaults.settings(),
            vec![
                ("lock_timeout", "3000".to_owned()),
                ("idle_in_transaction_session_timeout", "60000".to_owned()),
                ("client_connection_check_interval", "1000".to_owned()),
            ]
        );
        assert_eq!(
            defaults.set_statements(),
            "SET lock_timeout = 3000; SET idle_in_transaction_session_timeout = 60000; \
             SET client_connection_check_interval = 1000;"
        );
    }

    #[test]
    fn pooling_parses_its_names() {
        for pooling in [Pooling::Session, Pooling::Transaction] {
            assert_eq!(
                pooling.as_str().parse::<Pooling>().expect("parses"),
                pooling
            );
        }
        assert!("statement".parse::<Pooling>().is_err());
        assert_eq!(Pooling::default(), Pooling::Session);
    }

    #[test]
    fn begin_sets_the_bounds_for_its_transaction() {
        assert_eq!(
            SessionTimeouts::default().begin_statement(),
            "BEGIN; SET LOCAL lock_timeout = 3000; \
             SET LOCAL idle_in_transaction_session_timeout = 60000; \
             SET LOCAL client_connection_check_interval = 1000"
        );
        assert_eq!(SessionTimeouts::SERVER_DEFAULTS.begin_statement(), "BEGIN");
    }

    #[test]
    fn none_leaves_the_server_default_and_zero_turns_off() {
        assert!(SessionTimeouts::SERVER_DEFAULTS.settings().is_empty());
        assert_eq!(SessionTimeouts::SERVER_DEFAULTS.set_statements(), "");
        let off = SessionTimeouts {
            lock_timeout: Some(Duration::ZERO),
            ..SessionTimeouts::SERVER_DEFAULTS
        };
        assert_eq!(off.settings(), vec![("lock_timeout", "0".to_owned())]);
        let huge = SessionTimeouts {
            idle_in_transaction: Some(Duration::from_secs(u64::MAX)),
            ..SessionTimeouts::SERVER_DEFAULTS
        };
        assert_eq!(huge.settings()[0].1, i32::MAX.to_string());
    }
}
