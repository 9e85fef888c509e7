//! The admin console (`/console/`) in a real browser: headless Chromium
//! driven over WebDriver (Debian's `chromium` and `chromium-driver`, which
//! `scripts/test` installs when missing) against a real node process, on
//! both backends. Screenshots of each page land in the target directory.

use std::{
    os::unix::process::CommandExt,
    path::PathBuf,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use fantoccini::{Client, ClientBuilder, Locator};
use serde_json::{Value, json};

use crate::{
    helpers::*,
    http_support::{eventually, spawn_fast_app},
    protocol_support::NodeProcess,
};

/// A chromedriver process and a headless Chromium session on it; both end
/// when this is dropped (chromedriver runs in its own process group, killed
/// whole: killing chromedriver alone left its Chromium running).
struct Browser {
    client: Client,
    driver: Child,
}

impl Drop for Browser {
    fn drop(&mut self) {
        let group = format!("-{}", self.driver.id());
        let _ = Command::new("kill").args(["-KILL", "--", &group]).status();
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}

impl Browser {
    async fn start() -> Browser {
        let found = Command::new("chromedriver")
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success());
        assert!(
            found,
            "this test needs Debian's `chromium-driver` (and `chromium`) on PATH; \
             `./scripts/test` installs them when run as root"
        );
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let driver = Command::new("chromedriver")
            .arg(format!("--port={port}"))
            .process_group(0)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut caps = serde_json::Map::new();
        caps.insert(
            "goog:chromeOptions".to_owned(),
            json!({ "args": ["--headless", "--no-sandbox", "--disable-gpu",
                             "--disable-dev-shm-usage", "--window-size=1280,1400"] }),
        );
        let connector = hyper_util::client::legacy::connect::HttpConnector::new();
        let deadline = Instant::now() + DEADLINE;
        let client = loop {
            match ClientBuilder::new(connector.clone())
                .capabilities(caps.clone())
                .connect(&format!("http://127.0.0.1:{port}"))
                .await
            {
                Ok(client) => break client,
                Err(err) => {
                    assert!(Instant::now() < deadline, "chromedriver: {err}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        };
        Browser { client, driver }
    }

    /// The text of the first element matching `css`, if there is one.
    async fn text(&self, css: &str) -> Option<String> {
        let v = self
            .client
            .execute(
                "const e = document.querySelector(arguments[0]); return e ? e.textContent : null;",
                vec![json!(css)],
            )
            .await
            .unwrap();
        v.as_str().map(str::to_owned)
    }

    /// Waits until the element `css` exists and its text satisfies `ok`.
    async fn until_text(&self, css: &str, what: &str, ok: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + DEADLINE;
        loop {
            if let Some(t) = self.text(css).await
                && ok(&t)
            {
                return t;
            }
            let body = self.text("main").await.unwrap_or_default();
            assert!(Instant::now() < deadline, "{what}; the page says: {body}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Clicks the element `css`, finding it again if a refresh replaced it
    /// between the find and the click (pages re-render every 2 s).
    async fn click(&self, css: &str) {
        let deadline = Instant::now() + DEADLINE;
        loop {
            let element = self
                .client
                .wait()
                .at_most(DEADLINE)
                .for_element(Locator::Css(css))
                .await
                .unwrap_or_else(|e| panic!("{css}: {e}"));
            match element.click().await {
                Ok(()) => return,
                Err(e) if Instant::now() < deadline && e.to_string().contains("stale") => {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Err(e) => panic!("{css}: {e}"),
            }
        }
    }

    async fn type_into(&self, css: &str, text: &str) {
        self.client
            .wait()
            .at_most(DEADLINE)
            .for_element(Locator::Css(css))
            .await
            .unwrap_or_else(|e| panic!("{css}: {e}"))
            .send_keys(text)
            .await
            .unwrap();
    }

    async fn go(&self, url: &str) {
        self.client.goto(url).await.unwrap();
    }

    async fn eval(&self, script: &str) -> Value {
        self.client.execute(script, vec![]).await.unwrap()
    }

    /// Saves a screenshot as `console-NAME.png` in the target directory.
    async fn shot(&self, name: &str) {
        let png = self.client.screenshot().await.unwrap();
        let path = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("console-{name}.png"));
        std::fs::write(&path, png).unwrap();
        eprintln!("screenshot: {}", path.display());
    }
}

/// A subscription created with `extra`, returning its id.
async fn subscription(app: &TestApp, cred: &Cred, name: &str, extra: Value) -> String {
    let mut body = json!({ "name": name, "queue_id": cred.queue_id, "from_sequence": "0" });
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    let res = app
        .post("/v1/subscriptions", &cred.token, name, &body)
        .await;
    assert_eq!(res.status, 201, "{:#}", res.body);
    res.data()["subscription"]["id"]
        .as_str()
        .unwrap()
        .to_owned()
}

/// Pauses `sub_id` (at revision 1) over the API, as another admin would.
async fn pause(app: &TestApp, cred: &Cred, sub_id: &str, reason: &str) {
    let res = app
        .post(
            &format!("/v1/subscriptions/{sub_id}:configure"),
            &cred.token,
            &format!("pause-{sub_id}"),
            &json!({ "expected_revision": "1", "enabled": false, "reason": reason }),
        )
        .await;
    assert_eq!(res.status, 200, "{:#}", res.body);
}

async fn blocked_codes(app: &TestApp, cred: &Cred, sub_id: &str) -> Vec<String> {
    let res = app
        .get(&format!("/v1/subscriptions/{sub_id}/status"), &cred.token)
        .await;
    res.data()["blocked"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["code"].as_str().unwrap().to_owned())
        .collect()
}

#[actix_web::test]
async fn an_admin_sees_why_subscriptions_are_stuck_resumes_one_and_redrives_expired_deliveries_in_the_console()
 {
    let mut app = spawn_fast_app().await;
    let node = NodeProcess::serve_for(
        &mut app,
        &[
            ("ORBIT_EVENTS__TIMING__LEASE_MS", "300"),
            ("ORBIT_EVENTS__TIMING__SCAN_INTERVAL_MS", "50"),
            ("RUST_LOG", "debug"),
        ],
    )
    .await;
    let cred = app.bootstrap().await;
    // Held: a session takes 2 leases and never ACKs; with max_pending 2
    // the third result waits after the cursor (BACKLOG_FULL).
    let held = subscription(&app, &cred, "held", json!({ "max_pending": 2 })).await;
    // Paused before anything arrives (PAUSED).
    let paused = subscription(&app, &cred, "paused", json!({})).await;
    pause(&app, &cred, &paused, "maintenance").await;
    // Spent: one attempt each, leases never ACKed: all EXPIRED.
    let spent = subscription(&app, &cred, "spent", json!({ "max_attempts": 1 })).await;
    for _ in 0..3 {
        app.publish(&cred, vec![result(&cred.queue_id, "task.succeeded")])
            .await;
    }
    let mut held_ws = app.bind(&cred.token, &held, 2).await;
    held_ws.delivery().await;
    let _spent_ws = app.bind(&cred.token, &spent, 8).await;
    eventually("held is BACKLOG_FULL", || async {
        blocked_codes(&app, &cred, &held)
            .await
            .contains(&"BACKLOG_FULL".to_owned())
            .then_some(())
    })
    .await;
    eventually("spent has 3 EXPIRED deliveries", || async {
        let res = app
            .get(&format!("/v1/subscriptions/{spent}/status"), &cred.token)
            .await;
        (res.data()["expired"] == 3).then_some(())
    })
    .await;

    let browser = Browser::start().await;
    let console = format!("{}/console/", app.address);
    browser.go(&console).await;
    // A wrong token: the API's 401, with its code.
    browser.type_into("#token", "oe_wrong").await;
    browser.click("#sign-in").await;
    browser
        .until_text("#errors", "the 401 is shown", |t| {
            t.contains("UNAUTHENTICATED")
        })
        .await;
    browser.shot("sign-in-refused").await;
    browser.type_into("#token", &cred.token).await;
    browser.click("#sign-in").await;
    browser
        .until_text("main", "the queues page", |t| t.contains(&cred.queue_id))
        .await;
    browser.shot("queues").await;

    // The queue's subscriptions, each with why it does not move.
    browser
        .click(&format!("a[href='#/queue/{}']", cred.queue_id))
        .await;
    let held_why = browser
        .until_text(
            &format!("[data-subscription='{held}']"),
            "held shows BACKLOG_FULL",
            |t| t.contains("BACKLOG_FULL"),
        )
        .await;
    assert!(held_why.contains("BACKLOG_FULL"), "{held_why}");
    browser
        .until_text(
            &format!("[data-subscription='{paused}']"),
            "paused shows PAUSED",
            |t| t.contains("PAUSED"),
        )
        .await;
    browser.shot("subscriptions").await;

    // Resume the paused one with a reason; a consumer ACKs everything and
    // the page's lag falls to 0.
    browser
        .click(&format!("a[href='#/subscription/{paused}']"))
        .await;
    browser
        .until_text("#toggle", "the resume button", |t| t == "Resume")
        .await;
    browser.type_into("#reason", "maintenance over").await;
    // A double click is one action: one key, one write.
    browser
        .eval("const b = document.querySelector('#toggle'); b.click(); b.click(); return null;")
        .await;
    browser
        .until_text("#toggle", "resumed", |t| t == "Pause")
        .await;
    let mut consumer = app.bind(&cred.token, &paused, 8).await;
    for _ in 0..3 {
        let d = consumer.delivery().await;
        consumer.ack(&d).await;
    }
    browser.until_text("#lag", "lag 0", |t| t == "0").await;
    browser
        .until_text("#status", "moving again", |t| t.contains("moving"))
        .await;
    browser.shot("subscription").await;
    let sub = app
        .get(&format!("/v1/subscriptions/{paused}"), &cred.token)
        .await;
    assert_eq!(sub.data()["enabled"], true);
    assert_eq!(sub.data()["revision"], "3", "one pause, one resume");

    // A change made while the page was open is shown, not overwritten.
    browser.go(&format!("{console}#/subscription/{held}")).await;
    browser
        .until_text("#toggle", "held's page", |t| t == "Pause")
        .await;
    pause(&app, &cred, &held, "someone else").await;
    browser.type_into("#reason", "stale page").await;
    browser.click("#toggle").await;
    browser
        .until_text(".error", "the conflict is shown", |t| {
            t.contains("STATE_CONFLICT")
        })
        .await;
    browser.shot("conflict").await;
    let sub = app
        .get(&format!("/v1/subscriptions/{held}"), &cred.token)
        .await;
    assert_eq!(sub.data()["enabled"], false, "not overwritten");
    assert_eq!(sub.data()["revision"], "2");

    // An EXPIRED delivery's timeline.
    browser.go(&format!("{console}#/expired/{spent}")).await;
    browser.click("a[href^='#/delivery/']").await;
    let timeline = browser
        .until_text("#timeline", "the timeline", |t| t.contains("LEASE_LAPSED"))
        .await;
    assert!(timeline.contains("LEASED"), "{timeline}");
    browser.shot("delivery").await;

    // Bulk redrive: the dry run counts, the confirm re-arms exactly those.
    browser.go(&format!("{console}#/expired/{spent}")).await;
    browser.type_into("#redrive-reason", "receiver fixed").await;
    browser.click("#redrive-count").await;
    browser
        .until_text("#redrive-matched", "the dry run's count", |t| {
            t.starts_with("3 EXPIRED")
        })
        .await;
    browser.shot("redrive-dry-run").await;
    let expired_before = app
        .get(
            &format!("/v1/subscriptions/{spent}/deliveries?state=EXPIRED"),
            &cred.token,
        )
        .await;
    assert_eq!(
        expired_before.data()["items"].as_array().unwrap().len(),
        3,
        "the dry run changed nothing"
    );
    browser.click("#redrive-confirm").await;
    browser
        .until_text("#redrive-done", "the redrive's receipt", |t| {
            t.starts_with("Re-armed 3 of 3")
        })
        .await;
    browser.shot("redrive-done").await;
    for d in expired_before.data()["items"].as_array().unwrap() {
        let id = d["id"].as_str().unwrap();
        let history = app
            .get(
                &format!("/v1/subscriptions/{spent}/deliveries/{id}/history"),
                &cred.token,
            )
            .await;
        let retried = history.data()["items"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|s| s["step"] == "RETRIED")
            .count();
        assert_eq!(retried, 1, "{id} re-armed once: {:#}", history.body);
    }

    // Where the token is and is not; what the page requested.
    let url = browser.client.current_url().await.unwrap().to_string();
    assert!(!url.contains(&cred.token), "{url}");
    let local = browser.eval("return JSON.stringify(localStorage);").await;
    assert!(!local.to_string().contains(&cred.token), "{local}");
    let session = browser.eval("return JSON.stringify(sessionStorage);").await;
    assert!(session.to_string().contains(&cred.token), "{session}");
    let requested = browser
        .eval("return performance.getEntriesByType('resource').map(e => e.name);")
        .await;
    let origin = app.address.clone();
    let elsewhere: Vec<&Value> = requested
        .as_array()
        .unwrap()
        .iter()
        .filter(|u| !u.as_str().unwrap_or("").starts_with(&origin))
        .collect();
    assert!(
        elsewhere.is_empty(),
        "requests to other hosts: {elsewhere:?}"
    );
    assert!(
        requested.as_array().unwrap().len() > 5,
        "the page's own requests are seen: {requested}"
    );
    // An event's numbers are shown as published, not as floats.
    let shown = browser
        .eval(
            "return exactJson(parseExact('{\"a\": 1E400, \"b\": 123456789012345678901234567890, \"c\": [0.10000000000000000000001, -0]}'));",
        )
        .await;
    let shown = shown.as_str().unwrap();
    for exact in [
        "1E400",
        "123456789012345678901234567890",
        "0.10000000000000000000001",
        "-0",
    ] {
        assert!(shown.contains(exact), "{exact} in {shown}");
    }

    // A token revoked while a page refreshes: back to sign-in, the token
    // dropped from the tab.
    browser
        .go(&format!("{console}#/subscription/{spent}"))
        .await;
    browser
        .until_text("#status", "the status", |t| t.contains("Lag"))
        .await;
    crate::protocol_support::execute(
        &app,
        &format!(
            "UPDATE credentials SET revoked_at = 1 WHERE id = '{}'",
            cred.credential_id
        ),
    )
    .await;
    browser
        .until_text("#errors", "sign-in after the revocation", |t| {
            t.contains("UNAUTHENTICATED")
        })
        .await;
    let session = browser.eval("return JSON.stringify(sessionStorage);").await;
    assert!(!session.to_string().contains(&cred.token), "{session}");
    let url = browser.client.current_url().await.unwrap().to_string();
    assert!(
        url.ends_with(&format!("#/subscription/{spent}")),
        "the address is kept: {url}"
    );
    drop(browser);
    let log = node.log();
    assert!(
        log.contains("/console/"),
        "the node logged the console's requests"
    );
    assert!(!log.contains(&cred.token), "the token is in the node's log");
}

#[actix_web::test]
async fn console_responses_carry_a_strict_content_security_policy_and_deny_framing() {
    let app = spawn_app().await;
    for path in ["/console/", "/console/console.js", "/console/console.css"] {
        let res = app
            .http
            .get(format!("{}{path}", app.address))
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), 200, "{path}");
        let csp = res.headers()["content-security-policy"].to_str().unwrap();
        for rule in [
            "default-src 'none'",
            "script-src 'self'",
            "connect-src 'self'",
            "frame-ancestors 'none'",
        ] {
            assert!(csp.contains(rule), "{path}: {csp}");
        }
        assert!(!csp.contains("unsafe-inline"), "{path}: {csp}");
        assert_eq!(res.headers()["x-frame-options"], "DENY", "{path}");
        assert_eq!(res.headers()["x-content-type-options"], "nosniff");
        let body = res.text().await.unwrap();
        assert!(
            !body.contains("http://") && !body.contains("https://"),
            "{path} names another host"
        );
    }
    let page = app
        .http
        .get(format!("{}/console/", app.address))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(!page.contains("<script>"), "no inline script");
    let res = app
        .http
        .get(format!("{}/console/secret.txt", app.address))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 404);
}

#[actix_web::test]
async fn with_server_console_false_the_console_is_not_served() {
    let app = spawn_app_with(|s| s.server.console = false).await;
    for path in ["/console", "/console/", "/console/console.js"] {
        let res = app
            .http
            .get(format!("{}{path}", app.address))
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), 404, "{path}");
    }
}
