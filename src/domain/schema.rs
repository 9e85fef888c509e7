//! Schema primitives of the wire (ids, uint64 strings, times, the state and
//! type names) for the OpenAPI document and the views that use them: they
//! describe domain values, so every room can name them (http/openapi.rs
//! builds the document from them).

use utoipa::{
    PartialSchema, ToSchema,
    openapi::{
        ObjectBuilder, RefOr, Type,
        schema::{ArrayBuilder, KnownFormat, Schema, SchemaFormat},
    },
};

/// The pattern of a canonical uint64 decimal string, exact up to the bound:
/// `0`, or 1–19 digits without a leading zero, or 20 digits not above
/// 18446744073709551615 (one alternative per digit of the bound).
pub fn uint64_pattern() -> String {
    let max = u64::MAX.to_string();
    let digits = max.as_bytes();
    let mut alternatives = vec!["0".to_owned(), "[1-9][0-9]{0,18}".to_owned()];
    for (i, &d) in digits.iter().enumerate() {
        let low = if i == 0 { b'1' } else { b'0' };
        if d > low {
            let rest = digits.len() - i - 1;
            alternatives.push(format!(
                "{}[{}-{}][0-9]{{{rest}}}",
                &max[..i],
                low as char,
                (d - 1) as char
            ));
        }
    }
    alternatives.push(max.clone());
    format!("^({})$", alternatives.join("|"))
}
/// Pattern of an RFC 3339 time with at most microsecond precision (the
/// server refuses finer fractions rather than truncate them).
pub const TIME_PATTERN: &str = r"^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]{1,6})?(Z|[+-][0-9]{2}:[0-9]{2})$";
/// Pattern of every id: 32 lowercase hex characters.
pub const ID_PATTERN: &str = "^[0-9a-f]{32}$";
/// Pattern of an `Idempotency-Key`: 1–255 visible ASCII characters.
pub const IDEMPOTENCY_KEY_PATTERN: &str = "^[!-~]{1,255}$";

macro_rules! string_schema {
    ($(#[$doc:meta])* $name:ident, $build:expr) => {
        $(#[$doc])*
        pub struct $name;
        impl PartialSchema for $name {
            fn schema() -> RefOr<Schema> {
                let b: ObjectBuilder = $build;
                b.into()
            }
        }
        impl ToSchema for $name {}
    };
}

string_schema!(
    /// A canonical uint64 decimal string.
    Uint64String,
    ObjectBuilder::new()
        .schema_type(Type::String)
        .pattern(Some(uint64_pattern()))
        .description(Some(
            "A uint64 as a canonical decimal string: `0` or `[1-9][0-9]*`, at most 18446744073709551615; no sign, leading zero, fraction, exponent or whitespace."
        ))
);

string_schema!(
    /// An id: 32 lowercase hex characters.
    Id,
    ObjectBuilder::new()
        .schema_type(Type::String)
        .pattern(Some(ID_PATTERN))
        .description(Some("32 lowercase hex characters (128 random bits)."))
);

string_schema!(
    /// A UTC instant rendered as RFC 3339 with `Z`.
    Time,
    ObjectBuilder::new()
        .schema_type(Type::String)
        .format(Some(SchemaFormat::KnownFormat(KnownFormat::DateTime)))
        .pattern(Some(TIME_PATTERN))
        .description(Some(
            "RFC 3339 with at most microsecond precision; the server answers in UTC with `Z`."
        ))
);

string_schema!(
    /// One of the four result types.
    ResultTypeName,
    ObjectBuilder::new()
        .schema_type(Type::String)
        .enum_values(Some([
            "task.cancelled",
            "task.failed",
            "task.needs_review",
            "task.succeeded",
        ]))
);

string_schema!(
    /// The state of a task snapshot.
    SnapshotState,
    ObjectBuilder::new()
        .schema_type(Type::String)
        .enum_values(Some(["SUCCEEDED", "FAILED", "CANCELLED", "NEEDS_REVIEW"]))
);

string_schema!(
    /// A delivery state.
    DeliveryStateName,
    ObjectBuilder::new()
        .schema_type(Type::String)
        .enum_values(Some(["PENDING", "LEASED", "ACKED", "EXPIRED"]))
);

/// A set of result types as a request gives it: no repeats; `[]` = all.
pub struct ResultTypeList;

impl PartialSchema for ResultTypeList {
    fn schema() -> RefOr<Schema> {
        ArrayBuilder::new()
            .items(ResultTypeName::schema())
            .max_items(Some(4))
            .unique_items(true)
            .description(Some(
                "A non-repeating subset of the four result types; omitted or `[]` means all four.",
            ))
            .into()
    }
}
impl ToSchema for ResultTypeList {}

/// Any JSON object.
pub struct JsonObject;

impl PartialSchema for JsonObject {
    fn schema() -> RefOr<Schema> {
        ObjectBuilder::new().schema_type(Type::Object).into()
    }
}
impl ToSchema for JsonObject {}
