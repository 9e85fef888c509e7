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

use std::fmt;

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
/// depth and nothing after it. Numbers are checked against the grammar
/// only, never converted: a result may hold `1E400` (it is kept byte-exact,
/// delivery-model.md §3).
pub fn check_document(bytes: &[u8]) -> Result<(), StrictJsonError> {
    match std::str::from_utf8(bytes) {
        Ok(text) => Walk { text, at: 0 }.document(),
        Err(_) => Err(Walk::invalid(bytes)),
    }
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
    let value: T = serde_path_to_error::deserialize(ObjectsOnly(&mut de)).map_err(|err| {
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

/// A deserializer that builds structs from JSON objects only. serde's
/// derive also accepts a struct written as an array of its field values in
/// declaration order (`["name", "queue_id", ...]`), which would let a
/// client skip every field name; this wrapper refuses that form at every
/// depth by wrapping every nested deserializer, visitor and access. Enum
/// payloads are passed through unwrapped (no client JSON holds an enum
/// with struct variants).
struct ObjectsOnly<D>(D);

/// A visitor whose nested values are read through [`ObjectsOnly`];
/// `is_struct` refuses the array form.
struct Wrap<V> {
    inner: V,
    is_struct: bool,
}

impl<V> Wrap<V> {
    fn plain(inner: V) -> Wrap<V> {
        Wrap {
            inner,
            is_struct: false,
        }
    }
}

struct Seed<S>(S);
struct Seq<A>(A);
struct Map<A>(A);

macro_rules! forward_deserialize {
    ($($method:ident),* $(,)?) => {$(
        fn $method<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, D::Error> {
            self.0.$method(Wrap::plain(visitor))
        }
    )*};
}

impl<'de, D: Deserializer<'de>> Deserializer<'de> for ObjectsOnly<D> {
    type Error = D::Error;

    forward_deserialize!(
        deserialize_any,
        deserialize_bool,
        deserialize_i8,
        deserialize_i16,
        deserialize_i32,
        deserialize_i64,
        deserialize_i128,
        deserialize_u8,
        deserialize_u16,
        deserialize_u32,
        deserialize_u64,
        deserialize_u128,
        deserialize_f32,
        deserialize_f64,
        deserialize_char,
        deserialize_str,
        deserialize_string,
        deserialize_bytes,
        deserialize_byte_buf,
        deserialize_option,
        deserialize_unit,
        deserialize_seq,
        deserialize_map,
        deserialize_identifier,
        deserialize_ignored_any,
    );

    fn deserialize_unit_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        visitor: V,
    ) -> Result<V::Value, D::Error> {
        self.0.deserialize_unit_struct(name, Wrap::plain(visitor))
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        visitor: V,
    ) -> Result<V::Value, D::Error> {
        self.0
            .deserialize_newtype_struct(name, Wrap::plain(visitor))
    }

    fn deserialize_tuple<V: Visitor<'de>>(
        self,
        len: usize,
        visitor: V,
    ) -> Result<V::Value, D::Error> {
        self.0.deserialize_tuple(len, Wrap::plain(visitor))
    }

    fn deserialize_tuple_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        len: usize,
        visitor: V,
    ) -> Result<V::Value, D::Error> {
        self.0
            .deserialize_tuple_struct(name, len, Wrap::plain(visitor))
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, D::Error> {
        self.0.deserialize_struct(
            name,
            fields,
            Wrap {
                inner: visitor,
                is_struct: true,
            },
        )
    }

    fn deserialize_enum<V: Visitor<'de>>(
        self,
        name: &'static str,
        variants: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, D::Error> {
        self.0
            .deserialize_enum(name, variants, Wrap::plain(visitor))
    }

    fn is_human_readable(&self) -> bool {
        self.0.is_human_readable()
    }
}

macro_rules! forward_visit {
    ($($method:ident($ty:ty)),* $(,)?) => {$(
        fn $method<E: de::Error>(self, v: $ty) -> Result<V::Value, E> {
            self.inner.$method(v)
        }
    )*};
}

impl<'de, V: Visitor<'de>> Visitor<'de> for Wrap<V> {
    type Value = V::Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.inner.expecting(f)
    }

    forward_visit!(
        visit_bool(bool),
        visit_i8(i8),
        visit_i16(i16),
        visit_i32(i32),
        visit_i64(i64),
        visit_i128(i128),
        visit_u8(u8),
        visit_u16(u16),
        visit_u32(u32),
        visit_u64(u64),
        visit_u128(u128),
        visit_f32(f32),
        visit_f64(f64),
        visit_char(char),
        visit_str(&str),
        visit_borrowed_str(&'de str),
        visit_string(String),
        visit_bytes(&[u8]),
        visit_borrowed_bytes(&'de [u8]),
        visit_byte_buf(Vec<u8>),
    );

    fn visit_none<E: de::Error>(self) -> Result<V::Value, E> {
        self.inner.visit_none()
    }

    fn visit_unit<E: de::Error>(self) -> Result<V::Value, E> {
        self.inner.visit_unit()
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<V::Value, D::Error> {
        self.inner.visit_some(ObjectsOnly(d))
    }

    fn visit_newtype_struct<D: Deserializer<'de>>(self, d: D) -> Result<V::Value, D::Error> {
        self.inner.visit_newtype_struct(ObjectsOnly(d))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<V::Value, A::Error> {
        if self.is_struct {
            return Err(de::Error::invalid_type(
                de::Unexpected::Seq,
                &"a JSON object",
            ));
        }
        self.inner.visit_seq(Seq(seq))
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<V::Value, A::Error> {
        self.inner.visit_map(Map(map))
    }

    fn visit_enum<A: de::EnumAccess<'de>>(self, data: A) -> Result<V::Value, A::Error> {
        self.inner.visit_enum(data)
    }
}

impl<'de, S: DeserializeSeed<'de>> DeserializeSeed<'de> for Seed<S> {
    type Value = S::Value;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<S::Value, D::Error> {
        self.0.deserialize(ObjectsOnly(d))
    }
}

impl<'de, A: SeqAccess<'de>> SeqAccess<'de> for Seq<A> {
    type Error = A::Error;
    fn next_element_seed<T: DeserializeSeed<'de>>(
        &mut self,
        seed: T,
    ) -> Result<Option<T::Value>, A::Error> {
        self.0.next_element_seed(Seed(seed))
    }
    fn size_hint(&self) -> Option<usize> {
        self.0.size_hint()
    }
}

impl<'de, A: MapAccess<'de>> MapAccess<'de> for Map<A> {
    type Error = A::Error;
    fn next_key_seed<K: DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, A::Error> {
        self.0.next_key_seed(Seed(seed))
    }
    fn next_value_seed<T: DeserializeSeed<'de>>(&mut self, seed: T) -> Result<T::Value, A::Error> {
        self.0.next_value_seed(Seed(seed))
    }
    fn size_hint(&self) -> Option<usize> {
        self.0.size_hint()
    }
}

mod walk;
use walk::Walk;

#[cfg(test)]
mod tests;
