//! Logging setup: `tracing` to stderr, human-readable by default or JSON on
//! request; the filter comes from `RUST_LOG` (default `info`).

use std::io::IsTerminal;

use tracing_subscriber::{EnvFilter, fmt, prelude::*};

/// Installs the global subscriber once; later calls do nothing.
pub fn init(json: bool) {
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new("info,sqlx=warn,sea_orm=warn,actix_server=warn"));
    let registry = tracing_subscriber::registry().with(filter);
    let result = if json {
        registry
            .with(fmt::layer().json().with_writer(std::io::stderr))
            .try_init()
    } else {
        // Colour codes only for a person at a terminal: in a file, a pipe or
        // a log collector they are noise around every field.
        registry
            .with(
                fmt::layer()
                    .with_ansi(std::io::stderr().is_terminal())
                    .with_writer(std::io::stderr),
            )
            .try_init()
    };
    // Already installed (tests start several nodes in one process).
    drop(result);
}
