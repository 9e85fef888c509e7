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
    let created: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let out = orbit_events(&["credential", "list", "--format", "json"], &url);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let listed: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        listed[0]["credential_id"], created["credential_id"],
        "{listed}"
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

#[actix_web::test]
async fn completions_for_bash_zsh_and_fish_complete_every_command_and_an_unknown_shell_is_refused()
{
    for shell in ["bash", "zsh", "fish"] {
        let out = orbit_events_ending(&["completions", shell], &[]);
        assert_eq!(
            out.status.code(),
            Some(0),
            "{shell}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let script = String::from_utf8(out.stdout).unwrap();
        for command in [
            "serve",
            "bootstrap",
            "credential",
            "revoke",
            "subscriptions",
            "deliveries",
            "completions",
        ] {
            assert!(script.contains(command), "{shell}: no {command}");
        }
        if shell == "bash" {
            // The one shell every machine of the suite has: the script parses.
            let file = tempfile::NamedTempFile::new().unwrap();
            std::fs::write(file.path(), &script).unwrap();
            let check = Command::new("bash")
                .arg("-n")
                .arg(file.path())
                .output()
                .unwrap();
            assert!(
                check.status.success(),
                "{}",
                String::from_utf8_lossy(&check.stderr)
            );
            // And it completes below the first word, as a shell asks it to.
            for (line, expected) in [
                ("orbit-events cre", &["credential"][..]),
                ("orbit-events credential ", &["list", "revoke"][..]),
                (
                    "orbit-events credential list --format ",
                    &["table", "json"][..],
                ),
                ("orbit-events completions ", &["bash", "zsh", "fish"][..]),
            ] {
                let offered = bash_completions(file.path(), line);
                for word in expected {
                    assert!(
                        offered.iter().any(|o| o == word),
                        "`{line}<TAB>` offers {offered:?}, not {word}"
                    );
                }
            }
        }
    }
    let out = orbit_events_ending(&["completions", "tcsh"], &[]);
    assert_eq!(out.status.code(), Some(2));
    assert!(out.stdout.is_empty());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("invalid value 'tcsh'") && stderr.contains("bash"),
        "{stderr}"
    );
}

/// What bash's completion function from `script` offers for `line` (the
/// cursor at its end), one word per entry.
fn bash_completions(script: &std::path::Path, line: &str) -> Vec<String> {
    let program = format!(
        "source '{}'\nCOMP_LINE='{line}'\nCOMP_POINT=${{#COMP_LINE}}\n\
         read -ra COMP_WORDS <<< \"$COMP_LINE\"\n\
         [[ \"$COMP_LINE\" == *' ' ]] && COMP_WORDS+=('')\n\
         COMP_CWORD=$(( ${{#COMP_WORDS[@]}} - 1 ))\n\
         _orbit__events orbit-events \"${{COMP_WORDS[COMP_CWORD]}}\" \"${{COMP_WORDS[COMP_CWORD-1]}}\"\n\
         printf '%s\\n' \"${{COMPREPLY[@]}}\"\n",
        script.display()
    );
    let out = Command::new("bash")
        .arg("-c")
        .arg(program)
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_owned)
        .collect()
}

/// The length of the longest run of hex digits in `text`: a token digest
/// (SHA-256) is 64, ids are 32.
fn longest_hex_run(text: &str) -> usize {
    text.split(|c: char| !c.is_ascii_hexdigit())
        .map(str::len)
        .max()
        .unwrap_or(0)
}

/// What `credential list` prints must never let its reader act as a
/// credential: neither token nor digest, on stdout or stderr.
#[track_caller]
fn assert_no_secret(out: &Output, tokens: &[&str]) {
    for text in [&out.stdout, &out.stderr] {
        let text = String::from_utf8_lossy(text);
        for token in tokens {
            assert!(!text.contains(token), "a token is printed: {text}");
            let digest = orbit_events::domain::token_digest(token);
            assert!(!text.contains(&digest), "a digest is printed: {text}");
        }
        assert!(longest_hex_run(&text) < 64, "a digest-like string: {text}");
    }
}

#[actix_web::test]
async fn credential_list_shows_every_credential_with_its_scope_and_revocation_and_never_a_secret() {
    let app = crate::helpers::spawn_app().await;
    let url = app.settings.database.url.clone();
    let run = |args: &[&str]| {
        let out = orbit_events(args, &url);
        assert_eq!(
            out.status.code(),
            Some(0),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        out
    };
    let json = |out: &Output| serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap();
    let first = json(&run(&bootstrap_args(&["--event-access"])));
    let second = json(&run(&[
        "bootstrap",
        "--namespace",
        "demo",
        "--application",
        "publisher",
        "--queue",
        "other",
        "--publish-access",
    ]));
    let second_id = second["credential_id"].as_str().unwrap();
    let revoked = json(&run(&["credential", "revoke", second_id]));
    let revoked_at = revoked["revoked_at"].as_str().unwrap();
    let tokens = [
        first["token"].as_str().unwrap(),
        second["token"].as_str().unwrap(),
    ];

    let out = run(&["credential", "list", "--format", "json"]);
    assert_no_secret(&out, &tokens);
    let listed = json(&out);
    let expected = |bootstrap: &serde_json::Value,
                    application: &str,
                    queue: &str,
                    revoked_at: serde_json::Value| {
        serde_json::json!({
            "credential_id": bootstrap["credential_id"],
            "namespace_id": bootstrap["namespace_id"],
            "namespace": "demo",
            "application_id": bootstrap["application_id"],
            "application": application,
            "permissions": bootstrap["permissions"],
            "queue_scope": [{"id": bootstrap["queue_id"], "name": queue}],
            "revoked_at": revoked_at,
        })
    };
    let items = listed.as_array().unwrap();
    assert_eq!(items.len(), 2, "{listed:#}");
    let mut without_created = Vec::new();
    for item in items {
        let mut item = item.clone();
        let created = item.as_object_mut().unwrap().remove("created_at").unwrap();
        orbit_events::domain::Timestamp::parse_rfc3339(created.as_str().unwrap()).unwrap();
        without_created.push(item);
    }
    // Oldest first: the order of the bootstraps.
    assert_eq!(
        without_created,
        [
            expected(&first, "app", "results", serde_json::Value::Null),
            expected(&second, "publisher", "other", revoked_at.into()),
        ],
        "{listed:#}"
    );
    assert_eq!(
        first["permissions"],
        serde_json::json!(["events:manage", "events:read", "events:consume"])
    );

    let out = run(&["credential", "list"]);
    assert_no_secret(&out, &tokens);
    let table = String::from_utf8(out.stdout.clone()).unwrap();
    let rows: Vec<Vec<&str>> = table
        .lines()
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(
        rows[0],
        [
            "CREDENTIAL",
            "NAMESPACE",
            "APPLICATION",
            "PERMISSIONS",
            "QUEUES",
            "CREATED",
            "REVOKED"
        ],
        "{table}"
    );
    assert_eq!(rows.len(), 3, "{table}");
    let to_second = |t: &str| format!("{}Z", &t[..19]);
    let created = |item: &serde_json::Value| to_second(item["created_at"].as_str().unwrap());
    assert_eq!(
        rows[1],
        [
            first["credential_id"].as_str().unwrap(),
            "demo",
            "app",
            "events:manage,events:read,events:consume",
            "results",
            &created(&items[0]),
            "no",
        ],
        "{table}"
    );
    assert_eq!(
        rows[2],
        [
            second_id,
            "demo",
            "publisher",
            "results:publish",
            "other",
            &created(&items[1]),
            &to_second(revoked_at),
        ],
        "{table}"
    );
}

#[actix_web::test]
async fn credential_list_says_when_there_is_no_credential_and_never_creates_a_database() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("none.db");
    let url = format!("sqlite://{}?mode=rwc", file.display());
    // A read from the wrong folder must not leave an empty database there.
    let out = orbit_events(&["credential", "list"], &url);
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&format!("no database at {}", file.display())),
        "{stderr}"
    );
    assert!(!file.exists());

    assert!(orbit_events(&["migrate"], &url).status.success());
    let out = orbit_events(&["credential", "list"], &url);
    assert_eq!(out.status.code(), Some(0));
    assert!(out.stdout.is_empty());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&format!("no credentials in {}", file.display())),
        "{stderr}"
    );
    let out = orbit_events(&["credential", "list", "--format", "json"], &url);
    assert_eq!(out.status.code(), Some(0));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "[]");
}

#[actix_web::test]
async fn the_start_line_names_the_version_database_node_and_every_setting_that_differs_from_the_defaults()
 {
    let mut app = crate::helpers::spawn_app().await;
    let node = crate::protocol_support::NodeProcess::serve_for(
        &mut app,
        &[
            ("ORBIT_EVENTS_LOG_JSON", "true"),
            ("ORBIT_EVENTS__TIMING__LEASE_MS", "2000"),
        ],
    )
    .await;
    let log = node.log();
    let start: serde_json::Value = log
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|l| {
            l["fields"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("listening on"))
        })
        .unwrap_or_else(|| panic!("no start line: {log}"));
    let fields = &start["fields"];
    assert_eq!(fields["version"], env!("CARGO_PKG_VERSION"), "{start:#}");
    assert_eq!(fields["commit"], orbit_events::version::COMMIT, "{start:#}");
    assert_eq!(
        fields["address"],
        format!("http://127.0.0.1:{}", app.port),
        "{start:#}"
    );
    assert!(
        fields["node_id"].as_str().is_some_and(|n| n.len() == 32),
        "{start:#}"
    );
    assert!(fields["database"].as_str().is_some(), "{start:#}");
    let settings = fields["settings"].as_str().unwrap_or_default();
    for changed in [
        "timing.lease_ms=2000".to_owned(),
        format!("server.listen=127.0.0.1:{}", app.port),
    ] {
        assert!(settings.contains(&changed), "{changed} in {start:#}");
    }
    assert!(
        !settings.contains("heartbeat_interval_ms"),
        "only what differs: {start:#}"
    );

    // `--version` says the same, with the commit when built from git.
    let out = Command::new(env!("CARGO_BIN_EXE_orbit-events"))
        .arg("--version")
        .output()
        .unwrap();
    assert!(out.status.success());
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        format!("orbit-events {}", orbit_events::version::LONG_VERSION)
    );
    if std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.git")).exists() {
        assert!(
            orbit_events::version::LONG_VERSION.contains("(commit "),
            "{}",
            orbit_events::version::LONG_VERSION
        );
    }
}

#[test]
fn the_start_line_shows_a_database_url_without_its_password() {
    let mut settings = orbit_events::config::Settings::defaults().unwrap();
    settings.database.url = "postgres://orbit:s3cret@db.internal:5432/orbit".to_owned();
    let shown = settings.differences();
    assert_eq!(
        shown,
        vec![(
            "database.url".to_owned(),
            "postgres://***@db.internal:5432/orbit".to_owned()
        )]
    );
}
