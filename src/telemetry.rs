//! Logging setup: `tracing` to stderr, human-readable by default or JSON on
//! request; the filter comes from `RUST_LOG` (default `info`).

use std::{fmt::Debug, io::IsTerminal};

use tracing::{Event, Subscriber, field::Field};
use tracing_subscriber::{EnvFilter, fmt, layer::Context, prelude::*};

/// Installs the global subscriber once; later calls do nothing.
pub fn init(json: bool) {
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new("info,sqlx=warn,sea_orm=warn,actix_server=warn"));
    let registry = tracing_subscriber::registry()
        .with(filter)
        .with(RequestParseErrors);
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

/// Drops actix-http's `ERROR` lines for a request it could not parse and for
/// a malformed WebSocket frame: unauthenticated input, answered with an
/// enveloped 400/431 (logged at `DEBUG` in `http::server`) or a close, never
/// a fault of the node.
struct RequestParseErrors;

impl<S: Subscriber> tracing_subscriber::Layer<S> for RequestParseErrors {
    fn event_enabled(&self, event: &Event<'_>, _: Context<'_, S>) -> bool {
        match event.metadata().target() {
            // A client's malformed WebSocket frame: the connection closes
            // it with 1002/1008 itself.
            "actix_http::ws::codec" => return false,
            "actix_http::h1::dispatcher" => {}
            _ => return true,
        }
        let mut message = Message(None);
        event.record(&mut message);
        !message
            .0
            .is_some_and(|m| m.starts_with("stream error: request parse error"))
    }
}

struct Message(Option<String>);

impl tracing::field::Visit for Message {
    fn record_debug(&mut self, field: &Field, value: &dyn Debug) {
        if field.name() == "message" {
            self.0 = Some(format!("{value:?}"));
        }
    }
}
