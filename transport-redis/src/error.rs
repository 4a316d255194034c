//! What redis-rs' errors mean for the engine.

use inbox_core::TransportError;
use redis::RedisError;

/// Permanent: the server refused the command itself — a key of another type, no permission,
/// wrong credentials, a command or syntax it does not know, a cluster redirect this client does
/// not follow. Everything else passes with time, and is transient: the connection gone or
/// refused, a timeout, and the server's own conditions (`LOADING`, `BUSY`, `MISCONF` after a
/// failed save, `NOREPLICAS`, `OOM` at maxmemory, `UNBLOCKED`, `READONLY` after a failover,
/// `NOGROUP` — subscribing again declares the group —, too many clients).
pub(crate) fn transport_error(error: RedisError) -> TransportError {
    let refused = match error.code() {
        Some("WRONGTYPE" | "NOPERM" | "WRONGPASS" | "NOAUTH" | "MOVED" | "ASK" | "CROSSSLOT") => {
            true
        }
        Some("ERR") => !error.to_string().contains("max number of clients"),
        _ => false,
    };
    if refused {
        TransportError::Refused(Box::new(error))
    } else {
        TransportError::Disconnected(Box::new(error))
    }
}
