//! What this binary is: the package version and the commit it was built
//! from (stamped by `build.rs`; empty when not built from a git checkout).

/// The package version, e.g. `0.1.0`.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// The commit built from (12 hex characters), or `""` when unknown.
pub const COMMIT: &str = env!("ORBIT_EVENTS_COMMIT");

/// `VERSION (commit COMMIT)`, or `VERSION` alone when the commit is unknown:
/// what `orbit-events --version` and the start line say.
pub const LONG_VERSION: &str = env!("ORBIT_EVENTS_VERSION");
