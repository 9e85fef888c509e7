//! Typed ids: 32 lowercase hex characters (spec: delivery-model.md §2).
//! New ids are insert-ordered (UUIDv7: a 48-bit millisecond timestamp, then
//! 74 random bits), so that B-tree inserts land at the right edge of the
//! primary key and of every index that ends in an id (decision 0079).

use std::fmt;

use rand::RngExt;
use serde::{Deserialize, Deserializer, Serialize, Serializer, de};

/// True when `s` is exactly 32 lowercase hex characters.
pub fn is_id(s: &str) -> bool {
    s.len() == 32
        && s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// 128 fresh random bits as 32 lowercase hex characters (message ids,
/// anything never inserted into an index).
pub fn random_hex_id() -> String {
    let bytes: [u8; 16] = rand::rng().random();
    hex::encode(bytes)
}

/// A new row id as 32 lowercase hex characters: a UUIDv7, so ids created
/// later sort later (within a millisecond too: the generator's counter),
/// with 74 random bits that make it unguessable.
pub fn ordered_hex_id() -> String {
    uuid::Uuid::now_v7().simple().to_string()
}

macro_rules! typed_id {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(String);

        impl $name {
            /// A fresh insert-ordered id ([`ordered_hex_id`]).
            pub fn generate() -> Self {
                Self(ordered_hex_id())
            }

            /// Parses 32 lowercase hex characters; `None` otherwise.
            pub fn parse(s: &str) -> Option<Self> {
                is_id(s).then(|| Self(s.to_owned()))
            }

            /// Wraps an id read back from the database (already validated on write).
            pub fn from_db(s: String) -> Self {
                Self(s)
            }

            pub fn as_str(&self) -> &str {
                &self.0
            }

            pub fn into_string(self) -> String {
                self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}({})", stringify!($name), self.0)
            }
        }

        impl Serialize for $name {
            fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(&self.0)
            }
        }

        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                struct V;
                impl de::Visitor<'_> for V {
                    type Value = $name;
                    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                        f.write_str("a 32-character lowercase hex id")
                    }
                    fn visit_str<E: de::Error>(self, v: &str) -> Result<$name, E> {
                        $name::parse(v).ok_or_else(|| {
                            E::invalid_value(de::Unexpected::Str(v), &self)
                        })
                    }
                }
                d.deserialize_str(V)
            }
        }
    };
}

typed_id!(
    /// A namespace (tenant) id.
    NamespaceId
);
typed_id!(
    /// An application id.
    ApplicationId
);
typed_id!(
    /// A credential id.
    CredentialId
);
typed_id!(
    /// A queue id; each queue owns one result log.
    QueueId
);
typed_id!(
    /// A result event id (`event.id`): the key consumers dedupe by.
    EventId
);
typed_id!(
    /// A subscription id.
    SubscriptionId
);
typed_id!(
    /// A delivery id: stable across redeliveries of one event to one subscription.
    DeliveryId
);
typed_id!(
    /// A session id: one WebSocket connection after a successful hello.
    SessionId
);
typed_id!(
    /// A node id: one running server process.
    NodeId
);
typed_id!(
    /// A frame's `message_id` / `reply_to`, and a request's `request_id`.
    MessageId
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_32_lowercase_hex() {
        let id = SubscriptionId::generate();
        assert!(is_id(id.as_str()));
        assert!(SubscriptionId::parse(&"A".repeat(32)).is_none());
        assert!(SubscriptionId::parse(&"a".repeat(31)).is_none());
        assert!(SubscriptionId::parse(&"g".repeat(32)).is_none());
        assert!(SubscriptionId::parse(&"0".repeat(32)).is_some());
    }
}
