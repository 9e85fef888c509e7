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

/// `orbit-events ARGS` with `env`, which must end within the test deadline
/// (a command that should have refused to start would run forever).
fn orbit_events_ending(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_orbit-events"))
        .args(args)
        .envs(env.iter().copied())
        .env_remove("RUST_LOG")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + crate::helpers::DEADLINE;
    while child.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > deadline {
            child.kill().unwrap();
            let out = child.wait_with_output().unwrap();
            panic!(
                "orbit-events {args:?} did not end: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

#[actix_web::test]
async fn a_second_serve_or_migrate_on_a_running_nodes_sqlite_file_exits_naming_the_file_and_the_node()
 {
    use crate::helpers::*;
    if skip_unless_backend("sqlite", "the file lock guards a SQLite file") {
        return;
    }
    let mut app = spawn_app().await;
    let node = crate::protocol_support::NodeProcess::serve_for(&mut app, &[]).await;
    let url = app.settings.database.url.clone();
    let file = orbit_events::store::sqlite_path(&url).unwrap().to_owned();
    let env = [
        ("ORBIT_EVENTS__DATABASE__URL", url.as_str()),
        ("ORBIT_EVENTS__SERVER__LISTEN", "127.0.0.1:0"),
    ];
    for command in ["serve", "migrate"] {
        let out = orbit_events_ending(&[command], &env);
        assert_eq!(out.status.code(), Some(1), "{command}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains(&file) && stderr.contains(&format!("pid {}", node.child.id())),
            "{command}: the message names the file and the running node: {stderr}"
        );
    }
    // Offline credential commands still work beside the node.
    let out = orbit_events(&bootstrap_args(&["--event-access"]), &url);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The first node kept serving.
    let healthz = app.get("/healthz", "").await;
    assert_eq!(healthz.status, 200);
}

#[actix_web::test]
async fn an_address_in_use_stops_start_up_naming_orbit_events_server_listen() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let address = taken.local_addr().unwrap().to_string();
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}/in-use.db?mode=rwc", dir.path().display());
    let out = orbit_events_ending(
        &["serve"],
        &[
            ("ORBIT_EVENTS__DATABASE__URL", url.as_str()),
            ("ORBIT_EVENTS__SERVER__LISTEN", address.as_str()),
        ],
    );
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&address) && stderr.contains("ORBIT_EVENTS__SERVER__LISTEN"),
        "{stderr}"
    );
}
