//! Stamps the binary with the commit it was built from, when built from a
//! git checkout: `ORBIT_EVENTS_COMMIT` (empty otherwise) and
//! `ORBIT_EVENTS_VERSION` ("0.1.0 (commit 0123abcd4567)"), read by
//! `src/version.rs`. Decision 0084 says why this is not a crate.

use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    let text = String::from_utf8(out.stdout).ok()?;
    let text = text.trim();
    (out.status.success() && !text.is_empty()).then(|| text.to_owned())
}

fn main() {
    let version = std::env::var("CARGO_PKG_VERSION").unwrap_or_default();
    let commit = git(&["rev-parse", "--short=12", "HEAD"]).unwrap_or_default();
    let long = if commit.is_empty() {
        version
    } else {
        format!("{version} (commit {commit})")
    };
    println!("cargo:rustc-env=ORBIT_EVENTS_COMMIT={commit}");
    println!("cargo:rustc-env=ORBIT_EVENTS_VERSION={long}");
    // HEAD's reflog changes on every commit, checkout and reset. A path
    // that does not exist would make cargo run this script on every build.
    println!("cargo:rerun-if-changed=build.rs");
    for path in ["HEAD", "logs/HEAD"] {
        if let Some(file) = git(&["rev-parse", "--git-path", path])
            && std::path::Path::new(&file).exists()
        {
            println!("cargo:rerun-if-changed={file}");
        }
    }
}
