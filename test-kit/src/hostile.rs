//! Hostile input from another client, fed to the demo's consumers running as a separate process:
//! every shape of bad id and bad payload a producer in another language can send, and valid but
//! unusual ids. Each bad one must be dead-lettered once per consumer with its reason, each valid
//! one handled once; the process never exits on its own and drains on SIGTERM.

use std::collections::HashMap;

use inbox::OutgoingMessage;
use inbox::dead_letter::headers as h;

use crate::demo::DemoConsumer;
use crate::eventually;

/// Bad ids, each marked by its payload `{"case": <name>}`, with what the reason must say.
pub const BAD_IDS: [(&str, &str); 5] = [
    ("no-id", "no message id"),
    ("empty-id", "is empty"),
    ("long-id", "256 bytes"),
    ("non-utf8-header-id", "UTF-8"),
    ("control-id", "control character"),
];

/// Bad payloads under the valid ids `<run>-<name>`, with what the reason must say.
pub const BAD_PAYLOADS: [(&str, &str); 6] = [
    ("not-json", "not the expected JSON"),
    ("wrong-shape", "invalid type"),
    ("empty", "empty payload"),
    ("nested", "not the expected JSON"),
    ("oversized", "exceeds the limit"),
    ("nul-in-field", "invalid character"),
];

/// Publishes every case with a third-party client: `kind` is `amqp` (pika; `target` the URL,
/// `source` the exchange) or `kafka` (confluent-kafka; `target` the brokers, `source` the
/// topic). Valid ids, each handled once: SQL-looking, non-ASCII, exactly 255 bytes, space-padded
/// (ids are taken verbatim), and `<run>-twin` twice with different payloads (tracking numbers
/// `TWIN-A`, then `TWIN-B`: the first claimed is the message, the other a duplicate).
pub async fn publish_all(kind: &str, target: &str, source: &str, run: &str) {
    publish(&[kind, target, source, run]).await;
}

/// Publishes, with pika, a message whose `message_id` is not UTF-8: lapin cannot parse it at all,
/// and each delivery of it kills the consuming connection (so it is sent on its own, after the
/// rest settled: a connection killed under them could cost an ack and double a dead letter of an
/// id-less message, which nothing can tell apart).
pub async fn publish_unparsable(url: &str, source: &str, run: &str) {
    publish(&["amqp", url, source, run, "unparsable"]).await;
}

async fn publish(args: &[&str]) {
    let script = r#"
import json, sys, uuid
kind, target, source, run = sys.argv[1:5]
def event(tracking, parcel=None):
    return json.dumps({"parcel_id": parcel or str(uuid.uuid4()), "tracking_number": tracking, "destination": "Oslo"}).encode()
mark = lambda case: json.dumps({"case": case}).encode()
# (property id, header id, payload); the property is AMQP's message_id (Kafka: the header).
messages = [
    (None, None, mark("no-id")),
    ("", None, mark("empty-id")),
    (None, ("x" * 256).encode(), mark("long-id")),
    (None, b"\xff\xfe", mark("non-utf8-header-id")),
    ("a\x01b", None, mark("control-id")),
    (f"{run}-not-json", None, b"not json {"),
    (f"{run}-wrong-shape", None, b'{"parcel_id": 7}'),
    (f"{run}-empty", None, b""),
    (f"{run}-nested", None, b'{"pad": ' + b"[" * 20000 + b"]" * 20000 + b"}"),
    (f"{run}-oversized", None, b'{"pad": "' + b"x" * (1100 * 1024) + b'"}'),
    (f"{run}-nul-in-field", None, b'{"parcel_id": "\\u0000nul", "tracking_number": "T", "destination": "Oslo"}'),
    (f"{run}-x'; DROP TABLE notifications; --", None, event(f"{run}-SQL")),
    (f"{run}-\u00c4\u00d6\u2603", None, event(f"{run}-UNICODE")),
    ((f"{run}-" + "y" * 255)[:255], None, event(f"{run}-LONGEST")),
    (f" {run}-padded ", None, event(f"{run}-PADDED")),
    (f"{run}-twin", None, event("TWIN-A")),
    (f"{run}-twin", None, event("TWIN-B")),
]
if kind == "amqp":
    import pika
    connection = pika.BlockingConnection(pika.URLParameters(target))
    channel = connection.channel()
    channel.confirm_delivery()
    if sys.argv[5:] == ["unparsable"]:
        messages = [(b"\xff\xfe-not-utf8", None, event(f"{run}-UNPARSABLE"))]
    for prop, header, payload in messages:
        properties = pika.BasicProperties(delivery_mode=2, message_id=prop,
                                          headers={"message-id": header} if header is not None else None)
        channel.basic_publish(source, "", payload, properties, mandatory=True)
    connection.close()
else:
    from confluent_kafka import Producer
    producer = Producer({"bootstrap.servers": target, "message.max.bytes": 4 * 1024 * 1024})
    for prop, header, payload in messages:
        value = header if header is not None else (prop.encode() if isinstance(prop, str) else prop)
        headers = [("message-id", value)] if value is not None else []
        producer.produce(source, payload, headers=headers)
        producer.poll(0)
    sys.exit(1 if producer.flush(30) else 0)
"#;
    let run = crate::python(
        "the third-party producer (pika or confluent-kafka)",
        script,
        args,
    );
    tokio::time::timeout(crate::DEADLINE, run)
        .await
        .expect("the third-party producer returns");
}

/// The valid ids `publish_all` sends, as the inbox stores them.
pub fn valid_ids(run: &str) -> Vec<String> {
    vec![
        format!("{run}-x'; DROP TABLE notifications; --"),
        format!("{run}-\u{c4}\u{d6}\u{2603}"),
        format!("{run}-{}", "y".repeat(255))[..255].to_owned(),
        format!(" {run}-padded "),
        format!("{run}-twin"),
    ]
}

/// Waits until every case is settled, then checks: each bad one dead-lettered exactly once per
/// consumer with its reason, each valid one processed once per consumer, one twin handled.
/// `dead_letters` reads the dead-letter destination.
pub async fn assert_settled<F, Fut>(demo: &DemoConsumer, run: &str, dead_letters: F)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Vec<OutgoingMessage>>,
{
    let consumers = ["notification", "carrier-assignment"];
    let bad = BAD_IDS.len() + BAD_PAYLOADS.len();
    let pool = sqlx::PgPool::connect(&demo.database).await.unwrap();
    let valid = valid_ids(run);
    eventually("every hostile case settled", || async {
        let letters = dead_letters().await.len();
        let processed: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM inbox_messages WHERE processed_at IS NOT NULL AND message_id = ANY($1)",
        )
        .bind(&valid)
        .fetch_one(&pool)
        .await
        .map_err(|e| e.to_string())?;
        if letters >= bad * consumers.len() && processed as usize == valid.len() * consumers.len() {
            Ok(())
        } else {
            Err(format!("{letters} dead letters, {processed} processed"))
        }
    })
    .await;
    let letters = dead_letters().await;
    let mut seen: HashMap<(String, String), Vec<String>> = HashMap::new();
    for letter in &letters {
        let consumer = letter.headers.get_str(h::CONSUMER).unwrap_or("").to_owned();
        let reason = letter.headers.get_str(h::REASON).unwrap_or("").to_owned();
        let case = match letter.headers.get_str(h::MESSAGE_ID) {
            Some(id) => id.strip_prefix(&format!("{run}-")).unwrap_or(id).to_owned(),
            None => serde_json::from_slice::<serde_json::Value>(&letter.payload)
                .ok()
                .and_then(|v| v["case"].as_str().map(str::to_owned))
                .unwrap_or_default(),
        };
        seen.entry((consumer, case)).or_default().push(reason);
    }
    let mut wrong = Vec::new();
    for consumer in consumers {
        for (case, says) in BAD_IDS.iter().chain(BAD_PAYLOADS.iter()) {
            let reasons = seen
                .get(&(consumer.to_owned(), (*case).to_owned()))
                .cloned()
                .unwrap_or_default();
            if reasons.len() != 1 || !reasons[0].contains(says) {
                wrong.push(format!("{consumer}/{case} (want {says:?}): {reasons:?}"));
            }
        }
    }
    assert!(wrong.is_empty(), "dead letters:\n{}", wrong.join("\n"));
    assert_eq!(
        letters.len(),
        bad * consumers.len(),
        "no other dead letters"
    );
    let twins: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM notifications WHERE tracking_number IN ('TWIN-A', 'TWIN-B')",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(twins, 1, "of two messages with one id, one is handled");
}
