//! Headers: between inbox's headers and AMQP field tables.

use inbox_core::Headers;
use lapin::types::{AMQPValue, FieldTable, ShortString};

pub(crate) fn to_field_table(headers: &Headers) -> FieldTable {
    let mut table = FieldTable::default();
    for (name, value) in headers.iter() {
        if let Ok(name) = ShortString::try_new(name) {
            table.insert(name, AMQPValue::LongString(value.into()));
        }
    }
    table
}

pub(crate) fn from_field_table(table: &FieldTable) -> Headers {
    table
        .inner()
        .iter()
        .map(|(name, value)| (name.as_str().to_owned(), amqp_to_bytes(value)))
        .collect()
}

pub(crate) fn amqp_to_bytes(value: &AMQPValue) -> Vec<u8> {
    match value {
        AMQPValue::LongString(s) => s.as_bytes().to_vec(),
        AMQPValue::ShortString(s) => s.as_str().as_bytes().to_vec(),
        AMQPValue::ByteArray(b) => b.as_slice().to_vec(),
        AMQPValue::Boolean(b) => b.to_string().into_bytes(),
        AMQPValue::ShortShortInt(n) => n.to_string().into_bytes(),
        AMQPValue::ShortShortUInt(n) => n.to_string().into_bytes(),
        AMQPValue::ShortInt(n) => n.to_string().into_bytes(),
        AMQPValue::ShortUInt(n) => n.to_string().into_bytes(),
        AMQPValue::LongInt(n) => n.to_string().into_bytes(),
        AMQPValue::LongUInt(n) => n.to_string().into_bytes(),
        AMQPValue::LongLongInt(n) => n.to_string().into_bytes(),
        AMQPValue::Timestamp(n) => n.to_string().into_bytes(),
        AMQPValue::Float(n) => n.to_string().into_bytes(),
        AMQPValue::Double(n) => n.to_string().into_bytes(),
        other => format!("{other:?}").into_bytes(),
    }
}

/// Headers the broker sets on a delivery, about this delivery: not part of the message, so not
/// handed to the handler nor carried into a dead letter (a replayed letter with a stale
/// `x-delivery-count` would be dead-lettered again at once on a quorum queue).
pub(crate) fn broker_owned(name: &str) -> bool {
    matches!(name, "x-delivery-count" | "x-acquired-count" | "x-death")
        || name.starts_with("x-first-death-")
        || name.starts_with("x-last-death-")
}

pub(crate) fn amqp_to_u32(value: &AMQPValue) -> Option<u32> {
    std::str::from_utf8(&amqp_to_bytes(value))
        .ok()?
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use lapin::types::LongString;

    use super::*;

    #[test]
    fn broker_headers_are_not_the_message() {
        for name in [
            "x-delivery-count",
            "x-death",
            "x-first-death-reason",
            "x-acquired-count",
        ] {
            assert!(broker_owned(name), "{name}");
        }
        for name in ["message-id", "x-inbox-reason", "traceparent"] {
            assert!(!broker_owned(name), "{name}");
        }
    }

    #[test]
    fn header_values_become_bytes() {
        assert_eq!(amqp_to_bytes(&AMQPValue::LongLongInt(7)), b"7");
        assert_eq!(
            amqp_to_bytes(&AMQPValue::LongString(LongString::from("x"))),
            b"x"
        );
        assert_eq!(amqp_to_u32(&AMQPValue::LongLongInt(3)), Some(3));
    }
}
