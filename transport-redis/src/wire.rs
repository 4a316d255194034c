//! The wire format, both ways: `XADD <stream> * message-id <id> payload <body> [<header> <value>]…`.
//!
//! Replies are read as raw values, not through redis-rs' typed stream replies: an entry written
//! by another client may hold field names that are not UTF-8, and a typed reply would fail as a
//! whole — for ever, as the entry stays pending and is claimed again. Here such a name becomes a
//! header with the bytes replaced, and the engine judges the message like any other.

use bytes::Bytes;
use inbox_core::{DEFAULT_ID_HEADER, Headers, OutgoingMessage};
use redis::Value;

/// The field that holds the body.
pub const PAYLOAD_FIELD: &str = "payload";

/// One stream entry.
#[derive(Debug, Clone)]
pub(crate) struct Entry {
    /// The entry id (`<ms>-<seq>`).
    pub(crate) id: String,
    pub(crate) payload: Bytes,
    /// Every field but `payload`, the id's `message-id` included.
    pub(crate) headers: Headers,
}

/// The `XADD` arguments after `*` for `message`: the id, the body, then the headers (a header
/// named `payload` or `message-id` is left out: those fields are the body and the id).
pub(crate) fn fields(message: &OutgoingMessage) -> Vec<(Bytes, Bytes)> {
    let mut fields = Vec::with_capacity(message.headers.len() + 2);
    if let Some(id) = &message.message_id {
        fields.push((
            Bytes::from_static(DEFAULT_ID_HEADER.as_bytes()),
            Bytes::copy_from_slice(id.as_bytes()),
        ));
    }
    fields.push((
        Bytes::from_static(PAYLOAD_FIELD.as_bytes()),
        message.payload.clone(),
    ));
    for (name, value) in message.headers.iter() {
        if name == PAYLOAD_FIELD || (name == DEFAULT_ID_HEADER && message.message_id.is_some()) {
            continue;
        }
        fields.push((
            Bytes::copy_from_slice(name.as_bytes()),
            Bytes::copy_from_slice(value),
        ));
    }
    fields
}

fn text(value: &Value) -> Option<String> {
    match value {
        Value::BulkString(bytes) => Some(String::from_utf8_lossy(bytes).into_owned()),
        Value::SimpleString(s) => Some(s.clone()),
        Value::VerbatimString { text, .. } => Some(text.clone()),
        Value::Int(n) => Some(n.to_string()),
        _ => None,
    }
}

fn bytes(value: &Value) -> Bytes {
    match value {
        Value::BulkString(bytes) => Bytes::copy_from_slice(bytes),
        other => text(other).map(Bytes::from).unwrap_or_default(),
    }
}

/// One `[id, [field, value, …]]` entry; `None` for a nil entry (deleted while pending).
pub(crate) fn entry(value: &Value) -> Option<Entry> {
    let Value::Array(parts) = value else {
        return None;
    };
    let id = text(parts.first()?)?;
    let mut payload = Bytes::new();
    let mut headers = Headers::new();
    let pairs: Vec<(&Value, &Value)> = match parts.get(1)? {
        Value::Array(flat) => flat.chunks_exact(2).map(|p| (&p[0], &p[1])).collect(),
        Value::Map(map) => map.iter().map(|(k, v)| (k, v)).collect(),
        _ => return None,
    };
    for (name, value) in pairs {
        let name = text(name).unwrap_or_default();
        if name == PAYLOAD_FIELD {
            payload = bytes(value);
        } else {
            headers.insert(name, bytes(value));
        }
    }
    Some(Entry {
        id,
        payload,
        headers,
    })
}

/// The entries of an `XRANGE` / `XCLAIM` reply (nil ones skipped).
pub(crate) fn entries(value: &Value) -> Vec<Entry> {
    match value {
        Value::Array(items) => items.iter().filter_map(entry).collect(),
        _ => Vec::new(),
    }
}

/// The entries of an `XREADGROUP` reply for one stream (RESP2 array or RESP3 map).
pub(crate) fn read_reply(value: &Value) -> Vec<Entry> {
    match value {
        Value::Array(streams) => streams
            .iter()
            .filter_map(|stream| match stream {
                Value::Array(pair) => pair.get(1).map(entries),
                _ => None,
            })
            .flatten()
            .collect(),
        Value::Map(streams) => streams.iter().flat_map(|(_, v)| entries(v)).collect(),
        _ => Vec::new(),
    }
}

/// An `XAUTOCLAIM` reply: the next cursor and the entries claimed (deleted ones skipped).
pub(crate) fn autoclaim_reply(value: &Value) -> (String, Vec<Entry>) {
    match value {
        Value::Array(parts) => (
            parts
                .first()
                .and_then(text)
                .unwrap_or_else(|| "0-0".to_owned()),
            parts.get(1).map(entries).unwrap_or_default(),
        ),
        _ => ("0-0".to_owned(), Vec::new()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bulk(s: &[u8]) -> Value {
        Value::BulkString(s.to_vec())
    }

    #[test]
    fn entries_keep_bytes_and_survive_foreign_field_names() {
        let raw = Value::Array(vec![
            bulk(b"1-0"),
            Value::Array(vec![
                bulk(b"message-id"),
                bulk(b"a-1"),
                bulk(b"payload"),
                bulk(&[0xff, 0x00]),
                bulk(&[0xc3, 0x28]),
                bulk(b"x"),
            ]),
        ]);
        let entry = entry(&raw).unwrap();
        assert_eq!(entry.id, "1-0");
        assert_eq!(&entry.payload[..], &[0xff, 0x00]);
        assert_eq!(entry.headers.get_str("message-id"), Some("a-1"));
        assert_eq!(entry.headers.len(), 2, "the foreign name kept, lossily");
        assert!(super::entry(&Value::Nil).is_none());
    }

    #[test]
    fn fields_put_the_id_and_body_first() {
        let message = OutgoingMessage::new("a-1", "{}")
            .with_header("payload", "shadow")
            .with_header("tenant", "acme");
        let fields = fields(&message);
        let names: Vec<&[u8]> = fields.iter().map(|(n, _)| &n[..]).collect();
        assert_eq!(names, [&b"message-id"[..], b"payload", b"tenant"]);
        assert_eq!(&fields[1].1[..], b"{}");
    }
}
