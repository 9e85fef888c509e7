//! `GET /metrics` (architecture.md §6): Prometheus text that a real parser
//! reads, and census counters that agree with the database.

use std::collections::HashMap;

use prometheus_parse::{Sample, Scrape, Value as PromValue};
use serde_json::json;

use crate::{helpers::*, protocol_support::*};

/// A parsed scrape of a node's `/metrics`.
pub struct Scraped {
    pub text: String,
    pub samples: Vec<Sample>,
}

/// `line` with `{` and `}` inside quoted label values as `<` and `>`:
/// prometheus-parse reads a label set as `[^}]+`, so a route template
/// (`route="/v1/subscriptions/{id}"`, legal in the format) would cut it.
fn braces_in_values_swapped(line: &str) -> String {
    let (mut quoted, mut escaped) = (false, false);
    line.chars()
        .map(|c| {
            let out = match c {
                '{' if quoted => '<',
                '}' if quoted => '>',
                _ => c,
            };
            if escaped {
                escaped = false;
            } else if c == '\\' {
                escaped = true;
            } else if c == '"' {
                quoted = !quoted;
            }
            out
        })
        .collect()
}

impl Scraped {
    /// The sample `name` whose labels include `labels` (braces in a
    /// value as written; see [`braces_in_values_swapped`]).
    pub fn find(&self, name: &str, labels: &[(&str, &str)]) -> Option<&Sample> {
        self.samples.iter().find(|s| {
            s.metric == name
                && labels.iter().all(|(k, v)| {
                    s.labels.get(k) == Some(v.replace('{', "<").replace('}', ">").as_str())
                })
        })
    }

    /// The value of a counter, gauge or untyped sample; 0 when absent (a
    /// counter that never moved for these labels).
    pub fn value(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        match self.find(name, labels).map(|s| &s.value) {
            Some(PromValue::Counter(v) | PromValue::Gauge(v) | PromValue::Untyped(v)) => *v,
            Some(other) => panic!("{name} is not a scalar: {other:?}"),
            None => 0.0,
        }
    }
}

/// Scrapes `/metrics`: 200 with the Prometheus text content type, parsed by
/// `prometheus-parse`; every sample line must have become a parsed sample
/// (that parser skips lines it cannot read).
pub async fn scrape(app: &TestApp) -> Scraped {
    let res = app
        .http
        .get(format!("{}/metrics", app.address))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    assert_eq!(
        res.headers()["content-type"],
        "text/plain; version=0.0.4; charset=utf-8"
    );
    assert_eq!(res.headers()["cache-control"], "no-store");
    let text = res.text().await.unwrap();
    let scrape = Scrape::parse(text.lines().map(|l| Ok(braces_in_values_swapped(l)))).unwrap();
    let sample_lines = text
        .lines()
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .count();
    let parsed: usize = scrape
        .samples
        .iter()
        .map(|s| match &s.value {
            PromValue::Histogram(buckets) => buckets.len(),
            _ => 1,
        })
        .sum();
    assert_eq!(sample_lines, parsed, "unparsed lines in:\n{text}");
    for line in text.lines().filter(|l| l.starts_with("# TYPE ")) {
        let kind = line.rsplit(' ').next().unwrap();
        assert!(["counter", "gauge", "histogram"].contains(&kind), "{line}");
    }
    Scraped {
        text,
        samples: scrape.samples,
    }
}

#[actix_web::test]
async fn metrics_parse_as_prometheus_text_and_the_census_agrees_with_the_database_after_an_end_to_end_scenario()
 {
    let app = spawn_app_with(|s| {
        s.timing.lease_ms = 1000;
        s.timing.scan_interval_ms = 200;
    })
    .await;
    let one = app.bootstrap_with("ns1", "app1", "q1", true, true).await;
    let two = app.bootstrap_with("ns2", "app2", "q2", true, true).await;
    let all = subscription(&app, &one).await;
    let failed_only = app
        .subscribe(
            &one,
            json!({ "from_sequence": "0", "types": ["task.failed"] }),
        )
        .await["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let other = subscription(&app, &two).await;
    let mut ws_all = app.bind(&one.token, &all, 5).await;
    let mut ws_failed = app.bind(&one.token, &failed_only, 5).await;
    let mut ws_other = app.bind(&two.token, &other, 5).await;

    // Each consumer ACKs right away (one lease of `all` is left to lapse
    // on purpose): no other lease lapses while the test waits.
    publish_n(&app, &two, 4, "task.cancelled").await;
    for i in 0..4 {
        let d = ws_other.delivery().await;
        assert_eq!(ws_other.ack(&d).await["body"]["deduplicated"], false);
        if i == 0 {
            let repeat = ws_other.ack(&d).await;
            assert_eq!(repeat["body"]["deduplicated"], true, "{repeat:#}");
        }
    }
    publish_n(&app, &one, 3, "task.succeeded").await;
    publish_n(&app, &one, 2, "task.failed").await;
    for _ in 0..2 {
        let d = ws_failed.delivery().await;
        assert_eq!(ws_failed.ack(&d).await["body"]["deduplicated"], false);
    }
    // `all`: five deliveries, one left to lapse and be offered again.
    let mut lapsed = None;
    for i in 0..5 {
        let d = ws_all.delivery().await;
        if i == 2 {
            lapsed = Some(d);
        } else {
            assert_eq!(ws_all.ack(&d).await["body"]["deduplicated"], false);
        }
    }
    let lapsed = lapsed.unwrap();
    let again = ws_all.delivery().await;
    assert_eq!(
        again["body"]["delivery"]["id"],
        lapsed["body"]["delivery"]["id"]
    );
    assert_eq!(again["body"]["delivery"]["lease_epoch"], "2");
    assert_eq!(ws_all.ack(&again).await["body"]["deduplicated"], false);
    assert_eq!(
        app.scalar("SELECT COUNT(*) FROM deliveries WHERE state <> 'ACKED'")
            .await,
        0
    );

    let m = scrape(&app).await;
    let per_queue = |sql_where: &str| {
        format!(
            "FROM deliveries d JOIN subscriptions s ON s.id = d.subscription_id WHERE s.queue_id = '{sql_where}'"
        )
    };
    for cred in [&one, &two] {
        let q = cred.queue_id.as_str();
        let labels = [("queue_id", q)];
        let head = app
            .scalar(&format!(
                "SELECT head_sequence FROM queues WHERE id = '{q}'"
            ))
            .await;
        let events = app
            .scalar(&format!(
                "SELECT COUNT(*) FROM result_events WHERE queue_id = '{q}'"
            ))
            .await;
        let materialized = app
            .scalar(&format!("SELECT COUNT(*) {}", per_queue(q)))
            .await;
        let delivered = app
            .scalar(&format!(
                "SELECT CAST(SUM(d.attempts) AS BIGINT) {}",
                per_queue(q)
            ))
            .await;
        let acked = app
            .scalar(&format!(
                "SELECT COUNT(*) {} AND d.state = 'ACKED'",
                per_queue(q)
            ))
            .await;
        assert_eq!(head, events);
        let census = [
            ("orbit_events_appended_total", head),
            ("orbit_events_materialized_total", materialized),
            ("orbit_events_delivered_total", delivered),
            ("orbit_events_acked_total", acked),
            ("orbit_events_queue_head_sequence", head),
            ("orbit_events_queue_retention_floor", 0),
        ];
        for (name, expected) in census {
            assert_eq!(m.value(name, &labels), expected as f64, "{name} of {q}");
        }
    }
    // Queue one: 5 + 2 deliveries, `all` had a redelivery; queue two: 4.
    let one_q = [("queue_id", one.queue_id.as_str())];
    assert_eq!(m.value("orbit_events_materialized_total", &one_q), 7.0);
    assert!(m.value("orbit_events_delivered_total", &one_q) >= 8.0);

    let outcome = |o: &str| m.value("orbit_events_deliveries_total", &[("outcome", o)]);
    let attempts = app
        .scalar("SELECT CAST(SUM(attempts) AS BIGINT) FROM deliveries")
        .await as f64;
    assert_eq!(outcome("leased"), attempts);
    assert_eq!(outcome("acked"), 11.0);
    assert_eq!(outcome("ack_deduplicated"), 1.0);
    // Every lease ended in its ACK or lapsed (none is held now).
    assert_eq!(outcome("lease_expired"), attempts - 11.0);
    assert!(outcome("lease_expired") >= 1.0);
    assert_eq!(outcome("expired"), 0.0);
    assert_eq!(
        m.value("orbit_events_ack_duration_seconds_count", &[]),
        12.0
    );
    let claims: f64 = m
        .samples
        .iter()
        .filter(|s| s.metric == "orbit_events_claims_total")
        .map(|s| match s.value {
            PromValue::Counter(v) => v,
            _ => 0.0,
        })
        .sum();
    assert_eq!(
        m.value("orbit_events_claim_duration_seconds_count", &[]),
        claims
    );
    assert!(m.find("orbit_events_claim_wait_seconds", &[]).is_some());
    assert_eq!(m.value("orbit_events_connections", &[]), 3.0);
    assert_eq!(m.value("orbit_events_claims_waiting", &[]), 0.0);
    assert!(m.value("orbit_events_claims_in_flight_high_water", &[]) >= 1.0);
    assert!(
        !m.samples
            .iter()
            .any(|s| s.metric == "orbit_events_database_errors_total"),
        "no database error"
    );

    for (sub, cred) in [(&all, &one), (&failed_only, &one), (&other, &two)] {
        let labels = [
            ("subscription_id", sub.as_str()),
            ("queue_id", cred.queue_id.as_str()),
        ];
        assert_eq!(m.value("orbit_events_subscription_lag", &labels), 0.0);
        assert_eq!(m.value("orbit_events_subscription_backlog", &labels), 0.0);
        assert_eq!(
            m.value("orbit_events_subscription_max_pending", &labels),
            100.0
        );
        assert_eq!(
            m.value(
                "orbit_events_subscription_oldest_unacked_age_seconds",
                &labels
            ),
            0.0
        );
    }
    app.assert_invariants().await;
}

#[actix_web::test]
async fn the_subscription_gauges_show_lag_backlog_and_the_oldest_unacknowledged_age() {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let sub = app
        .subscribe(&cred, json!({ "from_sequence": "0", "max_pending": 3 }))
        .await["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let mut ws = app.bind(&cred.token, &sub, 1).await;
    publish_n(&app, &cred, 5, "task.succeeded").await;
    let _held = ws.delivery().await;
    let app_ref = &app;
    wait_until("three deliveries exist", || async move {
        app_ref.scalar("SELECT COUNT(*) FROM deliveries").await == 3
    })
    .await;
    let labels = [
        ("subscription_id", sub.as_str()),
        ("queue_id", cred.queue_id.as_str()),
    ];
    let m = scrape(&app).await;
    // The cursor stops before the fourth entry: max_pending is reached.
    assert_eq!(m.value("orbit_events_subscription_lag", &labels), 2.0);
    assert_eq!(m.value("orbit_events_subscription_backlog", &labels), 3.0);
    assert_eq!(
        m.value("orbit_events_subscription_max_pending", &labels),
        3.0
    );
    let age = m.value(
        "orbit_events_subscription_oldest_unacked_age_seconds",
        &labels,
    );
    assert!(age > 0.0 && age < 60.0, "{age}");
    app.assert_invariants().await;
}

#[actix_web::test]
async fn each_node_has_its_own_metrics_registry() {
    let first = spawn_app().await;
    let second = spawn_app().await;
    let cred = first.bootstrap().await;
    publish_n(&first, &cred, 2, "task.succeeded").await;
    let labels = [("queue_id", cred.queue_id.as_str())];
    assert_eq!(
        scrape(&first)
            .await
            .value("orbit_events_appended_total", &labels),
        2.0
    );
    assert!(
        scrape(&second)
            .await
            .find("orbit_events_appended_total", &labels)
            .is_none()
    );
}

#[actix_web::test]
async fn metrics_take_no_query_and_only_get() {
    let app = spawn_app().await;
    let res = app
        .request(reqwest::Method::GET, "/metrics?x=1", None, None, None)
        .await;
    res.assert_error(400, "INVALID_ARGUMENT");
    let res = app
        .request(reqwest::Method::POST, "/metrics", None, None, None)
        .await;
    res.assert_error(405, "INVALID_ARGUMENT");
    assert_eq!(res.headers["allow"], "GET");
    // No token needed. Labelled families (census, outcomes, errors) appear
    // with their first sample; the node-wide metrics are there from the start.
    let m = scrape(&app).await;
    let help: HashMap<&str, &str> = m
        .text
        .lines()
        .filter_map(|l| l.strip_prefix("# HELP "))
        .filter_map(|l| l.split_once(' '))
        .collect();
    for name in [
        "orbit_events_connections",
        "orbit_events_claims_waiting",
        "orbit_events_claims_in_flight",
        "orbit_events_claims_waiting_high_water",
        "orbit_events_claims_in_flight_high_water",
        "orbit_events_claims_in_flight_per_application_high_water",
        "orbit_events_claims_refused_total",
        "orbit_events_connections_refused_total",
        "orbit_events_claim_wait_seconds",
        "orbit_events_claim_duration_seconds",
        "orbit_events_ack_duration_seconds",
    ] {
        assert!(
            help.contains_key(name),
            "{name} is described in\n{}",
            m.text
        );
    }
}

#[actix_web::test]
async fn with_metrics_listen_set_metrics_are_served_only_there_and_that_listener_serves_only_metrics_and_health()
 {
    let app = spawn_app_with(|s| s.server.metrics_listen = Some("127.0.0.1:0".to_owned())).await;
    let cred = app.bootstrap().await;
    let metrics = format!(
        "http://127.0.0.1:{}",
        app.state.metrics_addr.expect("the metrics listener").port()
    );
    let get = async |url: String| {
        let res = app
            .http
            .get(url)
            .bearer_auth(&cred.token)
            .send()
            .await
            .unwrap();
        let status = res.status().as_u16();
        let body = res.text().await.unwrap();
        (status, body)
    };
    for path in ["/metrics", "/%6detrics", "/%6D%65trics"] {
        let (status, body) = get(format!("{}{path}", app.address)).await;
        assert_eq!(status, 404, "{path}: {body}");
        assert!(body.contains("NOT_FOUND"), "{path}: {body}");
    }
    let (status, body) = get(format!("{metrics}/metrics")).await;
    assert_eq!(status, 200);
    assert!(body.contains("orbit_events_writes_refused 0"), "{body}");
    for path in ["/healthz", "/readyz"] {
        assert_eq!(get(format!("{metrics}{path}")).await.0, 200, "{path}");
        assert_eq!(get(format!("{}{path}", app.address)).await.0, 200, "{path}");
    }
    let (status, body) = get(format!(
        "{metrics}/v1/subscriptions?queue_id={}",
        cred.queue_id
    ))
    .await;
    assert_eq!(status, 404, "{body}");
    let (status, _) = get(format!(
        "{}/v1/subscriptions?queue_id={}",
        app.address, cred.queue_id
    ))
    .await;
    assert_eq!(status, 200);
}

#[actix_web::test]
async fn http_requests_are_counted_and_timed_by_method_route_template_and_status() {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let sub = app.subscribe(&cred, json!({})).await;
    let sub_id = sub["id"].as_str().unwrap();
    for _ in 0..3 {
        assert_eq!(
            app.get(&format!("/v1/subscriptions/{sub_id}"), &cred.token)
                .await
                .status,
            200
        );
    }
    app.get(
        "/v1/subscriptions/0123456789abcdef0123456789abcdef",
        &cred.token,
    )
    .await
    .assert_error(404, "NOT_FOUND");
    app.get("/no/such/route/a1", &cred.token)
        .await
        .assert_error(404, "NOT_FOUND");
    app.get("/no/such/route/b2", &cred.token)
        .await
        .assert_error(404, "NOT_FOUND");
    let m = scrape(&app).await;
    let route = "/v1/subscriptions/{id}";
    let ok = [("method", "GET"), ("route", route), ("status", "200")];
    assert_eq!(m.value("orbit_events_http_requests_total", &ok), 3.0);
    let missing = [("method", "GET"), ("route", route), ("status", "404")];
    assert_eq!(m.value("orbit_events_http_requests_total", &missing), 1.0);
    // Paths no route has share one label: the label set stays bounded.
    let unmatched = [("route", "unmatched"), ("status", "404")];
    assert_eq!(m.value("orbit_events_http_requests_total", &unmatched), 2.0);
    assert!(
        !m.text.contains("/no/such/route"),
        "a raw path is never a label"
    );
    assert_eq!(
        m.value(
            "orbit_events_http_request_duration_seconds_count",
            &[("method", "GET"), ("route", route)]
        ),
        4.0,
        "the duration histogram has the four requests of the route"
    );
}

#[actix_web::test]
async fn build_info_is_one_labelled_with_the_version_and_commit() {
    let app = spawn_app().await;
    let m = scrape(&app).await;
    let info = m
        .find(
            "orbit_events_build_info",
            &[("version", env!("CARGO_PKG_VERSION"))],
        )
        .unwrap_or_else(|| panic!("no build_info: {}", m.text));
    assert!(
        matches!(info.value, PromValue::Gauge(v) if v == 1.0),
        "{info:?}"
    );
    let commit = info.labels.get("commit").unwrap_or_default();
    assert_eq!(commit, orbit_events::version::COMMIT);
    if std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.git")).exists() {
        assert_eq!(commit.len(), 12, "built from git: the commit is named");
    }
}
