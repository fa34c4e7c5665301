use super::*;

#[test]
fn a_healthy_seed_finishes_without_violation() {
    let mut bad = Vec::new();
    for seed in 0..60 {
        let (_, _, r) = run_seed(seed, None);
        if let Some(v) = r.violation {
            bad.push(format!(
                "seed {seed}: {} {} ({} events)",
                v.invariant, v.detail, r.events
            ));
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

#[test]
#[ignore]
fn trace_one() {
    let seed: u64 = std::env::var("SEED").unwrap().parse().unwrap();
    let o = Options::draw(seed, None);
    let p = Plan::draw(&o);
    eprintln!("{o}\n{p:?}");
    let r = run_plan_traced(&o, &p);
    eprintln!("{:?}", r.violation);
}
