//! The admin commands of the `orbit-events` binary (`subscriptions …`,
//! `deliveries …`) run as a user runs them, against a real node; their
//! `--help`, and the inbox consumer example's.

use clap::CommandFactory;
use serde_json::{Value, json};

use crate::{helpers::*, http_support::expired_delivery};

/// What one command printed.
struct Run {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

impl Run {
    #[track_caller]
    fn ok(&self) -> &str {
        assert_eq!(self.code, Some(0), "failed: {}{}", self.stdout, self.stderr);
        &self.stdout
    }

    #[track_caller]
    fn json(&self) -> Value {
        serde_json::from_str(self.ok()).expect("--json prints JSON")
    }
}

/// Runs `orbit-events ARGS` against `app` with `token` in the environment.
async fn cli(app: &TestApp, token: Option<&str>, args: &[&str]) -> Run {
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_orbit-events"));
    command
        .args(args)
        .env("ORBIT_EVENTS_URL", &app.address)
        .env_remove("ORBIT_EVENTS_TOKEN")
        .env("NO_COLOR", "1");
    if let Some(token) = token {
        command.env("ORBIT_EVENTS_TOKEN", token);
    }
    let out = tokio::task::spawn_blocking(move || command.output().unwrap())
        .await
        .unwrap();
    Run {
        code: out.status.code(),
        stdout: String::from_utf8(out.stdout).unwrap(),
        stderr: String::from_utf8(out.stderr).unwrap(),
    }
}

#[actix_web::test]
async fn an_admin_command_whose_reader_stopped_reading_exits_quietly() {
    // `orbit-events … | head -1` under `set -o pipefail`: the reader has
    // what it wanted; a closed pipe is not the command's failure.
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let sub = app.subscribe(&cred, json!({})).await;
    let sub = sub["id"].as_str().unwrap().to_owned();
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_orbit-events"));
    command
        .args(["subscriptions", "get", &sub])
        .env("ORBIT_EVENTS_URL", &app.address)
        .env("ORBIT_EVENTS_TOKEN", &cred.token)
        .stdout(writer);
    let out = tokio::task::spawn_blocking(move || command.output().unwrap())
        .await
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(stderr.is_empty(), "{stderr}");
}

/// The id in the first line of a write's table output (`Created <id>.`).
fn written_id(stdout: &str) -> String {
    stdout
        .split_whitespace()
        .nth(1)
        .unwrap()
        .trim_end_matches('.')
        .to_owned()
}

#[actix_web::test]
async fn subscription_commands_print_tables_for_people_and_exactly_the_apis_data_with_json() {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let t = Some(cred.token.as_str());
    let q = cred.queue_id.as_str();

    let created = cli(
        &app,
        t,
        &["subscriptions", "create", "--name", "orders", "--queue", q],
    )
    .await;
    let table = created.ok();
    assert!(table.starts_with("Created "), "{table}");
    let orders = written_id(table);
    for field in [
        "name:", "orders", "state:", "active", "types:", "all", "pending:",
    ] {
        assert!(table.contains(field), "{field} missing from\n{table}");
    }
    let json_create = cli(
        &app,
        t,
        &[
            "subscriptions",
            "create",
            "--name",
            "failures",
            "--queue",
            q,
            "--types",
            "failed,needs_review",
            "--from",
            "start",
            "--max-pending",
            "10",
            "--max-attempts",
            "3",
            "--json",
        ],
    )
    .await
    .json();
    assert_eq!(json_create["deduplicated"], false);
    let failures = json_create["subscription"]["id"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(
        json_create["subscription"],
        *app.get(&format!("/v1/subscriptions/{failures}"), &cred.token)
            .await
            .data()
    );
    assert_eq!(
        json_create["subscription"]["types"],
        json!(["task.failed", "task.needs_review"])
    );
    assert_eq!(json_create["subscription"]["cursor_sequence"], "0");

    // list: a table, one page at a time, or everything.
    let list = cli(&app, t, &["subscriptions", "list", "--queue", q]).await;
    let lines: Vec<&str> = list.ok().lines().collect();
    assert!(lines[0].starts_with("ID") && lines[0].contains("NAME") && lines[0].contains("STATE"));
    assert!(
        lines[1].starts_with(&failures) && lines[2].starts_with(&orders),
        "{lines:#?}"
    );
    let listed = cli(&app, t, &["subscriptions", "list", "--queue", q, "--json"])
        .await
        .json();
    assert_eq!(
        listed,
        *app.get(&format!("/v1/subscriptions?queue_id={q}"), &cred.token)
            .await
            .data()
    );
    let first = cli(
        &app,
        t,
        &["subscriptions", "list", "--queue", q, "--limit", "1"],
    )
    .await;
    assert!(
        first.ok().contains("More: repeat with --cursor "),
        "{}",
        first.stdout
    );
    let cursor = first
        .stdout
        .split("--cursor ")
        .nth(1)
        .unwrap()
        .split(' ')
        .next()
        .unwrap();
    let second = cli(
        &app,
        t,
        &[
            "subscriptions",
            "list",
            "--queue",
            q,
            "--limit",
            "1",
            "--cursor",
            cursor,
        ],
    )
    .await;
    assert!(second.ok().contains(&orders) && !second.stdout.contains("More:"));
    let all = cli(
        &app,
        t,
        &[
            "subscriptions",
            "list",
            "--queue",
            q,
            "--limit",
            "1",
            "--all",
            "--json",
        ],
    )
    .await
    .json();
    assert_eq!(all["items"].as_array().unwrap().len(), 2);

    // get, pause, resume.
    let got = cli(&app, t, &["subscriptions", "get", &orders, "--json"])
        .await
        .json();
    assert_eq!(
        got,
        *app.get(&format!("/v1/subscriptions/{orders}"), &cred.token)
            .await
            .data()
    );
    let paused = cli(
        &app,
        t,
        &["subscriptions", "pause", &orders, "--reason", "maintenance"],
    )
    .await;
    assert!(
        paused.ok().starts_with(&format!("Paused {orders}.")),
        "{}",
        paused.stdout
    );
    assert!(
        paused
            .stdout
            .contains("paused (no new deliveries until resumed)")
    );
    let stale = cli(
        &app,
        t,
        &[
            "subscriptions",
            "resume",
            &orders,
            "--reason",
            "done",
            "--expected-revision",
            "1",
        ],
    )
    .await;
    assert_eq!(stale.code, Some(1));
    assert!(stale.stderr.contains("STATE_CONFLICT"), "{}", stale.stderr);
    let resumed = cli(
        &app,
        t,
        &[
            "subscriptions",
            "resume",
            &orders,
            "--reason",
            "done",
            "--expected-revision",
            "2",
            "--json",
        ],
    )
    .await
    .json();
    assert_eq!(resumed["subscription"]["enabled"], true);
    assert_eq!(resumed["subscription"]["revision"], "3");
    let audit = app
        .scalar("SELECT COUNT(*) FROM audit_records WHERE reason IN ('maintenance', 'done')")
        .await;
    assert_eq!(audit, 2);

    // The same key twice: one effect, the original answer.
    let args = [
        "subscriptions",
        "create",
        "--name",
        "once",
        "--queue",
        q,
        "--idempotency-key",
        "create-once",
    ];
    let first = cli(&app, t, &args).await;
    let again = cli(&app, t, &args).await;
    assert!(first.ok().starts_with("Created "));
    assert!(
        again.ok().contains("earlier with this idempotency key"),
        "{}",
        again.stdout
    );
    assert_eq!(written_id(&first.stdout), written_id(&again.stdout));
    assert_eq!(
        app.scalar("SELECT COUNT(*) FROM subscriptions WHERE name = 'once'")
            .await,
        1
    );
    app.assert_invariants().await;
}

#[actix_web::test]
async fn delivery_commands_list_show_and_retry_an_expired_delivery() {
    let app = crate::http_support::spawn_fast_app().await;
    let cred = app.bootstrap().await;
    let t = Some(cred.token.as_str());
    let (sub, delivery, _session) = expired_delivery(&app, &cred).await;
    let id = delivery["id"].as_str().unwrap();

    let list = cli(&app, t, &["deliveries", "list", &sub, "--state", "expired"]).await;
    let lines: Vec<&str> = list.ok().lines().collect();
    assert!(
        lines[0].starts_with("ID") && lines[0].contains("ATTEMPTS"),
        "{lines:#?}"
    );
    assert!(lines[1].starts_with(id) && lines[1].contains("EXPIRED") && lines[1].contains("1/1"));
    let listed = cli(&app, t, &["deliveries", "list", &sub, "--json"])
        .await
        .json();
    let path = format!("/v1/subscriptions/{sub}/deliveries");
    assert_eq!(listed, *app.get(&path, &cred.token).await.data());

    let shown = cli(&app, t, &["deliveries", "get", &sub, id]).await;
    for field in [
        "delivery:",
        "EXPIRED",
        "event:",
        "task.succeeded",
        "details:",
    ] {
        assert!(
            shown.ok().contains(field),
            "{field} missing from\n{}",
            shown.stdout
        );
    }
    let detail = cli(&app, t, &["deliveries", "get", &sub, id, "--json"])
        .await
        .json();
    assert_eq!(
        detail,
        *app.get(&format!("{path}/{id}"), &cred.token).await.data()
    );

    let retried = cli(
        &app,
        t,
        &[
            "deliveries",
            "retry",
            &sub,
            id,
            "--reason",
            "fixed the handler",
            "--additional-attempts",
            "2",
        ],
    )
    .await;
    assert!(
        retried
            .ok()
            .starts_with(&format!("Re-armed delivery {id}.")),
        "{}",
        retried.stdout
    );
    let now = app.get(&format!("{path}/{id}"), &cred.token).await;
    assert_eq!(now.data()["delivery"]["attempt_budget"], 3);
    assert_ne!(now.data()["delivery"]["state"], "EXPIRED");
    let again = cli(
        &app,
        t,
        &["deliveries", "retry", &sub, id, "--reason", "twice"],
    )
    .await;
    assert_eq!(again.code, Some(1));
    assert!(again.stderr.contains("STATE_CONFLICT"), "{}", again.stderr);
    app.assert_invariants().await;
}

#[actix_web::test]
async fn the_admin_token_comes_only_from_the_environment_and_never_shows_in_output() {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let q = cred.queue_id.as_str();

    let missing = cli(&app, None, &["subscriptions", "list", "--queue", q]).await;
    assert_eq!(missing.code, Some(1));
    assert!(missing.stdout.is_empty());
    assert!(
        missing.stderr.contains("ORBIT_EVENTS_TOKEN is not set"),
        "{}",
        missing.stderr
    );

    let flag = cli(
        &app,
        None,
        &[
            "subscriptions",
            "list",
            "--queue",
            q,
            "--token",
            &cred.token,
        ],
    )
    .await;
    assert_eq!(flag.code, Some(2), "no --token flag exists");
    assert!(
        flag.stderr.contains("unexpected argument '--token'"),
        "{}",
        flag.stderr
    );

    let secret = "oe_this-token-is-wrong";
    let wrong = cli(&app, Some(secret), &["subscriptions", "list", "--queue", q]).await;
    assert_eq!(wrong.code, Some(1));
    assert!(wrong.stderr.contains("UNAUTHENTICATED"), "{}", wrong.stderr);
    assert!(!wrong.stderr.contains(secret) && !wrong.stdout.contains(secret));

    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let server = format!("http://127.0.0.1:{port}");
    let down = cli(
        &app,
        Some(&cred.token),
        &["subscriptions", "get", &cred.queue_id, "--server", &server],
    )
    .await;
    assert_eq!(down.code, Some(1));
    assert!(
        down.stderr.contains("no answer from the server"),
        "{}",
        down.stderr
    );
    assert!(
        down.stderr
            .contains(&format!("is a node running at {server}")),
        "{}",
        down.stderr
    );
    assert!(!down.stderr.contains(&cred.token));
}

/// Every subcommand has an about and every argument a help text.
fn assert_documented(command: &clap::Command, path: &str) {
    let path = format!("{path} {}", command.get_name()).trim().to_owned();
    if command.get_name() != "help" {
        assert!(command.get_about().is_some(), "`{path}` has no about");
    }
    for arg in command.get_arguments() {
        let id = arg.get_id().as_str();
        if id == "help" || id == "version" {
            continue;
        }
        assert!(
            arg.get_help().is_some(),
            "`{path}`: argument {id} has no help"
        );
    }
    for sub in command.get_subcommands() {
        assert_documented(sub, &path);
    }
}

#[actix_web::test]
async fn every_command_of_orbit_events_and_the_inbox_consumer_explains_itself_in_help() {
    let command = orbit_events::cli::Cli::command();
    command.clone().debug_assert();
    assert_documented(&command, "");

    let app = spawn_app().await;
    let admin: &[&[&str]] = &[
        &["subscriptions"],
        &["subscriptions", "list"],
        &["subscriptions", "get"],
        &["subscriptions", "create"],
        &["subscriptions", "pause"],
        &["subscriptions", "resume"],
        &["deliveries"],
        &["deliveries", "list"],
        &["deliveries", "get"],
        &["deliveries", "retry"],
        &["deliveries", "history"],
        &["subscriptions", "status"],
        &["queues"],
        &["queues", "list"],
        &["publish"],
    ];
    for args in admin {
        let help = cli(&app, None, &[args, &["--help"][..]].concat()).await;
        let text = help.ok();
        for needle in [
            "Usage: orbit-events ",
            "ORBIT_EVENTS_TOKEN",
            "--server <URL>",
            "--json",
        ] {
            assert!(
                text.contains(needle),
                "`{}`: no {needle}:\n{text}",
                args.join(" ")
            );
        }
    }
    let offline: &[(&[&str], &str)] = &[
        (&["credential", "list"], "--format <FORMAT>"),
        (&["credential", "revoke"], "CREDENTIAL_ID"),
        (&["completions"], "bash-completion"),
    ];
    for (args, needle) in offline {
        let help = cli(&app, None, &[args, &["--help"][..]].concat()).await;
        let text = help.ok();
        for needle in ["Usage: orbit-events ", needle] {
            assert!(
                text.contains(needle),
                "`{}`: no {needle}:\n{text}",
                args.join(" ")
            );
        }
    }
    let top = cli(&app, None, &["--help"]).await;
    for needle in [
        "subscriptions",
        "deliveries",
        "serve",
        "bootstrap",
        "credential",
        "completions",
        "ORBIT_EVENTS_URL",
    ] {
        assert!(top.ok().contains(needle), "no {needle} in\n{}", top.stdout);
    }

    let example = crate::sdk_crash::inbox_consumer_exe();
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(example)
            .arg("--help")
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    for needle in [
        "Usage: inbox_consumer",
        "--subscription <SUBSCRIPTION_ID>",
        "ORBIT_EVENTS_TOKEN",
        "Inbox",
        "Ctrl-C",
        "--server <URL>",
        "Example:",
    ] {
        assert!(text.contains(needle), "no {needle} in\n{text}");
    }
}

#[actix_web::test]
async fn diagnosis_commands_show_status_history_queues_and_retry_in_bulk_with_the_apis_data() {
    let app = crate::http_support::spawn_fast_app().await;
    let cred = app.bootstrap().await;
    let t = Some(cred.token.as_str());
    let (sub, delivery, _session) = expired_delivery(&app, &cred).await;
    let id = delivery["id"].as_str().unwrap();
    let api = |path: String| {
        let app = &app;
        let token = cred.token.clone();
        async move { app.get(&path, &token).await.data().clone() }
    };

    // status: a table naming what blocks, and the API's data with --json.
    let status = cli(&app, t, &["subscriptions", "status", &sub]).await;
    assert!(
        status.ok().contains("EXPIRED_DELIVERIES"),
        "{}",
        status.stdout
    );
    assert!(status.ok().contains("moving:"), "{}", status.stdout);
    let json = cli(&app, t, &["subscriptions", "status", &sub, "--json"])
        .await
        .json();
    let mut expected = api(format!("/v1/subscriptions/{sub}/status")).await;
    // The age grows between the two reads.
    json["oldest_unacked"]["age_seconds"].as_f64().unwrap();
    expected["oldest_unacked"]["age_seconds"] = json["oldest_unacked"]["age_seconds"].clone();
    assert_eq!(json, expected);
    let get = cli(&app, t, &["subscriptions", "get", &sub]).await;
    for needle in ["cursor:", "consumers:", "blocked:", "EXPIRED_DELIVERIES"] {
        assert!(
            get.ok().contains(needle),
            "{needle} missing from\n{}",
            get.stdout
        );
    }

    // history.
    let history = cli(&app, t, &["deliveries", "history", &sub, id]).await;
    for needle in ["STEP", "MATERIALIZED", "LEASED", "LEASE_LAPSED"] {
        assert!(
            history.ok().contains(needle),
            "{needle} missing from\n{}",
            history.stdout
        );
    }
    let json = cli(&app, t, &["deliveries", "history", &sub, id, "--json"])
        .await
        .json();
    assert_eq!(
        json,
        api(format!("/v1/subscriptions/{sub}/deliveries/{id}/history")).await
    );

    // queues list.
    let queues = cli(&app, t, &["queues", "list"]).await;
    assert!(queues.ok().contains(&cred.queue_id), "{}", queues.stdout);
    let json = cli(&app, t, &["queues", "list", "--json"]).await.json();
    assert_eq!(json, api("/v1/queues".to_owned()).await);

    // retry --expired: a dry run, then the real one.
    let dry = cli(
        &app,
        t,
        &[
            "deliveries",
            "retry",
            &sub,
            "--expired",
            "--dry-run",
            "--reason",
            "check",
            "--json",
        ],
    )
    .await
    .json();
    assert_eq!(dry["matched"], 1);
    assert_eq!(dry["retried"], 0);
    let done = cli(
        &app,
        t,
        &[
            "deliveries",
            "retry",
            &sub,
            "--expired",
            "--from",
            "1",
            "--to",
            "1",
            "--reason",
            "handler fixed",
        ],
    )
    .await;
    assert!(
        done.ok()
            .starts_with("Re-armed 1 of 1 matching EXPIRED deliveries"),
        "{}",
        done.stdout
    );
    let stray = cli(
        &app,
        t,
        &[
            "deliveries",
            "retry",
            &sub,
            id,
            "--reason",
            "x",
            "--dry-run",
        ],
    )
    .await;
    assert_eq!(stray.code, Some(1), "{}", stray.stdout);
    assert!(stray.stderr.contains("--expired"), "{}", stray.stderr);
    let both = cli(
        &app,
        t,
        &[
            "deliveries",
            "retry",
            &sub,
            id,
            "--expired",
            "--reason",
            "x",
        ],
    )
    .await;
    assert_eq!(both.code, Some(2), "{}", both.stderr);

    // publish: the snapshot agrees with the type, task and revision.
    let published = cli(
        &app,
        t,
        &[
            "publish",
            &cred.queue_id,
            "--type",
            "failed",
            "--task",
            "7a5c0000000000000000000000000007",
            "--revision",
            "3",
            "--result",
            r#"{"code": 12345678901234567890.5}"#,
            "--json",
        ],
    )
    .await
    .json();
    assert_eq!(published["events"][0]["sequence"], "2");
    let text = crate::http_support::scalar_text(
        &app,
        "SELECT snapshot FROM result_events WHERE sequence = 2",
    )
    .await;
    let snapshot: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(snapshot["task_id"], "7a5c0000000000000000000000000007");
    assert_eq!(snapshot["revision"], "3");
    assert_eq!(snapshot["state"], "FAILED");
    assert!(text.contains("12345678901234567890.5"), "{text}");
    // The same key and time again: the original answer.
    let once = [
        "publish",
        &cred.queue_id,
        "--type",
        "succeeded",
        "--task",
        "7a5c0000000000000000000000000008",
        "--occurred-at",
        "2026-09-17T10:00:00.123456Z",
        "--idempotency-key",
        "publish-once",
    ];
    let first = cli(&app, t, &once).await;
    assert!(
        first.ok().starts_with("Published event"),
        "{}",
        first.stdout
    );
    let again = cli(&app, t, &once).await;
    assert!(
        again.ok().contains("nothing was appended now"),
        "{}",
        again.stdout
    );
    let bad = cli(
        &app,
        t,
        &[
            "publish",
            &cred.queue_id,
            "--type",
            "failed",
            "--task",
            "x",
            "--result",
            "{nope",
        ],
    )
    .await;
    assert_eq!(bad.code, Some(1));
    assert!(bad.stderr.contains("--result"), "{}", bad.stderr);
}

#[actix_web::test]
async fn bootstrap_with_format_env_prints_export_lines_a_shell_can_eval() {
    let app = spawn_app().await;
    let url = app.settings.database.url.clone();
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(env!("CARGO_BIN_EXE_orbit-events"))
            .args([
                "bootstrap",
                "--namespace",
                "acme",
                "--application",
                "billing",
                "--queue",
                "invoices",
                "--event-access",
                "--format",
                "env",
            ])
            .env("ORBIT_EVENTS__DATABASE__URL", url)
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8(out.stdout).unwrap();
    // A shell reads it back.
    let script = format!("{stdout}\necho \"$ORBIT_EVENTS_TOKEN $ORBIT_EVENTS_QUEUE_ID\"");
    let echoed = std::process::Command::new("sh")
        .args(["-c", &script])
        .output()
        .unwrap();
    let echoed = String::from_utf8(echoed.stdout).unwrap();
    let (token, queue_id) = echoed.trim().split_once(' ').unwrap();
    assert!(token.starts_with("oe_"), "{stdout}");
    let queues = app.get("/v1/queues", token).await;
    assert_eq!(queues.status, 200, "{:#}", queues.body);
    assert_eq!(queues.data()["items"][0]["id"], queue_id);
    assert_eq!(queues.data()["items"][0]["name"], "invoices");
}
