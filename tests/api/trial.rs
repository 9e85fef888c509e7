//! Rules found by trying the product as a new user, from the README only:
//! the node's command line refuses what could only surprise later, and its
//! log output is fit for files and collectors.

use std::process::{Command, Output};

fn orbit_events(args: &[&str], database_url: &str) -> Output {
    orbit_events_in(std::path::Path::new("."), args, database_url)
}

/// `orbit-events ARGS` run in the folder `dir`.
fn orbit_events_in(dir: &std::path::Path, args: &[&str], database_url: &str) -> Output {
    Command::new(env!("CARGO_BIN_EXE_orbit-events"))
        .args(args)
        .current_dir(dir)
        .env("ORBIT_EVENTS__DATABASE__URL", database_url)
        .env_remove("RUST_LOG")
        .output()
        .unwrap()
}

/// The arguments of a bootstrap of the `demo` namespace, then `extra`.
fn bootstrap_args<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec![
        "bootstrap",
        "--namespace",
        "demo",
        "--application",
        "app",
        "--queue",
        "results",
    ];
    args.extend_from_slice(extra);
    args
}

#[actix_web::test]
async fn bootstrap_without_an_access_flag_creates_a_credential_without_permissions_and_warns() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("cli.db");
    let url = format!("sqlite://{}?mode=rwc", file.display());
    let out = orbit_events(&bootstrap_args(&[]), &url);
    assert_eq!(out.status.code(), Some(0));
    let printed: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(printed["permissions"], serde_json::json!([]), "{printed}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("warning")
            && stderr.contains("--event-access")
            && stderr.contains("--publish-access"),
        "the warning names both flags: {stderr}"
    );
    let token = printed["token"].as_str().unwrap();
    assert!(
        !stderr.contains(token),
        "the token is printed only once, on stdout"
    );
}

#[actix_web::test]
async fn bootstrap_names_the_database_file_it_wrote_the_credential_to_resolved() {
    // Run where a relative SQLite URL lands somewhere unexpected: the
    // token only works on nodes of that file, so the command names it.
    let dir = tempfile::tempdir().unwrap();
    let out = orbit_events_in(
        dir.path(),
        &bootstrap_args(&["--event-access"]),
        "sqlite://var/here.db?mode=rwc",
    );
    assert_eq!(out.status.code(), Some(0));
    let stderr = String::from_utf8_lossy(&out.stderr);
    let file = std::path::absolute(dir.path().join("var/here.db")).unwrap();
    assert!(
        stderr.contains(&format!("credential created in {}", file.display())),
        "{stderr}"
    );
}

#[actix_web::test]
async fn log_lines_carry_no_colour_codes_when_stderr_is_not_a_terminal() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}/log.db?mode=rwc", dir.path().display());
    let out = orbit_events(&["migrate"], &url);
    assert!(out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("migrations applied"), "{stderr}");
    assert!(
        !stderr.contains('\u{1b}'),
        "no escape sequences: {stderr:?}"
    );
}

#[actix_web::test]
async fn a_heartbeat_interval_not_below_the_read_idle_timeout_stops_start_up_naming_both_keys() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}/timing.db?mode=rwc", dir.path().display());
    let run = |heartbeat: &str, idle: &str| {
        Command::new(env!("CARGO_BIN_EXE_orbit-events"))
            .arg("migrate")
            .env("ORBIT_EVENTS__DATABASE__URL", &url)
            .env("ORBIT_EVENTS__TIMING__HEARTBEAT_INTERVAL_MS", heartbeat)
            .env("ORBIT_EVENTS__TIMING__READ_IDLE_TIMEOUT_MS", idle)
            .output()
            .unwrap()
    };
    for (heartbeat, idle) in [("15000", "3000"), ("3000", "3000")] {
        let out = run(heartbeat, idle);
        assert_eq!(out.status.code(), Some(1), "{heartbeat} vs {idle}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains("timing.heartbeat_interval_ms")
                && stderr.contains("timing.read_idle_timeout_ms"),
            "{stderr}"
        );
    }
    let out = run("1000", "3000");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
