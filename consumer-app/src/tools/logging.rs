//! Logs: the `tracing` subscriber the service's binaries install. A library
//! (the runtime) only emits events; which subscriber writes them, and how, is
//! the application's choice.

/// How log lines are written.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// One human-readable line per event (coloured on a terminal).
    #[default]
    Text,
    /// One JSON object per line, the event's fields (`message_id`,
    /// `consumer`, …) at the top level beside `timestamp`, `level`,
    /// `target` and `message`: what log collectors parse without a regex.
    Json,
}

/// The log filter when `RUST_LOG` is unset: `info`, without lapin's own
/// lines. Every lapin failure reaches the runtime as an error, which logs
/// it once with what it was doing and the redacted URL; lapin's lines
/// repeated it at ERROR without either ("Exponential backoff attempts
/// exhausted, aborting recovery" for each refused connect). `RUST_LOG=
/// info,lapin=debug` brings them back.
pub const DEFAULT_FILTER: &str = "info,lapin=off";

/// Installs a `tracing` subscriber reading `RUST_LOG` (default
/// [`DEFAULT_FILTER`]), writing to stderr in `format`, once; later calls do
/// nothing.
///
/// Colours only when stderr is a terminal: in a file, a pipe or a log
/// collector the escape codes are noise that breaks grep and parsers.
pub fn init_logging(format: LogFormat) {
    use std::io::IsTerminal as _;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(DEFAULT_FILTER));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Text => builder
            .with_ansi(std::io::stderr().is_terminal())
            .try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    };
}
