//! Endpoint grants: which tools an endpoint may call, on which queues, and what an endpoint may
//! be named. `relay endpoint create` vends through [`vend`]; the queue server (and the simulator,
//! through the same serving code) checks every call against a [`Grant`]. One place, so that
//! what the operator is told an endpoint may do is what the server lets it do.

use std::collections::BTreeSet;

use crate::Error;
use crate::ledger::valid_queue_name;
use crate::wire::Tool;

/// What an endpoint was vended: its verbs and its queues (`None`: every queue).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Grant {
    verbs: BTreeSet<Tool>,
    queues: Option<Vec<String>>,
}

impl Grant {
    /// The grant of a stored endpoint. A verb this build does not know grants nothing (a newer
    /// build may have vended it).
    pub fn new(verbs: &[String], queues: Option<Vec<String>>) -> Grant {
        Grant {
            verbs: verbs.iter().filter_map(|v| Tool::parse(v)).collect(),
            queues,
        }
    }

    /// Every verb on every queue.
    pub fn all() -> Grant {
        Grant {
            verbs: Tool::ALL.into_iter().collect(),
            queues: None,
        }
    }

    /// The tools the endpoint may list and call ([`crate::wire::tools_for`] its verbs).
    pub fn tools(&self) -> Vec<Tool> {
        crate::wire::tools_for(&self.verbs)
    }

    /// Whether the endpoint may call `tool`.
    pub fn allows(&self, tool: Tool) -> bool {
        self.tools().contains(&tool)
    }

    /// `tool`, refused unless granted.
    pub fn check_tool(&self, tool: Tool) -> Result<(), Error> {
        if self.allows(tool) {
            return Ok(());
        }
        let name = tool.as_str();
        Err(Error::forbidden(format!(
            "{name}: this endpoint is not granted this verb; vend an endpoint with it \
             (`relay endpoint create NAME --verbs {name},…`)"
        )))
    }

    /// Whether the endpoint may claim at all (without a claim verb a doorbell rings for
    /// nothing it could take).
    pub fn may_claim(&self) -> bool {
        self.verbs.contains(&Tool::ClaimNext) || self.verbs.contains(&Tool::Claim)
    }

    /// The granted queues; `None`: every queue.
    pub fn queues(&self) -> Option<&[String]> {
        self.queues.as_deref()
    }

    /// Whether `queue` is granted.
    pub fn covers(&self, queue: &str) -> bool {
        self.queues
            .as_ref()
            .is_none_or(|qs| qs.iter().any(|q| q == queue))
    }

    /// A queue a call names, refused unless granted.
    pub fn check_queue(&self, tool: Tool, queue: &str) -> Result<(), Error> {
        if self.covers(queue) {
            return Ok(());
        }
        Err(Error::forbidden(format!(
            "{}: queue {queue:?} is not granted to this endpoint; use a granted queue or vend an \
             endpoint with it (`--queues`)",
            tool.as_str()
        )))
    }

    /// The queues a scan (`claim_next`, `list_todos`) reads: the one the call names, when it
    /// is granted, or else every granted queue (`None`: all).
    pub fn scope(&self, tool: Tool, queue: Option<&str>) -> Result<Option<Vec<String>>, Error> {
        match queue {
            Some(q) => {
                self.check_queue(tool, q)?;
                Ok(Some(vec![q.to_string()]))
            }
            None => Ok(self.queues.clone()),
        }
    }
}

/// What an operator's add (`relay todo add`, the Board's form) checks of the endpoint it names
/// as the todo's owner, before the ledger's own checks: `found` is the endpoint's row (whether
/// it is revoked, its granted queues; `None`: no such endpoint). A revoked owner or a queue it
/// is not granted would leave a todo nobody can claim. `fields` name the endpoint and queue
/// inputs in the caller's words (`--endpoint`, `--queue`).
pub fn check_owner(
    endpoint: &str,
    found: Option<(bool, Option<&[String]>)>,
    queue: &str,
    fields: [&str; 2],
) -> Result<(), Error> {
    let [ef, qf] = fields;
    let Some((revoked, queues)) = found else {
        return Err(Error::not_found(format!(
            "{ef} {endpoint}: no such endpoint; `relay endpoint list` shows them"
        )));
    };
    if revoked {
        return Err(Error::conflict(format!(
            "{ef} {endpoint}: the endpoint is revoked; vend a new one"
        )));
    }
    if let Some(qs) = queues
        && !qs.iter().any(|q| q == queue)
    {
        return Err(Error::forbidden(format!(
            "{qf} {queue}: endpoint {endpoint} is not granted this queue (it has {}); nobody \
             could claim the todo. Use a granted queue",
            qs.join(", ")
        )));
    }
    Ok(())
}

/// Endpoint names follow the queue-name rule (a letter or digit, then up to 63 letters, digits,
/// `_`, `-` or `.`): they stand in the URL path `/mcp/NAME` and in log lines.
pub fn valid_endpoint_name(name: &str) -> bool {
    valid_queue_name(name)
}

/// What `relay endpoint create` may store: the name and queues checked, the verbs checked and
/// put in the tools' order without repeats. Errors name the flag and what to write instead.
pub fn vend(name: &str, verbs: &[String], queues: Option<&[String]>) -> Result<Vec<String>, Error> {
    if !valid_endpoint_name(name) {
        return Err(Error::invalid(format!(
            "endpoint name {name:?} must start with a letter or digit and hold at most 64 \
             letters, digits, '_', '-' or '.'"
        )));
    }
    let mut seen = BTreeSet::new();
    for v in verbs.iter().map(|v| v.trim()) {
        let Some(tool) = Tool::parse(v) else {
            let all: Vec<&str> = Tool::ALL.iter().map(|t| t.as_str()).collect();
            return Err(Error::invalid(format!(
                "--verbs: unknown verb {v:?}; choose from {}",
                all.join(", ")
            )));
        };
        seen.insert(tool);
    }
    if let Some(bad) = queues.into_iter().flatten().find(|q| !valid_queue_name(q)) {
        return Err(Error::invalid(format!(
            "--queues: {bad:?} is not a queue name (a letter or digit, then up to 63 letters, \
             digits, '_', '-' or '.')"
        )));
    }
    Ok(seen.into_iter().map(|t| t.as_str().to_string()).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ErrorCode;

    fn strings(xs: &[&str]) -> Vec<String> {
        xs.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn an_owner_must_exist_be_live_and_be_granted_the_queue() {
        let f = ["endpoint", "queue"];
        let qs = strings(&["a"]);
        let code = |r: Result<(), Error>| r.unwrap_err().code;
        assert_eq!(code(check_owner("e", None, "a", f)), ErrorCode::NotFound);
        assert_eq!(
            code(check_owner("e", Some((true, None)), "a", f)),
            ErrorCode::Conflict
        );
        let e = check_owner("e", Some((false, Some(&qs))), "b", f).unwrap_err();
        assert_eq!(e.code, ErrorCode::Forbidden);
        assert!(e.message.starts_with("queue b:"), "{}", e.message);
        assert!(check_owner("e", Some((false, Some(&qs))), "a", f).is_ok());
        assert!(check_owner("e", Some((false, None)), "b", f).is_ok());
    }

    #[test]
    fn list_todos_implies_get_todo_and_nothing_implies_release() {
        let g = Grant::new(&strings(&["list_todos", "complete", "teleport"]), None);
        assert_eq!(
            g.tools(),
            vec![Tool::Complete, Tool::GetTodo, Tool::ListTodos]
        );
        assert!(!g.allows(Tool::Release));
        assert!(!g.may_claim());
        let e = g.check_tool(Tool::Release).unwrap_err();
        assert_eq!(e.code, ErrorCode::Forbidden);
        assert!(e.message.contains("--verbs release,"), "{}", e.message);
    }

    #[test]
    fn a_queue_grant_scopes_scans_and_refuses_other_queues() {
        let g = Grant::new(&strings(&["claim"]), Some(strings(&["a", "b"])));
        assert!(g.may_claim());
        assert_eq!(
            g.scope(Tool::ClaimNext, None).unwrap(),
            Some(strings(&["a", "b"]))
        );
        assert_eq!(
            g.scope(Tool::ClaimNext, Some("b")).unwrap(),
            Some(strings(&["b"]))
        );
        let e = g.scope(Tool::ListTodos, Some("c")).unwrap_err();
        assert_eq!(e.code, ErrorCode::Forbidden);
        assert!(
            e.message.starts_with("list_todos: queue \"c\""),
            "{}",
            e.message
        );
        assert_eq!(Grant::all().scope(Tool::ClaimNext, None).unwrap(), None);
        assert!(Grant::all().covers("anything"));
    }

    #[test]
    fn vend_orders_verbs_and_refuses_bad_names() {
        assert_eq!(
            vend("ci", &strings(&["fail", " claim_next", "fail"]), None).unwrap(),
            strings(&["claim_next", "fail"])
        );
        for (name, verbs, queues, flag) in [
            ("-x", vec!["fail"], None, "endpoint name"),
            ("ci", vec!["teleport"], None, "--verbs"),
            ("ci", vec!["fail"], Some(vec!["a b"]), "--queues"),
        ] {
            let queues = queues.map(|q| strings(&q));
            let e = vend(name, &strings(&verbs), queues.as_deref()).unwrap_err();
            assert_eq!(e.code, ErrorCode::Invalid);
            assert!(e.message.starts_with(flag), "{}", e.message);
        }
    }
}
