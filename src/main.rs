//! The `orbit-events` binary: parses the command line and runs it.

use std::process::ExitCode;

use clap::Parser;

/// mimalloc instead of glibc's malloc (decision 0101): at full speed
/// glibc's allocation paths were 18 % of the node's samples.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let cli = orbit_events::cli::Cli::parse();
    actix_web::rt::System::new().block_on(orbit_events::cli::run(cli))
}
