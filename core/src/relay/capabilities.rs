//! Is this lease source's server one relay can work with? Read from the input schemas
//! of its tools/list answer, never from a version string: the schemas forbid unknown
//! properties, so what they declare is exactly what the server accepts. `relay doctor` uses
//! the same answer.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::table::{ARGUMENTS, OPTIONAL_VERBS, RELEASE, REQUIRED};

/// The verdict over one tools/list answer.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Capabilities {
    /// What is missing, `verb` for an absent verb and `verb.argument` for an undeclared
    /// argument. Empty means supported.
    pub missing: Vec<String>,
    pub release_advertised: bool,
    /// The required verbs that are absent altogether (doctor names them).
    pub missing_verbs: Vec<String>,
    /// The arguments each advertised drain verb declares (its inputSchema's properties), so
    /// that an extension argument is sent only where it is declared.
    #[serde(default)]
    pub declared: BTreeMap<String, BTreeSet<String>>,
}

impl Capabilities {
    pub fn supported(&self) -> bool {
        self.missing.is_empty()
    }

    /// What a server with exactly the contract's surface, attempt-history arguments included,
    /// answers (tests and drivers use it).
    pub fn full(release_advertised: bool) -> Capabilities {
        Capabilities {
            missing: Vec::new(),
            release_advertised,
            missing_verbs: Vec::new(),
            declared: ARGUMENTS
                .iter()
                .filter(|(verb, _)| release_advertised || *verb != "release")
                .map(|(verb, args)| {
                    let args = args.iter().map(|a| a.to_string()).collect();
                    (verb.to_string(), args)
                })
                .collect(),
        }
    }

    /// Whether the server's schema for `verb` declares the argument `arg`.
    pub fn declares(&self, verb: &str, arg: &str) -> bool {
        self.declared
            .get(verb)
            .is_some_and(|args| args.contains(arg))
    }

    /// Whether the server lets this endpoint ask a person: it lists `request_input` with the
    /// arguments the daemon needs (an endpoint not granted the verb is not shown the tool).
    pub fn asks(&self) -> bool {
        let (verb, args) = OPTIONAL_VERBS[0];
        args.iter().all(|a| self.declares(verb, a))
    }
}

/// Checks a tools/list result: `{"tools": [{"name", "inputSchema": {"properties"}}]}` (a bare
/// array of tools is accepted too).
pub fn check_capabilities(tools_list: &Value) -> Capabilities {
    let tools = tools_list
        .get("tools")
        .unwrap_or(tools_list)
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default();
    let declared = |verb: &str| -> Option<Vec<&str>> {
        let tool = tools
            .iter()
            .find(|t| t.get("name").and_then(Value::as_str) == Some(verb))?;
        let props = tool
            .get("inputSchema")
            .and_then(|s| s.get("properties"))
            .and_then(Value::as_object);
        Some(
            props
                .map(|p| p.keys().map(String::as_str).collect())
                .unwrap_or_default(),
        )
    };
    let mut caps = Capabilities::default();
    let check = |verb: &str, args: &[&str], caps: &mut Capabilities| match declared(verb) {
        None => false,
        Some(props) => {
            for arg in args {
                if !props.contains(arg) {
                    caps.missing.push(format!("{verb}.{arg}"));
                }
            }
            true
        }
    };
    for (verb, args) in REQUIRED {
        if !check(verb, args, &mut caps) {
            caps.missing.push(verb.to_string());
            caps.missing_verbs.push(verb.to_string());
        }
    }
    caps.release_advertised = check(RELEASE.0, RELEASE.1, &mut caps);
    for verb in ARGUMENTS.iter().chain(&OPTIONAL_VERBS).map(|(v, _)| *v) {
        if let Some(props) = declared(verb) {
            let props = props.into_iter().map(str::to_string).collect();
            caps.declared.insert(verb.to_string(), props);
        }
    }
    caps
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::relay::{contract_tools, tools_list};

    #[test]
    fn the_full_contract_surface_is_supported() {
        assert_eq!(
            check_capabilities(&contract_tools()),
            Capabilities::full(true)
        );
    }

    #[test]
    fn a_release_without_the_fence_is_refused() {
        let list = tools_list(&[
            ("claim_next", &["require_fence", "claimant"]),
            ("heartbeat", &["lease_token"]),
            ("complete", &["lease_token", "summary", "artifact"]),
            ("fail", &["lease_token", "summary", "artifact"]),
            ("release", &["id", "summary"]),
        ]);
        let caps = check_capabilities(&list);
        assert!(!caps.supported());
        assert_eq!(caps.missing, ["release.lease_token"]);
    }

    #[test]
    fn the_declared_arguments_are_kept_per_verb() {
        let mut list = contract_tools();
        list["tools"][3]["inputSchema"]["properties"]["retryable"] = serde_json::json!({});
        assert_eq!(list["tools"][3]["name"], "fail");
        let caps = check_capabilities(&list);
        assert!(caps.supported());
        assert!(caps.declares("fail", "retryable"));
        assert!(caps.declares("fail", "lease_token"));
        assert!(!caps.declares("complete", "retryable"));
        assert!(
            !caps.declares("get_todo", "id"),
            "only the drain verbs are kept"
        );
        assert!(!Capabilities::full(false).declares("release", "id"));
    }

    #[test]
    fn asking_needs_request_input_with_its_question_and_fence() {
        use crate::wire::Tool;
        assert!(!check_capabilities(&contract_tools()).asks());
        // Our server, to an endpoint granted every verb: it asks, and usage is declared on
        // the heartbeat and every report.
        let ours = check_capabilities(&crate::wire::tools_list(&Tool::ALL));
        assert!(ours.supported() && ours.asks());
        for verb in ["heartbeat", "complete", "fail", "release", "request_input"] {
            assert!(ours.declares(verb, "usage"), "{verb}");
        }
        // An endpoint not granted request_input is not shown it.
        let granted: Vec<Tool> = Tool::ALL
            .into_iter()
            .filter(|t| *t != Tool::RequestInput)
            .collect();
        let caps = check_capabilities(&crate::wire::tools_list(&granted));
        assert!(caps.supported() && !caps.asks());
        // Without the fence the daemon cannot ask (it never reports unfenced).
        let mut verbs = crate::relay::table::ARGUMENTS.to_vec();
        verbs.push(("request_input", &["id", "question"]));
        let caps = check_capabilities(&tools_list(&verbs));
        assert!(caps.supported() && !caps.asks());
    }
}
