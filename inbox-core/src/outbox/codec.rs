//! What the outbox checks on the way in, and how it keeps headers.

// The header codec serves the SQL stores only.
#![cfg_attr(
    not(any(feature = "postgres", feature = "mysql", feature = "sqlite")),
    allow(dead_code)
)]

use bytes::Bytes;
use serde_json::{Map, Value};

use crate::error::StoreError;
use crate::message::{Headers, OutgoingMessage};
use crate::trace::TRACEPARENT;

/// The longest destination and ordering key, in bytes (the table's checks).
const MAX_NAME_BYTES: usize = 255;

pub(super) fn check_destination(destination: &str) -> Result<(), StoreError> {
    if destination.is_empty() || destination.len() > MAX_NAME_BYTES || destination.contains('\0') {
        return Err(StoreError::Invalid(format!(
            "an outbox destination is 1 to {MAX_NAME_BYTES} bytes without NUL; got {} bytes",
            destination.len()
        )));
    }
    Ok(())
}

/// The message's key as the ordering key: UTF-8 text, so that operators can query it.
pub(super) fn ordering_key(message: &OutgoingMessage) -> Result<Option<&str>, StoreError> {
    let Some(key) = &message.key else {
        return Ok(None);
    };
    let text = std::str::from_utf8(key)
        .map_err(|_| StoreError::Invalid("an outbox ordering key must be UTF-8 text".to_owned()))?;
    if text.is_empty() || text.len() > MAX_NAME_BYTES || text.contains('\0') {
        return Err(StoreError::Invalid(format!(
            "an outbox ordering key is 1 to {MAX_NAME_BYTES} bytes without NUL; got {} bytes",
            text.len()
        )));
    }
    Ok(Some(text))
}

/// The caller's `traceparent`, kept in a column of its own.
pub(crate) fn traceparent(message: &OutgoingMessage) -> Option<&str> {
    message.headers.get_str(TRACEPARENT)
}

/// Headers as a JSON object: UTF-8 values as strings (what operators read), others as
/// `{"hex": "…"}`. NUL is kept in neither form's way: JSON escapes it.
pub(crate) fn encode_headers(headers: &Headers) -> String {
    let mut object = Map::new();
    for (name, value) in headers.iter() {
        let value = match std::str::from_utf8(value) {
            Ok(text) if !text.contains('\0') => Value::String(text.to_owned()),
            _ => {
                let mut hex = String::with_capacity(value.len() * 2);
                for byte in value {
                    hex.push_str(&format!("{byte:02x}"));
                }
                let mut wrapped = Map::new();
                wrapped.insert("hex".to_owned(), Value::String(hex));
                Value::Object(wrapped)
            }
        };
        object.insert(name.to_owned(), value);
    }
    Value::Object(object).to_string()
}

/// The inverse of [`encode_headers`]; what it cannot read it leaves out (and logs), so that one
/// hand-edited row cannot stop the relay.
pub(crate) fn decode_headers(text: &str) -> Headers {
    let Ok(Value::Object(object)) = serde_json::from_str::<Value>(text) else {
        tracing::warn!("outbox row with unreadable headers; publishing it without them");
        return Headers::new();
    };
    let mut headers = Headers::new();
    for (name, value) in object {
        match value {
            Value::String(text) => headers.insert(name, text),
            Value::Object(wrapped) => {
                match wrapped.get("hex").and_then(Value::as_str).and_then(unhex) {
                    Some(bytes) => headers.insert(name, bytes),
                    None => {
                        tracing::warn!(header = %name, "outbox header value unreadable; left out")
                    }
                }
            }
            _ => tracing::warn!(header = %name, "outbox header value unreadable; left out"),
        }
    }
    headers
}

fn unhex(text: &str) -> Option<Bytes> {
    if !text.len().is_multiple_of(2) {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok())
        .collect::<Option<Vec<u8>>>()
        .map(Bytes::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip_text_and_bytes() {
        let headers = Headers::new()
            .with(
                "traceparent",
                "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            )
            .with("raw", Bytes::from_static(&[0, 159, 146, 150]))
            .with("nul", "a\0b")
            .with("empty", "");
        assert_eq!(decode_headers(&encode_headers(&headers)), headers);
    }

    #[test]
    fn unreadable_headers_do_not_fail() {
        assert!(decode_headers("not json").is_empty());
        let partly = decode_headers(r#"{"a": "x", "b": 3, "c": {"hex": "zz"}}"#);
        assert_eq!(partly, Headers::new().with("a", "x"));
    }

    #[test]
    fn keys_and_destinations_are_checked() {
        assert!(check_destination("").is_err());
        assert!(check_destination(&"d".repeat(256)).is_err());
        assert!(check_destination("parcels").is_ok());
        let bad = OutgoingMessage::new("m", "p").with_key(Bytes::from_static(&[0xff]));
        assert!(ordering_key(&bad).is_err());
        let good = OutgoingMessage::new("m", "p").with_key("parcel-1");
        assert_eq!(ordering_key(&good).unwrap(), Some("parcel-1"));
    }
}
