//! Rebuilds the crate when a migration is added or removed: `sqlx::migrate!` tracks the files it
//! read, not their directories, so a new file alone would leave the embedded list stale.

fn main() {
    for directory in ["postgres", "mysql", "sqlite"] {
        println!("cargo:rerun-if-changed={directory}");
    }
}
