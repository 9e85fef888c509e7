//! The API reference page in a real browser: headless Chromium (Debian's
//! `chromium`, which `scripts/test` installs when missing) loads `/docs/`
//! from a node, runs its scripts, and the rendered page lists every path of
//! the OpenAPI document. A screenshot is left for a person to look at.

use std::{path::PathBuf, process::Command};

use crate::helpers::*;

/// Chromium's command, or a failure that says how to get it.
fn chromium() -> &'static str {
    let found = Command::new("chromium")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        found,
        "this test needs Debian's `chromium` on PATH; `./scripts/test` installs it \
         when run as root (apt-get install chromium)"
    );
    "chromium"
}

/// Runs headless Chromium on `url` with `args`, giving its scripts up to
/// 20 s of (virtual) time; returns stdout.
fn headless(url: &str, args: &[&str]) -> String {
    let profile = tempfile::tempdir().unwrap();
    let out = Command::new(chromium())
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--virtual-time-budget=20000",
        ])
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .args(args)
        .arg(url)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "chromium failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[actix_web::test]
async fn headless_chromium_renders_the_api_reference_with_every_path_of_the_openapi_document() {
    let app = spawn_app().await;
    let document: serde_json::Value = app
        .http
        .get(format!("{}/openapi.json", app.address))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let paths: Vec<String> = document["paths"]
        .as_object()
        .unwrap()
        .keys()
        .cloned()
        .collect();
    assert!(paths.len() > 10, "{paths:?}");
    let url = format!("{}/docs/", app.address);
    let dom = tokio::task::spawn_blocking({
        let url = url.clone();
        move || headless(&url, &["--dump-dom"])
    })
    .await
    .unwrap();
    // Swagger UI renders each operation's path in `data-path`.
    let missing: Vec<&String> = paths
        .iter()
        .filter(|p| !dom.contains(&format!("data-path=\"{p}\"")))
        .collect();
    assert!(
        missing.is_empty(),
        "the rendered page lacks {missing:?}; its DOM:\n{}",
        &dom[..dom.len().min(4000)]
    );
    assert!(dom.contains("orbit-events"), "the page names the API");

    let shot = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("api-reference.png");
    let _ = std::fs::remove_file(&shot);
    tokio::task::spawn_blocking({
        let shot = shot.clone();
        move || {
            headless(
                &url,
                &[
                    "--window-size=1280,2400",
                    "--hide-scrollbars",
                    &format!("--screenshot={}", shot.display()),
                ],
            )
        }
    })
    .await
    .unwrap();
    let size = std::fs::metadata(&shot).map(|m| m.len()).unwrap_or(0);
    assert!(size > 10_000, "a screenshot of the page: {size} bytes");
    eprintln!("screenshot of /docs/: {}", shot.display());
}
