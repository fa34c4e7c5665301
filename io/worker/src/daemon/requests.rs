//! The control socket's requests, answered on the actor.

use super::*;

impl Daemon {
    pub(super) fn control(&mut self, request: control::Request, reply: oneshot::Sender<Value>) {
        let unknown = |h: &str| {
            control::error(format!(
                "no leased harness named {h:?} runs in this daemon; see `relay describe` for the names"
            ))
        };
        match request {
            control::Request::Trigger { harness } => {
                if !self.fleet.running(&harness) {
                    let _ = reply.send(unknown(&harness));
                    return;
                }
                self.fire(&harness, "manual");
                let _ = reply.send(json!({"ok": true, "harness": harness}));
            }
            control::Request::Stop { harness } => {
                let Some(member) = self.fleet.get(&harness) else {
                    let _ = reply.send(unknown(&harness));
                    return;
                };
                let Some(attempt) = member.relay().describe(self.clock.reading()).attempt else {
                    let _ = reply.send(json!({"ok": true, "harness": harness, "stopped": false}));
                    return;
                };
                let stops = member.relay().stop_would_abort();
                let answer = json!({
                    "ok": true,
                    "harness": harness,
                    "stopped": stops,
                    "run_id": attempt.run_id,
                    "todo_id": attempt.todo_id,
                    "phase": attempt.phase,
                });
                if stops {
                    tracing::info!(harness = %harness, run_id = attempt.run_id, "operator stop");
                    self.input(
                        &harness,
                        Input::StopRequested {
                            reason: StopReason::OperatorStop,
                        },
                    );
                }
                let _ = reply.send(answer);
            }
            control::Request::Reload => self.reload(Some(reply)),
            control::Request::Describe { harness } => {
                let names: Vec<&String> = match &harness {
                    Some(h) => self.slots.keys().filter(|k| *k == h).collect(),
                    None => self.slots.keys().collect(),
                };
                if let Some(h) = &harness
                    && names.is_empty()
                {
                    let _ = reply.send(unknown(h));
                    return;
                }
                let harnesses: Vec<Value> = names
                    .into_iter()
                    .map(|name| {
                        let (slot, member) =
                            (&self.slots[name], &self.fleet.get(name).expect("a member"));
                        let source = self
                            .sources
                            .get(&slot.source)
                            .filter(|s| s.generation == slot.generation);
                        let session = match source.map(|s| &s.caps) {
                            // The attempt in flight holds a client a reload replaced or removed.
                            None => "replaced",
                            Some(None) => "unverified",
                            Some(Some(c)) if c.supported() => "supported",
                            Some(Some(_)) => "unsupported",
                        };
                        json!({
                            "relay": member.relay().describe(self.clock.reading()),
                            "source": {
                                "name": slot.source,
                                "url": source.map(|s| s.url.clone()),
                                "header_names": source.map(|s| s.header_names.clone()),
                                "session": session,
                            },
                            "removed": member.removed(),
                            "schedule": member.next_fire().map(|at| relay_core::time::rfc3339(at.ms())),
                            "triggers": member.harness().triggers,
                        })
                    })
                    .collect();
                let _ = reply.send(json!({"ok": true, "harnesses": harnesses}));
            }
            control::Request::Doctor => {
                let config = self.resolved.config.clone();
                let clients: Vec<(String, Arc<LeaseClient>)> =
                    relay::doctor::bound_sources(&config)
                        .into_iter()
                        .filter_map(|n| Some((n.clone(), self.sources.get(&n)?.client.clone())))
                        .collect();
                tokio::spawn(async move {
                    let rows = doctor::rows(&config, clients).await;
                    let _ = reply.send(json!({"ok": true, "rows": rows}));
                });
            }
            // The socket task asks with `Msg::Events`; a request that gets here is answered.
            control::Request::Events { .. } => {
                let _ = reply.send(control::error("events are streamed, not answered".into()));
            }
        }
    }
}
