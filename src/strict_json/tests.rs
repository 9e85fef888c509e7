//! Tests of the strict JSON path.

use super::*;
use crate::domain::U64Str;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
#[allow(dead_code)]
struct Inner {
    capacity: u32,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
#[allow(dead_code)]
struct Outer {
    name: String,
    #[serde(default, deserialize_with = "non_null")]
    inner: Option<Inner>,
    #[serde(default, deserialize_with = "non_null")]
    seq: Option<U64Str>,
}

fn err(text: &str) -> StrictJsonError {
    parse::<Outer>(text.as_bytes()).unwrap_err()
}

#[test]
fn accepts_a_strict_document() {
    let v: Outer = parse(br#"{"name":"a","inner":{"capacity":3},"seq":"7"}"#).unwrap();
    assert_eq!(v.name, "a");
    assert_eq!(v.seq, Some(U64Str(7)));
}

#[test]
fn numbers_are_checked_by_grammar_and_never_converted() {
    for ok in [
        "1E400",
        "-1e-400",
        "123456789012345678901234567890.5",
        "0",
        "-0.0e+1",
    ] {
        check_document(format!(r#"{{"n":{ok}}}"#).as_bytes())
            .unwrap_or_else(|e| panic!("{ok}: {e}"));
    }
    for bad in ["01", "1.", ".5", "1e", "-", "+1", "1e+", "0x10", "NaN"] {
        let e = check_document(format!(r#"{{"n":{bad}}}"#).as_bytes()).unwrap_err();
        assert!(e.message.starts_with("not valid JSON"), "{bad}: {e}");
    }
}

#[test]
fn text_that_is_not_json_is_refused_with_the_parsers_message() {
    for bad in [
        "",
        "{",
        r#"{"a":1,}"#,
        "[1,]",
        r#"{"a" 1}"#,
        "{} {}",
        r#""\u12""#,
        "\"tab\there\"",
        "tru",
        r#"{"a":"\x"}"#,
    ] {
        let e = check_document(bad.as_bytes()).unwrap_err();
        assert!(e.message.starts_with("not valid JSON"), "{bad:?}: {e}");
    }
    assert!(check_document(&[b'"', 0xff, b'"']).is_err());
    let deep = format!("{}{}", "[".repeat(129), "]".repeat(129));
    assert!(check_document(deep.as_bytes()).is_err());
    let ok = format!("{}{}", "[".repeat(128), "]".repeat(128));
    assert!(check_document(ok.as_bytes()).is_ok());
    check_document(r#" {"k\ud83d\ude00":["\n",true,false,null,{}]} "#.as_bytes()).unwrap();
}

#[test]
fn duplicate_keys_are_refused_at_every_depth() {
    let e = err(r#"{"name":"a","name":"b"}"#);
    assert_eq!(e.message, "duplicate key `name`");
    let e = err(r#"{"name":"a","inner":{"capacity":1,"capacity":2}}"#);
    assert_eq!(
        (e.path.as_str(), e.message.as_str()),
        ("inner", "duplicate key `capacity`")
    );
    let e = err(r#"{"name":"a","inner":{"capacity":1,"capac\u0069ty":2}}"#);
    assert_eq!(e.message, "duplicate key `capacity`");
    let e = check_document(br#"{"a":[{"x":1},{"y":1,"y":2}]}"#).unwrap_err();
    assert_eq!(e.path, "a[1]");
}

#[test]
fn unknown_fields_and_case_variants_are_refused_by_name() {
    let e = err(r#"{"Name":"a"}"#);
    assert!(e.message.contains("unknown field `Name`"), "{e}");
    let e = err(r#"{"name":"a","inner":{"capacity":1,"extra":true}}"#);
    assert_eq!(e.path, "inner.extra");
    assert!(e.message.contains("unknown field `extra`"), "{e}");
}

#[test]
fn null_wrong_types_and_trailing_data_are_refused() {
    assert_eq!(err(r#"{"name":"a","inner":null}"#).path, "inner");
    assert_eq!(err(r#"{"name":"a","seq":7}"#).path, "seq");
    assert_eq!(err(r#"{"name":"a","seq":"07"}"#).path, "seq");
    assert!(err(r#"{"name":"a"} {}"#).message.contains("trailing"));
    assert!(err(r#"{"name":"a"}x"#).message.contains("JSON"));
    assert!(err("").message.contains("JSON"));
    assert!(err(r#"{"name":1}"#).path == "name");
}

#[test]
fn a_struct_written_as_an_array_is_refused_at_every_depth() {
    let e = err(r#"["a"]"#);
    assert!(e.message.contains("a JSON object"), "{e}");
    let e = err(r#"{"name":"a","inner":[3]}"#);
    assert_eq!(e.path, "inner");
    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct List {
        items: Vec<Inner>,
        raw: Box<serde_json::value::RawValue>,
    }
    let e = parse::<List>(br#"{"items":[{"capacity":1},[2]],"raw":[1]}"#).unwrap_err();
    assert_eq!(e.path, "items[1]");
    let ok: List = parse(br#"{"items":[{"capacity":1}],"raw":{"x":[1,{"y":2}]}}"#).unwrap();
    assert_eq!(ok.raw.get(), r#"{"x":[1,{"y":2}]}"#);
}

#[test]
fn canonical_text_ignores_key_order_and_spacing_but_keeps_numbers() {
    let a: Box<serde_json::value::RawValue> =
        serde_json::from_str(r#"{ "b": [1, {"y":2,"x":1}], "a": 12345678901234567890123 }"#)
            .unwrap();
    let b: Box<serde_json::value::RawValue> =
        serde_json::from_str(r#"{"a":12345678901234567890123,"b":[1,{"x":1,"y":2}]}"#).unwrap();
    assert_eq!(canonical(&a).unwrap(), canonical(&b).unwrap());
    assert_eq!(
        canonical(&a).unwrap(),
        r#"{"a":12345678901234567890123,"b":[1,{"x":1,"y":2}]}"#
    );
}

#[test]
fn random_duplicate_free_documents_pass_and_injected_duplicates_fail() {
    // A small deterministic property test: build nested objects with
    // distinct keys, check they pass; duplicate one key, check it fails.
    let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    for _ in 0..300 {
        let width = (next() % 5 + 1) as usize;
        let depth = (next() % 4) as usize;
        let mut doc = String::from("1");
        for level in 0..depth {
            let keys: Vec<String> = (0..width).map(|i| format!("k{level}_{i}")).collect();
            let body: Vec<String> = keys.iter().map(|k| format!("\"{k}\":{doc}")).collect();
            doc = format!("{{{}}}", body.join(","));
        }
        assert!(check_document(doc.as_bytes()).is_ok(), "{doc}");
        if depth > 0 && width > 1 {
            let dup = doc.replacen(
                &format!("\"k{}_1\"", depth - 1),
                &format!("\"k{}_0\"", depth - 1),
                1,
            );
            assert!(check_document(dup.as_bytes()).is_err(), "{dup}");
        }
    }
}
