//! Canonical uint64 decimal strings (spec: http-api.md §1): `0` or
//! `[1-9][0-9]*`, at most 18446744073709551615; no sign, leading zero,
//! fraction, exponent or whitespace.

use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer, de};

/// Parses a canonical uint64 decimal string.
pub fn parse_canonical_u64(s: &str) -> Option<u64> {
    let bytes = s.as_bytes();
    if bytes.is_empty() || bytes.len() > 20 || !bytes.iter().all(u8::is_ascii_digit) {
        return None;
    }
    if bytes.len() > 1 && bytes[0] == b'0' {
        return None;
    }
    s.parse::<u64>().ok()
}

/// A uint64 carried on the wire as a canonical decimal string.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct U64Str(pub u64);

impl U64Str {
    /// The value as a database `BIGINT`, if it fits (values above
    /// `i64::MAX` can never equal a stored value).
    pub fn to_i64(self) -> Option<i64> {
        i64::try_from(self.0).ok()
    }
}

impl fmt::Display for U64Str {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

impl Serialize for U64Str {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for U64Str {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl de::Visitor<'_> for V {
            type Value = U64Str;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a canonical uint64 decimal string")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<U64Str, E> {
                parse_canonical_u64(v)
                    .map(U64Str)
                    .ok_or_else(|| E::invalid_value(de::Unexpected::Str(v), &self))
            }
        }
        d.deserialize_str(V)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn canonical_forms_only() {
        for ok in ["0", "7", "10", "18446744073709551615"] {
            assert!(parse_canonical_u64(ok).is_some(), "{ok}");
        }
        for bad in [
            "",
            "007",
            "00",
            "+7",
            "-7",
            "7e0",
            "7.0",
            " 7",
            "7 ",
            "18446744073709551616",
            "99999999999999999999",
            "0x7",
            "١",
        ] {
            assert!(parse_canonical_u64(bad).is_none(), "{bad}");
        }
    }

    #[test]
    fn numbers_are_not_uint64_strings() {
        assert!(serde_json::from_str::<U64Str>("7").is_err());
        assert_eq!(serde_json::from_str::<U64Str>("\"7\"").unwrap(), U64Str(7));
    }

    #[test]
    fn every_u64_round_trips() {
        // A cheap property check over a spread of values.
        let mut x: u64 = 1;
        for _ in 0..2000 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            for v in [x, x >> 7, x >> 33, x >> 60] {
                assert_eq!(parse_canonical_u64(&v.to_string()), Some(v));
                assert_eq!(parse_canonical_u64(&format!("0{v}")), None);
                assert_eq!(parse_canonical_u64(&format!("+{v}")), None);
            }
        }
    }
}
