//! The `orbit-events` binary: parses the command line and runs it.

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let cli = orbit_events::cli::Cli::parse();
    actix_web::rt::System::new().block_on(orbit_events::cli::run(cli))
}
