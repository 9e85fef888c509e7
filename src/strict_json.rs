//! The one strict JSON parsing path for every piece of client JSON: HTTP
//! bodies, result ingest and WebSocket frames (spec: http-api.md §1,
//! protocol.md §2).
//!
//! serde's derive refuses repeated struct fields, but `serde_json::Value`,
//! `RawValue` and flattened maps silently keep the last duplicate, so a first
//! pass walks the raw text and refuses a duplicate key at any depth (keys are
//! compared after unescaping: `"capac\u0069ty"` duplicates `"capacity"`).
//! The second pass is typed: unknown fields (including case variants),
//! wrong JSON types, `null` where not allowed and trailing data are errors
//! whose message names the field.

use std::{collections::HashSet, fmt};

use serde::{
    Deserialize, Deserializer,
    de::{self, DeserializeOwned, DeserializeSeed, MapAccess, SeqAccess, Visitor},
};

/// A strictness violation. `path` is the field it concerns (`.` = the whole
/// document); `message` is safe to show to the client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StrictJsonError {
    pub path: String,
    pub message: String,
}

impl fmt::Display for StrictJsonError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.path == "." {
            write!(f, "{}", self.message)
        } else {
            write!(f, "{}: {}", self.path, self.message)
        }
    }
}

impl std::error::Error for StrictJsonError {}

/// Checks that `bytes` is one JSON document with no duplicate key at any
/// depth and nothing after it.
pub fn check_document(bytes: &[u8]) -> Result<(), StrictJsonError> {
    let mut de = serde_json::Deserializer::from_slice(bytes);
    DupWalk { path: "" }
        .deserialize(&mut de)
        .and_then(|()| de.end())
        .map_err(|err| {
            let text = strip_position(&err.to_string());
            match text.strip_prefix(DUP_MARK) {
                Some(rest) => match rest.split_once('\u{0}') {
                    Some((path, key)) => StrictJsonError {
                        path: if path.is_empty() {
                            ".".to_owned()
                        } else {
                            path.to_owned()
                        },
                        message: format!("duplicate key `{key}`"),
                    },
                    None => StrictJsonError {
                        path: ".".to_owned(),
                        message: text,
                    },
                },
                None => StrictJsonError {
                    path: ".".to_owned(),
                    message: format!("not valid JSON: {text}"),
                },
            }
        })
}

/// Parses a strict JSON document into `T` (which should use
/// `#[serde(deny_unknown_fields)]`): duplicate keys, unknown fields, wrong
/// types and trailing data are errors naming the field.
pub fn parse<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, StrictJsonError> {
    check_document(bytes)?;
    parse_checked(bytes)
}

/// Typed parse of a document already accepted by [`check_document`] (e.g.
/// the body of a frame whose whole text was checked).
pub fn parse_checked<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, StrictJsonError> {
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let value: T = serde_path_to_error::deserialize(&mut de).map_err(|err| {
        let path = err.path().to_string();
        StrictJsonError {
            path,
            message: strip_position(&err.inner().to_string()),
        }
    })?;
    de.end().map_err(|err| StrictJsonError {
        path: ".".to_owned(),
        message: format!("trailing data: {}", strip_position(&err.to_string())),
    })?;
    Ok(value)
}

/// For `#[serde(default, deserialize_with = "non_null")]` on an optional
/// field that may be omitted but must not be `null`.
pub fn non_null<'de, D, T>(d: D) -> Result<Option<T>, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de>,
{
    T::deserialize(d).map(Some)
}

/// A canonical text of a strict JSON value for digests: object keys sorted,
/// whitespace removed; numbers and strings keep their exact text (so no
/// precision is lost). Expects a value already accepted by
/// [`check_document`] (no duplicate keys).
pub fn canonical(raw: &serde_json::value::RawValue) -> Result<String, StrictJsonError> {
    let mut out = String::with_capacity(raw.get().len());
    write_canonical(raw, &mut out).map_err(|e| StrictJsonError {
        path: ".".to_owned(),
        message: strip_position(&e.to_string()),
    })?;
    Ok(out)
}

fn write_canonical(
    raw: &serde_json::value::RawValue,
    out: &mut String,
) -> Result<(), serde_json::Error> {
    use serde_json::value::RawValue;
    let text = raw.get().trim();
    match text.as_bytes().first() {
        Some(b'{') => {
            let map: std::collections::BTreeMap<String, Box<RawValue>> =
                serde_json::from_str(text)?;
            out.push('{');
            for (i, (key, value)) in map.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&serde_json::to_string(key)?);
                out.push(':');
                write_canonical(value, out)?;
            }
            out.push('}');
        }
        Some(b'[') => {
            let items: Vec<Box<RawValue>> = serde_json::from_str(text)?;
            out.push('[');
            for (i, value) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_canonical(value, out)?;
            }
            out.push(']');
        }
        _ => out.push_str(text),
    }
    Ok(())
}

/// serde_json appends " at line L column C"; the field path says more.
fn strip_position(msg: &str) -> String {
    match msg.rfind(" at line ") {
        Some(idx) => msg[..idx].to_owned(),
        None => msg.to_owned(),
    }
}

const DUP_MARK: &str = "\u{0}dup\u{0}";

/// Walks any JSON value, refusing duplicate keys. `path` is the location of
/// the value being walked, for the error message.
struct DupWalk<'a> {
    path: &'a str,
}

impl<'de> DeserializeSeed<'de> for DupWalk<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for DupWalk<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_bool<E>(self, _: bool) -> Result<(), E> {
        Ok(())
    }
    fn visit_i64<E>(self, _: i64) -> Result<(), E> {
        Ok(())
    }
    fn visit_u64<E>(self, _: u64) -> Result<(), E> {
        Ok(())
    }
    fn visit_f64<E>(self, _: f64) -> Result<(), E> {
        Ok(())
    }
    fn visit_str<E>(self, _: &str) -> Result<(), E> {
        Ok(())
    }
    fn visit_unit<E>(self) -> Result<(), E> {
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let mut index = 0usize;
        loop {
            let path = format!("{}[{index}]", self.path);
            if seq.next_element_seed(DupWalk { path: &path })?.is_none() {
                return Ok(());
            }
            index += 1;
        }
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let mut seen: HashSet<String> = HashSet::new();
        while let Some(key) = map.next_key::<String>()? {
            let path = if self.path.is_empty() {
                key.clone()
            } else {
                format!("{}.{key}", self.path)
            };
            if seen.contains(&key) {
                return Err(de::Error::custom(format!(
                    "{DUP_MARK}{}\u{0}{key}",
                    self.path
                )));
            }
            map.next_value_seed(DupWalk { path: &path })?;
            seen.insert(key);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
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
}
