use super::*;
use crate::mcp::client::Subscriptions;
use crate::relay::OnOverlap;
use crate::testing::config::{config, rung_fixer};
use crate::testing::relay::{claimed, is_claim, our_server_capabilities, request_in, settings};
use crate::time::{HOUR, MINUTE, Mono, SECOND, read_wall_text};

fn at(s: &str) -> Wall {
    read_wall_text(s).unwrap()
}

/// `[harness.<name>]` with these extra keys.
fn harness(name: &str, keys: &str) -> Harness {
    let text = format!("[harness.{name}]\ncommand = [\"agent\"]\n{keys}");
    let c = config(&text);
    c.harnesses[name].clone()
}

fn on(name: &str, lease: &str) -> HarnessSettings {
    HarnessSettings {
        harness: name.into(),
        lease: lease.into(),
        on_overlap: OnOverlap::Skip,
        ..settings()
    }
}

/// Plain harnesses, each on its lease source, added at wall time `wall`.
fn fleet_on(members: &[(&str, &str)], wall: Wall) -> Fleet {
    let mut f = Fleet::default();
    for (name, lease) in members {
        f.add(harness(name, ""), on(name, lease), 1, 1, wall);
    }
    f
}

fn now(mono: Millis, wall: Wall) -> Now {
    Now {
        mono: Mono::from_ms(mono),
        wall,
    }
}

#[test]
fn a_schedule_fires_once_per_slot_on_the_wall_clock() {
    let t0 = at("2026-09-22T10:00:00Z");
    let mut t = Timetable::new(Some(Schedule::parse("@every 30m").unwrap()), t0 + MINUTE);
    assert_eq!(t.next(), Some(t0 + 30 * MINUTE));
    assert!(!t.due(t0 + (30 * MINUTE - 1)));
    assert!(t.due(t0 + 30 * MINUTE));
    assert_eq!(t.next(), Some(t0 + HOUR));
    // Slots missed meanwhile (a suspend, a wall clock stepped forward) fire once.
    assert!(t.due(t0 + 3 * HOUR + SECOND));
    assert!(!t.due(t0 + 3 * HOUR + 2 * SECOND));
    assert_eq!(t.next(), Some(t0 + 3 * HOUR + 30 * MINUTE));
    // A wall clock stepped back waits for the slot.
    assert!(!t.due(t0 + HOUR));
    let mut never = Timetable::new(None, t0);
    assert_eq!(never.next(), None);
    assert!(!never.due(Wall::from_ms(Millis::MAX)));
}

#[test]
fn a_reload_keeps_an_unchanged_schedule_and_restarts_a_changed_one() {
    let t0 = at("2026-09-22T10:00:00Z");
    let hourly = Schedule::parse("@hourly").unwrap();
    let mut t = Timetable::starting_at(hourly.clone(), t0 + 7);
    t.reschedule(Some(hourly), t0 + 5 * MINUTE);
    assert_eq!(t.next(), Some(t0 + 7));
    t.reschedule(
        Some(Schedule::parse("@every 10m").unwrap()),
        t0 + 5 * MINUTE,
    );
    assert_eq!(t.next(), Some(t0 + 10 * MINUTE));
    t.reschedule(None, t0);
    assert_eq!(t.next(), None);
}

#[test]
fn the_next_wake_is_the_earliest_timer_or_firing_each_on_its_own_clock() {
    let wall = at("2026-09-22T10:00:00Z");
    let mut f = Fleet::default();
    f.add(
        harness("a", "schedule = \"@every 1m\"\n"),
        on("a", "queue.ci"),
        1,
        1,
        wall,
    );
    // The monotonic reading is nothing like the wall one: each deadline is read on its own.
    assert_eq!(f.next_wake(now(5, wall + 20 * SECOND)), Some(40 * SECOND));
    assert_eq!(f.due(now(5, wall + 59 * SECOND)), []);
    assert_eq!(f.due(now(6, wall + MINUTE)), [Due::Schedule("a".into())]);
    assert_eq!(f.get("a").unwrap().next_fire(), Some(wall + 2 * MINUTE));
    // An attempt in flight sets a timer on the monotonic clock.
    let caps = our_server_capabilities();
    let relay = f.relay_mut("a").unwrap();
    relay
        .handle_input(now(10, wall + MINUTE), Input::CapabilitiesKnown(caps))
        .unwrap();
    let firing = f.firing("a", "schedule", wall + MINUTE).unwrap();
    let relay = f.relay_mut("a").unwrap();
    relay.handle_input(now(10, wall + MINUTE), firing).unwrap();
    let cmds: Vec<_> = std::iter::from_fn(|| relay.poll_command()).collect();
    let request = request_in(&cmds, is_claim).expect("a claim");
    let claim = claimed("td_1", 1, 5, Some("tok"));
    let answer = Input::ClaimAnswered { request, claim };
    relay.handle_input(now(10, wall + MINUTE), answer).unwrap();
    while relay.poll_command().is_some() {}
    let (timer, _) = relay
        .poll_timeout()
        .expect("the claim request has a deadline");
    let wake = f.next_wake(now(10, wall + MINUTE)).unwrap();
    assert_eq!(wake, timer.since(Mono::from_ms(10)).min(MINUTE));
    let due = f.due(now(timer.ms(), wall + MINUTE + 1));
    assert_eq!(due, [Due::Timer("a".into())]);
    // Stopping: no schedule fires, timers still do.
    f.stop();
    assert!(
        f.due(now(11, wall + 10 * MINUTE))
            .iter()
            .all(|d| matches!(d, Due::Timer(_)))
    );
}

#[test]
fn catch_up_is_owed_at_start_and_fires_once_when_the_source_answers() {
    let wall = at("2026-09-22T12:30:00Z");
    let mut f = Fleet::default();
    let keys = "schedule = \"@every 1h\"\ncatch_up = true\n";
    f.add(harness("a", keys), on("a", "queue.ci"), 1, 1, wall);
    f.add(
        harness("b", "schedule = \"@every 1h\"\n"),
        on("b", "queue.ci"),
        1,
        1,
        wall,
    );
    assert!(f.catches_up("a"));
    assert!(!f.catches_up("b"));
    let last = Some(at("2026-09-22T10:00:00Z"));
    assert_eq!(
        f.owe_catch_up("a", last, wall),
        Some(at("2026-09-22T11:00:00Z"))
    );
    assert_eq!(f.owe_catch_up("b", last, wall), None);
    assert!(f.take_catch_up("a"));
    assert!(!f.take_catch_up("a"));
    assert!(!f.take_catch_up("b"));
    // A stopping daemon fires no catch_up.
    f.owe_catch_up("a", last, wall);
    f.stop();
    assert!(!f.take_catch_up("a"));
}

#[test]
fn harnesses_bind_to_the_source_their_settings_name() {
    let wall = at("2026-09-22T10:00:00Z");
    let mut f = fleet_on(
        &[("a", "queue.ci"), ("b", "queue.ops"), ("c", "queue.ci")],
        wall,
    );
    assert_eq!(f.bound_sources(), ["queue.ci", "queue.ops"]);
    assert_eq!(f.harnesses_on("queue.ci"), ["a", "c"]);
    assert_eq!(
        f.settle("b"),
        Settled::Idle {
            lease: "queue.ops".into()
        }
    );
    // A removed harness binds nothing, fires nothing, and leaves once idle.
    assert_eq!(f.reload("b", None, wall), None);
    assert!(!f.running("b"));
    assert_eq!(f.firing("b", "manual", wall), None);
    assert_eq!(f.bound_sources(), ["queue.ci"]);
    assert_eq!(f.harnesses_on("queue.ops"), ["b"]);
    assert_eq!(f.settle("b"), Settled::Gone);
    assert!(!f.contains("b"));
    assert_eq!(f.settle("b"), Settled::Busy);
    assert!(f.stopped() == f.stopping());
}

fn names(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

#[test]
fn a_reload_stops_a_removed_harness_or_one_on_a_removed_source() {
    let wall = at("2026-09-22T10:00:00Z");
    let mut f = fleet_on(&[("a", "queue.ci"), ("b", "queue.ops")], wall);
    let mut diff = ConfigDiff::default();
    let plan = f.plan_reload(&names(&["a", "b"]), &diff);
    assert_eq!(plan.stop, Vec::<String>::new());
    assert_eq!(plan.keep, ["a", "b"]);
    // Without settings in the new config (removed, disabled, or leasing nothing): it stops
    // and leaves.
    let plan = f.plan_reload(&names(&["b"]), &diff);
    assert_eq!(
        (plan.stop, plan.remove, plan.keep),
        (names(&["a"]), names(&["a"]), names(&["b"]))
    );
    // Its source removed: the attempt stops, the harness stays with its new settings.
    diff.queues.removed.push("queue.ops".into());
    let plan = f.plan_reload(&names(&["a", "b"]), &diff);
    assert_eq!(plan.close, ["queue.ops"]);
    assert_eq!(plan.stop, ["b"]);
    assert_eq!(plan.keep, ["a", "b"]);
    assert!(plan.remove.is_empty());
    // Kept: new settings and a new schedule.
    let moved = on("a", "queue.ops");
    let h = harness("a", "schedule = \"@every 10m\"\n");
    let applied = f.reload("a", Some((moved, Some(h))), wall + MINUTE);
    assert_eq!(applied, Some(Reconfigured::Now));
    assert_eq!(f.get("a").unwrap().next_fire(), Some(wall + 10 * MINUTE));
    assert_eq!(f.harnesses_on("queue.ops"), ["a", "b"]);
}

#[test]
fn a_reload_opens_added_and_changed_sources_and_starts_added_harnesses() {
    let wall = at("2026-09-22T10:00:00Z");
    let f = fleet_on(
        &[("a", "queue.ci"), ("b", "queue.ops"), ("c", "queue.ci")],
        wall,
    );
    let mut diff = ConfigDiff::default();
    diff.queues.added.push("queue.new".into());
    diff.queues.changed.push("queue.ci".into());
    diff.new_sessions.push("queue.ci".into());
    let plan = f.plan_reload(&names(&["a", "b", "c", "d"]), &diff);
    assert_eq!(plan.open, ["queue.new", "queue.ci"]);
    // The harnesses on a source whose session changed hear it expire; nothing stops.
    assert_eq!(plan.expire, ["a", "c"]);
    assert!(plan.stop.is_empty() && plan.close.is_empty() && plan.remove.is_empty());
    assert_eq!(plan.add, ["d"]);
    assert_eq!(plan.keep, ["a", "b", "c"]);
}

#[test]
fn an_attempt_in_flight_keeps_its_settings_until_it_settles() {
    let wall = at("2026-09-22T10:00:00Z");
    let mut f = fleet_on(&[("a", "queue.ci")], wall);
    let caps = our_server_capabilities();
    let relay = f.relay_mut("a").unwrap();
    relay
        .handle_input(now(10, wall), Input::CapabilitiesKnown(caps))
        .unwrap();
    let firing = f.firing("a", "manual", wall).unwrap();
    let relay = f.relay_mut("a").unwrap();
    relay.handle_input(now(10, wall), firing).unwrap();
    while relay.poll_command().is_some() {}
    assert_eq!(f.settle("a"), Settled::Busy);
    let plan = f.plan_reload(&names(&["a"]), &ConfigDiff::default());
    assert_eq!(plan.keep, ["a"]);
    let slower = HarnessSettings {
        heartbeat_interval: on("a", "queue.ci").heartbeat_interval * 2,
        ..on("a", "queue.ci")
    };
    let applied = f.reload("a", Some((slower.clone(), None)), wall);
    assert!(
        matches!(applied, Some(Reconfigured::AfterRun { .. })),
        "{applied:?}"
    );
    assert_ne!(f.get("a").unwrap().relay().settings(), &slower);
}

#[test]
fn a_harness_between_attempts_follows_its_source() {
    assert_eq!(rebind(("queue.ci", 1), ("queue.ci", 1)), Rebind::Stay);
    assert_eq!(rebind(("queue.ci", 1), ("queue.ci", 2)), Rebind::Client);
    assert_eq!(rebind(("queue.ci", 1), ("queue.ops", 3)), Rebind::Moved);
    let wall = at("2026-09-22T10:00:00Z");
    let f = fleet_on(&[("a", "queue.ci"), ("b", "queue.ops")], wall);
    assert_eq!(f.to_initialize(|s| s == "queue.ops"), ["queue.ops"]);
    assert_eq!(f.to_initialize(|_| true), ["queue.ci", "queue.ops"]);
}

#[test]
fn doorbells_listen_on_the_enabled_channels_of_running_harnesses() {
    // `fixer` rung by bell; `quiet` by a disabled channel; gong rings nobody.
    let url = "http://127.0.0.1:1/mcp";
    let quiet = r#"
[channel.gong]
url = "http://127.0.0.1:1/mcp"
[channel.off]
url = "http://127.0.0.1:1/mcp"
enabled = false
[harness.quiet]
command = ["agent"]
triggers = ["channel.off"]
lease = "queue.ci"
"#;
    let config = config(&(rung_fixer(url, url) + quiet));
    let wall = at("2026-09-22T10:00:00Z");
    let mut f = Fleet::default();
    for name in ["fixer", "quiet"] {
        let h = config.harnesses[name].clone();
        f.add(h, on(name, "queue.ci"), 1, 1, wall);
    }
    let wanted = f.doorbells(&config);
    assert_eq!(wanted.keys().collect::<Vec<_>>(), ["bell"]);
    let ci = Subscriptions::Queues(["ci-failures".to_string()].into());
    assert_eq!(wanted["bell"], ci);
    // Nothing listens yet: bell starts.
    let none = BTreeMap::new();
    let (stop, start) = doorbell_changes(&none, wanted.clone(), &ConfigDiff::default());
    assert!(stop.is_empty());
    assert_eq!(start, [("bell".to_string(), ci.clone())]);
    // Listening on bell (as wanted) and gong (no longer): gong stops, bell stays.
    let listening: BTreeMap<_, _> = [
        ("bell".to_string(), ci.clone()),
        ("gong".into(), ci.clone()),
    ]
    .into();
    let (stop, start) = doorbell_changes(&listening, wanted.clone(), &ConfigDiff::default());
    assert_eq!((stop, start), (names(&["gong"]), vec![]));
    // A changed channel, or changed subscriptions, restarts its listener.
    let mut diff = ConfigDiff::default();
    diff.channels.changed.push("channel.bell".into());
    let (stop, start) = doorbell_changes(&listening, wanted.clone(), &diff);
    assert_eq!(stop, ["bell", "gong"]);
    assert_eq!(start, [("bell".to_string(), ci.clone())]);
    let granted: BTreeMap<_, _> = [("bell".to_string(), Subscriptions::Granted)].into();
    let (stop, start) = doorbell_changes(&granted, wanted, &ConfigDiff::default());
    assert_eq!(
        (stop, start),
        (names(&["bell"]), vec![("bell".to_string(), ci)])
    );
    // A removed harness rings nothing: no listener is wanted (quiet's channel is off).
    f.reload("fixer", None, wall);
    assert!(f.doorbells(&config).is_empty());
}

#[test]
fn a_channel_rings_the_running_harnesses_it_triggers() {
    let wall = at("2026-09-22T10:00:00Z");
    let mut f = Fleet::default();
    let mut a = harness("a", "");
    a.triggers = vec!["bell".into()];
    let mut b = harness("b", "");
    b.triggers = vec!["bell".into(), "gong".into()];
    f.add(a, on("a", "queue.ci"), 1, 1, wall);
    f.add(b, on("b", "queue.ci"), 1, 1, wall);
    assert_eq!(f.rung("bell"), ["a", "b"]);
    assert_eq!(f.rung("gong"), ["b"]);
    f.reload("a", None, wall);
    assert_eq!(f.rung("bell"), ["b"]);
}

#[test]
fn a_channel_hears_the_queues_its_harnesses_claim_from() {
    let text = rung_fixer("http://127.0.0.1:1/mcp/a", "http://127.0.0.1:1/mcp/a");
    let fixer = config(&text);
    assert_eq!(
        channel_subscriptions(&fixer, "bell"),
        Subscriptions::Queues(BTreeSet::from(["ci-failures".to_string()]))
    );
    let sweeper = "[harness.sweeper]\ncommand = [\"true\"]\ntriggers = [\"channel.bell\"]\nlease = \"queue.all\"\n";
    let both = config(&format!("{text}{sweeper}"));
    assert_eq!(channel_subscriptions(&both, "bell"), Subscriptions::Granted);
    assert_eq!(
        channel_subscriptions(&fixer, "nobody"),
        Subscriptions::Granted
    );
}
