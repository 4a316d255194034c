//! The wire format: where the message id travels, and headers both ways.

use std::str::FromStr;

use async_nats::HeaderMap;
use async_nats::header::{HeaderName, HeaderValue, NATS_MESSAGE_ID};
use inbox_core::{
    DEFAULT_ID_HEADER, Headers, OutgoingMessage, TransportError, dead_letter_headers,
};

/// The delivery's message id: the `message-id` header, else `Nats-Msg-Id` (what JetStream
/// deduplicates on, and what other NATS clients set with their `msg_id` option).
pub(crate) fn nats_id(headers: Option<&HeaderMap>) -> Option<String> {
    let headers = headers?;
    headers
        .get(DEFAULT_ID_HEADER)
        .or_else(|| headers.get(NATS_MESSAGE_ID))
        .map(|value| value.as_str().to_owned())
}

/// A message's headers as the engine sees them: all of them but the server's own (`Nats-…`);
/// of a repeated header, the first value.
pub(crate) fn from_header_map(map: &HeaderMap) -> Headers {
    map.iter()
        .filter(|(name, _)| !is_server_header(name.as_ref()))
        .filter_map(|(name, values)| {
            let value = values.first()?;
            Some((
                AsRef::<str>::as_ref(name).to_owned(),
                bytes::Bytes::copy_from_slice(value.as_str().as_bytes()),
            ))
        })
        .collect()
}

fn is_server_header(name: &str) -> bool {
    name.as_bytes()
        .get(..5)
        .is_some_and(|prefix| prefix.eq_ignore_ascii_case(b"nats-"))
}

/// The headers to publish `message` with.
///
/// The id goes in `message-id` (so the consumer finds the inbox id whatever else is set) and,
/// for an ordinary message, in `Nats-Msg-Id` too, so that JetStream drops a producer's retry
/// within the stream's duplicate window. A dead letter or a replay gets a fresh `Nats-Msg-Id`:
/// it carries the id of a message the stream may have seen within the window (a second
/// consumer's dead letter of the same message, a replay of a message consumed a minute ago),
/// and the window would silently swallow it.
/// Without `deduplicate`, every message gets a fresh `Nats-Msg-Id`.
pub(crate) fn to_header_map(
    message: &OutgoingMessage,
    deduplicate: bool,
) -> Result<HeaderMap, TransportError> {
    let mut map = HeaderMap::new();
    for (name, value) in message.headers.iter() {
        if is_server_header(name) {
            continue;
        }
        let header = HeaderName::from_str(name).map_err(|e| {
            TransportError::Refused(
                format!("header name {name:?} cannot travel in a NATS message: {e}").into(),
            )
        })?;
        let text = std::str::from_utf8(value).map_err(|_| {
            TransportError::Refused(
                format!("the value of header {name:?} is not UTF-8, which NATS headers must be")
                    .into(),
            )
        })?;
        // Line breaks (a dead letter's multi-line reason) become spaces.
        map.insert(header, HeaderValue::from_lossy(text));
    }
    if let Some(id) = &message.message_id {
        map.insert(DEFAULT_ID_HEADER, id.as_str());
        let fresh = !deduplicate
            || message.headers.get(dead_letter_headers::REASON).is_some()
            || message
                .headers
                .get(dead_letter_headers::REPLAY_FOR)
                .is_some();
        if fresh {
            map.insert(NATS_MESSAGE_ID, uuid::Uuid::now_v7().to_string());
        } else {
            map.insert(NATS_MESSAGE_ID, id.as_str());
        }
    }
    Ok(map)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_and_headers_round_trip() {
        let message = OutgoingMessage::new("order-1", "{}").with_header("tenant", "acme");
        let map = to_header_map(&message, true).unwrap();
        assert_eq!(nats_id(Some(&map)).as_deref(), Some("order-1"));
        assert_eq!(map.get(NATS_MESSAGE_ID).unwrap().as_str(), "order-1");
        let headers = from_header_map(&map);
        assert_eq!(headers.get_str("tenant"), Some("acme"));
        assert_eq!(headers.get_str("message-id"), Some("order-1"));
        assert!(
            headers.get("Nats-Msg-Id").is_none(),
            "the server's headers stay out"
        );
    }

    #[test]
    fn without_deduplication_every_copy_is_new_to_jetstream() {
        let message = OutgoingMessage::new("order-1", "{}");
        let map = to_header_map(&message, false).unwrap();
        assert_eq!(map.get("message-id").unwrap().as_str(), "order-1");
        assert_ne!(map.get(NATS_MESSAGE_ID).unwrap().as_str(), "order-1");
    }

    #[test]
    fn a_foreign_publisher_id_is_found() {
        let mut map = HeaderMap::new();
        map.insert(NATS_MESSAGE_ID, "py-1");
        assert_eq!(nats_id(Some(&map)).as_deref(), Some("py-1"));
        map.insert("message-id", "inbox-1");
        assert_eq!(nats_id(Some(&map)).as_deref(), Some("inbox-1"));
        assert_eq!(nats_id(None), None);
    }

    #[test]
    fn dead_letters_and_replays_escape_the_duplicate_window() {
        for header in [dead_letter_headers::REASON, dead_letter_headers::REPLAY_FOR] {
            let message =
                OutgoingMessage::new("order-1", "{}").with_header(header, "line 1\nline 2");
            let map = to_header_map(&message, true).unwrap();
            assert_eq!(map.get("message-id").unwrap().as_str(), "order-1");
            assert_ne!(map.get(NATS_MESSAGE_ID).unwrap().as_str(), "order-1");
            assert!(!map.get(header).unwrap().as_str().contains('\n'));
        }
    }

    #[test]
    fn headers_nats_cannot_carry_are_refused() {
        // Not a panic on a name whose fifth byte is inside a character.
        let non_ascii = OutgoingMessage::new("a", "").with_header("abcdé", "x");
        assert!(matches!(
            to_header_map(&non_ascii, true),
            Err(TransportError::Refused(_))
        ));
        let bad_name = OutgoingMessage::new("a", "").with_header("a:b", "x");
        assert!(matches!(
            to_header_map(&bad_name, true),
            Err(TransportError::Refused(_))
        ));
        let bad_value = OutgoingMessage::new("a", "").with_header("x", vec![0xff_u8]);
        assert!(matches!(
            to_header_map(&bad_value, true),
            Err(TransportError::Refused(_))
        ));
    }
}
