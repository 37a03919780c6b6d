//! What TLS costs: the runtime's per-message consumption and the outbox
//! relay over plain connections and over TLS, in the same run, against
//! the same servers.
//!
//! - PostgreSQL: the server at `DATABASE_URL`, which must take both
//!   (`ssl = on`, as this machine's has): plain is `sslmode=disable`, TLS
//!   is `sslmode=require`. `require` does not check the chain; checking
//!   costs at the handshake only, and a pool opens its connections once.
//!   Each store's connection is asked (`pg_stat_ssl`) whether it is
//!   encrypted before anything is measured.
//! - RabbitMQ: a private node (`PrivateRabbit::start_tls_beside_plain`)
//!   with a plain and a TLS listener, the TLS one verified against the
//!   run's own CA (`cacertfile`; the certificate names 127.0.0.1, so the
//!   host name is checked too). One node, so the two differ by TLS alone.
//!
//! Consumption is the runtime-alone cell (`e2e::runtime_cell`: per
//! message, a handler doing only the business write), draining `events`
//! pre-published messages at each task count, over four connection kinds:
//! both plain, the database over TLS, the broker over TLS, both over TLS.
//! The relay (`relay::relayed`, the sqlx outbox, the relay section's batch
//! and depth) publishes `events` messages with both connections plain
//! against both over TLS. Every repetition runs every kind, in a rotated
//! order; each ratio is taken within its repetition, to the plain cell.

use std::num::NonZeroU32;

use inbox_backend_sqlx::SqlxStore;
use private_servers::PrivateRabbit;
use private_servers::pki::Pki;

use super::e2e::{self, BoxError};
use super::relay::{self, Target};
use super::spread::{self, Spread};

/// Which connections of a cell speak TLS.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Plain,
    Database,
    Broker,
    Both,
}

impl Kind {
    const ALL: [Self; 4] = [Self::Plain, Self::Database, Self::Broker, Self::Both];

    fn database(self) -> bool {
        matches!(self, Self::Database | Self::Both)
    }

    fn broker(self) -> bool {
        matches!(self, Self::Broker | Self::Both)
    }

    fn index(self) -> usize {
        Self::ALL.iter().position(|k| *k == self).unwrap_or(0)
    }
}

/// The run's two stores, two broker URLs and its private node.
struct Connections {
    plain_store: SqlxStore,
    tls_store: SqlxStore,
    plain_amqp: String,
    tls_amqp: String,
    /// What the TLS store's connections negotiated (`pg_stat_ssl`).
    database_tls: String,
    /// Stops the node when the run ends.
    _rabbit: PrivateRabbit,
}

impl Connections {
    fn store(&self, kind: Kind) -> &SqlxStore {
        if kind.database() {
            &self.tls_store
        } else {
            &self.plain_store
        }
    }

    fn amqp(&self, kind: Kind) -> &str {
        if kind.broker() {
            &self.tls_amqp
        } else {
            &self.plain_amqp
        }
    }
}

/// What the TLS cells measured, per repetition.
#[derive(Debug)]
pub(crate) struct TlsCost {
    events: usize,
    tasks: Vec<usize>,
    database_tls: String,
    /// Deliveries/s per repetition, `[tasks index][Kind::index]`.
    consumption: Vec<[Vec<f64>; 4]>,
    /// Messages/s per repetition: both plain, both over TLS.
    relay: [Vec<f64>; 2],
    batch: NonZeroU32,
    depth: NonZeroU32,
}

/// `url` with its `sslmode` parameter set to `mode`.
fn with_sslmode(url: &str, mode: &str) -> String {
    let (base, query) = url.split_once('?').unwrap_or((url, ""));
    let mut params: Vec<String> = query
        .split('&')
        .filter(|p| !p.is_empty() && !p.starts_with("sslmode="))
        .map(str::to_owned)
        .collect();
    params.push(format!("sslmode={mode}"));
    format!("{base}?{}", params.join("&"))
}

/// Whether `store`'s connection is encrypted, and with what.
async fn negotiated(store: &SqlxStore) -> Result<Option<String>, BoxError> {
    let row: (bool, Option<String>, Option<String>) = inbox_backend_sqlx::sqlx::query_as(
        "SELECT ssl, version, cipher FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
    )
    .fetch_one(store.pool())
    .await?;
    Ok(match row {
        (true, version, cipher) => Some(format!(
            "{} {}",
            version.unwrap_or_default(),
            cipher.unwrap_or_default()
        )),
        (false, _, _) => None,
    })
}

async fn connections(
    url: &str,
    schema: &str,
    pool: u32,
    pki: &Pki,
) -> Result<Connections, BoxError> {
    let plain_store = e2e::store(&with_sslmode(url, "disable"), schema, pool).await?;
    let tls_store = e2e::store(&with_sslmode(url, "require"), schema, pool).await?;
    if negotiated(&plain_store).await?.is_some() {
        return Err("the plain store's connection is encrypted".into());
    }
    let Some(database_tls) = negotiated(&tls_store).await? else {
        return Err("the TLS store's connection is not encrypted".into());
    };
    let rabbit = PrivateRabbit::start_tls_beside_plain(pki).await;
    let tls_port = rabbit
        .tls_port()
        .ok_or("the private node has no TLS listener")?;
    Ok(Connections {
        plain_store,
        tls_store,
        plain_amqp: rabbit.url(),
        tls_amqp: format!(
            "amqps://guest:guest@127.0.0.1:{tls_port}/%2f?cacertfile={}",
            pki.ca.display()
        ),
        database_tls,
        _rabbit: rabbit,
    })
}

/// Runs the TLS cells: `reps` repetitions of every kind at every task
/// count, then of the relay, in `schema` (which holds the report's
/// `bench_events`) and on a private RabbitMQ node; queues under `prefix`.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn run(
    url: &str,
    schema: &str,
    prefix: &str,
    tasks: &[usize],
    events: usize,
    batch: NonZeroU32,
    depth: NonZeroU32,
    reps: usize,
) -> Result<TlsCost, BoxError> {
    let dir = std::env::temp_dir().join(format!("{prefix}tls-pki"));
    let pki = Pki::new(&dir);
    let pool = u32::try_from(tasks.iter().copied().max().unwrap_or(16)).unwrap_or(16) + 1;
    let result = async {
        let conns = connections(url, schema, pool, &pki).await?;
        let mut cost = TlsCost {
            events,
            tasks: tasks.to_vec(),
            database_tls: conns.database_tls.clone(),
            consumption: vec![Default::default(); tasks.len()],
            relay: Default::default(),
            batch,
            depth,
        };
        for rep in 0..reps {
            for (t, &n) in tasks.iter().enumerate() {
                let mut order = Kind::ALL;
                order.rotate_left(rep % Kind::ALL.len());
                for kind in order {
                    let cell = format!("{prefix}tls.{kind:?}.{n}.{rep}.").to_lowercase();
                    let (rate, _) =
                        e2e::runtime_cell(conns.amqp(kind), n, events, conns.store(kind), &cell)
                            .await?;
                    eprintln!("tls rep {rep}, {n:>2} tasks, {kind:?}: {rate:.0} deliveries/s");
                    cost.consumption[t][kind.index()].push(rate);
                }
            }
            let target = Target::open(&conns.plain_amqp, &format!("{prefix}tls.")).await?;
            let mut order = [Kind::Plain, Kind::Both];
            order.rotate_left(rep % 2);
            for kind in order {
                target.purge().await?;
                let messages = relay::events(events, &target.exchange)?;
                let rate =
                    relay::relayed(conns.amqp(kind), conns.store(kind), &messages, batch, depth)
                        .await?;
                eprintln!("tls rep {rep}, relay, {kind:?}: {rate:.0} messages/s");
                cost.relay[usize::from(kind == Kind::Both)].push(rate);
            }
            target.close().await;
        }
        for store in [&conns.plain_store, &conns.tls_store] {
            inbox_runtime::shutdown::bounded("close a TLS cell pool", store.pool().close()).await;
        }
        Ok(cost)
    }
    .await;
    let _ = std::fs::remove_dir_all(&dir);
    result
}

impl TlsCost {
    /// The Markdown section: rates, and each TLS kind's ratio to plain with
    /// its spread over the repetitions.
    pub(crate) fn markdown(&self) -> String {
        use std::fmt::Write as _;
        let reps = self.relay[0].len();
        let mut out = format!(
            "### What TLS costs\n\n\
             The runtime alone per message (a handler doing only the business write), {} \
             messages pre-published per cell and drained; PostgreSQL `sslmode=disable` against \
             `sslmode=require` (negotiated: {}), RabbitMQ one private node with a plain and a \
             TLS listener (`amqps://`, the run's CA verified). {reps} repetitions, the four \
             kinds in a rotated order; deliveries/s median, and each kind's ratio to plain \
             within its repetition, median (lowest–highest).\n\n\
             | tasks | plain | TLS database | ratio | TLS broker | ratio | TLS both | ratio |\n\
             |---:|---:|---:|---:|---:|---:|---:|---:|\n",
            self.events, self.database_tls
        );
        for (t, n) in self.tasks.iter().enumerate() {
            let rates = &self.consumption[t];
            let plain = &rates[Kind::Plain.index()];
            let _ = write!(
                out,
                "| {n} | {} |",
                spread::cell(Spread::of(plain.iter().copied()), 0)
            );
            for kind in [Kind::Database, Kind::Broker, Kind::Both] {
                let these = &rates[kind.index()];
                let _ = write!(
                    out,
                    " {} | {} |",
                    spread::cell(Spread::of(these.iter().copied()), 0),
                    spread::cell(Spread::ratios(these, plain), 2)
                );
            }
            out.push('\n');
        }
        let _ = write!(
            out,
            "\nThe outbox relay (sqlx outbox), {} messages per cell, batches of {}, pipeline \
             depth {}, both connections plain against both over TLS:\n\n\
             | relay | plain, messages/s | TLS, messages/s | ratio |\n|---|---:|---:|---:|\n\
             | sqlx outbox | {} | {} | {} |\n",
            self.events,
            self.batch,
            self.depth,
            spread::cell(Spread::of(self.relay[0].iter().copied()), 0),
            spread::cell(Spread::of(self.relay[1].iter().copied()), 0),
            spread::cell(Spread::ratios(&self.relay[1], &self.relay[0]), 2),
        );
        out
    }
}
