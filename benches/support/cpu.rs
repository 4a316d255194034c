//! The CPU account of a measured mode: the processor time each side spent — the database, the
//! broker, the bench itself (the relay, the producer) — read from `/proc` before and after it,
//! and how busy the machine was.
//!
//! Over a run of `T` seconds the machine's processes cannot use more than `processors × T`
//! seconds of CPU, so a mode whose rows cost the database and the broker what they cost in this
//! run cannot go faster than `processors / (their CPU seconds per row)`: the ceiling for this
//! relay's SQL and this publish, which only cheaper SQL or a cheaper publish could raise.
//! What is counted: every process of the machine by its command name (another job's PostgreSQL
//! on the same machine counts as the database), the time each spent inside the window (a process
//! that ends inside it is lost, so a side may show less than it spent); the database's background
//! work left over from before the window (a checkpoint, autovacuum) counts. Times come in clock
//! ticks (10 ms), so a mode needs a second or more for its account to mean much. Linux only;
//! elsewhere there is no account.

use std::collections::HashMap;
use std::time::Instant;

/// Who a process works for, by its command name.
#[cfg(target_os = "linux")]
fn side(comm: &str) -> &'static str {
    match comm {
        "postgres" | "postmaster" => "postgres",
        "mariadbd" | "mysqld" => "mysql",
        "beam.smp" | "erl_child_setup" | "epmd" | "inet_gethost" => "rabbitmq",
        "tansu" => "kafka",
        "nats-server" => "nats",
        "redis-server" | "valkey-server" => "redis",
        _ => "other",
    }
}

/// Each process's side and CPU seconds so far (by pid and start time: a pid reused inside the
/// window is another process), the machine's busy seconds and its processors.
struct Snapshot {
    processes: HashMap<(i32, u64), (&'static str, f64)>,
    machine_busy: f64,
    processors: usize,
}

#[cfg(target_os = "linux")]
fn snapshot() -> Option<Snapshot> {
    use procfs::CurrentSI;
    let ticks = procfs::ticks_per_second() as f64;
    let me = std::process::id() as i32;
    let mut processes = HashMap::new();
    for process in procfs::process::all_processes().ok()?.flatten() {
        let Ok(stat) = process.stat() else { continue };
        let name = if stat.pid == me {
            "bench"
        } else {
            side(&stat.comm)
        };
        let spent = (stat.utime + stat.stime) as f64 / ticks;
        processes.insert((stat.pid, stat.starttime), (name, spent));
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
        processes,
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
        let mut by_side: HashMap<&'static str, f64> = HashMap::new();
        for (process, (side, spent)) in &end.processes {
            // Started inside the window: all its time is.
            let before = start.processes.get(process).map_or(0.0, |(_, s)| *s);
            *by_side.entry(side).or_default() += (spent - before).max(0.0);
        }
        Some(CpuAccount {
            seconds,
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
    /// The processors `/proc/stat` counts.
    pub processors: f64,
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

    /// How busy the machine was: 1.0 is every processor all the time (counted in clock ticks, so
    /// a window of a few ticks may read above it).
    pub fn busy(&self) -> f64 {
        self.machine_busy / (self.processors * self.seconds).max(1e-9)
    }

    /// Microseconds of CPU per row spent by `side`.
    pub fn per_row_us(&self, side: &str, rows: usize) -> f64 {
        self.spent(side) / rows.max(1) as f64 * 1e6
    }

    /// The rate the machine allows at most if each row costs what `sides` spent on it here:
    /// `processors / (their CPU seconds per row)`. `None` when a side shows under a tenth of a
    /// second (ten clock ticks), too little to divide by.
    pub fn ceiling(&self, sides: &[&str], rows: usize) -> Option<f64> {
        if sides.iter().any(|side| self.spent(side) < 0.1) {
            return None;
        }
        let per_row: f64 = sides.iter().map(|s| self.spent(s)).sum::<f64>() / rows.max(1) as f64;
        Some(self.processors / per_row)
    }

    /// The account as the JSON output's `cpu` object.
    pub fn json(&self, rows: usize) -> serde_json::Value {
        let mut sides: Vec<_> = self.by_side.keys().collect();
        sides.sort();
        let per_row: serde_json::Map<_, _> = sides
            .into_iter()
            .map(|side| {
                (
                    (*side).to_owned(),
                    serde_json::json!(self.per_row_us(side, rows)),
                )
            })
            .collect();
        serde_json::json!({
            "us_per_row": per_row,
            "machine_busy": self.busy(),
            "processors": self.processors,
        })
    }
}
