//! The examples of `docs/http-api.md` are recorded here, from a real node:
//! the test runs the guide's scenario, renders every request and response
//! (ids, times, cursors and the token replaced by stable placeholders) and
//! fails when the guide's example blocks differ. Regenerate them with
//! `ORBIT_UPDATE_DOCS=1 cargo test --test api guide`.

use std::collections::{BTreeSet, HashMap};

use serde_json::{Value, json};

use crate::{helpers::*, http_support::*};

const SUBS: &str = "/v1/subscriptions";
const CONFIGURE: &str = "/v1/subscriptions/{id}:configure";
const LIST: &str = "/v1/subscriptions/{id}/deliveries";

/// One recorded exchange.
struct Example {
    name: &'static str,
    method: &'static str,
    path: String,
    key: Option<&'static str>,
    body: Option<String>,
    status: u16,
    response: Value,
}

struct Recorder<'a> {
    app: &'a TestApp,
    token: String,
    examples: Vec<Example>,
}

impl Recorder<'_> {
    async fn post(
        &mut self,
        name: &'static str,
        template: &str,
        path: &str,
        key: &'static str,
        body: &str,
    ) -> Resp {
        let res = post_text(self.app, path, &self.token, key, body).await;
        assert_conforms("POST", template, &res);
        self.examples.push(Example {
            name,
            method: "POST",
            path: path.to_owned(),
            key: Some(key),
            body: Some(body.to_owned()),
            status: res.status.as_u16(),
            response: res.body.clone(),
        });
        res
    }

    async fn get(&mut self, name: &'static str, template: &str, path: &str) -> Resp {
        let res = self.app.get(path, &self.token).await;
        assert_conforms("GET", template, &res);
        self.examples.push(Example {
            name,
            method: "GET",
            path: path.to_owned(),
            key: None,
            body: None,
            status: res.status.as_u16(),
            response: res.body.clone(),
        });
        res
    }
}

/// Stable placeholders for what differs between runs.
#[derive(Default)]
struct Placeholders {
    ids: HashMap<String, String>,
    times: HashMap<String, String>,
    cursors: HashMap<String, String>,
}

impl Placeholders {
    fn id(&mut self, id: &str) -> String {
        let n = self.ids.len() + 1;
        self.ids
            .entry(id.to_owned())
            .or_insert_with(|| format!("{n:02x}").repeat(16))
            .clone()
    }

    fn text(&mut self, s: &str) -> String {
        if let Some(t) = self.times.get(s) {
            return t.clone();
        }
        if let Some(c) = self.cursors.get(s) {
            return c.clone();
        }
        if orbit_events::domain::is_id(s) {
            return self.id(s);
        }
        s.to_owned()
    }

    fn value(&mut self, v: &Value, key: Option<&str>) -> Value {
        match v {
            Value::String(_) if key == Some("request_id") => json!("7".repeat(32)),
            // An age grows while the test runs: a stable placeholder.
            Value::Number(_) if key == Some("age_seconds") => json!(4.2),
            Value::String(s) => json!(self.text(s)),
            Value::Array(items) => {
                Value::Array(items.iter().map(|i| self.value(i, None)).collect())
            }
            Value::Object(map) => Value::Object(
                map.iter()
                    .map(|(k, v)| (k.clone(), self.value(v, Some(k))))
                    .collect(),
            ),
            other => other.clone(),
        }
    }

    /// Replaces ids, times and cursors inside free text (paths, bodies).
    fn inline(&mut self, text: &str) -> String {
        let mut out = text.to_owned();
        for (from, to) in self.times.iter().chain(self.cursors.iter()) {
            out = out.replace(from.as_str(), to);
        }
        let mut result = String::new();
        let mut rest = out.as_str();
        while let Some(pos) = rest.find(|c: char| c.is_ascii_hexdigit()) {
            result.push_str(&rest[..pos]);
            let candidate = &rest[pos..];
            let len = candidate
                .find(|c: char| !c.is_ascii_hexdigit())
                .unwrap_or(candidate.len());
            let token = &candidate[..len];
            if orbit_events::domain::is_id(token) {
                result.push_str(&self.id(token));
            } else {
                result.push_str(token);
            }
            rest = &candidate[len..];
        }
        result.push_str(rest);
        result
    }
}

fn collect_times(v: &Value, out: &mut BTreeSet<String>) {
    match v {
        Value::String(s) if orbit_events::domain::Timestamp::parse_rfc3339(s).is_ok() => {
            out.insert(s.clone());
        }
        Value::Array(items) => items.iter().for_each(|i| collect_times(i, out)),
        Value::Object(map) => map.values().for_each(|i| collect_times(i, out)),
        _ => {}
    }
}

fn collect_cursors(v: &Value, out: &mut Vec<String>) {
    if let Some(c) = v["data"]["next_cursor"].as_str()
        && !out.iter().any(|x| x == c)
    {
        out.push(c.to_owned());
    }
}

fn status_text(status: u16) -> &'static str {
    match status {
        200 => "OK",
        201 => "Created",
        400 => "Bad Request",
        404 => "Not Found",
        409 => "Conflict",
        410 => "Gone",
        _ => "",
    }
}

/// Renders every example as markdown, by name.
fn render(examples: &[Example]) -> HashMap<&'static str, String> {
    let mut p = Placeholders::default();
    // Times keep their order: the n-th distinct instant becomes n seconds
    // after a fixed base.
    let mut times = BTreeSet::new();
    for e in examples {
        collect_times(&e.response, &mut times);
        if let Some(body) = &e.body
            && let Ok(v) = serde_json::from_str::<Value>(body)
        {
            collect_times(&v, &mut times);
        }
    }
    let mut ordered: Vec<(i64, String)> = times
        .into_iter()
        .map(|t| {
            (
                orbit_events::domain::Timestamp::parse_rfc3339(&t)
                    .unwrap()
                    .micros(),
                t,
            )
        })
        .collect();
    ordered.sort();
    let base = orbit_events::domain::Timestamp::parse_rfc3339("2026-09-17T10:00:00Z").unwrap();
    for (i, (_, t)) in ordered.iter().enumerate() {
        let shifted = base.plus(std::time::Duration::from_secs(i as u64));
        p.times.insert(t.clone(), shifted.to_rfc3339());
    }
    let mut cursors = Vec::new();
    for e in examples {
        collect_cursors(&e.response, &mut cursors);
    }
    for (i, c) in cursors.iter().enumerate() {
        p.cursors.insert(c.clone(), format!("CURSOR{}", i + 1));
    }
    let mut out: HashMap<&'static str, String> = HashMap::new();
    for e in examples {
        let mut text = String::from("```http\n");
        text.push_str(&format!("{} {}\n", e.method, p.inline(&e.path)));
        text.push_str("Authorization: Bearer $TOKEN\n");
        if let Some(key) = e.key {
            text.push_str(&format!(
                "Idempotency-Key: {key}\nContent-Type: application/json\n"
            ));
        }
        if let Some(body) = &e.body {
            text.push('\n');
            text.push_str(&p.inline(body));
            text.push('\n');
        }
        text.push_str("```\n\n");
        text.push_str(&format!("`{} {}`\n\n", e.status, status_text(e.status)));
        let response = p.value(&e.response, None);
        text.push_str("```json\n");
        text.push_str(&serde_json::to_string_pretty(&response).unwrap());
        text.push_str("\n```\n");
        let entry = out.entry(e.name).or_default();
        if !entry.is_empty() {
            entry.push('\n');
        }
        entry.push_str(&text);
    }
    out
}

/// Replaces the inside of every `<!-- example: NAME -->` ...
/// `<!-- /example -->` block of `doc`.
fn fill(doc: &str, rendered: &HashMap<&'static str, String>) -> String {
    let mut out = String::new();
    let mut rest = doc;
    let mut used = BTreeSet::new();
    while let Some(start) = rest.find("<!-- example: ") {
        let after = &rest[start..];
        let name_end = after.find(" -->").expect("an example marker ends with -->");
        let name = &after["<!-- example: ".len()..name_end];
        let end = after
            .find("<!-- /example -->")
            .expect("an example block is closed");
        let body = rendered
            .get(name)
            .unwrap_or_else(|| panic!("docs/http-api.md names an unknown example {name:?}"));
        used.insert(name.to_owned());
        out.push_str(&rest[..start]);
        out.push_str(&after[..name_end + " -->".len()]);
        out.push('\n');
        out.push_str(body);
        rest = &after[end..];
    }
    out.push_str(rest);
    let missing: Vec<_> = rendered.keys().filter(|k| !used.contains(**k)).collect();
    assert!(
        missing.is_empty(),
        "examples not in docs/http-api.md: {missing:?}"
    );
    out
}

#[actix_web::test]
async fn the_examples_in_docs_http_api_md_are_what_the_server_answers() {
    let app = spawn_fast_app().await;
    let cred = app
        .bootstrap_with("demo", "app", "results", true, true)
        .await;
    let q = cred.queue_id.clone();
    let mut r = Recorder {
        app: &app,
        token: cred.token.clone(),
        examples: Vec::new(),
    };

    // Subscriptions.
    let create = format!(
        r#"{{"name": "object-results", "queue_id": "{q}", "from_sequence": "0", "max_attempts": 1}}"#
    );
    let res = r
        .post(
            "create",
            SUBS,
            "/v1/subscriptions",
            "create-object-results",
            &create,
        )
        .await;
    assert_eq!(res.status, 201);
    let sub = res.data()["subscription"]["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let res = r
        .post(
            "create-replay",
            SUBS,
            "/v1/subscriptions",
            "create-object-results",
            &create,
        )
        .await;
    assert_eq!(res.status, 200);
    let audit = format!(r#"{{"name": "audit-copy", "queue_id": "{q}", "types": ["task.failed"]}}"#);
    let res = r
        .post(
            "create-second",
            SUBS,
            "/v1/subscriptions",
            "create-audit-copy",
            &audit,
        )
        .await;
    assert_eq!(res.status, 201);
    let second = res.data()["subscription"]["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let res = r
        .get(
            "list",
            SUBS,
            &format!("/v1/subscriptions?queue_id={q}&limit=1"),
        )
        .await;
    let cursor = res.data()["next_cursor"].as_str().unwrap().to_owned();
    r.get(
        "list",
        SUBS,
        &format!("/v1/subscriptions?queue_id={q}&limit=1&cursor={cursor}"),
    )
    .await;
    r.get(
        "get",
        "/v1/subscriptions/{id}",
        &format!("/v1/subscriptions/{second}"),
    )
    .await;
    let pause = r#"{"expected_revision": "1", "enabled": false, "reason": "receiver maintenance"}"#;
    let res = r
        .post(
            "configure",
            CONFIGURE,
            &format!("/v1/subscriptions/{second}:configure"),
            "pause-audit-copy-1",
            pause,
        )
        .await;
    assert_eq!(res.status, 200);
    let res = r
        .post(
            "configure-stale",
            CONFIGURE,
            &format!("/v1/subscriptions/{second}:configure"),
            "pause-audit-copy-2",
            pause,
        )
        .await;
    assert_eq!(res.status, 409);
    let dup = format!(r#"{{"name": "a", "name": "b", "queue_id": "{q}"}}"#);
    let res = r
        .post("strict", SUBS, "/v1/subscriptions", "create-dup", &dup)
        .await;
    assert_eq!(res.status, 400);

    // Results, deliveries, a retry.
    let mut results = Vec::new();
    for (task, t, state) in [
        (
            "66666666666666666666666666666666",
            "task.succeeded",
            "SUCCEEDED",
        ),
        ("99999999999999999999999999999999", "task.failed", "FAILED"),
    ] {
        results.push(json!({
            "type": t, "aggregate_id": task, "aggregate_revision": "2",
            "occurred_at": "2026-09-17T09:59:00Z", "details": { "state": state },
            "snapshot": { "schema_version": 1, "task_id": task, "queue_id": q, "state": state,
                          "revision": "2", "effect_uncertain": false, "result": { "ok": t == "task.succeeded" } }
        }));
    }
    // One result now, the other while the session's one slot holds the
    // first: the two deliveries have distinct creation times (list order),
    // and the second is materialized PENDING by the scanner, then leased
    // by the claim after the ACK, on both backends (a result appended
    // while a session waits may be inserted LEASED by its claim, or
    // PENDING by the scanner, whichever runs first).
    let second_result = results.pop().unwrap();
    let publish = serde_json::to_string_pretty(&json!({ "results": results })).unwrap();
    let res = r
        .post(
            "publish",
            "/v1/queues/{queue_id}/results",
            &format!("/v1/queues/{q}/results"),
            "publish-1",
            &publish,
        )
        .await;
    assert_eq!(res.status, 201);
    let mut ws = app.bind(&cred.token, &sub, 1).await;
    let acked = ws.delivery().await;
    app.publish(&cred, vec![second_result]).await;
    let pending = format!(
        "SELECT COUNT(*) FROM deliveries WHERE subscription_id = '{sub}' AND state = 'PENDING'"
    );
    eventually("the second result materialized PENDING", || async {
        (app.scalar(&pending).await == 1).then_some(())
    })
    .await;
    let reply = ws.ack(&acked).await;
    assert_eq!(reply["type"], "ack");
    let unacked = ws.delivery().await;
    let expired_id = unacked["body"]["delivery"]["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let list = format!("/v1/subscriptions/{sub}/deliveries");
    eventually("the unacknowledged delivery to expire", || async {
        let res = app.get(&format!("{list}?state=EXPIRED"), &cred.token).await;
        (res.data()["items"].as_array().map(Vec::len) == Some(1)).then_some(())
    })
    .await;
    r.get("deliveries", LIST, &list).await;
    r.get(
        "deliveries-filtered",
        LIST,
        &format!("{list}?state=EXPIRED"),
    )
    .await;
    let res = r
        .get(
            "delivery",
            "/v1/subscriptions/{id}/deliveries/{delivery_id}",
            &format!("{list}/{expired_id}"),
        )
        .await;
    let revision = res.data()["delivery"]["revision"]
        .as_str()
        .unwrap()
        .to_owned();
    let res = r
        .post(
            "retry-expired-dry",
            "/v1/subscriptions/{id}/deliveries:retry",
            &format!("{list}:retry"),
            "retry-expired-dry-1",
            r#"{"reason": "how many would a redrive re-arm?", "additional_attempts": 2, "from_sequence": "1", "limit": 1000, "dry_run": true}"#,
        )
        .await;
    assert_eq!(res.status, 200, "{:#}", res.body);
    let retry = format!(
        r#"{{"expected_revision": "{revision}", "reason": "receiver persistence failure repaired", "additional_attempts": 2}}"#
    );
    let res = r
        .post(
            "retry",
            "/v1/subscriptions/{id}/deliveries/{delivery_id}:retry",
            &format!("{list}/{expired_id}:retry"),
            "retry-1",
            &retry,
        )
        .await;
    assert_eq!(res.status, 200, "{:#}", res.body);
    // Offered again at once, on the same session.
    let again = ws.delivery().await;
    assert_eq!(again["body"]["delivery"]["id"], json!(expired_id));
    r.get(
        "history",
        "/v1/subscriptions/{id}/deliveries/{delivery_id}/history",
        &format!("{list}/{expired_id}/history"),
    )
    .await;
    r.get(
        "status",
        "/v1/subscriptions/{id}/status",
        &format!("/v1/subscriptions/{sub}/status"),
    )
    .await;
    r.get("queues", "/v1/queues", "/v1/queues").await;
    drop(ws);

    let rendered = render(&r.examples);
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/http-api.md");
    let mut doc = std::fs::read_to_string(&path).unwrap();
    let filled = fill(&doc, &rendered);
    if std::env::var_os("ORBIT_UPDATE_DOCS").is_some() {
        std::fs::write(&path, &filled).unwrap();
        doc = filled.clone();
    }
    if filled != doc {
        let new = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("http-api.md.new");
        std::fs::write(&new, &filled).unwrap();
        eprintln!("the recorded guide is at {}", new.display());
    }
    assert!(
        filled == doc,
        "docs/http-api.md examples differ from what the server answers; regenerate with \
         ORBIT_UPDATE_DOCS=1 cargo test --test api guide"
    );
    app.assert_invariants().await;
}
