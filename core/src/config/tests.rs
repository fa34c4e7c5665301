use super::parse::TableKind;
use super::*;
use proptest::prelude::*;

const SB_URL: &str = "https://switchboard.example.com/mcp/ci-fixer";

fn global(text: &str) -> Result<Config, ConfigErrors> {
    parse(
        &ConfigFile::new("harness.toml", text),
        &[],
        FileKind::Global,
    )
}

fn project(text: &str) -> Result<Config, ConfigErrors> {
    parse(
        &ConfigFile::new("proj/harness.toml", text),
        &[],
        FileKind::Project,
    )
}

/// The errors of a config that must fail, as display lines.
fn fails(result: Result<Config, ConfigErrors>) -> Vec<String> {
    let errors = result.expect_err("config should fail to parse");
    errors.0.iter().map(ToString::to_string).collect()
}

/// The single error of a config that must fail with exactly one.
fn one_error(result: Result<Config, ConfigErrors>) -> ConfigError {
    let errors = result.expect_err("config should fail to parse");
    assert_eq!(errors.0.len(), 1, "expected one error, got:\n{errors}");
    errors.0[0].clone()
}

const QUEUE_CI: &str = r#"
[queue.ci]
url = "https://switchboard.example.com/mcp/ci-fixer"
"#;

// --- lease source tables ---------------------------------------------------------------------

#[test]
fn lease_source_beside_its_channel() {
    let text = format!(
        "[channel.sb]\nurl = \"{SB_URL}\"\n\n[queue.sb]\nurl = \"{SB_URL}\"\n\n\
         [harness.fixer]\ncommand = [\"agent\"]\ntriggers = [\"channel.sb\"]\nlease = \"queue.sb\"\n"
    );
    let config = global(&text).unwrap();
    assert_eq!(config.channels["sb"].address.url.as_str(), SB_URL);
    assert_eq!(config.queues["sb"].address.url.as_str(), SB_URL);
    assert_eq!(config.queues["sb"].lease_ttl, 5 * MINUTE);
    assert_eq!(config.queues["sb"].heartbeat_interval, 100 * SECOND);
    let h = &config.harnesses["fixer"];
    assert_eq!(h.triggers, vec!["sb".to_string()]);
    assert_eq!(
        h.relay.as_ref().unwrap().lease_ref().to_string(),
        "queue.sb"
    );
}

#[test]
fn heartbeat_slower_than_half_the_lease() {
    let e = one_error(global(&format!(
        "{QUEUE_CI}lease_ttl = \"5m\"\nheartbeat_interval = \"4m\"\n"
    )));
    assert_eq!(e.table.as_deref(), Some("queue.ci"));
    assert_eq!(
        e.to_string(),
        "harness.toml: [queue.ci] heartbeat_interval = \"4m\" must be at most lease_ttl / 2 \
         (2m30s): lower heartbeat_interval or raise lease_ttl"
    );
    // Exactly half is allowed.
    global(&format!(
        "{QUEUE_CI}lease_ttl = \"5m\"\nheartbeat_interval = \"2m30s\"\n"
    ))
    .unwrap();
    // Against the default lease_ttl the message says where 5m came from.
    let e = one_error(global(&format!("{QUEUE_CI}heartbeat_interval = \"3m\"\n")));
    assert!(e.message.contains("lease_ttl defaults to 5m"), "{e}");
}

#[test]
fn lease_source_in_a_project_file() {
    let e = one_error(project(QUEUE_CI));
    let shown = e.to_string();
    assert_eq!(e.table.as_deref(), Some("queue.ci"));
    assert!(
        shown.starts_with("proj/harness.toml: [queue.ci]"),
        "{shown}"
    );
    assert!(shown.contains("global harness.toml"), "{shown}");
    let e = one_error(project(
        "[cairn.main]\nurl = \"https://cairn.example.com\"\n",
    ));
    assert!(e.to_string().contains("global harness.toml"), "{e}");
}

#[test]
fn lease_ttl_bounds_and_defaults() {
    for bad in ["30s", "2h", "0s"] {
        let e = one_error(global(&format!("{QUEUE_CI}lease_ttl = \"{bad}\"\n")));
        assert_eq!(e.key.as_deref(), Some("lease_ttl"), "{e}");
    }
    let c = global(&format!(
        "{QUEUE_CI}lease_ttl = \"1h\"\nqueue = \"ci-failures\"\n"
    ))
    .unwrap();
    let q = &c.queues["ci"];
    assert_eq!((q.lease_ttl, q.heartbeat_interval), (HOUR, 20 * MINUTE));
    assert_eq!(q.queue.as_deref(), Some("ci-failures"));
    assert!(q.enabled);
}

// --- the lease key and its exclusions --------------------------------------------------------

#[test]
fn lease_on_a_resident_harness() {
    let e = one_error(global(&format!(
        "{QUEUE_CI}\n[harness.fixer]\ncommand = [\"agent\"]\nlease = \"queue.ci\"\nenabled = true\n"
    )));
    assert_eq!(e.table.as_deref(), Some("harness.fixer"));
    assert_eq!(e.key.as_deref(), Some("lease"));
    assert!(e.message.contains("requires a triggered harness"), "{e}");
}

#[test]
fn check_without_a_lease() {
    let e = one_error(global(
        "[harness.fixer]\ncommand = [\"agent\"]\nschedule = \"@every 30m\"\n\
         success_check = [\"./check.sh\"]\n",
    ));
    assert_eq!(e.table.as_deref(), Some("harness.fixer"));
    assert_eq!(e.key.as_deref(), Some("success_check"));
    assert!(
        e.message.starts_with("success_check ") && e.message.contains("lease"),
        "{e}"
    );
}

#[test]
fn every_relay_key_without_a_lease_is_named() {
    let errs = fails(global(
        "[cairn.main]\nurl = \"https://cairn.example.com\"\n\
         [harness.fixer]\ncommand = [\"agent\"]\nschedule = \"@hourly\"\n\
         success_check_timeout = \"5m\"\nsuccess_check_interval = \"10s\"\n\
         success_check_before = false\nattempt_receipt = \"cairn.main\"\n",
    ));
    assert_eq!(errs.len(), 4, "{errs:#?}");
    for key in [
        "success_check_timeout",
        "success_check_interval",
        "success_check_before",
        "attempt_receipt",
    ] {
        assert!(
            errs.iter().any(|e| e.contains(&format!("] {key} "))),
            "{key}: {errs:#?}"
        );
    }
}

#[test]
fn lease_naming_an_undeclared_queue() {
    let e = one_error(global(&format!(
        "{QUEUE_CI}\n[harness.fixer]\ncommand = [\"agent\"]\nschedule = \"@hourly\"\nlease = \"queue.cj\"\n"
    )));
    assert_eq!(e.key.as_deref(), Some("lease"));
    assert!(
        e.message.contains("queue.cj") && e.message.contains("declared: queue.ci"),
        "{e}"
    );
    let e = one_error(global(&format!(
        "{QUEUE_CI}\n[harness.fixer]\ncommand = [\"agent\"]\nschedule = \"@hourly\"\nlease = \"ci\"\n"
    )));
    assert!(e.message.contains("\"queue.<name>\""), "{e}");
}

#[test]
fn lease_in_a_project_file() {
    let e = one_error(project(
        "[channel.sb]\nurl = \"https://sb.example.com/mcp/x\"\n\
         [harness.fixer]\ncommand = [\"agent\"]\ntriggers = [\"channel.sb\"]\nlease = \"queue.ci\"\n",
    ));
    assert_eq!(
        (e.table.as_deref(), e.key.as_deref()),
        (Some("harness.fixer"), Some("lease"))
    );
    assert!(e.message.contains("project harness.toml"), "{e}");
}

#[test]
fn attempt_receipt_naming_an_undeclared_cairn() {
    let e = one_error(global(&format!(
        "{QUEUE_CI}\n[harness.fixer]\ncommand = [\"agent\"]\nschedule = \"@hourly\"\n\
         lease = \"queue.ci\"\nattempt_receipt = \"cairn.main\"\n"
    )));
    assert_eq!(e.key.as_deref(), Some("attempt_receipt"));
    assert!(e.message.contains("no [cairn.*] table is declared"), "{e}");
}

// --- success check keys ----------------------------------------------------------------------

fn leased(extra: &str) -> String {
    format!(
        "{QUEUE_CI}\n[harness.fixer]\ncommand = [\"agent\"]\nschedule = \"@hourly\"\n\
         lease = \"queue.ci\"\n{extra}"
    )
}

#[test]
fn empty_argv() {
    let e = one_error(global(&leased("success_check = []\n")));
    assert_eq!(
        (e.table.as_deref(), e.key.as_deref()),
        (Some("harness.fixer"), Some("success_check"))
    );
    assert!(e.message.starts_with("success_check = [] is empty"), "{e}");
    let e = one_error(global("[harness.x]\ncommand = []\n"));
    assert_eq!(e.key.as_deref(), Some("command"));
}

#[test]
fn success_check_defaults_and_rules() {
    let c = global(&leased("success_check = [\"./check.sh\", \"--strict\"]\n")).unwrap();
    let relay = c.harnesses["fixer"].relay.clone().unwrap();
    assert_eq!(relay.success_check_timeout, 10 * MINUTE);
    assert_eq!(relay.success_check_interval, 30 * SECOND);
    assert!(!relay.success_check_before);
    assert_eq!(relay.attempt_receipt, None);

    for (arg, shown) in [
        ("${TOKEN}", "${TOKEN}"),
        ("--todo={todo_id}", "{todo_id}"),
        ("{}", "{}"),
    ] {
        let e = one_error(global(&leased(&format!(
            "success_check = [\"./c.sh\", \"{arg}\"]\n"
        ))));
        assert_eq!(e.key.as_deref(), Some("success_check[1]"), "{e}");
        assert!(e.message.contains(shown), "{e}");
    }
    // Braces that are not a placeholder (JSON) are fine.
    global(&leased("success_check = [\"./c.sh\", '{\"a\": 1}']\n")).unwrap();

    let e = one_error(global(&leased(
        "success_check = [\"c\"]\nsuccess_check_timeout = \"1m\"\nsuccess_check_interval = \"1m\"\n",
    )));
    assert_eq!(e.key.as_deref(), Some("success_check_interval"));
    assert!(e.message.contains("success_check_timeout = \"1m\""), "{e}");
    let e = one_error(global(&leased(
        "success_check = [\"c\"]\nsuccess_check_timeout = \"20s\"\n",
    )));
    assert!(
        e.message.contains("success_check_interval (default 30s)"),
        "{e}"
    );
    let e = one_error(global(&leased("success_check_before = true\n")));
    assert_eq!(e.key.as_deref(), Some("success_check_before"));
    let e = one_error(global(&leased(
        "success_check = [\"c\"]\nsuccess_check_timeout = \"0s\"\n",
    )));
    assert!(e.message.contains("more than zero"), "{e}");
}

// --- Structure -------------------------------------------------------------------------------

#[test]
fn duplicates_across_dropins() {
    let main = ConfigFile::new("harness.toml", QUEUE_CI);
    let a = ConfigFile::new(
        "harness.d/10-a.toml",
        "[channel.sb]\nurl = \"https://sb.example.com/mcp\"\n",
    );
    let b = ConfigFile::new("harness.d/20-b.toml", QUEUE_CI);
    let c = ConfigFile::new(
        "harness.d/30-c.toml",
        "[channel.sb]\nurl = \"https://sb.example.com/mcp\"\n",
    );
    let errors = parse(&main, &[a, b, c], FileKind::Global).unwrap_err();
    let shown: Vec<String> = errors.0.iter().map(ToString::to_string).collect();
    assert_eq!(shown.len(), 2, "{shown:#?}");
    assert!(
        shown.contains(
            &"harness.d/20-b.toml: [queue.ci] is declared in both harness.toml and \
        harness.d/20-b.toml: a name may be declared once across the main file and its drop-ins; \
        remove or rename one"
                .to_string()
        ),
        "{shown:#?}"
    );
    assert!(
        shown.iter().any(|s| s.contains("[channel.sb]")
            && s.contains("10-a.toml")
            && s.contains("30-c.toml"))
    );
    // The same name under different kinds is no conflict.
    let ok = ConfigFile::new(
        "harness.d/10-a.toml",
        "[channel.ci]\nurl = \"https://sb.example.com/mcp\"\n",
    );
    parse(&main, &[ok], FileKind::Global).unwrap();
}

#[test]
fn unknown_key() {
    let e = one_error(global(&format!("{QUEUE_CI}heartbeat_intervall = \"1m\"\n")));
    assert_eq!(
        e.to_string(),
        "harness.toml: [queue.ci] heartbeat_intervall is not a key of [queue.ci]: did you mean \
         heartbeat_interval?"
    );
    let e = one_error(global(
        "[harness.x]\ncommand = [\"a\"]\nharness = \"claude-code\"\n",
    ));
    assert!(e.message.contains("command"), "{e}");
    let e = one_error(global("[harness.x]\ncommand = [\"a\"]\nzzz = 1\n"));
    assert!(
        e.message.contains("zzz is not a key") && e.message.contains("keep_runs"),
        "{e}"
    );
    let e = one_error(global("[harnes.x]\ncommand = [\"a\"]\n"));
    assert!(e.message.contains("did you mean [harness.<name>]"), "{e}");
    let e = one_error(global("url = \"https://x.example.com\"\n"));
    assert!(e.message.contains("outside any table"), "{e}");
    let e = one_error(global("[queue]\nurl = \"https://x.example.com\"\n"));
    assert!(e.message.contains("[queue.<name>]"), "{e}");
    let e = one_error(global("[[queue.ci]]\nurl = \"https://x.example.com\"\n"));
    assert!(e.message.contains("not [[queue.ci]]"), "{e}");
}

#[test]
fn invalid_names() {
    for name in ["\"bad name\"", "_x", "-x", &"a".repeat(65)] {
        let e = one_error(global(&format!(
            "[channel.{name}]\nurl = \"https://x.example.com\"\n"
        )));
        assert!(e.message.contains("invalid name"), "{e}");
    }
    global(&format!(
        "[channel.{}]\nurl = \"https://x.example.com\"\n",
        "A_-9".repeat(16)
    ))
    .unwrap();
}

#[test]
fn malformed_toml_says_so_without_the_line() {
    let e = one_error(global(
        "[queue.ci]\nurl = \"https://x\"\nheaders = { Authorization = \"Bearer s3cret }\n",
    ));
    assert!(
        e.message.contains("not valid TOML") && e.message.contains("line 3"),
        "{e}"
    );
    assert!(!e.to_string().contains("s3cret"), "{e}");
}

#[test]
fn type_errors_and_missing_keys_are_all_collected() {
    let errs = fails(global(
        "[queue.a]\nenabled = \"yes\"\n\
         [channel.b]\nurl = 5\n\
         [harness.c]\nkeep_runs = 0\non_overlap = \"wait\"\ntimeout = 30\ntriggers = \"channel.b\"\n",
    ));
    let expect = [
        "[queue.a] url is missing",
        "[queue.a] enabled must be true or false, not a string",
        "[channel.b] url must be a string, not an integer",
        "[harness.c] command is missing",
        "[harness.c] keep_runs = 0 must be between 1 and 10000",
        "[harness.c] on_overlap = \"wait\" must be \"skip\" or \"queue\"",
        "[harness.c] timeout must be a duration string such as \"5m\", not an integer",
        "[harness.c] triggers must be an array of strings",
    ];
    for want in expect {
        assert!(
            errs.iter().any(|e| e.contains(want)),
            "missing {want:?} in {errs:#?}"
        );
    }
    assert_eq!(errs.len(), expect.len(), "{errs:#?}");
}

#[test]
fn harness_keys_and_defaults() {
    let c = global(
        "[channel.sb]\nurl = \"http://localhost:7777/mcp/x\"\n\
         [harness.x]\ncommand = [\"agent\", \"-p\"]\ntriggers = [\"channel.sb\"]\n\
         operating_hours = \"mon-fri 09:00-18:00\"\non_overlap = \"queue\"\ncatch_up = true\n\
         schedule = \"@hourly\"\n",
    )
    .unwrap();
    let h = &c.harnesses["x"];
    assert_eq!(h.command, vec!["agent", "-p"]);
    assert_eq!(
        (h.on_overlap, h.catch_up, h.enabled),
        (OnOverlap::Queue, true, true)
    );
    assert_eq!(
        (h.keep_runs, h.kill_grace, h.timeout),
        (DEFAULT_KEEP_RUNS, 10 * SECOND, None)
    );
    assert!(h.operating_hours.is_some() && h.schedule.is_some() && h.relay.is_none());

    let errs = fails(global(
        "[harness.x]\ncommand = [\"a\"]\ntriggers = [\"channel.nope\", \"webhook.x\"]\n\
         schedule = \"0 25 * * *\"\noperating_hours = [\"mon-fri 09:00-18:00\", \"sat 9-5\"]\n",
    ));
    assert!(
        errs.iter()
            .any(|e| e.contains("triggers[0] = \"channel.nope\" names no declared")),
        "{errs:#?}"
    );
    assert!(
        errs.iter()
            .any(|e| e.contains("triggers[1] = \"webhook.x\" must name")),
        "{errs:#?}"
    );
    assert!(
        errs.iter()
            .any(|e| e.contains("schedule = \"0 25 * * *\"") && e.contains("hour")),
        "{errs:#?}"
    );
    assert!(
        errs.iter()
            .any(|e| e.contains("operating_hours[1] = \"sat 9-5\"")),
        "{errs:#?}"
    );
}

// --- URLs ------------------------------------------------------------------------------------

#[test]
fn userinfo_and_http_url_rejection() {
    let e = one_error(global(
        "[queue.ci]\nurl = \"https://bob:hunter2@sb.example.com/mcp\"\n",
    ));
    assert_eq!(e.key.as_deref(), Some("url"));
    assert!(
        e.message.contains("userinfo") && !e.to_string().contains("hunter2"),
        "{e}"
    );
    let e = one_error(global("[cairn.main]\nurl = \"http://cairn.example.com\"\n"));
    assert!(e.message.contains("use https"), "{e}");
    let e = one_error(global("[channel.sb]\nurl = \"http://10.0.0.1/mcp\"\n"));
    assert_eq!(e.key.as_deref(), Some("url"));
}

#[test]
fn http_on_loopback_accepted() {
    let c = global(
        "[queue.a]\nurl = \"http://127.0.0.1:8080/mcp/a\"\n\
         [cairn.b]\nurl = \"http://localhost:9000\"\n\
         [channel.c]\nurl = \"http://[::1]:8080/mcp/a\"\n",
    )
    .unwrap();
    assert_eq!(c.queues["a"].address.url.port, Some(8080));
    assert!(c.channels["c"].address.url.is_loopback());
}

// --- Credentials -----------------------------------------------------------------------------

const SECRET: &str = "sbt_9f8e7d6c5b4a";
const CAIRN_SECRET: &str = "cairn-abcdef123456";

fn creds_config() -> Config {
    global(
        "[queue.ci]\nurl = \"https://sb.example.com/mcp/ci\"\nenv_file = \"~/env/ci.env\"\n\
         headers = { Authorization = \"Bearer ${SB_TOKEN}\", X-Static = \"static-value\" }\n\
         [cairn.main]\nurl = \"https://cairn.example.com\"\nenv_file = \"~/env/cairn.env\"\n\
         headers = { Authorization = \"Bearer ${CAIRN_TOKEN}\" }\n\
         [harness.x]\ncommand = [\"a\"]\nenv_file = \"~/env/agent.env\"\n",
    )
    .unwrap()
}

fn env_map(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

#[test]
fn header_references_resolve_from_their_own_env_file() {
    let config = creds_config();
    assert_eq!(
        config.env_files().into_iter().collect::<Vec<_>>(),
        vec!["~/env/agent.env", "~/env/cairn.env", "~/env/ci.env"]
    );
    let files = env_map(&[
        (
            "~/env/ci.env",
            &format!("# switchboard\nexport SB_TOKEN=\"{SECRET}\"\n"),
        ),
        ("~/env/cairn.env", &format!("CAIRN_TOKEN={CAIRN_SECRET}\n")),
        ("~/env/agent.env", "GH_TOKEN=ghp_agentvalue\n"),
    ]);
    let resolved = resolve(&config, &files).unwrap();
    let ci = SourceRef {
        kind: SourceKind::Queue,
        name: "ci".into(),
    };
    let headers = resolved.headers(&ci).unwrap();
    assert_eq!(
        headers["Authorization"].expose(),
        format!("Bearer {SECRET}")
    );
    assert_eq!(headers["X-Static"].expose(), "static-value");
    assert_eq!(
        resolved
            .env_file("~/env/agent.env")
            .unwrap()
            .get("GH_TOKEN"),
        Some("ghp_agentvalue")
    );
    let secrets = resolved.secret_values();
    for want in [
        format!("Bearer {SECRET}"),
        format!("Bearer {CAIRN_SECRET}"),
        SECRET.to_string(),
        CAIRN_SECRET.to_string(),
        "ghp_agentvalue".to_string(),
        "static-value".to_string(),
    ] {
        assert!(
            secrets.contains(&want.as_str()),
            "{want} missing from secret_values"
        );
    }
    assert!(
        secrets.windows(2).all(|w| w[0].len() >= w[1].len()),
        "longest first"
    );
    let debug = format!("{resolved:?}");
    for s in &secrets {
        assert!(!debug.contains(s), "Debug shows a secret: {debug}");
    }
}

#[test]
fn reference_without_an_env_file() {
    let e = one_error(global(
        "[queue.ci]\nurl = \"https://sb.example.com/mcp\"\nheaders = { Authorization = \"Bearer ${SB_TOKEN}\" }\n",
    ));
    assert_eq!(
        (e.table.as_deref(), e.key.as_deref()),
        (Some("queue.ci"), Some("headers.Authorization"))
    );
    assert!(
        e.message.contains("no env_file") && e.message.contains("SB_TOKEN"),
        "{e}"
    );
}

#[test]
fn resolution_errors_name_source_header_and_variable_never_a_value() {
    let config = creds_config();
    let files = env_map(&[
        (
            "~/env/ci.env",
            &format!("OTHER={SECRET}\nSB_TOKN={SECRET}\n"),
        ),
        (
            "~/env/cairn.env",
            &format!("CAIRN_TOKEN={CAIRN_SECRET}\nthis line {SECRET} is broken\n"),
        ),
    ]);
    let errors = resolve(&config, &files).unwrap_err();
    let shown: Vec<String> = errors.0.iter().map(ToString::to_string).collect();
    assert_eq!(shown.len(), 3, "{shown:#?}");
    assert!(
        shown.contains(
            &"harness.toml: [queue.ci] headers.Authorization refers to ${SB_TOKEN}, \
        which env_file \"~/env/ci.env\" does not set: add a SB_TOKEN=… line to that file"
                .to_string()
        ),
        "{shown:#?}"
    );
    assert!(
        shown
            .iter()
            .any(|s| s.contains("[cairn.main] env_file = \"~/env/cairn.env\": line 2")),
        "{shown:#?}"
    );
    assert!(
        shown
            .iter()
            .any(|s| s.contains("[harness.x] env_file = \"~/env/agent.env\" was not read")),
        "{shown:#?}"
    );
    for s in &shown {
        assert!(
            !s.contains(SECRET) && !s.contains(CAIRN_SECRET),
            "secret in error: {s}"
        );
    }
    assert!(!format!("{errors:?}").contains(SECRET));
}

#[test]
fn bad_header_templates_are_parse_errors() {
    let errs = fails(global(
        "[queue.ci]\nurl = \"https://sb.example.com/mcp\"\nenv_file = \"e\"\n\
         headers = { Authorization = \"Bearer ${SB_TOKEN\", \"Bad Name\" = \"x\", X-N = 5 }\n",
    ));
    assert_eq!(errs.len(), 3, "{errs:#?}");
    assert!(
        errs.iter()
            .any(|e| e.contains("headers.Authorization has a ${ without"))
    );
    assert!(
        errs.iter()
            .any(|e| e.contains("headers.\"Bad Name\" is not a valid header name"))
    );
    assert!(
        errs.iter()
            .any(|e| e.contains("headers.X-N must be a string"))
    );
}

// --- The example -----------------------------------------------------------------------------

#[test]
fn example_config_parses_and_resolves() {
    let config = global(include_str!("example.toml")).unwrap();
    let h = &config.harnesses["ci-fixer"];
    let relay = h.relay.as_ref().unwrap();
    assert_eq!(relay.lease, "ci");
    assert_eq!(relay.attempt_receipt.as_deref(), Some("main"));
    assert_eq!(relay.success_check_timeout, 15 * MINUTE);
    assert!(relay.success_check_before);
    assert_eq!(h.schedule, Some(Schedule::Every(30 * MINUTE)));
    assert_eq!((h.timeout, h.keep_runs), (Some(45 * MINUTE), 50));
    assert_eq!(config.queues["ci"].heartbeat_interval, MINUTE);
    assert_eq!(config.cairns["main"].ttl, 7 * DAY);
    let files = env_map(&[
        ("~/.config/relay/env/ci-fixer.env", "SWITCHBOARD_TOKEN=t1\n"),
        ("~/.config/relay/env/cairn.env", "CAIRN_TOKEN=t2\n"),
    ]);
    resolve(&config, &files).unwrap();
    // The example is a global file: a project file refuses its lease source, receipt store and lease.
    let errs = fails(project(include_str!("example.toml")));
    assert_eq!(errs.len(), 3, "{errs:#?}");
}

// --- Property --------------------------------------------------------------------------------

fn toml_ish() -> impl Strategy<Value = String> {
    let header = (
        prop::sample::select(vec![
            "queue", "cairn", "channel", "harness", "webhook", "queue.ci",
        ]),
        prop::sample::select(vec!["ci", "main", "sb", "x", "\"bad name\""]),
    )
        .prop_map(|(k, n)| format!("[{k}.{n}]"));
    let mut keys: Vec<&str> = TableKind::ALL
        .iter()
        .flat_map(|k| k.keys().iter().copied())
        .collect();
    keys.extend(["harness", "typo", "headers.Authorization", "\"we ird\""]);
    let value = prop_oneof![
        12 => prop::sample::select(vec![
            "\"https://sb.example.com/mcp/x\"", "\"http://127.0.0.1:1/mcp\"", "\"http://x.example.com\"",
            "\"5m\"", "\"4m\"", "\"0s\"", "\"1h30m\"", "\"garbage\"", "true", "false", "3", "-1", "1.5",
            "[]", "[\"a\"]", "[\"channel.sb\", \"channel.x\"]", "\"queue.ci\"", "\"cairn.main\"",
            "{ Authorization = \"Bearer ${T}\" }", "{ A = \"${\" }", "\"@every 1m\"", "\"*/5 * * * *\"",
            "\"0 0 31 2 *\"", "\"mon-fri 09:00-18:00\"", "[\"fri 22:00-02:00 +02:00\"]", "\"~/x.env\"",
            "[\"./c.sh\", \"{id}\"]", "\"skip\"", "1979-05-27T07:32:00Z", "{}",
        ])
        .prop_map(str::to_string),
        1 => "[a-zA-Z0-9 ${}:/._-]{0,16}".prop_map(|s| format!("{s:?}")),
    ];
    let assignment = (prop::sample::select(keys), value).prop_map(|(k, v)| format!("{k} = {v}"));
    let line = prop_oneof![4 => header, 12 => assignment, 1 => ".{0,20}"];
    prop::collection::vec(line, 0..14).prop_map(|lines| lines.join("\n"))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn config_parse_never_panics_on_toml_ish_text(text in toml_ish()) {
        crate::testing::config_parse_never_panics(&text);
    }

    #[test]
    fn config_parse_never_panics_on_any_text(text in ".{0,200}") {
        crate::testing::config_parse_never_panics(&text);
    }
}

// --- catch_up ---------------------------------------------------------------------------------

#[test]
fn catch_up_without_a_schedule_is_refused_naming_the_key() {
    let e = one_error(global(
        "[harness.x]\ncommand = [\"agent\"]\ncatch_up = true\n",
    ));
    assert_eq!(e.table.as_deref(), Some("harness.x"));
    assert_eq!(e.key.as_deref(), Some("catch_up"));
    assert!(e.message.contains("needs a schedule"), "{e}");
    // Off, it needs nothing.
    assert!(global("[harness.x]\ncommand = [\"agent\"]\ncatch_up = false\n").is_ok());
}

#[test]
fn catch_up_fires_once_for_a_slot_missed_since_the_last_run() {
    use crate::time::{HOUR, read_wall_text};
    let at = |s: &str| read_wall_text(s).unwrap();
    let c =
        global("[harness.x]\ncommand = [\"agent\"]\nschedule = \"@every 1h\"\ncatch_up = true\n")
            .unwrap();
    let h = &c.harnesses["x"];
    let last = Some(at("2026-09-22T10:00:00Z"));
    // Down from 10:30 to 10:45: no slot passed.
    assert_eq!(h.catch_up_slot(last, at("2026-09-22T10:45:00Z")), None);
    // Down past 11:00 (and 12:00): one catch-up, for the first missed slot.
    assert_eq!(
        h.catch_up_slot(last, at("2026-09-22T12:30:00Z")),
        Some(at("2026-09-22T11:00:00Z"))
    );
    assert_eq!(
        h.catch_up_slot(last, at("2026-09-22T11:00:00Z")),
        Some(at("2026-09-22T00:00:00Z") + 11 * HOUR)
    );
    // A harness that never ran owes nothing; without catch_up nothing is owed either.
    assert_eq!(h.catch_up_slot(None, at("2026-09-22T12:30:00Z")), None);
    let mut off = h.clone();
    off.catch_up = false;
    assert_eq!(off.catch_up_slot(last, at("2026-09-22T12:30:00Z")), None);
    // A cron schedule's grid is found the same way.
    let c = global(
        "[harness.x]\ncommand = [\"agent\"]\nschedule = \"0 9 * * mon-fri\"\ncatch_up = true\n",
    )
    .unwrap();
    let h = &c.harnesses["x"];
    // Friday 09:00 ran; down over the weekend until Monday 08:00: nothing missed.
    let fri = Some(at("2026-09-25T09:00:00Z"));
    assert_eq!(h.catch_up_slot(fri, at("2026-09-28T08:00:00Z")), None);
    assert_eq!(
        h.catch_up_slot(fri, at("2026-09-28T09:30:00Z")),
        Some(at("2026-09-28T09:00:00Z"))
    );
}

// --- reload diff ------------------------------------------------------------------------------

fn resolved_with(text: &str, dropin: Option<&str>, env: &str) -> ResolvedConfig {
    let dropins: Vec<ConfigFile> = dropin
        .map(|t| ConfigFile::new("harness.d/extra.toml", t))
        .into_iter()
        .collect();
    let config = parse(
        &ConfigFile::new("harness.toml", text),
        &dropins,
        FileKind::Global,
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let files: std::collections::BTreeMap<String, String> =
        [("q.env".to_string(), env.to_string())]
            .into_iter()
            .collect();
    resolve(&config, &files).unwrap_or_else(|e| panic!("{e}"))
}

const RELOAD_BASE: &str = r#"
[queue.q]
url = "http://127.0.0.1:7070/mcp/a"
env_file = "q.env"
headers = { Authorization = "Bearer ${TOKEN}" }

[queue.spare]
url = "http://127.0.0.1:7070/mcp/b"

[harness.w1]
command = ["sh", "agent.sh"]
schedule = "@every 1m"
lease = "queue.q"

[harness.w2]
command = ["sh", "agent.sh"]
schedule = "@every 1m"
lease = "queue.q"
"#;

#[test]
fn the_same_config_is_no_change_even_when_a_table_moves_to_a_dropin() {
    let old = resolved_with(RELOAD_BASE, None, "TOKEN=a\n");
    assert!(diff(&old, &old).is_empty());
    let (main, moved) = RELOAD_BASE.split_at(RELOAD_BASE.find("[harness.w2]").unwrap());
    let new = resolved_with(main, Some(moved), "TOKEN=a\n");
    assert_eq!(diff(&old, &new), ConfigDiff::default());
    let described = RELOAD_BASE.replace(
        "[harness.w1]\n",
        "[harness.w1]\ndescription = \"new words\"\n",
    );
    assert!(diff(&old, &resolved_with(&described, None, "TOKEN=a\n")).is_empty());
}

#[test]
fn a_reload_names_what_was_added_removed_and_changed() {
    let old = resolved_with(RELOAD_BASE, None, "TOKEN=a\n");
    let text = RELOAD_BASE
        .replace("[harness.w2]\ncommand = [\"sh\", \"agent.sh\"]\nschedule = \"@every 1m\"\nlease = \"queue.q\"\n", "")
        .replace("[harness.w1]\ncommand = [\"sh\", \"agent.sh\"]", "[harness.w1]\ncommand = [\"sh\", \"other.sh\"]")
        + "\n[harness.w3]\ncommand = [\"true\"]\nschedule = \"@every 1m\"\nlease = \"queue.spare\"\n";
    let d = diff(&old, &resolved_with(&text, None, "TOKEN=a\n"));
    assert_eq!(d.harnesses.added, ["w3"]);
    assert_eq!(d.harnesses.removed, ["w2"]);
    assert_eq!(d.harnesses.changed, ["w1"]);
    assert!(d.queues.is_empty() && d.new_sessions.is_empty());
    assert!(d.aborts("w2", "queue.q"), "a removed harness is aborted");
    assert!(!d.aborts("w1", "queue.q"), "a changed one runs on");
}

#[test]
fn a_lease_source_gets_a_new_session_when_its_url_headers_or_credentials_change() {
    let old = resolved_with(RELOAD_BASE, None, "TOKEN=a\n");
    // The credential alone (the env file's value) changed.
    let d = diff(&old, &resolved_with(RELOAD_BASE, None, "TOKEN=b\n"));
    assert_eq!(d.new_sessions, ["queue.q"]);
    assert_eq!(d.queues.changed, ["queue.q"]);
    assert!(d.harnesses.is_empty());
    let moved = RELOAD_BASE.replace("/mcp/a", "/mcp/c");
    assert_eq!(
        diff(&old, &resolved_with(&moved, None, "TOKEN=a\n")).new_sessions,
        ["queue.q"]
    );
    let header = RELOAD_BASE.replace("Bearer ${TOKEN}", "Token ${TOKEN}");
    assert_eq!(
        diff(&old, &resolved_with(&header, None, "TOKEN=a\n")).new_sessions,
        ["queue.q"]
    );
    // A lease_ttl change is a change of the source, not of its session.
    let ttl = RELOAD_BASE.replace(
        "headers = { Authorization = \"Bearer ${TOKEN}\" }\n",
        "headers = { Authorization = \"Bearer ${TOKEN}\" }\nlease_ttl = \"2m\"\n",
    );
    let d = diff(&old, &resolved_with(&ttl, None, "TOKEN=a\n"));
    assert_eq!(d.queues.changed, ["queue.q"]);
    assert!(d.new_sessions.is_empty());
    // No secret reaches the diff.
    assert!(!format!("{d:?}").contains("TOKEN=a"));
}

#[test]
fn a_removed_lease_source_aborts_the_attempts_on_it() {
    let old = resolved_with(RELOAD_BASE, None, "TOKEN=a\n");
    let text = RELOAD_BASE.replace("[queue.spare]\nurl = \"http://127.0.0.1:7070/mcp/b\"\n", "");
    let d = diff(&old, &resolved_with(&text, None, "TOKEN=a\n"));
    assert_eq!(d.queues.removed, ["queue.spare"]);
    assert!(
        d.aborts("w1", "queue.spare"),
        "an attempt still on the removed source"
    );
    assert!(!d.aborts("w1", "queue.q"));
}

#[test]
fn a_harness_answers_its_next_firing_and_whether_a_firing_is_within_hours() {
    use crate::time::read_wall_text;
    let at = |s: &str| read_wall_text(s).unwrap();
    let c = global(
        "[harness.x]\ncommand = [\"agent\"]\nschedule = \"@every 30m\"\n\
         operating_hours = \"mon-fri 09:00-18:00 +02:00\"\n\
         [harness.y]\ncommand = [\"agent\"]\n",
    )
    .unwrap();
    let (x, y) = (&c.harnesses["x"], &c.harnesses["y"]);
    // 2026-09-22 is a Tuesday: 07:10Z is 09:10 at +02:00, 06:50Z is 08:50.
    assert!(x.within_hours(at("2026-09-22T07:10:00Z")));
    assert!(!x.within_hours(at("2026-09-22T06:50:00Z")));
    assert!(!x.within_hours(at("2026-09-26T07:10:00Z")), "a Saturday");
    assert!(
        y.within_hours(at("2026-09-26T07:10:00Z")),
        "no hours: always"
    );
    assert_eq!(
        x.next_fire(at("2026-09-22T07:10:00Z")),
        Some(at("2026-09-22T07:30:00Z"))
    );
    assert_eq!(y.next_fire(at("2026-09-22T07:10:00Z")), None);
}

#[test]
fn mcp_era_is_auto_by_default_and_forced_by_the_key() {
    use crate::mcp::client::EraChoice;
    let c = global(
        "[queue.a]\nurl = \"https://h.example.com/mcp/e\"\n\
         [queue.b]\nurl = \"https://h.example.com/mcp/e\"\nmcp_era = \"legacy\"\n\
         [channel.c]\nurl = \"https://h.example.com/mcp/e\"\nmcp_era = \"modern\"\n",
    )
    .unwrap();
    assert_eq!(c.queues["a"].address.mcp_era, EraChoice::Auto);
    assert_eq!(c.queues["b"].address.mcp_era, EraChoice::Legacy);
    assert_eq!(c.channels["c"].address.mcp_era, EraChoice::Modern);
    let e = global("[queue.a]\nurl = \"https://h.example.com/mcp/e\"\nmcp_era = \"2026\"\n")
        .unwrap_err();
    let text = e.to_string();
    assert!(
        text.contains("mcp_era = \"2026\" is not an MCP era"),
        "{text}"
    );
    assert!(text.contains("\"auto\""), "{text}");
    let e =
        global("[cairn.a]\nurl = \"https://h.example.com/\"\nmcp_era = \"legacy\"\n").unwrap_err();
    assert!(e.to_string().contains("mcp_era"), "{e}");
}

/// The keys only a harness with a lease may set are the attempt's: from the success check to
/// the exit codes that do not retry (the tail of the harness's keys, cut by a count).
#[test]
fn the_relay_only_keys_are_the_attempts() {
    let keys = super::parse::RELAY_ONLY_KEYS;
    assert_eq!(keys.first(), Some(&"success_check"));
    assert_eq!(keys.last(), Some(&"non_retryable_exit_codes"));
    assert!(keys.iter().all(|k| k.starts_with("success_check")
        || ["attempt_receipt", "non_retryable_exit_codes"].contains(k)));
}
