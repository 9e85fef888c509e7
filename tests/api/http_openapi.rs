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
            "GET /readyz",
            "GET /v1/subscriptions",
            "GET /v1/subscriptions/{id}",
            "GET /v1/subscriptions/{id}/deliveries",
            "GET /v1/subscriptions/{id}/deliveries/{delivery_id}",
            "POST /v1/queues/{queue_id}/results",
            "POST /v1/subscriptions",
            "POST /v1/subscriptions/{id}/deliveries/{delivery_id}:retry",
            "POST /v1/subscriptions/{id}:configure",
        ]
    );
}
