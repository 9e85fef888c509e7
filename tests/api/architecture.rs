//! Imports run one way (style.md, "Imports run downward"): the rooms below
//! the edge never name the edge. A name that a lower room needs from an
//! upper one is in the wrong room; this test names the file and the path.

use std::path::{Path, PathBuf};

/// The first segment of every `crate::` path in `text` (grouped imports
/// included), comments left out.
fn crate_paths(text: &str) -> Vec<String> {
    let code: String = text
        .lines()
        .map(|l| l.split("//").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n");
    let mut found = Vec::new();
    let mut rest = code.as_str();
    while let Some(i) = rest.find("crate::") {
        rest = &rest[i + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            // `crate::{a::b, c, d::{e}}`: the top-level names of the group.
            let mut depth = 0;
            let mut item = String::new();
            for c in group.chars() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        found.push(std::mem::take(&mut item));
                        continue;
                    }
                    _ => {}
                }
                if depth == 0 {
                    item.push(c);
                }
            }
            found.push(item);
        } else {
            found.push(rest.to_owned());
        }
    }
    found
        .into_iter()
        .map(|p| {
            p.trim()
                .split(|c: char| !(c.is_alphanumeric() || c == '_'))
                .next()
                .unwrap_or("")
                .to_owned()
        })
        .filter(|p| !p.is_empty())
        .collect()
}

fn rust_files(path: &Path) -> Vec<PathBuf> {
    if path.is_file() {
        return vec![path.to_path_buf()];
    }
    let mut files = Vec::new();
    for entry in std::fs::read_dir(path).unwrap() {
        files.extend(rust_files(&entry.unwrap().path()));
    }
    files.retain(|f| f.extension().is_some_and(|e| e == "rs"));
    files
}

/// Every file under `rooms` names none of `forbidden` (first segments of
/// `crate::` paths).
fn assert_rooms_do_not_import(rooms: &[&str], forbidden: &[&str]) {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut wrong = Vec::new();
    for room in rooms {
        for file in rust_files(&src.join(room)) {
            let text = std::fs::read_to_string(&file).unwrap();
            for path in crate_paths(&text) {
                if forbidden.contains(&path.as_str()) {
                    wrong.push(format!(
                        "{} uses crate::{path}",
                        file.strip_prefix(&src).unwrap().display()
                    ));
                }
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "imports that run upward:\n{}",
        wrong.join("\n")
    );
}

#[test]
fn store_delivery_journal_and_metrics_never_import_the_http_or_websocket_edge() {
    assert_rooms_do_not_import(
        &["store", "delivery", "journal.rs", "metrics.rs"],
        &["http", "ws", "startup", "cli"],
    );
}

#[test]
fn the_store_the_journal_and_metrics_never_import_the_actors() {
    assert_rooms_do_not_import(
        &["store", "journal.rs", "metrics.rs"],
        &["delivery", "node", "state"],
    );
}

#[test]
fn domain_types_import_no_other_room() {
    assert_rooms_do_not_import(
        &["domain"],
        &[
            "http", "ws", "store", "delivery", "journal", "metrics", "startup", "node", "state",
            "auth", "error", "cli",
        ],
    );
}

#[test]
fn the_import_check_sees_grouped_and_nested_imports() {
    let paths = crate_paths(
        "use crate::{\n    http::x,\n    store::{a, b::{c}},\n};\nfn f() { crate::ws::y(); } // crate::cli\n",
    );
    assert_eq!(paths, ["http", "store", "ws"]);
}

#[test]
fn the_client_knows_every_error_code_the_server_answers_with() {
    for code in orbit_events::error::ErrorCode::ALL {
        let parsed = orbit_events_client::ErrorCode::parse(code.as_str());
        assert!(
            !matches!(parsed, orbit_events_client::ErrorCode::Other(_)),
            "the client does not know {code}"
        );
        assert_eq!(parsed.as_str(), code.as_str());
    }
}
