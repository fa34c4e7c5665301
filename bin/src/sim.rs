//! `relay sim`: run the deterministic simulator over one seed or a sweep of seeds.
//!
//! Exit status: 0 when every run held every invariant; 1 on a correctness violation; 3 on a
//! liveness violation; 4 when `--check-determinism` saw one seed run two ways; 2 on bad usage.

use std::collections::BTreeMap;
use std::process::ExitCode;
use std::time::Instant;

use relay_core::config::format_duration;
use relay_sim::{
    Kind, Mutation, Options, Plan, RunResult, SavedRun, run_plan, run_plan_traced, shrink,
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
    /// server-skips-fence, report-after-deadline or reaper-closes-twice.
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
    #[arg(long, value_name = "FILE", conflicts_with_all = ["seed", "seeds", "mutation"])]
    plan: Option<std::path::PathBuf>,
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

#[allow(clippy::print_stdout)]
pub fn run(args: Args) -> ExitCode {
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
    for seed in first..first.saturating_add(n) {
        let (options, plan) = match &saved {
            Some(s) => (s.options.clone(), s.plan.clone()),
            None => {
                let options = Options::draw(seed, args.mutation);
                let plan = Plan::draw(&options);
                (options, plan)
            }
        };
        let seed = options.seed;
        if single {
            println!("seed {seed}");
            println!("{options}");
            println!("plan: {}", plan_line(&plan));
        }
        let result = if args.trace {
            run_plan_traced(&options, &plan)
        } else {
            run_plan(&options, &plan)
        };
        if args.check_determinism {
            let again = run_plan(&options, &plan);
            if (again.trace_hash, again.events) != (result.trace_hash, result.events) {
                eprintln!(
                    "relay: seed {seed} is not deterministic: trace {:#018x} after {} events, then \
                     {:#018x} after {}; repro: {} --check-determinism",
                    result.trace_hash,
                    result.events,
                    again.trace_hash,
                    again.events,
                    repro(seed, &args)
                );
                return ExitCode::from(4);
            }
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
            return code;
        }
        if single && let Some(path) = &args.save_plan {
            if let Err(e) = save(path, &options, &plan) {
                eprintln!("relay: {e}");
                return ExitCode::from(2);
            }
            println!("saved the run to {}", path.display());
        }
        if single {
            println!(
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
    }
    if let Some(b) = &bar {
        b.finish_and_clear();
    }
    let secs = started.elapsed().as_secs_f64().max(1e-9);
    println!(
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
    println!("counts: {}", counts_line(&totals));
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

#[allow(clippy::print_stdout)]
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
    println!(
        "VIOLATION ({kind}) of {} at step {} (+{} simulated): {}",
        v.invariant,
        v.step,
        format_duration(v.at.saturating_sub(relay_sim::world::T0)),
        v.detail
    );
    println!("seed {seed}: {options}");
    println!("counts: {}", counts_line(&result.counts));
    let mut keep = plan.clone();
    if args.shrink {
        let small = shrink(options, plan, v.invariant);
        println!(
            "shrunk plan: {} of {} faults still break {}:",
            small.faults.len(),
            plan.faults.len(),
            v.invariant
        );
        for (at, f) in &small.faults {
            println!("  +{} {f:?}", format_duration(*at));
        }
        keep = small;
    }
    if let Some(path) = &args.save_plan {
        match save(path, options, &keep) {
            Ok(()) => println!(
                "saved the run to {}; replay: relay sim --plan {}",
                path.display(),
                path.display()
            ),
            Err(e) => eprintln!("relay: {e}"),
        }
    }
    println!("repro: {}", repro(seed, args));
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
