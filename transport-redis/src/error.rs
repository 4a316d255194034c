//! What redis-rs' errors mean for the engine.

use inbox_core::TransportError;
use redis::RedisError;

/// Transient: the connection is gone or refused, a reply timed out, the server is loading its
/// data or read-only (a replica promoted), a group was deleted under a subscription (subscribing
/// again declares it). Anything else the server refused is permanent.
pub(crate) fn transport_error(error: RedisError) -> TransportError {
    let passing = error.is_io_error()
        || error.is_connection_dropped()
        || error.is_connection_refusal()
        || error.is_timeout()
        || matches!(
            error.code(),
            Some(
                "LOADING"
                    | "BUSY"
                    | "TRYAGAIN"
                    | "MASTERDOWN"
                    | "READONLY"
                    | "NOGROUP"
                    | "CLUSTERDOWN"
            )
        );
    if passing {
        TransportError::Disconnected(Box::new(error))
    } else {
        TransportError::Refused(Box::new(error))
    }
}
