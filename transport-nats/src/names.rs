//! How sources, destinations and consumer names become subjects, streams and durable consumers.
//!
//! A source (or any destination) is a NATS subject used literally: its stream listens on exactly
//! that subject, never a wildcard, so a consumer of `parcels` never reads `parcels.dead-letter`.
//! Stream and consumer names cannot hold `.`, `*`, `>`, `/`, `\` or whitespace, so they are the
//! subject (or consumer name) with every byte outside `A–Z a–z 0–9 _ -` written as `~` and two
//! hex digits: `parcels.dead-letter` → stream `parcels~2Edead-letter`. The mapping is one to one
//! (`~` itself is escaped), so two sources never share a stream. A durable consumer is named
//! after its source and its consumer name, joined by `~~` (which escaping never produces), as
//! RabbitMQ's queues and Kafka's groups are: one consumer name on two sources of one stream (an
//! application's stream on `orders.>`) is two durables, never one.

use inbox_core::TransportError;

/// The longest stream or consumer name this transport makes. The server's own limit is on the
/// API subjects the name appears in; 255 bytes leaves room for them.
const MAX_NAME: usize = 255;

/// Checks that `subject` is a literal NATS subject: dot-separated non-empty tokens, no
/// whitespace or control characters, no wildcard (`*`, `>`).
pub(crate) fn check_subject(subject: &str) -> Result<(), TransportError> {
    let bad = |why: &str| {
        Err(TransportError::Config(format!(
            "{subject:?} cannot be a NATS subject: {why}"
        )))
    };
    if subject.is_empty() {
        return bad("it is empty");
    }
    if subject.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return bad("it contains whitespace or a control character");
    }
    if subject.contains(['*', '>']) {
        return bad("wildcards (`*`, `>`) are not allowed: a source is one literal subject");
    }
    if subject.split('.').any(str::is_empty) {
        return bad("it has an empty token (a leading, trailing or doubled `.`)");
    }
    Ok(())
}

/// `text` with every byte outside `[A-Za-z0-9_-]` written as `~XX`.
fn escape(text: &str) -> String {
    let mut name = String::with_capacity(text.len());
    for byte in text.bytes() {
        if byte.is_ascii_alphanumeric() || byte == b'_' || byte == b'-' {
            name.push(byte as char);
        } else {
            name.push_str(&format!("~{byte:02X}"));
        }
    }
    name
}

fn checked(kind: &str, of: &str, name: String) -> Result<String, TransportError> {
    if name.len() > MAX_NAME {
        return Err(TransportError::Config(format!(
            "the {kind} name for {of:?} would be {} bytes long (escaped: {name}); the limit is {MAX_NAME}",
            name.len()
        )));
    }
    Ok(name)
}

/// The stream this transport creates for `subject` (a source or a dead-letter destination).
pub fn stream_name(subject: &str) -> Result<String, TransportError> {
    check_subject(subject)?;
    checked("stream", subject, escape(subject))
}

/// The durable consumer of `consumer` (an inbox consumer name) on `source`'s stream:
/// `<source>~~<consumer>`, each escaped.
pub fn durable_name(source: &str, consumer: &str) -> Result<String, TransportError> {
    check_subject(source)?;
    checked(
        "durable consumer",
        consumer,
        format!("{}~~{}", escape(source), escape(consumer)),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_escaped_one_to_one() {
        assert_eq!(stream_name("parcels").unwrap(), "parcels");
        assert_eq!(
            stream_name("parcels.dead-letter").unwrap(),
            "parcels~2Edead-letter"
        );
        assert_eq!(stream_name("order_events").unwrap(), "order_events");
        // `~` is escaped too, so an escaped name cannot collide with a literal one.
        assert_ne!(stream_name("a.b").unwrap(), stream_name("a~2Eb").unwrap());
        assert_eq!(
            durable_name("parcels", "billing service").unwrap(),
            "parcels~~billing~20service"
        );
        assert_eq!(durable_name("p", "naïve").unwrap(), "p~~na~C3~AFve");
        // The separator cannot be forged by either part.
        assert_ne!(
            durable_name("a", "~~b").unwrap(),
            durable_name("a~~", "b").unwrap_or_default()
        );
        assert_ne!(
            durable_name("a.b", "c").unwrap(),
            durable_name("a", "b.c").unwrap()
        );
    }

    #[test]
    fn subjects_are_literal() {
        for bad in ["", "a..b", ".a", "a.", "a b", "a.*", "a.>", "a\tb"] {
            assert!(check_subject(bad).is_err(), "{bad:?}");
        }
        for good in ["a", "a.b", "parcels.dead-letter", "a-b_c.D9"] {
            check_subject(good).unwrap();
        }
    }

    #[test]
    fn overlong_names_are_refused() {
        assert!(stream_name(&"a".repeat(256)).is_err());
        // 100 ASCII bytes (the longest consumer name) fit beside a source of 150; escaped
        // bytes take three.
        assert!(durable_name(&"s".repeat(150), &"a".repeat(100)).is_ok());
        assert!(durable_name("s", &"é".repeat(42)).is_ok());
        assert!(durable_name("s", &"é".repeat(43)).is_err());
    }
}
