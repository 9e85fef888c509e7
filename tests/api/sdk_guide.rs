//! `docs/consumer-guide.md` shows the Inbox pattern in code that is
//! compiled and run: each of its Rust blocks is a part of
//! `examples/inbox-consumer/src/main.rs` (which the crash test runs),
//! marked there with `// ANCHOR: name` … `// ANCHOR_END: name`. This test
//! fails when the two differ; `ORBIT_UPDATE_DOCS=1` rewrites the guide's
//! blocks.

use std::{collections::BTreeMap, path::Path};

const GUIDE: &str = "docs/consumer-guide.md";
const EXAMPLE: &str = "examples/inbox-consumer/src/main.rs";

/// The anchored parts of the example, without their common indentation.
fn anchors(source: &str) -> BTreeMap<String, String> {
    let mut parts = BTreeMap::new();
    let mut open: Option<(String, Vec<&str>)> = None;
    for line in source.lines() {
        let marker = line.trim();
        if let Some(name) = marker.strip_prefix("// ANCHOR: ") {
            open = Some((name.to_owned(), Vec::new()));
        } else if let Some(name) = marker.strip_prefix("// ANCHOR_END: ") {
            let (open_name, lines) = open.take().expect("ANCHOR_END without ANCHOR");
            assert_eq!(open_name, name, "anchors do not nest");
            let indent = lines
                .iter()
                .filter(|l| !l.trim().is_empty())
                .map(|l| l.len() - l.trim_start().len())
                .min()
                .unwrap_or(0);
            let text: Vec<&str> = lines
                .iter()
                .map(|l| {
                    if l.len() >= indent {
                        &l[indent..]
                    } else {
                        l.trim_start()
                    }
                })
                .collect();
            parts.insert(name.to_owned(), text.join("\n"));
        } else if let Some((_, lines)) = open.as_mut() {
            lines.push(line);
        }
    }
    assert!(open.is_none(), "an ANCHOR is never closed");
    parts
}

/// The guide with each `<!-- example:NAME -->` block replaced by the
/// example's part `NAME`; also returns the names used.
fn render(guide: &str, parts: &BTreeMap<String, String>) -> (String, Vec<String>) {
    let mut out = String::new();
    let mut used = Vec::new();
    let mut rest = guide;
    while let Some(start) = rest.find("<!-- example:") {
        let (before, from) = rest.split_at(start);
        out.push_str(before);
        let name_end = from.find(" -->").expect("an unterminated example marker");
        let name = &from["<!-- example:".len()..name_end];
        let end = from
            .find("<!-- /example -->")
            .expect("an example block without its end");
        let part = parts
            .get(name)
            .unwrap_or_else(|| panic!("{GUIDE} shows `{name}`, which {EXAMPLE} does not mark"));
        out.push_str(&format!("<!-- example:{name} -->\n```rust\n{part}\n```\n"));
        used.push(name.to_owned());
        rest = &from[end..];
    }
    out.push_str(rest);
    (out, used)
}

#[test]
fn the_consumer_guide_shows_the_inbox_example_exactly_as_it_is_compiled_and_run() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let parts = anchors(&std::fs::read_to_string(root.join(EXAMPLE)).unwrap());
    let guide = std::fs::read_to_string(root.join(GUIDE)).unwrap();
    let (rendered, used) = render(&guide, &parts);
    for required in ["schema", "store", "process", "handler", "run"] {
        assert!(
            used.iter().any(|u| u == required),
            "{GUIDE} does not show `{required}`"
        );
    }
    if std::env::var("ORBIT_UPDATE_DOCS").is_ok() {
        std::fs::write(root.join(GUIDE), &rendered).unwrap();
        return;
    }
    assert!(
        rendered == guide,
        "{GUIDE} differs from {EXAMPLE}: run ORBIT_UPDATE_DOCS=1 cargo test --test api \
         the_consumer_guide_shows"
    );
}
