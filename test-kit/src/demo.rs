//! The demo's `consume` subcommand as a separate process, on a database of its own: for the
//! cross-client tests, where another program publishes and the demo's consumers must handle
//! every event exactly once.

use std::process::Stdio;

use tokio::process::{Child, Command};

use crate::stores::Postgres;
use crate::{DEADLINE, eventually};

/// The demo binary, built by cargo next to the test binaries (`target/<profile>/examples`).
pub fn binary() -> std::path::PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    let profile_dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("target/<profile>/deps");
    let demo = profile_dir.join("examples").join("parcel_tracker");
    assert!(
        demo.exists(),
        "{} is missing: build it with cargo build --examples --all-features",
        demo.display()
    );
    demo
}

/// `parcel_tracker consume` running against a fresh PostgreSQL database.
pub struct DemoConsumer {
    child: Child,
    /// The demo's own database (a fresh one).
    pub database: String,
    /// The source it consumes.
    pub source: String,
    pool: sqlx::PgPool,
}

impl DemoConsumer {
    /// Starts consuming `source` (both consumers) over `transport`, with `env` for the broker.
    pub async fn start(transport: &str, source: &str, env: &[(&str, String)]) -> Self {
        Self::start_with(transport, source, env, &[]).await
    }

    /// The same, with more arguments for `consume` (`--handler batch`, say).
    pub async fn start_with(
        transport: &str,
        source: &str,
        env: &[(&str, String)],
        extra: &[&str],
    ) -> Self {
        let database = Postgres::fresh_url().await;
        let child = spawn_consume(transport, &database, source, extra, env, "warn");
        let pool = sqlx::PgPool::connect(&database)
            .await
            .expect("the demo's database");
        Self {
            child,
            database,
            source: source.to_owned(),
            pool,
        }
    }

    /// Waits until both consumers wrote their effect for `events` events.
    pub async fn wait_for_effects(&self, events: i64) {
        eventually("both effects of every event", || async {
            let n: i64 = sqlx::query_scalar(
                "SELECT (SELECT count(*) FROM notifications) + (SELECT count(*) FROM carrier_bookings)",
            )
            .fetch_one(&self.pool)
            .await
            .map_err(|e| e.to_string())?;
            if n >= 2 * events { Ok(()) } else { Err(format!("{n} effect rows")) }
        })
        .await;
    }

    /// SIGTERM; the demo must drain and exit 0. Returns what it printed on stderr.
    pub async fn stop(self) -> String {
        terminate(&self.child).await;
        let output = tokio::time::timeout(DEADLINE, self.child.wait_with_output())
            .await
            .expect("the demo drains and exits after SIGTERM")
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
        assert!(
            output.status.success(),
            "the demo exits 0 after SIGTERM: {stderr}"
        );
        stderr
    }

    /// SIGTERM (the demo must drain and exit 0), then [`assert_exactly_once`](Self::assert_exactly_once)
    /// on what it printed.
    pub async fn stop_exactly_once(self, events: u64, duplicates: u64) {
        let database = self.database.clone();
        let stderr = self.stop().await;
        println!("{stderr}");
        Self::assert_exactly_once(&database, &stderr, events, duplicates).await;
    }

    /// Checks the demo's summary lines and its own report (`report --expect`).
    pub async fn assert_exactly_once(database: &str, stderr: &str, events: u64, duplicates: u64) {
        for consumer in ["notification", "carrier-assignment"] {
            let line = stderr
                .lines()
                .find(|l| l.starts_with(&format!("{consumer}:")))
                .unwrap_or_else(|| panic!("no summary line for {consumer} in {stderr}"));
            assert!(line.contains(&format!("processed {events} ")), "{line}");
            assert!(
                line.contains(&format!("duplicates {duplicates} ")),
                "{line}"
            );
        }
        let report = Command::new(binary())
            .args([
                "report",
                "--database",
                database,
                "--expect",
                &events.to_string(),
            ])
            .output()
            .await
            .unwrap();
        println!("{}", String::from_utf8_lossy(&report.stdout));
        assert!(
            report.status.success(),
            "every parcel: one notification, one booking"
        );
    }
}

/// The demo's two consumers, as `--consumer both` runs them.
pub fn consumers() -> [inbox::ConsumerName; 2] {
    ["notification", "carrier-assignment"].map(|name| inbox::ConsumerName::new(name).unwrap())
}

/// Waits until both of the demo's consumers have nothing left: `pending` of each is 0.
pub async fn eventually_acked<F, Fut>(pending: F)
where
    F: Fn(String) -> Fut,
    Fut: std::future::Future<Output = Result<u64, inbox::TransportError>>,
{
    let consumers = consumers();
    let names: Vec<&inbox::ConsumerName> = consumers.iter().collect();
    eventually("every message acked by both consumers", || {
        crate::settled_by_pending(&names, 0, &pending)
    })
    .await;
}

/// Starts `parcel_tracker consume --transport … --database … --source …` and `extra` arguments,
/// with `env` and `RUST_LOG=log`; stderr piped, killed when dropped.
pub fn spawn_consume(
    transport: &str,
    database: &str,
    source: &str,
    extra: &[&str],
    env: &[(&str, String)],
    log: &str,
) -> Child {
    let mut args = vec![
        "consume",
        "--transport",
        transport,
        "--database",
        database,
        "--source",
        source,
    ];
    args.extend_from_slice(extra);
    spawn(&args, env, log)
}

/// Starts `parcel_tracker` with `args`, `env` and `RUST_LOG=log`; stdout and stderr piped,
/// killed when dropped.
pub fn spawn(args: &[&str], env: &[(&str, String)], log: &str) -> Child {
    let demo = binary();
    Command::new(&demo)
        .args(args)
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .env("RUST_LOG", log)
        .env("NO_COLOR", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap_or_else(|e| panic!("start {}: {e}", demo.display()))
}

/// Sends SIGTERM: the demo is to drain and exit 0 (the caller waits for it).
pub async fn terminate(child: &Child) {
    let pid = child.id().expect("running");
    let killed = Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .await
        .expect("kill -TERM");
    assert!(killed.success(), "kill -TERM {pid}: {killed}");
}

/// The demo's `report --json` on `database`: parcels complete, double effects.
pub async fn report(database: &str) -> serde_json::Value {
    let output = Command::new(binary())
        .args(["report", "--json", "--database", database])
        .output()
        .await
        .expect("run the demo's report");
    serde_json::from_slice(&output.stdout).unwrap_or_else(|e| {
        panic!(
            "report --json: {e}: {}",
            String::from_utf8_lossy(&output.stderr)
        )
    })
}

/// An HTTP/1.1 answer: status, headers (names in lowercase) and body.
#[derive(Debug)]
pub struct HttpAnswer {
    /// The status code.
    pub status: u16,
    /// Header names in lowercase, with their values.
    pub headers: Vec<(String, String)>,
    /// The body, as text.
    pub body: String,
}

impl HttpAnswer {
    /// A header's value.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// One request on a connection of its own (`Connection: close`), enough for the demo's API and
/// free of an HTTP client crate.
pub async fn http(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> HttpAnswer {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr)
        .await
        .unwrap_or_else(|e| panic!("connect to {addr}: {e}"));
    let mut request = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (name, value) in headers {
        request.push_str(&format!("{name}: {value}\r\n"));
    }
    request.push_str("\r\n");
    request.push_str(body);
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut raw = Vec::new();
    tokio::time::timeout(DEADLINE, stream.read_to_end(&mut raw))
        .await
        .expect("an answer in time")
        .unwrap();
    let raw = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = raw.split_once("\r\n\r\n").expect("a complete HTTP answer");
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("a status line: {head}"));
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect::<Vec<_>>();
    assert!(
        !headers
            .iter()
            .any(|(n, v)| n == "transfer-encoding" && v.contains("chunked")),
        "a chunked answer: {head}"
    );
    HttpAnswer {
        status,
        headers,
        body: body.to_owned(),
    }
}
