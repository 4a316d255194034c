//! The span of each delivery, read back through a `tracing` layer: consumer, transport, message
//! id, attempt, outcome, and the producer's trace from a W3C `traceparent` header.

use inbox_test_kit as conformance;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use conformance::stores::Sqlite;
use conformance::{Running, Scenario, Script};
use inbox::OutgoingMessage;
use inbox::memory::Faults;
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::registry::Registry;

type Fields = HashMap<String, String>;

/// Keeps the fields of every `inbox.delivery` span, by span id.
#[derive(Clone, Default)]
struct Spans(Arc<Mutex<HashMap<u64, Fields>>>);

struct Collect<'a>(&'a mut Fields);

impl Visit for Collect<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().to_owned(), value.to_owned());
    }
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.insert(field.name().to_owned(), format!("{value:?}"));
    }
}

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Spans {
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, _: Context<'_, S>) {
        if attrs.metadata().name() == "inbox.delivery" {
            let mut fields = Fields::new();
            attrs.record(&mut Collect(&mut fields));
            self.0.lock().unwrap().insert(id.into_u64(), fields);
        }
    }
    fn on_record(&self, id: &Id, values: &Record<'_>, _: Context<'_, S>) {
        if let Some(fields) = self.0.lock().unwrap().get_mut(&id.into_u64()) {
            values.record(&mut Collect(fields));
        }
    }
}

// One thread, so that the subscriber set for this test sees the consumer's tasks too.
#[tokio::test(flavor = "current_thread")]
async fn each_delivery_has_a_span_that_joins_the_producers_trace() {
    let spans = Spans::default();
    let _default = tracing::subscriber::set_default(Registry::default().with(spans.clone()));

    let db = Arc::new(Sqlite);
    let s = Scenario::new(&conformance::memory::Memory, &db, Faults::none()).await;
    let name = s.name("traced");
    s.broker.prepare(&s.source, &[&name]).await;
    let (traced, untraced, garbled) = (s.id(1), s.id(2), s.id(3));
    let parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    s.publish_raw(
        OutgoingMessage::new(traced.clone(), r#"{"n":1}"#).with_header("traceparent", parent),
    )
    .await;
    s.publish(&untraced, 2).await;
    s.publish_raw(
        OutgoingMessage::new(garbled.clone(), r#"{"n":3}"#)
            .with_header("traceparent", "00-not-a-trace-01"),
    )
    .await;
    let consumer = s.consumer(&name, &Arc::new(Script::default()));
    let running = Running::start(&consumer, 1);
    s.wait_for(&[&name], 3).await;
    running.stop().await;

    let spans = spans.0.lock().unwrap();
    let of = |id: &str| -> &Fields {
        spans
            .values()
            .find(|f| f.get("message_id").map(String::as_str) == Some(id))
            .unwrap_or_else(|| panic!("a span for {id}: {spans:?}"))
    };
    let t = of(&traced);
    assert_eq!(t["consumer"], name.as_str());
    assert_eq!(t["transport"], "memory");
    assert_eq!(t["attempt"], "1");
    assert_eq!(t["outcome"], "processed");
    assert_eq!(t["trace_id"], "4bf92f3577b34da6a3ce929d0e0e4736");
    assert_eq!(t["parent_span_id"], "00f067aa0ba902b7");
    for id in [&untraced, &garbled] {
        let f = of(id);
        assert_eq!(f["outcome"], "processed");
        assert!(!f.contains_key("trace_id"), "no trace for {id}: {f:?}");
    }
}
