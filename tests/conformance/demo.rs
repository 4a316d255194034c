//! The demo's `consume` subcommand as a separate process, on a database of its own: for the
//! cross-client tests, where another program publishes and the demo's consumers must handle
//! every event exactly once.

use std::process::Stdio;

use super::stores::Postgres;
use super::{DEADLINE, eventually};

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
    child: tokio::process::Child,
    pub database: String,
    pub source: String,
    pool: sqlx::PgPool,
}

impl DemoConsumer {
    /// Starts consuming `source` (both consumers) over `transport`, with `env` for the broker.
    pub async fn start(transport: &str, source: &str, env: &[(&str, String)]) -> Self {
        let database = Postgres::fresh_url().await;
        let demo = binary();
        let child = tokio::process::Command::new(&demo)
            .args([
                "consume",
                "--transport",
                transport,
                "--database",
                &database,
                "--source",
                source,
            ])
            .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
            .env("RUST_LOG", "warn")
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("start {}: {e}", demo.display()));
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
        let pid = self.child.id().expect("running");
        let killed = tokio::process::Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status()
            .await
            .unwrap();
        assert!(killed.success());
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
        let report = tokio::process::Command::new(binary())
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
