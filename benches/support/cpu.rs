//! The CPU account of a measured mode: the processor time each side spent — the database, the
//! broker, the bench itself (the relay, the producer) — read from `/proc` before and after it.
//!
//! Where the database, the broker and the bench share the machine's cores, a mode's rate is at
//! most `cores / (CPU seconds per row)`, whatever the code: over a run of `T` seconds the
//! processes cannot use more than `cores × T`. The account gives that ceiling for a row's
//! database and broker work alone, which is what a faster relay could not take away (only
//! cheaper SQL or a cheaper publish could). Linux only; elsewhere there is no account. Times
//! come in clock ticks (10 ms), so a mode needs a second or more for its account to mean much.

use std::collections::HashMap;
use std::time::Instant;

/// Who a process works for, by its command name.
fn side(comm: &str) -> &'static str {
    match comm {
        "postgres" | "postmaster" => "postgres",
        "mariadbd" | "mysqld" => "mysql",
        "beam.smp" | "erl_child_setup" | "epmd" | "inet_gethost" => "rabbitmq",
        "tansu" => "kafka",
        "nats-server" => "nats",
        "redis-server" => "redis",
        _ => "other",
    }
}

/// CPU seconds by side at one moment, the machine's busy seconds (all its processors) and how
/// many processors `/proc/stat` counts.
#[derive(Default)]
struct Snapshot {
    by_side: HashMap<&'static str, f64>,
    machine_busy: f64,
    processors: usize,
}

#[cfg(target_os = "linux")]
fn snapshot() -> Option<Snapshot> {
    use procfs::CurrentSI;
    let ticks = procfs::ticks_per_second() as f64;
    let me = std::process::id() as i32;
    let mut by_side: HashMap<&'static str, f64> = HashMap::new();
    // Processes that end between two snapshots lose their time: the account then shows less
    // than was spent, which only makes its ceiling higher, never a false "cannot".
    for process in procfs::process::all_processes().ok()?.flatten() {
        let Ok(stat) = process.stat() else { continue };
        let name = if stat.pid == me {
            "bench"
        } else {
            side(&stat.comm)
        };
        *by_side.entry(name).or_default() += (stat.utime + stat.stime) as f64 / ticks;
    }
    let stats = procfs::KernelStats::current().ok()?;
    let total = stats.total;
    let busy = total.user
        + total.nice
        + total.system
        + total.irq.unwrap_or(0)
        + total.softirq.unwrap_or(0)
        + total.steal.unwrap_or(0);
    Some(Snapshot {
        by_side,
        machine_busy: busy as f64 / ticks,
        processors: stats.cpu_time.len().max(1),
    })
}

#[cfg(not(target_os = "linux"))]
fn snapshot() -> Option<Snapshot> {
    None
}

/// Started before a mode; [`CpuClock::stop`] gives its account.
pub struct CpuClock {
    start: Option<Snapshot>,
    started: Instant,
}

impl CpuClock {
    pub fn start() -> Self {
        CpuClock {
            start: snapshot(),
            started: Instant::now(),
        }
    }

    pub fn stop(self) -> Option<CpuAccount> {
        let seconds = self.started.elapsed().as_secs_f64();
        let (start, end) = (self.start?, snapshot()?);
        let by_side = end
            .by_side
            .iter()
            .map(|(side, spent)| {
                let before = start.by_side.get(side).copied().unwrap_or(0.0);
                (*side, (spent - before).max(0.0))
            })
            .collect();
        Some(CpuAccount {
            seconds,
            cores: std::thread::available_parallelism().map_or(1, usize::from) as f64,
            processors: end.processors as f64,
            by_side,
            machine_busy: (end.machine_busy - start.machine_busy).max(0.0),
        })
    }
}

/// The CPU a mode spent, by side.
pub struct CpuAccount {
    /// The mode's wall-clock seconds.
    pub seconds: f64,
    /// The cores this process may use: the ceiling's.
    pub cores: f64,
    /// The processors `/proc/stat` counts: the busy share's.
    processors: f64,
    by_side: HashMap<&'static str, f64>,
    machine_busy: f64,
}

impl CpuAccount {
    /// Adds another run of the same mode: the account of both together.
    pub fn absorb(&mut self, other: CpuAccount) {
        self.seconds += other.seconds;
        self.processors = self.processors.max(other.processors);
        self.machine_busy += other.machine_busy;
        for (side, spent) in other.by_side {
            *self.by_side.entry(side).or_default() += spent;
        }
    }

    /// CPU seconds spent by `side` (`postgres`, `rabbitmq`, `kafka`, `nats`, `redis`, `mysql`,
    /// `bench`, `other`).
    pub fn spent(&self, side: &str) -> f64 {
        self.by_side.get(side).copied().unwrap_or(0.0)
    }

    /// How busy the machine was: 1.0 is every processor all the time.
    pub fn busy(&self) -> f64 {
        self.machine_busy / (self.processors * self.seconds).max(1e-9)
    }

    /// Microseconds of CPU per row spent by `side`.
    pub fn per_row_us(&self, side: &str, rows: usize) -> f64 {
        self.spent(side) / rows.max(1) as f64 * 1e6
    }

    /// The rate the machine allows at most, if each row costs what `sides` spent on it here:
    /// `cores / (their CPU seconds per row)`.
    pub fn ceiling(&self, sides: &[&str], rows: usize) -> f64 {
        let per_row: f64 = sides.iter().map(|s| self.spent(s)).sum::<f64>() / rows.max(1) as f64;
        self.cores / per_row.max(1e-12)
    }

    /// The account as the JSON output's `cpu` object.
    pub fn json(&self, rows: usize) -> serde_json::Value {
        let mut per_row = serde_json::Map::new();
        let mut sides: Vec<_> = self.by_side.keys().collect();
        sides.sort();
        for side in sides {
            per_row.insert(
                (*side).to_owned(),
                serde_json::json!(self.per_row_us(side, rows)),
            );
        }
        serde_json::json!({
            "us_per_row": per_row,
            "machine_busy": self.busy(),
            "cores": self.cores,
        })
    }
}
