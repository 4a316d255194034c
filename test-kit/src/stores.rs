//! The databases the suite runs on: each scenario gets a database of its own, so that cleanup and
//! migrations in one scenario never touch another's rows.

use std::collections::HashMap;

use async_trait::async_trait;
use inbox::{
    ConsumerName, InboxAdmin, InboxStore, MySqlStore, MySqlTx, PgTx, PostgresStore, SqliteStore,
    SqliteTx,
};
use sqlx::migrate::Migrator;
use sqlx::{Connection, Executor};

use crate::services;

/// An inbox row as the tests inspect it.
#[derive(Debug, Clone)]
pub struct InboxRow {
    /// `processed_at` is set.
    pub processed: bool,
    /// `dead_lettered_at` is set.
    pub dead: bool,
    /// Handler attempts counted.
    pub attempts: i64,
    /// The last failure's text.
    pub last_error: Option<String>,
}

/// A database the conformance suite can run on.
#[async_trait]
pub trait TestDb: Send + Sync + Sized + 'static {
    /// The store under test.
    type Store: InboxAdmin + inbox::outbox::OutboxStore + Clone;
    /// Whether several write transactions run at once (not on SQLite).
    const CONCURRENT_WRITERS: bool;
    /// Whether a failed statement aborts its transaction (PostgreSQL; not SQLite).
    const FAILED_STATEMENT_ABORTS: bool;
    /// A migrated store on a database of its own, with the effects table.
    async fn store(&self) -> Self::Store;
    /// The test handler's business write.
    async fn write_effect(
        &self,
        tx: &mut <Self::Store as InboxStore>::Tx,
        run: &str,
        consumer: &str,
        message_id: &str,
    ) -> Result<(), sqlx::Error>;
    /// A statement the database refuses (an unknown table), run in the handler's transaction.
    async fn failing_statement(
        &self,
        tx: &mut <Self::Store as InboxStore>::Tx,
    ) -> Result<(), sqlx::Error>;
    /// Effect rows per (consumer, message id).
    async fn effects(&self, store: &Self::Store, run: &str) -> HashMap<(String, String), i64>;
    /// The inbox row of (consumer, id).
    async fn row(&self, store: &Self::Store, consumer: &ConsumerName, id: &str)
    -> Option<InboxRow>;
    /// Runs an application's own sqlx migrations (version 1, like ours would be if we used
    /// `_sqlx_migrations`) next to ours, in both orders.
    async fn check_app_migrations_coexist(&self);
}

const EFFECTS: &str = "CREATE TABLE IF NOT EXISTS conformance_effects (
    run TEXT NOT NULL, consumer TEXT NOT NULL, message_id TEXT NOT NULL)";

/// The statements the test handler and the checks run, in a database's placeholder style.
struct TestSql {
    insert_effect: &'static str,
    effects: &'static str,
    row: &'static str,
}

const DOLLAR_SQL: TestSql = TestSql {
    insert_effect: "INSERT INTO conformance_effects (run, consumer, message_id) VALUES ($1, $2, $3)",
    effects: "SELECT consumer, message_id, count(*) FROM conformance_effects WHERE run = $1 GROUP BY 1, 2",
    row: "SELECT processed_at IS NOT NULL, dead_lettered_at IS NOT NULL, CAST(attempts AS BIGINT), last_error
          FROM inbox_messages WHERE consumer = $1 AND message_id = $2",
};

/// MySQL: `?` placeholders; texts in utf8mb4 with a collation sqlx reads as text (not `_bin`),
/// ids compared as bytes.
const MYSQL_EFFECTS: &str = "CREATE TABLE IF NOT EXISTS conformance_effects (
    run VARCHAR(64) NOT NULL, consumer VARBINARY(255) NOT NULL, message_id VARBINARY(1024) NOT NULL)
    CHARACTER SET utf8mb4 COLLATE utf8mb4_unicode_ci";

const MYSQL_SQL: TestSql = TestSql {
    insert_effect: "INSERT INTO conformance_effects (run, consumer, message_id) VALUES (?, ?, ?)",
    effects: "SELECT CONVERT(consumer USING utf8mb4), CONVERT(message_id USING utf8mb4), COUNT(*)
              FROM conformance_effects WHERE run = ? GROUP BY consumer, message_id",
    row: "SELECT processed_at IS NOT NULL, dead_lettered_at IS NOT NULL, CAST(attempts AS SIGNED), last_error
          FROM inbox_messages WHERE consumer = ? AND message_id = ?",
};

fn app_migrator() -> Migrator {
    // Built at run time from a folder of its own, as an application's `migrate!()` would be.
    let dir = std::env::temp_dir().join(format!(
        "inbox-app-migrations-{}",
        uuid::Uuid::new_v4().simple()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("1_app_orders.sql"),
        "CREATE TABLE app_orders (id INTEGER PRIMARY KEY);",
    )
    .unwrap();
    let migrator = futures::executor::block_on(Migrator::new(dir.as_path())).unwrap();
    std::fs::remove_dir_all(&dir).ok();
    migrator
}

/// The implementation both databases share: the SQL is the same, only the types differ.
/// (A macro producing the whole impl, as `#[async_trait]` must see every method.)
macro_rules! test_db {
    ($db:ty, $store:ty, $tx:ty, concurrent_writers = $concurrent:expr, failed_statement_aborts = $aborts:expr) => {
        test_db!(
            $db,
            $store,
            $tx,
            concurrent_writers = $concurrent,
            failed_statement_aborts = $aborts,
            effects = EFFECTS,
            sql = DOLLAR_SQL
        );
    };
    ($db:ty, $store:ty, $tx:ty, concurrent_writers = $concurrent:expr, failed_statement_aborts = $aborts:expr,
     effects = $effects:expr, sql = $sql:expr) => {
        #[async_trait]
        impl TestDb for $db {
            type Store = $store;
            const CONCURRENT_WRITERS: bool = $concurrent;
            const FAILED_STATEMENT_ABORTS: bool = $aborts;

            async fn store(&self) -> $store {
                let store = Self::connect_fresh().await;
                store.migrate().await.expect("migrate the inbox");
                store.pool().execute($effects).await.expect("effects table");
                store
            }

            async fn write_effect(
                &self,
                tx: &mut $tx,
                run: &str,
                consumer: &str,
                id: &str,
            ) -> Result<(), sqlx::Error> {
                sqlx::query($sql.insert_effect)
                    .bind(run)
                    .bind(consumer)
                    .bind(id)
                    .execute(&mut **tx)
                    .await
                    .map(drop)
            }

            async fn failing_statement(&self, tx: &mut $tx) -> Result<(), sqlx::Error> {
                sqlx::query("SELECT * FROM conformance_no_such_table")
                    .execute(&mut **tx)
                    .await
                    .map(drop)
            }

            async fn effects(&self, store: &$store, run: &str) -> HashMap<(String, String), i64> {
                let rows: Vec<(String, String, i64)> = sqlx::query_as($sql.effects)
                    .bind(run)
                    .fetch_all(store.pool())
                    .await
                    .expect("read effects");
                rows.into_iter().map(|(c, m, n)| ((c, m), n)).collect()
            }

            async fn row(
                &self,
                store: &$store,
                consumer: &ConsumerName,
                id: &str,
            ) -> Option<InboxRow> {
                let row: Option<(bool, bool, i64, Option<String>)> = sqlx::query_as($sql.row)
                    .bind(consumer.as_str())
                    .bind(id)
                    .fetch_optional(store.pool())
                    .await
                    .expect("read inbox row");
                row.map(|(processed, dead, attempts, last_error)| InboxRow {
                    processed,
                    dead,
                    attempts,
                    last_error,
                })
            }

            async fn check_app_migrations_coexist(&self) {
                let app = app_migrator();
                for ours_first in [true, false] {
                    let store = Self::connect_fresh().await;
                    if ours_first {
                        store.migrate().await.unwrap();
                    }
                    app.run(store.pool())
                        .await
                        .expect("the application's migrations run beside ours");
                    store
                        .migrate()
                        .await
                        .expect("ours run beside the application's");
                    app.run(store.pool()).await.expect("and again");
                    let versions: Vec<i64> =
                        sqlx::query_scalar("SELECT version FROM _sqlx_migrations")
                            .fetch_all(store.pool())
                            .await
                            .unwrap();
                    assert_eq!(
                        versions,
                        vec![1],
                        "only the application's version in _sqlx_migrations"
                    );
                }
            }
        }
    };
}

/// SQLite: a new database file per scenario.
pub struct Sqlite;

impl Sqlite {
    fn fresh_url() -> String {
        let path = std::env::temp_dir().join(format!(
            "inbox-conformance-{}.db",
            uuid::Uuid::new_v4().simple()
        ));
        format!("sqlite:{}", path.display())
    }

    async fn connect_fresh() -> SqliteStore {
        SqliteStore::connect(&Self::fresh_url())
            .await
            .expect("open SQLite")
    }
}

test_db!(
    Sqlite,
    SqliteStore,
    SqliteTx,
    concurrent_writers = false,
    failed_statement_aborts = false
);

/// PostgreSQL: a new database per scenario on the server of `DATABASE_URL`.
pub struct Postgres;

impl Postgres {
    /// The URL of a new, empty database on the test server.
    pub async fn fresh_url() -> String {
        let base = services::postgres_url();
        let name = format!("inbox_t_{}", uuid::Uuid::new_v4().simple());
        let mut admin = sqlx::PgConnection::connect(&base).await.expect(
            "connect to PostgreSQL at DATABASE_URL (scripts/test starts it; see the README)",
        );
        admin
            .execute(format!("CREATE DATABASE {name}").as_str())
            .await
            .expect("create a scenario database");
        let mut url: url_like::Url = base.parse().unwrap();
        url.set_database(&name);
        url.to_string()
    }

    /// The URL of the database `store` is connected to (for a separate process, such as the
    /// `inbox` command line).
    pub async fn url_of(store: &PostgresStore) -> String {
        let name: String = sqlx::query_scalar("SELECT current_database()")
            .fetch_one(store.pool())
            .await
            .expect("current_database()");
        let mut url: url_like::Url = services::postgres_url().parse().unwrap();
        url.set_database(&name);
        url.to_string()
    }

    async fn connect_fresh() -> PostgresStore {
        PostgresStore::connect(&Self::fresh_url().await, 8)
            .await
            .expect("connect PostgreSQL")
    }
}

test_db!(
    Postgres,
    PostgresStore,
    PgTx,
    concurrent_writers = true,
    failed_statement_aborts = true
);

/// MySQL / MariaDB: a new database per scenario on the server of `MYSQL_URL`.
pub struct MySql;

impl MySql {
    /// The URL of a new, empty database on the test server.
    pub async fn fresh_url() -> String {
        let base = services::mysql_url();
        let name = format!("inbox_t_{}", uuid::Uuid::new_v4().simple());
        let mut admin = sqlx::MySqlConnection::connect(&base.replacen("mariadb://", "mysql://", 1))
            .await
            .expect(
                "connect to MySQL/MariaDB at MYSQL_URL (scripts/test starts it; see the README)",
            );
        admin
            .execute(format!("CREATE DATABASE {name}").as_str())
            .await
            .expect("create a scenario database");
        let mut url: url_like::Url = base.parse().unwrap();
        url.set_database(&name);
        url.to_string()
    }

    /// The URL of the database `store` is connected to (for another process).
    pub async fn url_of(store: &MySqlStore) -> String {
        let name: String = sqlx::query_scalar("SELECT DATABASE()")
            .fetch_one(store.pool())
            .await
            .expect("DATABASE()");
        let mut url: url_like::Url = services::mysql_url().parse().unwrap();
        url.set_database(&name);
        url.to_string()
    }

    async fn connect_fresh() -> MySqlStore {
        MySqlStore::connect(&Self::fresh_url().await, 8)
            .await
            .expect("connect MySQL")
    }
}

test_db!(
    MySql,
    MySqlStore,
    MySqlTx,
    concurrent_writers = true,
    // A failed statement rolls back itself only (a deadlock rolls back everything, which
    // the commit detects).
    failed_statement_aborts = false,
    effects = MYSQL_EFFECTS,
    sql = MYSQL_SQL
);

mod url_like {
    //! Just enough URL handling to swap the database name of a PostgreSQL or MySQL URL.
    use std::fmt;
    use std::str::FromStr;

    pub struct Url {
        head: String,
        query: String,
    }

    impl FromStr for Url {
        type Err = String;
        fn from_str(s: &str) -> Result<Self, String> {
            let (rest, query) = match s.split_once('?') {
                Some((r, q)) => (r, format!("?{q}")),
                None => (s, String::new()),
            };
            let scheme_end = rest.find("://").ok_or("not a URL")? + 3;
            let head = match rest[scheme_end..].find('/') {
                Some(slash) => rest[..scheme_end + slash].to_owned(),
                None => rest.to_owned(),
            };
            Ok(Self { head, query })
        }
    }

    impl Url {
        pub fn set_database(&mut self, name: &str) {
            self.head = format!("{}/{name}", self.head);
        }
    }

    impl fmt::Display for Url {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            write!(f, "{}{}", self.head, self.query)
        }
    }
}
