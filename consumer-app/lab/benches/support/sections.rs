//! Which parts of the report a run measures: `INBOX_BENCH_SECTIONS`, a
//! comma-separated list of section names (unset: every section).
//!
//! A run of only some sections prints its tables to stdout but leaves
//! `docs/` alone: a partial run made while working on one part must never
//! replace the committed report with a report that lacks the others.

/// One part of the report.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Section {
    /// Per-message and batched claims on both drivers, against the bare
    /// transactions (the first table and the targets built on it).
    Postgres,
    /// The memory store on one core.
    Memory,
    /// End to end through RabbitMQ: bare consume+ack against the app.
    EndToEnd,
    /// The RabbitMQ runtime alone, per message, against the database-only
    /// inbox beside it.
    Runtime,
    /// Every message delivered twice at once.
    Race,
    /// The outbox relay against a bare publisher.
    Relay,
    /// NATS JetStream: bare consume+ack, the runtime per message and
    /// batched, the relay against a bare JetStream publisher.
    Nats,
    /// The runtime and the relay over TLS against plain connections.
    Tls,
    /// The full loop's latency, endpoint to last consumer.
    Latency,
    /// Cleanup at scale.
    Cleanup,
    /// Claim cost against table size.
    TableSize,
}

impl Section {
    /// Every section, in the report's order.
    pub(crate) const ALL: [Self; 11] = [
        Self::Postgres,
        Self::Memory,
        Self::EndToEnd,
        Self::Runtime,
        Self::Race,
        Self::Relay,
        Self::Nats,
        Self::Tls,
        Self::Latency,
        Self::Cleanup,
        Self::TableSize,
    ];

    /// The name `INBOX_BENCH_SECTIONS` uses.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Postgres => "postgres",
            Self::Memory => "memory",
            Self::EndToEnd => "e2e",
            Self::Runtime => "runtime",
            Self::Race => "race",
            Self::Relay => "relay",
            Self::Nats => "nats",
            Self::Tls => "tls",
            Self::Latency => "latency",
            Self::Cleanup => "cleanup",
            Self::TableSize => "table-size",
        }
    }
}

/// The sections this run measures.
#[derive(Clone, Debug)]
pub(crate) struct Sections(Vec<Section>);

impl Sections {
    /// From `INBOX_BENCH_SECTIONS`; an unknown name is an error that lists
    /// the known ones, so a typo never silently measures nothing.
    pub(crate) fn from_env() -> Result<Self, String> {
        match std::env::var("INBOX_BENCH_SECTIONS") {
            Err(_) => Ok(Self(Section::ALL.to_vec())),
            Ok(list) => Self::parse(&list),
        }
    }

    fn parse(list: &str) -> Result<Self, String> {
        let mut chosen = Vec::new();
        for name in list.split(',').map(str::trim).filter(|n| !n.is_empty()) {
            let section = Section::ALL
                .into_iter()
                .find(|s| s.name() == name)
                .ok_or_else(|| {
                    format!(
                        "INBOX_BENCH_SECTIONS: unknown section {name:?}; known: {}",
                        Section::ALL.map(Section::name).join(",")
                    )
                })?;
            if !chosen.contains(&section) {
                chosen.push(section);
            }
        }
        if chosen.is_empty() {
            return Err("INBOX_BENCH_SECTIONS names no section".into());
        }
        Ok(Self(chosen))
    }

    /// Whether this run measures `section`.
    pub(crate) fn has(&self, section: Section) -> bool {
        self.0.contains(&section)
    }

    /// Whether this run measures every section, and so may rewrite `docs/`.
    pub(crate) fn complete(&self) -> bool {
        Section::ALL.iter().all(|s| self.has(*s))
    }
}
