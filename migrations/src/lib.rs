//! The SQL that creates and evolves the inbox tables, one folder per database, embedded at
//! compile time so that a published `inbox-core` carries it.
//!
//! The stores in `inbox-core` apply these with their own bookkeeping table
//! (`inbox_schema_migrations`), so an application's own `sqlx::migrate!` never sees our versions.
//! To review or apply the SQL by hand, read the `.sql` files beside this crate: they are the same
//! text.

use sqlx::migrate::Migrator;

/// The PostgreSQL migrations (`postgres/`).
#[cfg(feature = "postgres")]
pub static POSTGRES: Migrator = sqlx::migrate!("./postgres");

/// The MySQL / MariaDB migrations (`mysql/`).
#[cfg(feature = "mysql")]
pub static MYSQL: Migrator = sqlx::migrate!("./mysql");

/// The SQLite migrations (`sqlite/`).
#[cfg(feature = "sqlite")]
pub static SQLITE: Migrator = sqlx::migrate!("./sqlite");
