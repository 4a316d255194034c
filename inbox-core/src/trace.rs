//! The W3C Trace Context header a producer's tracing puts on a message, read so that the
//! consumer's span joins the producer's trace.

/// The W3C Trace Context header a producer's tracing puts on a message.
pub const TRACEPARENT: &str = "traceparent";

/// A valid W3C `traceparent` value (`00-<trace id>-<parent span id>-<flags>`), whose ids the
/// delivery span records as `trace_id` and `parent_span_id`, so that the consumer's work joins
/// the producer's trace (an OpenTelemetry layer can set the span's parent from them; a log search
/// finds both sides by trace id).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct TraceParent<'a> {
    /// 32 lowercase hex digits, not all zero.
    pub trace_id: &'a str,
    /// 16 lowercase hex digits, not all zero.
    pub span_id: &'a str,
    /// The trace flags (bit 0: sampled).
    pub flags: u8,
}

impl<'a> TraceParent<'a> {
    /// Parses a `traceparent` header value; `None` when it is not valid (then it is ignored, as
    /// the specification says).
    pub fn parse(value: &'a str) -> Option<Self> {
        let mut parts = value.trim().split('-');
        let (version, trace_id, span_id, flags) =
            (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
        let hex = |s: &str, len: usize| {
            s.len() == len && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
        };
        let nonzero = |s: &str| s.bytes().any(|b| b != b'0');
        // Version 00 has exactly four fields; later versions may append more; ff is invalid.
        let valid = hex(version, 2)
            && version != "ff"
            && (version != "00" || parts.next().is_none())
            && hex(trace_id, 32)
            && nonzero(trace_id)
            && hex(span_id, 16)
            && nonzero(span_id)
            && hex(flags, 2);
        valid.then(|| Self {
            trace_id,
            span_id,
            flags: u8::from_str_radix(flags, 16).unwrap_or(0),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::TraceParent;

    #[test]
    fn traceparent_is_parsed_as_the_w3c_spec_says() {
        let p = TraceParent::parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
            .expect("the spec's example");
        assert_eq!(p.trace_id, "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(p.span_id, "00f067aa0ba902b7");
        assert_eq!(p.flags, 1);
        // A later version may add fields.
        assert!(
            TraceParent::parse("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00-extra")
                .is_some()
        );
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-1",
        ] {
            assert_eq!(TraceParent::parse(bad), None, "{bad:?}");
        }
    }
}
