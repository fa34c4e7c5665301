//! `relay sim`: run the deterministic simulator over one seed or a sweep of seeds.
//!
//! Exit status: 0 when every run held every invariant; 1 on a correctness violation; 3 on a
//! liveness violation; 4 when `--check-determinism` saw one seed run two ways; 2 on bad usage.

use std::collections::BTreeMap;
use std::process::ExitCode;
use std::time::Instant;

use relay_core::config::format_duration;
use relay_sim::{
    Kind, Mutation, Options, Plan, RunResult, SavedRun, Shape, run_plan, run_plan_traced, shrink,
};

#[derive(clap::Args)]
pub struct Args {
    /// Run this seed (with --seeds, the first seed of the sweep; a sweep starts at 0 without
    /// it). A single run without it draws a seed from the clock and prints it.
    #[arg(long)]
    seed: Option<u64>,
    /// Run this many consecutive seeds.
    #[arg(long)]
    seeds: Option<u64>,
    /// Run every seed twice and compare the trace hashes.
    #[arg(long)]
    check_determinism: bool,
    /// Plant a deliberate bug to see the invariants catch it: ignore-heartbeat-conflict,
    /// server-skips-fence, report-after-deadline, reaper-closes-twice, deadlines-on-wall-clock,
    /// answer-dropped, task-cancel-overrides or limit-off-by-one.
    #[arg(long, value_parser = parse_mutation)]
    mutation: Option<Mutation>,
    /// Print every event and command to stderr (one seed).
    #[arg(long)]
    trace: bool,
    /// On a violation, remove fault events while the same invariant still breaks, and print
    /// the smallest plan.
    #[arg(long)]
    shrink: bool,
    /// Write the run's options and plan (after --shrink, the shrunk plan) to this JSON file.
    #[arg(long, value_name = "FILE")]
    save_plan: Option<std::path::PathBuf>,
    /// Replay a run saved with --save-plan instead of drawing one from a seed.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["seed", "seeds", "mutation", "relays", "todos", "duration", "all_faults"])]
    plan: Option<std::path::PathBuf>,
    /// Force this many relays on every seed (1 or more).
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..=64))]
    relays: Option<u16>,
    /// Force this many todos on every seed.
    #[arg(long)]
    todos: Option<u16>,
    /// Force the length of the faulted phase on every seed (e.g. 24h); the healed phase follows.
    #[arg(long, value_parser = parse_phase)]
    duration: Option<u64>,
    /// Turn every fault kind on for every seed (the seed still draws when and how hard).
    #[arg(long)]
    all_faults: bool,
    /// Threads a sweep runs seeds on (default: one per core). Results are the same for any
    /// number: each seed runs alone, and they are reported in seed order.
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..))]
    threads: Option<u16>,
}

fn parse_phase(s: &str) -> Result<u64, String> {
    relay_core::config::parse_duration(s).map_err(|e| e.to_string())
}

fn parse_mutation(s: &str) -> Result<Mutation, String> {
    Mutation::parse(s).ok_or_else(|| {
        let names: Vec<&str> = Mutation::ALL.iter().map(|m| m.as_str()).collect();
        format!("unknown mutation {s:?}; choose one of {}", names.join(", "))
    })
}

fn repro(seed: u64, args: &Args) -> String {
    if let Some(path) = &args.plan {
        return format!("relay sim --plan {}", path.display());
    }
    match args.mutation {
        Some(m) => format!("relay sim --seed {seed} --mutation {}", m.as_str()),
        None => format!("relay sim --seed {seed}"),
    }
}

fn counts_line(counts: &BTreeMap<&'static str, u64>) -> String {
    counts
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// One seed's run: what was drawn (or loaded), what happened, and under
/// `--check-determinism` the (trace hash, events) of the second run.
struct Seeded {
    options: Options,
    plan: Plan,
    result: RunResult,
    again: Option<(u64, u64)>,
}

impl Args {
    fn shape(&self) -> Shape {
        Shape {
            relays: self.relays.map(usize::from),
            todos: self.todos.map(usize::from),
            safety: self.duration,
            all_faults: self.all_faults,
        }
    }

    /// Runs one seed (or the loaded plan) as the flags say.
    fn run_one(&self, seed: u64, saved: Option<&SavedRun>) -> Seeded {
        let (options, plan) = match saved {
            Some(s) => (s.options.clone(), s.plan.clone()),
            None => {
                let options = Options::draw_shaped(seed, self.mutation, self.shape());
                let plan = Plan::draw(&options);
                (options, plan)
            }
        };
        let result = if self.trace {
            run_plan_traced(&options, &plan)
        } else {
            run_plan(&options, &plan)
        };
        let again = self.check_determinism.then(|| {
            let again = run_plan(&options, &plan);
            (again.trace_hash, again.events)
        });
        Seeded {
            options,
            plan,
            result,
            again,
        }
    }
}

/// Runs seeds `first..first + n` on `threads` threads, handing each result to `take` in seed
/// order. Each seed's world is single-threaded and deterministic, so running several at once
/// changes nothing but the wall time. Once `take` answers `Break`, no seed after that one starts
/// and every result after it is dropped: a sweep reports its lowest failing seed, as run in
/// order would.
fn sweep(
    args: &Args,
    first: u64,
    n: u64,
    threads: usize,
    mut take: impl FnMut(u64, Seeded) -> std::ops::ControlFlow<ExitCode>,
) -> Option<ExitCode> {
    use std::ops::ControlFlow;
    use std::sync::atomic::{AtomicU64, Ordering};
    let next = AtomicU64::new(0);
    let stop = AtomicU64::new(u64::MAX);
    std::thread::scope(|scope| {
        let (tx, rx) = std::sync::mpsc::channel::<(u64, Seeded)>();
        for _ in 0..threads {
            let tx = tx.clone();
            let (next, stop) = (&next, &stop);
            scope.spawn(move || {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= n || i > stop.load(Ordering::Relaxed) {
                        break;
                    }
                    if tx.send((i, args.run_one(first + i, None))).is_err() {
                        break;
                    }
                }
            });
        }
        drop(tx);
        let mut waiting = BTreeMap::new();
        let mut due = 0u64;
        for (i, seeded) in rx {
            waiting.insert(i, seeded);
            while let Some(seeded) = waiting.remove(&due) {
                if let ControlFlow::Break(code) = take(first + due, seeded) {
                    stop.store(due, Ordering::Relaxed);
                    return Some(code);
                }
                due += 1;
            }
        }
        None
    })
}

pub fn run(args: Args) -> ExitCode {
    use std::ops::ControlFlow;
    // A sweep without --seed starts at 0, so that it is the same sweep every time; a single
    // run without --seed explores a seed drawn from the clock (and prints it).
    let first = args.seed.unwrap_or_else(|| {
        if args.seeds.is_some() {
            0
        } else {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64)
        }
    });
    let n = args.seeds.unwrap_or(1).max(1);
    let single = n == 1;
    let bar = (!single).then(|| {
        let b = indicatif::ProgressBar::new(n);
        b.set_style(
            indicatif::ProgressStyle::with_template("{bar:40} {pos}/{len} seeds {msg}")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        b
    });
    let started = Instant::now();
    let mut events = 0u64;
    let mut simulated = 0u64;
    let mut totals: BTreeMap<&'static str, u64> = BTreeMap::new();
    let saved = match &args.plan {
        Some(path) => match load(path) {
            Ok(saved) => Some(saved),
            Err(e) => {
                eprintln!("relay: {e}");
                return ExitCode::from(2);
            }
        },
        None => None,
    };
    let mut take = |seed: u64, s: Seeded| -> ControlFlow<ExitCode> {
        let Seeded {
            options,
            plan,
            result,
            again,
        } = s;
        let seed = if saved.is_some() { options.seed } else { seed };
        if single {
            out!("seed {seed}");
            out!("{options}");
            out!("plan: {}", plan_line(&plan));
        }
        if let Some(again) = again
            && again != (result.trace_hash, result.events)
        {
            eprintln!(
                "relay: seed {seed} is not deterministic: trace {:#018x} after {} events, then \
                 {:#018x} after {}; repro: {} --check-determinism",
                result.trace_hash,
                result.events,
                again.0,
                again.1,
                repro(seed, &args)
            );
            return ControlFlow::Break(ExitCode::from(4));
        }
        events += result.events;
        simulated += result.sim_time;
        for (k, v) in &result.counts {
            *totals.entry(k).or_default() += v;
        }
        if let Some(b) = &bar {
            b.inc(1);
            b.set_message(format!("{events} events"));
        }
        if let Some(code) = report_violation(seed, &args, &options, &plan, &result) {
            if let Some(b) = &bar {
                b.abandon();
            }
            return ControlFlow::Break(code);
        }
        if single && let Some(path) = &args.save_plan {
            if let Err(e) = save(path, &options, &plan) {
                eprintln!("relay: {e}");
                return ControlFlow::Break(ExitCode::from(2));
            }
            out!("saved the run to {}", path.display());
        }
        if single {
            out!(
                "ok: {} events, {} simulated, trace {:#018x}{}",
                result.events,
                format_duration(result.sim_time),
                result.trace_hash,
                if args.check_determinism {
                    " (same on a second run)"
                } else {
                    ""
                }
            );
        }
        ControlFlow::Continue(())
    };
    let stopped = if single {
        match take(first, args.run_one(first, saved.as_ref())) {
            ControlFlow::Break(code) => Some(code),
            ControlFlow::Continue(()) => None,
        }
    } else {
        let threads = args.threads.map_or_else(
            || std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get),
            usize::from,
        );
        sweep(&args, first, n, threads.max(1), take)
    };
    if let Some(code) = stopped {
        return code;
    }
    if let Some(b) = &bar {
        b.finish_and_clear();
    }
    let secs = started.elapsed().as_secs_f64().max(1e-9);
    out!(
        "{n} seed{} ok: {events} events, {} simulated, {:.0} events/s{}",
        if n == 1 { "" } else { "s" },
        format_duration(simulated),
        events as f64 / secs,
        if args.check_determinism {
            ", each run twice with the same trace"
        } else {
            ""
        }
    );
    out!("counts: {}", counts_line(&totals));
    ExitCode::SUCCESS
}

fn plan_line(plan: &Plan) -> String {
    let mut kinds: BTreeMap<&str, usize> = BTreeMap::new();
    for (_, f) in &plan.faults {
        *kinds.entry(f.kind()).or_default() += 1;
    }
    let faults: Vec<String> = kinds.iter().map(|(k, v)| format!("{k}×{v}")).collect();
    format!(
        "{} scheduled work items, {} faults ({})",
        plan.work.len(),
        plan.faults.len(),
        if faults.is_empty() {
            "none".to_string()
        } else {
            faults.join(", ")
        }
    )
}

fn report_violation(
    seed: u64,
    args: &Args,
    options: &Options,
    plan: &Plan,
    result: &RunResult,
) -> Option<ExitCode> {
    let v = result.violation.as_ref()?;
    let kind = match v.kind {
        Kind::Correctness => "correctness",
        Kind::Liveness => "liveness",
    };
    out!(
        "VIOLATION ({kind}) of {} at step {} (+{} simulated): {}",
        v.invariant,
        v.step,
        format_duration(v.at.saturating_sub(relay_sim::world::T0)),
        v.detail
    );
    out!("seed {seed}: {options}");
    out!("counts: {}", counts_line(&result.counts));
    let mut keep = plan.clone();
    if args.shrink {
        let small = shrink(options, plan, v.invariant);
        out!(
            "shrunk plan: {} of {} faults still break {}:",
            small.faults.len(),
            plan.faults.len(),
            v.invariant
        );
        for (at, f) in &small.faults {
            out!("  +{} {f:?}", format_duration(*at));
        }
        keep = small;
    }
    if let Some(path) = &args.save_plan {
        match save(path, options, &keep) {
            Ok(()) => out!(
                "saved the run to {}; replay: relay sim --plan {}",
                path.display(),
                path.display()
            ),
            Err(e) => eprintln!("relay: {e}"),
        }
    }
    out!("repro: {}", repro(seed, args));
    Some(ExitCode::from(match v.kind {
        Kind::Correctness => 1,
        Kind::Liveness => 3,
    }))
}

fn save(path: &std::path::Path, options: &Options, plan: &Plan) -> Result<(), String> {
    let run = SavedRun {
        options: options.clone(),
        plan: plan.clone(),
    };
    let json = serde_json::to_string_pretty(&run).map_err(|e| e.to_string())?;
    std::fs::write(path, json + "\n").map_err(|e| {
        format!(
            "cannot write {}: {e}; choose a writable path",
            path.display()
        )
    })
}

fn load(path: &std::path::Path) -> Result<SavedRun, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    serde_json::from_str(&text).map_err(|e| {
        format!(
            "{} is not a saved run ({e}); write one with `relay sim --seed N --save-plan FILE`",
            path.display()
        )
    })
}
