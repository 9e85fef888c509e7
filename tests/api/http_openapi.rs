//! The committed OpenAPI document is the one the code generates, and what
//! it says matches what the server does (http-api.md §4, last paragraph).

use std::path::PathBuf;

use crate::helpers::*;

fn committed_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("docs/openapi.json")
}

#[test]
fn docs_openapi_json_is_the_document_the_code_generates() {
    let generated = orbit_events::http::openapi::document();
    let path = committed_path();
    if std::env::var_os("ORBIT_UPDATE_OPENAPI").is_some() {
        std::fs::write(&path, &generated).unwrap();
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == generated,
        "docs/openapi.json differs from the generated document; regenerate it with \
         ORBIT_UPDATE_OPENAPI=1 cargo test --test api openapi"
    );
}

#[test]
fn the_document_is_openapi_3_1_and_lists_every_management_route() {
    let doc = openapi();
    assert_eq!(doc["openapi"], "3.1.0");
    let mut routes: Vec<String> = Vec::new();
    for (path, item) in doc["paths"].as_object().unwrap() {
        for method in item.as_object().unwrap().keys() {
            routes.push(format!("{} {path}", method.to_uppercase()));
        }
    }
    routes.sort();
    assert_eq!(
        routes,
        [
            "GET /healthz",
            "GET /metrics",
            "GET /openapi.json",
            "GET /readyz",
            "GET /v1/queues",
            "GET /v1/subscriptions",
            "GET /v1/subscriptions/{id}",
            "GET /v1/subscriptions/{id}/deliveries",
            "GET /v1/subscriptions/{id}/deliveries/{delivery_id}",
            "GET /v1/subscriptions/{id}/deliveries/{delivery_id}/history",
            "GET /v1/subscriptions/{id}/status",
            "POST /v1/queues/{queue_id}/results",
            "POST /v1/subscriptions",
            "POST /v1/subscriptions/{id}/deliveries/{delivery_id}:retry",
            "POST /v1/subscriptions/{id}/deliveries:retry",
            "POST /v1/subscriptions/{id}:configure",
        ]
    );
}

#[test]
fn the_uint64_pattern_accepts_exactly_the_canonical_strings_up_to_the_maximum() {
    let pattern = orbit_events::http::openapi::uint64_pattern();
    let schema = serde_json::json!({ "type": "string", "pattern": pattern });
    let validator = jsonschema::validator_for(&schema).unwrap();
    let accepts = |s: &str| validator.is_valid(&serde_json::json!(s));
    let mut x: u64 = 0x2545_f491_4f6c_dd1d;
    let mut samples = vec![
        0,
        1,
        9,
        10,
        u64::MAX,
        u64::MAX - 1,
        10_000_000_000_000_000_000,
    ];
    for _ in 0..3000 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        samples.extend([x, x >> 11, x >> 37, x >> 59]);
    }
    for v in samples {
        let text = v.to_string();
        assert!(accepts(&text), "{text}");
        assert_eq!(orbit_events::domain::parse_canonical_u64(&text), Some(v));
        assert!(!accepts(&format!("0{text}")), "0{text}");
        assert!(!accepts(&format!("+{text}")), "+{text}");
        assert!(
            !accepts(&format!("{text}0")) || (v <= u64::MAX / 10 && v != 0),
            "{text}0"
        );
    }
    for bad in [
        "",
        "007",
        "+7",
        "7e0",
        "7.0",
        " 7",
        "18446744073709551616",
        "18446744073709551620",
        "18446744073709552000",
        "19000000000000000000",
        "20000000000000000000",
        "99999999999999999999",
        "100000000000000000000",
    ] {
        assert!(!accepts(bad), "{bad}");
    }
}

#[actix_web::test]
async fn the_node_serves_the_committed_document_at_openapi_json_with_servers_naming_itself() {
    let app = spawn_app().await;
    // No token: the reference is public, like /healthz.
    let res = app
        .http
        .get(format!("{}/openapi.json", app.address))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    assert_eq!(res.headers()["content-type"], "application/json");
    let mut served: serde_json::Value = res.json().await.unwrap();
    assert_eq!(
        served["servers"],
        serde_json::json!([{ "url": app.address }]),
        "servers names the node as the request reached it"
    );
    // Behind a proxy that mounts the node under a path.
    for (prefix, expected) in [
        ("/orbit/", format!("{}/orbit", app.address)),
        ("/orbit events", app.address.clone()),
    ] {
        let doc: serde_json::Value = app
            .http
            .get(format!("{}/openapi.json", app.address))
            .header("X-Forwarded-Prefix", prefix)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(doc["servers"][0]["url"], expected.as_str(), "{prefix:?}");
    }
    served.as_object_mut().unwrap().remove("servers");
    let committed: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(committed_path()).unwrap()).unwrap();
    assert!(
        served == committed,
        "the served document is docs/openapi.json plus servers"
    );
}

/// `GET` of a public path of `app`, without a token: (status, headers, body).
async fn get_public(app: &TestApp, path: &str) -> (u16, reqwest::header::HeaderMap, String) {
    let res = app
        .http
        .get(format!("{}{path}", app.address))
        .send()
        .await
        .unwrap();
    let status = res.status().as_u16();
    let headers = res.headers().clone();
    (status, headers, res.text().await.unwrap())
}

/// Every absolute URL in `text` (`http://…` or `https://…`, up to a quote,
/// space or bracket).
fn absolute_urls(text: &str) -> Vec<String> {
    let mut urls = Vec::new();
    for scheme in ["http://", "https://"] {
        for (at, _) in text.match_indices(scheme) {
            let url: String = text[at..]
                .chars()
                .take_while(|c| !matches!(c, '"' | '\'' | ' ' | ')' | '<' | '>' | '`' | '\n'))
                .collect();
            urls.push(url);
        }
    }
    urls
}

#[actix_web::test]
async fn the_api_reference_page_at_docs_is_served_by_the_node_and_refers_to_no_other_host() {
    let app = spawn_app().await;
    // `/` and `/docs` lead to `/docs/` (relative, so a proxy's prefix stays).
    for (path, status) in [("/", 307), ("/docs", 308)] {
        let res = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .unwrap()
            .get(format!("{}{path}", app.address))
            .send()
            .await
            .unwrap();
        assert_eq!(res.status().as_u16(), status, "{path}");
        assert_eq!(res.headers()["location"], "docs/", "{path}");
    }
    let (status, headers, page) = get_public(&app, "/docs/").await;
    assert_eq!(status, 200);
    assert!(
        headers["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/html"),
        "{headers:?}"
    );
    assert!(
        page.contains("<html") || page.contains("<!DOCTYPE html"),
        "{page}"
    );
    assert!(
        absolute_urls(&page).is_empty(),
        "the page names no host: {:?}",
        absolute_urls(&page)
    );
    // What the page loads comes from the node too, and points at its own
    // document, with no validator badge (an image from another host).
    let (status, _, init) = get_public(&app, "/docs/swagger-initializer.js").await;
    assert_eq!(status, 200);
    assert!(init.contains("../openapi.json"), "{init}");
    assert!(init.contains("\"validatorUrl\": \"none\""), "{init}");
    assert!(absolute_urls(&init).is_empty(), "{init}");
    for asset in ["swagger-ui-bundle.js", "swagger-ui.css", "index.css"] {
        let (status, _, body) = get_public(&app, &format!("/docs/{asset}")).await;
        assert_eq!(status, 200, "{asset}");
        assert!(!body.is_empty(), "{asset}");
    }
    let (status, _, body) = get_public(&app, "/docs/no-such-file.js").await;
    assert_eq!(status, 404);
    assert!(body.contains("NOT_FOUND"), "{body}");
}
