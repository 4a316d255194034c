//! The `inbox` command line, run as a separate process against real PostgreSQL and MariaDB
//! (`DATABASE_URL`, `MYSQL_URL`), and its dead-letter replay through RabbitMQ (`AMQP_URL`), Kafka
//! (`KAFKA_BROKERS`), NATS (`NATS_URL`) and Redis (`REDIS_URL`).
#![cfg(feature = "cli")]

use inbox_test_kit as conformance;

use std::collections::HashSet;
use std::process::Output;
use std::sync::{Arc, Mutex};

use conformance::stores::{MySql, Postgres};
use conformance::{BrokerFactory, Running, Scenario, Script, eventually, services};
use inbox::memory::Faults;
use inbox::{InboxAdmin, MySqlStore, PostgresStore};
use sqlx::Executor;

/// Runs `inbox args…` with `DATABASE_URL = database` (none with `None`) and the broker URLs.
async fn inbox(database: Option<&str>, args: &[&str]) -> Output {
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_inbox"));
    command
        .args(args)
        .env_remove("DATABASE_URL")
        .env("AMQP_URL", services::amqp_url())
        .env("KAFKA_BROKERS", services::kafka_brokers())
        .env("NATS_URL", services::nats_url())
        .env("REDIS_URL", services::redis_url())
        .env("NO_COLOR", "1");
    if let Some(url) = database {
        command.env("DATABASE_URL", url);
    }
    command.output().await.expect("run the inbox binary")
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[track_caller]
fn ok(out: &Output) -> String {
    assert!(
        out.status.success(),
        "exit {:?}\nstdout: {}\nstderr: {}",
        out.status.code(),
        stdout(out),
        stderr(out)
    );
    stdout(out)
}

fn json(out: &Output) -> serde_json::Value {
    serde_json::from_str(&ok(out)).expect("--json prints JSON")
}

#[tokio::test]
async fn help_names_every_command_and_option() {
    let top = ok(&inbox(None, &["--help"]).await);
    for word in [
        "migrate",
        "stats",
        "cleanup",
        "dead",
        "--database-url",
        "DATABASE_URL",
    ] {
        assert!(top.contains(word), "{word} in:\n{top}");
    }
    let dead = ok(&inbox(None, &["dead", "--help"]).await);
    assert!(dead.contains("list") && dead.contains("replay"), "{dead}");
    let cleanup = ok(&inbox(None, &["cleanup", "--help"]).await);
    for word in ["--older-than", "--batch-size", "--redelivery-horizon"] {
        assert!(cleanup.contains(word), "{word} in:\n{cleanup}");
    }
    let replay = ok(&inbox(None, &["dead", "replay", "--help"]).await);
    for word in [
        "--all",
        "--consumer",
        "--source",
        "--dead-letter",
        "--transport",
        "AMQP_URL",
        "KAFKA_BROKERS",
    ] {
        assert!(replay.contains(word), "{word} in:\n{replay}");
    }
}

#[tokio::test]
async fn errors_are_one_line_with_a_non_zero_exit_and_no_password() {
    let none = inbox(None, &["stats"]).await;
    assert_eq!(none.status.code(), Some(1));
    assert_eq!(
        stderr(&none).trim(),
        "error: no database: set DATABASE_URL or pass --database-url"
    );

    let unreachable = inbox(
        Some("postgres://postgres:hunter2@127.0.0.1:1/nothing"),
        &["stats"],
    )
    .await;
    assert_eq!(unreachable.status.code(), Some(1));
    let text = stderr(&unreachable);
    assert_eq!(text.trim().lines().count(), 1, "{text}");
    assert!(text.starts_with("error: database unavailable"), "{text}");
    assert!(!text.contains("hunter2"), "the password leaked: {text}");
    let unreachable = inbox(Some("mysql://root:hunter2@127.0.0.1:1/nothing"), &["stats"]).await;
    assert_eq!(unreachable.status.code(), Some(1));
    let text = stderr(&unreachable);
    assert_eq!(text.trim().lines().count(), 1, "{text}");
    assert!(text.starts_with("error: database unavailable"), "{text}");
    assert!(!text.contains("hunter2"), "the password leaked: {text}");

    let bad_duration = inbox(
        Some("postgres://127.0.0.1/x"),
        &["cleanup", "--older-than", "a week"],
    )
    .await;
    assert_eq!(
        bad_duration.status.code(),
        Some(2),
        "{}",
        stderr(&bad_duration)
    );
    assert!(stderr(&bad_duration).contains("--older-than"));

    let neither = inbox(
        Some("postgres://127.0.0.1/x"),
        &[
            "dead",
            "replay",
            "x",
            "--consumer",
            "c",
            "--transport",
            "kafka",
        ],
    )
    .await;
    assert_eq!(
        neither.status.code(),
        Some(2),
        "--source or --dead-letter is required"
    );
}

/// Rows of two consumers written as a running consumer would have left them.
async fn seed(store: &PostgresStore) {
    let pool = store.pool();
    for sql in [
        // a: 1000 rows processed a month ago, 10 just now, 2 failing, 3 dead (long ago).
        "INSERT INTO inbox_messages (consumer, message_id, received_at, processed_at)
         SELECT 'a', 'old-' || g, now() - interval '30 days', now() - interval '30 days'
         FROM generate_series(1, 1000) g",
        "INSERT INTO inbox_messages (consumer, message_id, processed_at)
         SELECT 'a', 'new-' || g, now() FROM generate_series(1, 10) g",
        "INSERT INTO inbox_messages (consumer, message_id, received_at, attempts, last_error)
         SELECT 'a', 'failing-' || g, now() - interval '2 hours', 2, 'timeout calling the carrier'
         FROM generate_series(1, 2) g",
        "INSERT INTO inbox_messages (consumer, message_id, received_at, attempts, last_error, dead_lettered_at)
         SELECT 'a', 'dead-' || g, now() - interval '40 days', 5, 'invalid JSON: expected value at line 1
column 1', now() - interval '40 days'
         FROM generate_series(1, 3) g",
        // b: 5 processed just now.
        "INSERT INTO inbox_messages (consumer, message_id, processed_at)
         SELECT 'b', 'b-' || g, now() FROM generate_series(1, 5) g",
    ] {
        pool.execute(sql).await.expect("seed rows");
    }
}

/// The same rows as [`seed`], in MySQL's SQL.
async fn seed_mysql(store: &MySqlStore) {
    const SERIES: &str =
        "WITH RECURSIVE g (n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM g WHERE n < ?)";
    let now = "UTC_TIMESTAMP(6)";
    for (sql, count) in [
        (format!("INSERT INTO inbox_messages (consumer, message_id, received_at, processed_at)
          {SERIES} SELECT 'a', CONCAT('old-', n), {now} - INTERVAL 30 DAY, {now} - INTERVAL 30 DAY FROM g"), 1000),
        (format!("INSERT INTO inbox_messages (consumer, message_id, processed_at)
          {SERIES} SELECT 'a', CONCAT('new-', n), {now} FROM g"), 10),
        (format!("INSERT INTO inbox_messages (consumer, message_id, received_at, attempts, last_error)
          {SERIES} SELECT 'a', CONCAT('failing-', n), {now} - INTERVAL 2 HOUR, 2, 'timeout calling the carrier' FROM g"), 2),
        (format!("INSERT INTO inbox_messages (consumer, message_id, received_at, attempts, last_error, dead_lettered_at)
          {SERIES} SELECT 'a', CONCAT('dead-', n), {now} - INTERVAL 40 DAY, 5, 'invalid JSON: expected value at line 1
column 1', {now} - INTERVAL 40 DAY FROM g"), 3),
        (format!("INSERT INTO inbox_messages (consumer, message_id, processed_at)
          {SERIES} SELECT 'b', CONCAT('b-', n), {now} FROM g"), 5),
    ] {
        sqlx::query(&sql)
            .bind(count)
            .execute(store.pool())
            .await
            .expect("seed rows");
    }
}

#[tokio::test]
async fn migrate_stats_cleanup_and_dead_list_on_postgres() {
    let url = Postgres::fresh_url().await;
    migrate_stats_cleanup_and_dead_list(&url, async {
        seed(&PostgresStore::connect(&url, 2).await.unwrap()).await
    })
    .await;
}

/// The same commands on MariaDB (`DATABASE_URL=mysql://…`), and with the `mariadb://` scheme.
#[tokio::test]
async fn migrate_stats_cleanup_and_dead_list_on_mysql() {
    let url = MySql::fresh_url().await;
    migrate_stats_cleanup_and_dead_list(&url, async {
        seed_mysql(&MySqlStore::connect(&url, 2).await.unwrap()).await
    })
    .await;
    let mariadb = url.replacen("mysql://", "mariadb://", 1);
    let b = json(&inbox(Some(&mariadb), &["stats", "--consumer", "b", "--json"]).await);
    assert_eq!(b[0]["rows"], 5);
}

async fn migrate_stats_cleanup_and_dead_list(url: &str, seed: impl Future<Output = ()>) {
    assert_eq!(
        ok(&inbox(Some(url), &["migrate"]).await).trim(),
        "inbox schema is up to date"
    );
    // Idempotent.
    ok(&inbox(Some(url), &["migrate"]).await);
    assert_eq!(ok(&inbox(Some(url), &["stats"]).await).trim(), "no rows");

    seed.await;

    let table = ok(&inbox(Some(url), &["stats"]).await);
    let lines: Vec<&str> = table.lines().collect();
    assert_eq!(lines.len(), 3, "{table}");
    assert!(lines[0].starts_with("consumer") && lines[0].contains("oldest unprocessed"));
    let a: Vec<&str> = lines[1].split_whitespace().collect();
    assert_eq!(&a[..6], ["a", "1015", "1010", "10", "2", "3"], "{table}");
    assert!(a[6].starts_with("2h"), "oldest unprocessed: {table}");

    let all = json(&inbox(Some(url), &["stats", "--json"]).await);
    assert_eq!(all.as_array().unwrap().len(), 2);
    let b = json(&inbox(Some(url), &["stats", "--consumer", "b", "--json"]).await);
    assert_eq!(b[0]["consumer"], "b");
    assert_eq!(b[0]["rows"], 5);
    assert_eq!(b[0]["processed_last_hour"], 5);
    assert_eq!(b[0]["oldest_unprocessed_seconds"], serde_json::Value::Null);

    let dead = ok(&inbox(Some(url), &["dead", "list"]).await);
    let lines: Vec<&str> = dead.lines().collect();
    assert_eq!(
        lines.len(),
        4,
        "a header and one line per letter, whatever the error holds:\n{dead}"
    );
    assert!(
        lines[1].contains("dead-")
            && lines[1].contains("invalid JSON: expected value at line 1 column 1"),
        "{dead}"
    );
    let dead = json(&inbox(Some(url), &["dead", "list", "--consumer", "a", "--json"]).await);
    assert_eq!(dead.as_array().unwrap().len(), 3);
    assert_eq!(dead[0]["attempts"], 5);
    assert!(dead[0]["dead_for_seconds"].as_f64().unwrap() > 39.0 * 86400.0);
    let none = ok(&inbox(Some(url), &["dead", "list", "--consumer", "b"]).await);
    assert_eq!(none.trim(), "no dead letters");

    // Short retention: warned about, and done.
    let cleaned = inbox(
        Some(url),
        &["cleanup", "--older-than", "7d", "--batch-size", "300"],
    )
    .await;
    let said = ok(&cleaned);
    assert!(said.starts_with("deleted 1000 rows in 4 batches"), "{said}");
    assert!(
        stderr(&cleaned).is_empty(),
        "no warning at the horizon: {}",
        stderr(&cleaned)
    );
    let short = inbox(Some(url), &["cleanup", "--older-than", "1h"]).await;
    assert!(
        ok(&short).starts_with("deleted 0 rows"),
        "{}",
        stdout(&short)
    );
    assert!(
        stderr(&short)
            .contains("warning: --older-than 1h is shorter than the redelivery horizon 7d"),
        "{}",
        stderr(&short)
    );
    let after = json(&inbox(Some(url), &["stats", "--consumer", "a", "--json"]).await);
    assert_eq!(
        after[0]["rows"], 15,
        "the new, failing and dead rows are kept"
    );
    assert_eq!(after[0]["dead"], 3);
}

/// `inbox outbox …` on rows as a relay would leave them: stats (table and JSON), the dead list,
/// retry of one row and skip of another.
#[tokio::test]
async fn outbox_stats_dead_list_retry_and_skip_on_postgres() {
    let url = Postgres::fresh_url().await;
    outbox_stats_dead_list_retry_and_skip(&url, async {
        let store = PostgresStore::connect(&url, 2).await.unwrap();
        for sql in OUTBOX_ROWS {
            store.pool().execute(sql).await.expect("seed outbox rows");
        }
    })
    .await;
}

#[tokio::test]
async fn outbox_stats_dead_list_retry_and_skip_on_mysql() {
    let url = MySql::fresh_url().await;
    outbox_stats_dead_list_retry_and_skip(&url, async {
        let store = MySqlStore::connect(&url, 2).await.unwrap();
        for sql in OUTBOX_ROWS {
            // The same rows in MySQL's words for the times.
            let sql = sql
                .replace(
                    "now() - interval '3 hours'",
                    "UTC_TIMESTAMP(6) - INTERVAL 3 HOUR",
                )
                .replace(
                    "now() - interval '2 hours'",
                    "UTC_TIMESTAMP(6) - INTERVAL 2 HOUR",
                )
                .replace("now()", "UTC_TIMESTAMP(6)");
            store
                .pool()
                .execute(sql.as_str())
                .await
                .expect("seed outbox rows");
        }
    })
    .await;
}

/// Outbox rows as a relay would leave them: in `parcels`, 3 pending (one keyed behind a dead
/// head), 1 failing, 2 dead heads of keys; in `invoices`, one published.
const OUTBOX_ROWS: [&str; 5] = [
        "INSERT INTO outbox_messages (destination, message_id, ordering_key, payload, created_at)
         VALUES ('parcels', 'p-1', 'k1', '{}', now() - interval '3 hours'),
                ('parcels', 'p-2', 'k1', '{}', now()),
                ('parcels', 'p-3', NULL, '{}', now() - interval '2 hours')",
        "INSERT INTO outbox_messages (destination, message_id, ordering_key, payload, attempts, last_error)
         VALUES ('parcels', 'p-4', 'k4', '{}', 2, 'no route for the message')",
        "UPDATE outbox_messages SET dead_at = now(), attempts = 1,
           last_error = 'broker refused: message too large
(frame 131072)' WHERE message_id = 'p-1'",
        "INSERT INTO outbox_messages (destination, message_id, ordering_key, payload, attempts, last_error, dead_at)
         VALUES ('parcels', 'p-5', 'k5', '{}', 1, 'broker refused', now())",
        "INSERT INTO outbox_messages (destination, message_id, payload, published_at)
         VALUES ('invoices', 'i-1', '{}', now())",
];

async fn outbox_stats_dead_list_retry_and_skip(url: &str, seed: impl Future<Output = ()>) {
    ok(&inbox(Some(url), &["migrate"]).await);
    assert_eq!(
        ok(&inbox(Some(url), &["outbox", "stats"]).await).trim(),
        "no outbox rows"
    );
    seed.await;
    let table = ok(&inbox(Some(url), &["outbox", "stats"]).await);
    let lines: Vec<&str> = table.lines().collect();
    assert_eq!(lines.len(), 3, "{table}");
    assert!(lines[0].starts_with("destination") && lines[0].contains("blocked keys"));
    let invoices: Vec<&str> = lines[1].split_whitespace().collect();
    assert_eq!(
        invoices,
        ["invoices", "0", "0", "0", "0", "1", "-"],
        "{table}"
    );
    let parcels: Vec<&str> = lines[2].split_whitespace().collect();
    assert_eq!(
        &parcels[..6],
        ["parcels", "5", "1", "2", "3", "0"],
        "{table}"
    );
    assert!(parcels[6].starts_with("2h"), "oldest pending: {table}");
    let stats = json(&inbox(Some(url), &["outbox", "stats", "--json"]).await);
    assert_eq!(stats[1]["destination"], "parcels");
    assert_eq!(stats[1]["blocked_keys"], 3);

    let dead = ok(&inbox(Some(url), &["outbox", "dead", "list"]).await);
    assert_eq!(
        dead.lines().count(),
        3,
        "a header and one line per row:\n{dead}"
    );
    assert!(dead.contains("message too large (frame 131072)"), "{dead}");
    let dead = json(&inbox(Some(url), &["outbox", "dead", "list", "--json"]).await);
    let row = |message: &str| {
        dead.as_array()
            .unwrap()
            .iter()
            .find(|d| d["message_id"] == message)
            .unwrap()["id"]
            .as_i64()
            .unwrap()
            .to_string()
    };
    let (p1, p5) = (row("p-1"), row("p-5"));
    assert_eq!(dead[0]["ordering_key"], "k1");

    let retried = ok(&inbox(Some(url), &["outbox", "dead", "retry", &p1]).await);
    assert_eq!(retried.trim(), "1 dead rows will be published again");
    let skipped = ok(&inbox(Some(url), &["outbox", "dead", "skip", &p5]).await);
    assert_eq!(skipped.trim(), "1 dead rows deleted without publishing");
    let none = ok(&inbox(Some(url), &["outbox", "dead", "list"]).await);
    assert_eq!(none.trim(), "no dead outbox rows");
    let again = ok(&inbox(Some(url), &["outbox", "dead", "retry", "--all"]).await);
    assert_eq!(again.trim(), "0 dead rows will be published again");
    let stats = json(&inbox(Some(url), &["outbox", "stats", "--json"]).await);
    assert_eq!(
        (stats[1]["pending"].as_u64(), stats[1]["dead"].as_u64()),
        (Some(4), Some(0))
    );
    let refused = inbox(Some(url), &["outbox", "dead", "skip"]).await;
    assert!(!refused.status.success(), "skip needs row ids");
}

/// A consumer dead-letters two messages through a real broker; after the fix, `inbox dead replay`
/// (one by id, then `--all`) republishes them and the consumer handles each once.
async fn replay_through(brokers: &dyn BrokerFactory, transport: &str) {
    let db = Arc::new(Postgres);
    let s = Scenario::new(brokers, &db, Faults::none()).await;
    let url = Postgres::url_of(&s.store).await;
    let name = s.name("cli");
    s.broker.prepare(&s.source, &[&name]).await;
    let ids: Vec<String> = (0..5).map(|i| s.id(i)).collect();
    let (x, y) = (ids[3].clone(), ids[4].clone());
    let broken = Arc::new(Mutex::new(HashSet::from([x.clone(), y.clone()])));
    let script = Arc::new(Script {
        hook: Some(conformance::refusing(&broken)),
        ..Script::default()
    });
    let consumer = s.consumer(&name, &script);
    let running = Running::start(&consumer, 1);
    for (i, id) in ids.iter().enumerate() {
        s.publish(id, i).await;
    }
    s.wait_for(&[&name], 3).await;
    eventually("x and y dead", || async {
        let dead = s.store.dead_letters(Some(&name), 10).await.unwrap();
        if dead.len() == 2 {
            Ok(())
        } else {
            Err(format!("{dead:?}"))
        }
    })
    .await;
    let listed = json(
        &inbox(
            Some(&url),
            &["dead", "list", "--consumer", name.as_str(), "--json"],
        )
        .await,
    );
    let listed: HashSet<&str> = listed
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["message_id"].as_str().unwrap())
        .collect();
    assert_eq!(listed, HashSet::from([x.as_str(), y.as_str()]));
    assert!(
        stdout(&inbox(Some(&url), &["dead", "list"]).await).contains("bug #17 refuses"),
        "the reason is listed"
    );
    broken.lock().unwrap().clear();

    let replay = |which: Vec<String>| {
        let (url, name, source) = (url.clone(), name.to_string(), s.source.clone());
        async move {
            let mut args = vec!["dead", "replay"];
            args.extend(which.iter().map(String::as_str));
            args.extend([
                "--consumer",
                &name,
                "--source",
                &source,
                "--transport",
                transport,
            ]);
            inbox(Some(&url), &args).await
        }
    };
    // A broker may show a just-published dead letter a moment late ("no letter", exit 1); running
    // the replay again is safe.
    eventually("x replayed by id", || async {
        let out = replay(vec![x.clone()]).await;
        if out.status.success() && stdout(&out).contains(&format!("replayed   {x}")) {
            Ok(())
        } else {
            Err(format!("{}{}", stdout(&out), stderr(&out)))
        }
    })
    .await;
    s.wait_for(&[&name], 4).await;
    let again = replay(vec![x.clone()]).await;
    assert_eq!(again.status.code(), Some(1), "x is not dead any more");
    assert!(
        stdout(&again).contains(&format!("not dead   {x}")),
        "{}",
        stdout(&again)
    );

    let all = replay(vec!["--all".to_owned()]).await;
    assert!(
        ok(&all).contains(&format!("replayed   {y}")),
        "{}",
        stdout(&all)
    );
    s.wait_for(&[&name], 5).await;
    running.stop().await;
    s.assert_exactly_once(&[&name], &ids).await;
    assert_eq!(
        script.calls(&x),
        2,
        "refused once, handled once after the replay"
    );
    assert_eq!(script.calls(&y), 2);
    let stats = json(
        &inbox(
            Some(&url),
            &["stats", "--consumer", name.as_str(), "--json"],
        )
        .await,
    );
    assert_eq!(
        (stats[0]["processed"].as_u64(), stats[0]["dead"].as_u64()),
        (Some(5), Some(0))
    );
    assert!(
        s.store
            .dead_letters(Some(&name), 10)
            .await
            .unwrap()
            .is_empty()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_replay_through_rabbitmq() {
    conformance::init_tracing();
    replay_through(
        &conformance::rabbitmq::RabbitMq::new(inbox::rabbitmq::QueueType::Classic),
        "rabbitmq",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_replay_through_kafka() {
    conformance::init_tracing();
    replay_through(&conformance::kafka::Kafka { ordered: true }, "kafka").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_replay_through_nats() {
    conformance::init_tracing();
    replay_through(&conformance::nats::Nats::new(), "nats").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_replay_through_redis() {
    conformance::init_tracing();
    replay_through(&conformance::redis::Redis::new(), "redis").await;
}

/// A malformed AMQP URL (`amqp:user:password@host`, the `//` missing) is refused at once, on one
/// line, without its password — lapin's own error would quote the URL whole, and as a lost
/// connection it would be retried (and logged) for ever.
#[tokio::test]
async fn a_malformed_amqp_url_is_refused_without_its_password() {
    let store = PostgresStore::connect(&Postgres::fresh_url().await, 2)
        .await
        .unwrap();
    store.migrate().await.unwrap();
    // One dead row, so that the replay reaches the broker.
    store
        .pool()
        .execute(
            "INSERT INTO inbox_messages (consumer, message_id, attempts, last_error, dead_lettered_at)
             VALUES ('c', 'm-1', 1, 'broken', now())",
        )
        .await
        .unwrap();
    let url = Postgres::url_of(&store).await;
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_inbox"))
        .args([
            "dead",
            "replay",
            "m-1",
            "--consumer",
            "c",
            "--source",
            "parcels",
            "--transport",
            "rabbitmq",
        ])
        .env("DATABASE_URL", &url)
        .env("AMQP_URL", "amqp:guest:s3cret@127.0.0.1/%2f")
        .env("NO_COLOR", "1")
        .output()
        .await
        .unwrap();
    let text = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert_eq!(text.trim().lines().count(), 1, "{text}");
    assert!(!text.contains("s3cret"), "the password leaked: {text}");
    assert!(text.contains("invalid transport configuration"), "{text}");
}
