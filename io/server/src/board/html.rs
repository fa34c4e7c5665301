//! The Board's HTML: one escaping function that every user-supplied string goes through, and
//! the pages, written as plain strings around it. No inline script or style (the CSP forbids
//! both): the look is `assets/board.css`, the live updates `assets/board.js`.

use std::fmt::Write as _;

use relay_core::board::Chart;
use relay_core::ledger::flow::{Held, QueueLine};
use relay_core::ledger::{Attempt, Todo, TodoState, TodoView};

use crate::store::Endpoint;
use relay_core::time::rfc3339;
use serde_json::Value;

/// Escapes text for HTML element content and double-quoted attribute values. Every string that
/// did not come from this file goes through it: titles, summaries, payloads, names, errors.
pub fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            _ => out.push(c),
        }
    }
    out
}

/// A whole page: the head, a nav bar (with logout when `csrf` is given) and `body`.
pub fn page(title: &str, csrf: Option<&str>, body: &str) -> String {
    let nav = match csrf {
        Some(csrf) => format!(
            "<nav><a href=\"/board/\">relay Board</a><a href=\"/board/add\">Add a todo</a>\
             <a href=\"/board/endpoints\">Endpoints</a><form method=\"post\" \
             action=\"/board/logout\">{}<button type=\"submit\">Log out</button></form></nav>",
            csrf_field(csrf)
        ),
        None => "<nav><span>relay Board</span></nav>".to_string(),
    };
    format!(
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\
         <meta name=\"color-scheme\" content=\"light dark\">\
         <title>{} · relay Board</title><link rel=\"stylesheet\" href=\"/board/assets/board.css\">\
         <script src=\"/board/assets/board.js\" defer></script></head>\
         <body>{nav}<main>{body}</main></body></html>",
        esc(title)
    )
}

pub fn csrf_field(csrf: &str) -> String {
    format!(
        "<input type=\"hidden\" name=\"csrf\" value=\"{}\">",
        esc(csrf)
    )
}

pub fn error_banner(message: &str) -> String {
    format!("<p class=\"error\" role=\"alert\">{}</p>", esc(message))
}

pub fn login(message: Option<&str>) -> String {
    let banner = message.map(error_banner).unwrap_or_default();
    page(
        "Log in",
        None,
        &format!(
            "<h1>Log in</h1>{banner}<form method=\"post\" action=\"/board/login\" class=\"login\">\
             <label for=\"token\">Operator token</label>\
             <input id=\"token\" name=\"token\" type=\"password\" autocomplete=\"off\" required>\
             <button type=\"submit\">Log in</button></form>\
             <p class=\"hint\">Create one with <code>relay operator create NAME</code>.</p>"
        ),
    )
}

pub use relay_core::board::QueueCounts;

fn time(t: Option<u64>) -> String {
    t.map_or_else(|| "–".to_string(), rfc3339)
}

fn age(now: u64, t: Option<u64>) -> String {
    let Some(t) = t else {
        return "–".into();
    };
    let s = now.saturating_sub(t) / 1000;
    match s {
        0..60 => format!("{s} s"),
        60..3600 => format!("{} min", s / 60),
        3600..86_400 => format!("{} h", s / 3600),
        _ => format!("{} d", s / 86_400),
    }
}

fn todo_link(t: &Todo) -> String {
    format!("<a href=\"/board/todos/{}\">{}</a>", esc(&t.id), esc(&t.id))
}

fn state_of(t: &Todo) -> String {
    if t.dead_letter() {
        "dead letter".into()
    } else if t.state == TodoState::Failed {
        "retrying".into()
    } else {
        t.state.to_string()
    }
}

fn todo_rows(now: u64, todos: &[Todo]) -> String {
    if todos.is_empty() {
        return "<p class=\"empty\">none</p>".into();
    }
    let mut out = String::from(
        "<table><thead><tr><th>id</th><th>title</th><th>queue</th><th>state</th>\
         <th>attempt</th><th>updated</th></tr></thead><tbody>",
    );
    for t in todos {
        let _ = write!(
            out,
            "<tr data-todo=\"{}\"><td>{}</td><td>{}</td><td>{}</td><td class=\"state\">{}</td>\
             <td>{}/{}</td><td>{} ago</td></tr>",
            esc(&t.id),
            todo_link(t),
            esc(&t.title),
            esc(&t.queue),
            esc(&state_of(t)),
            t.attempt,
            t.max_attempts,
            age(now, Some(t.updated_at)),
        );
    }
    out.push_str("</tbody></table>");
    out
}

/// Claimed todos with the time left on their lease (negative: lapsed, not yet reaped).
fn lapsing_rows(now: u64, todos: &[Todo]) -> String {
    if todos.is_empty() {
        return "<p class=\"empty\">none</p>".into();
    }
    let mut out = String::from(
        "<table class=\"lapsing\"><thead><tr><th>id</th><th>title</th><th>queue</th>\
         <th>attempt</th><th>lease</th></tr></thead><tbody>",
    );
    for t in todos {
        let lease = t.lease_expires_at.map_or_else(
            || "–".to_string(),
            |at| {
                if at > now {
                    format!("lapses in {}", age(at, Some(now)))
                } else {
                    format!("lapsed {} ago", age(now, Some(at)))
                }
            },
        );
        let _ = write!(
            out,
            "<tr data-todo=\"{}\"><td>{}</td><td>{}</td><td>{}</td><td>{}/{}</td>\
             <td class=\"lease\">{}</td></tr>",
            esc(&t.id),
            todo_link(t),
            esc(&t.title),
            esc(&t.queue),
            t.attempt,
            t.max_attempts,
            lease
        );
    }
    out.push_str("</tbody></table>");
    out
}

/// Todos whose attempts died more than once, with the count.
fn died_rows(now: u64, todos: &[(Todo, u64)]) -> String {
    if todos.is_empty() {
        return "<p class=\"empty\">none</p>".into();
    }
    let mut out = String::from(
        "<table class=\"died-again\"><thead><tr><th>id</th><th>title</th><th>queue</th>\
         <th>state</th><th>died</th><th>updated</th></tr></thead><tbody>",
    );
    for (t, n) in todos {
        let _ = write!(
            out,
            "<tr data-todo=\"{}\"><td>{}</td><td>{}</td><td>{}</td><td class=\"state\">{}</td>\
             <td class=\"deaths\">{n}×</td><td>{} ago</td></tr>",
            esc(&t.id),
            todo_link(t),
            esc(&t.title),
            esc(&t.queue),
            esc(&state_of(t)),
            age(now, Some(t.updated_at)),
        );
    }
    out.push_str("</tbody></table>");
    out
}

pub struct Overview<'a> {
    pub now: u64,
    pub csrf: &'a str,
    pub queues: &'a [QueueCounts],
    /// The queues with limits or paused.
    pub flow: &'a [QueueLine],
    pub chart: &'a Chart,
    pub dead_letters: &'a [Todo],
    pub lapsing: &'a [Todo],
    /// Todos with more than one attempt that died, and how many.
    pub died_again: &'a [(Todo, u64)],
}

/// The chart's drawing size (SVG user units): one bar per minute.
const BAR: u64 = 10;
const CHART_HEIGHT: u64 = 100;

/// Attempts closed per minute, by outcome, as inline SVG: stacked bars coloured by class (the
/// CSP allows no inline style; the colours are in board.css), a `<title>` per bar for the
/// numbers, and a legend with the hour's totals. Only our own text goes in: outcome names and
/// times.
pub fn chart(c: &Chart) -> String {
    let peak = c.peak();
    let width = BAR * c.minutes.len() as u64;
    let mut svg = format!(
        "<figure class=\"chart\"><svg viewBox=\"0 0 {width} {CHART_HEIGHT}\" \
         preserveAspectRatio=\"none\" role=\"img\" aria-label=\"attempts closed per minute \
         over the last hour, by outcome\" data-peak=\"{peak}\">"
    );
    for (i, m) in c.minutes.iter().enumerate() {
        let x = i as u64 * BAR;
        let start = c.since + i as u64 * relay_core::time::MINUTE;
        let total: u64 = m.values().sum();
        let _ = write!(
            svg,
            "<g class=\"minute\" data-closed=\"{total}\"><title>{} · {total} closed{}</title>",
            rfc3339(start),
            m.iter()
                .map(|(o, n)| format!(", {n} {o}"))
                .collect::<String>()
        );
        let mut y = CHART_HEIGHT;
        for (o, n) in m {
            // Scaled to the busiest minute; a minute with any close shows at least a sliver.
            let h = (n * CHART_HEIGHT).div_ceil(peak.max(1)).max(1).min(y);
            y -= h;
            let _ = write!(
                svg,
                "<rect class=\"o-{o}\" x=\"{x}\" y=\"{y}\" width=\"{}\" height=\"{h}\"></rect>",
                BAR - 1
            );
        }
        svg.push_str("</g>");
    }
    svg.push_str("</svg><figcaption><ul class=\"legend\">");
    let totals = c.totals();
    if totals.is_empty() {
        svg.push_str("<li class=\"empty\">no attempt closed in the last hour</li>");
    }
    for (o, n) in totals {
        let _ = write!(
            svg,
            "<li><svg class=\"swatch\" viewBox=\"0 0 10 10\" aria-hidden=\"true\"><rect \
             class=\"o-{o}\" width=\"10\" height=\"10\"></rect></svg>{o} <span class=\"n\" \
             data-outcome=\"{o}\">{n}</span></li>"
        );
    }
    let _ = write!(
        svg,
        "</ul>busiest minute: {peak} · from {} to now</figcaption></figure>",
        rfc3339(c.since)
    );
    svg
}

pub fn overview(o: &Overview<'_>) -> String {
    let mut body = String::from("<h1>Queues</h1>");
    if o.queues.is_empty() {
        body.push_str("<p class=\"empty\">No todos yet.</p>");
    } else {
        body.push_str(
            "<table class=\"counts\"><thead><tr><th>queue</th><th>pending</th><th>claimed</th>\
             <th>retrying</th><th>dead letters</th><th>done</th><th>canceled</th>\
             <th>oldest pending</th><th>waiting for an answer</th><th></th></tr></thead><tbody>",
        );
        for q in o.queues {
            let _ = write!(
                body,
                "<tr data-queue=\"{0}\"><td><a href=\"/board/queues/{0}\">{0}</a>{1}</td>\
                 <td class=\"n-pending\">{2}</td><td class=\"n-claimed\">{3}</td>\
                 <td class=\"n-retrying\">{4}</td><td class=\"n-dead\">{5}</td>\
                 <td class=\"n-done\">{6}</td><td class=\"n-canceled\">{7}</td><td>{8}</td>\
                 <td class=\"n-waiting\">{10}</td><td>{9}</td></tr>",
                esc(&q.queue),
                if q.paused {
                    " <span class=\"badge\">paused</span>"
                } else {
                    ""
                },
                q.pending,
                q.claimed,
                q.retrying,
                q.dead_letters,
                q.done,
                q.canceled,
                age(o.now, q.oldest_pending),
                pause_form(o.csrf, &q.queue, q.paused),
                if q.waiting == 0 {
                    "0".to_string()
                } else {
                    format!("{} (longest {})", q.waiting, age(o.now, q.oldest_waiting))
                },
            );
        }
        body.push_str("</tbody></table>");
    }
    if o.flow.iter().any(|l| !l.limits.is_empty()) {
        body.push_str("<h2>Flow limits</h2>");
        body.push_str(&flow_rows(o.flow));
    }
    body.push_str("<h2>Attempts closed per minute, last hour</h2>");
    body.push_str(&chart(o.chart));
    body.push_str("<h2>Dead letters</h2>");
    body.push_str(&todo_rows(o.now, o.dead_letters));
    body.push_str("<h2>Claims about to lapse</h2>");
    body.push_str(&lapsing_rows(o.now, o.lapsing));
    body.push_str("<h2>Died more than once</h2>");
    body.push_str(&died_rows(o.now, o.died_again));
    page("Overview", Some(o.csrf), &body)
}

/// The limited queues' lines: their limits, what is claimed, how many waiting todos the limits
/// hold back and why (`relay queue show` in a table).
fn flow_rows(lines: &[QueueLine]) -> String {
    let mut out = String::from(
        "<table class=\"flow\"><thead><tr><th>queue</th><th>limits</th><th>claimed</th>\
         <th>claims in the last minute</th><th>held back</th><th>why</th></tr></thead><tbody>",
    );
    for l in lines.iter().filter(|l| !l.limits.is_empty()) {
        let why = l.reasons();
        let _ = write!(
            out,
            "<tr data-queue=\"{}\"><td>{0}</td><td>{}</td><td class=\"n-claimed\">{}</td>\
             <td class=\"n-recent\">{}</td><td class=\"n-held-back\">{}</td><td>{}</td></tr>",
            esc(&l.queue),
            esc(&l.limits.describe()),
            l.claimed,
            l.recent,
            l.held_back,
            esc(&why.join("; "))
        );
    }
    out.push_str("</tbody></table>");
    out
}

pub fn pause_form(csrf: &str, queue: &str, paused: bool) -> String {
    let (action, label) = if paused {
        ("resume", "Resume")
    } else {
        ("pause", "Pause")
    };
    format!(
        "<form method=\"post\" action=\"/board/queues/{}/{action}\">{}\
         <button type=\"submit\">{label}</button></form>",
        esc(queue),
        csrf_field(csrf)
    )
}

pub struct QueuePage<'a> {
    pub now: u64,
    pub csrf: &'a str,
    pub queue: &'a str,
    /// The queue's limits and pause, if it has any.
    pub flow: Option<&'a QueueLine>,
    pub filter: &'a relay_core::board::TodoMatch,
    /// How many todos the filter matches in all (the page shows one page of them).
    pub matched: usize,
    pub todos: &'a [Todo],
    pub page: usize,
    pub more: bool,
}

pub fn queue(q: &QueuePage<'_>) -> String {
    let f = q.filter;
    let mut body = format!("<h1>Queue {}</h1>", esc(q.queue));
    body.push_str(&pause_form(
        q.csrf,
        q.queue,
        q.flow.is_some_and(|l| l.paused),
    ));
    if let Some(l) = q.flow.filter(|l| !l.limits.is_empty()) {
        body.push_str(&flow_rows(std::slice::from_ref(l)));
    }
    let _ = write!(
        body,
        "<p><a href=\"/board/add?queue={}\">Add a todo to this queue</a></p>",
        esc(&query_escape(q.queue))
    );
    let _ = write!(
        body,
        "<form method=\"get\" class=\"filter\"><select name=\"state\" aria-label=\"state\">\
         <option value=\"\">any state</option>"
    );
    for s in TodoState::ALL {
        let _ = write!(
            body,
            "<option value=\"{s}\"{}>{s}</option>",
            if f.state == Some(s) { " selected" } else { "" }
        );
    }
    body.push_str(
        "</select><select name=\"reason\" aria-label=\"dead-letter reason\">\
         <option value=\"\">any dead-letter reason</option>",
    );
    for r in relay_core::ledger::DeadLetterReason::ALL {
        let _ = write!(
            body,
            "<option value=\"{r}\"{}>{r}</option>",
            if f.reason == Some(r) { " selected" } else { "" }
        );
    }
    let _ = write!(
        body,
        "</select><input name=\"q\" type=\"search\" placeholder=\"id or title\" value=\"{}\">\
         <button type=\"submit\">Filter</button></form>",
        esc(&f.text)
    );
    let state = f.state.map_or("", |s| s.as_str());
    let reason = f.reason.map_or("", |r| r.as_str());
    if q.matched > 0 {
        // Everything the filter matches, not only this page: the next page confirms the count.
        let _ = write!(
            body,
            "<form method=\"post\" action=\"/board/bulk\" class=\"bulk\" data-key=\"bulk\">{}\
             <input type=\"hidden\" name=\"queue\" value=\"{}\">\
             <input type=\"hidden\" name=\"state\" value=\"{state}\">\
             <input type=\"hidden\" name=\"reason\" value=\"{reason}\">\
             <input type=\"hidden\" name=\"q\" value=\"{}\">\
             <span class=\"hint\"><span class=\"n-matched\">{}</span> matching</span> \
             <button type=\"submit\" name=\"action\" value=\"retry\">Retry all</button>\
             <button type=\"submit\" name=\"action\" value=\"cancel\">Cancel all</button></form>",
            csrf_field(q.csrf),
            esc(q.queue),
            esc(&f.text),
            q.matched
        );
    }
    body.push_str(&todo_rows(q.now, q.todos));
    let link = |page: usize, label: &str| {
        format!(
            "<a href=\"?state={state}&amp;reason={reason}&amp;q={}&amp;page={page}\">{label}</a>",
            esc(&query_escape(&f.text)),
        )
    };
    body.push_str("<p class=\"pager\">");
    if q.page > 0 {
        body.push_str(&link(q.page - 1, "newer ‹"));
    }
    let _ = write!(body, " page {} ", q.page + 1);
    if q.more {
        body.push_str(&link(q.page + 1, "› older"));
    }
    body.push_str("</p>");
    page(&format!("Queue {}", q.queue), Some(q.csrf), &body)
}

/// A bulk action's page: before confirmation, the count and the confirm button; after it, the
/// progress (applied, skipped, left) and each listed todo's result.
pub fn bulk(csrf: &str, operator: &str, b: &crate::store::Bulk) -> String {
    let verb = match b.action {
        relay_core::board::BulkAction::Retry => "Retry",
        relay_core::board::BulkAction::Cancel => "Cancel",
    };
    let n = b.items.len();
    let mut body = format!(
        "<h1>{verb} all: queue {queue}</h1><p><span class=\"bulk-count\">{n}</span> todos of \
         queue <a href=\"/board/queues/{link}\">{queue}</a> matched {filter} when {operator} \
         asked.</p>",
        queue = esc(&b.queue),
        link = esc(&query_escape(&b.queue)),
        filter = esc(&b.filter),
        operator = esc(&b.operator)
    );
    if b.confirmed_at.is_none() {
        if b.operator == operator {
            let _ = write!(
                body,
                "<p class=\"hint\">Each is {} through the same transition as its own {verb} \
                 button; a todo that changed since it was listed here (claimed by a worker, retried, \
                 canceled, completed) is skipped and counted.</p>\
                 <form method=\"post\" action=\"/board/bulk/{}\" class=\"confirm\">{}\
                 <button type=\"submit\">{verb} {n} todos</button></form> \
                 <a href=\"/board/queues/{}\">Back</a>",
                if verb == "Retry" {
                    "retried"
                } else {
                    "canceled"
                },
                esc(&b.id),
                csrf_field(csrf),
                esc(&query_escape(&b.queue)),
            );
        } else {
            body.push_str("<p class=\"hint\">Not confirmed: only the operator who asked may.</p>");
        }
    } else {
        let applied = b.items.iter().filter(|i| i.applied == Some(true)).count();
        let skipped = b.items.iter().filter(|i| i.applied == Some(false)).count();
        let left = n - applied - skipped;
        let _ = write!(
            body,
            "<p class=\"progress\" data-key=\"progress\">applied <strong class=\"n-applied\">{applied}</strong>, \
             skipped <strong class=\"n-skipped\">{skipped}</strong>, left \
             <strong class=\"n-left\">{left}</strong></p>{}",
            match b.finished_at {
                Some(t) => format!("<p class=\"finished\">finished {}</p>", rfc3339(t)),
                None => String::new(),
            }
        );
        body.push_str(
            "<table class=\"bulk-items\"><thead><tr><th>todo</th><th>listed as</th>\
             <th>result</th><th>why</th></tr></thead><tbody>",
        );
        for i in &b.items {
            let _ = write!(
                body,
                "<tr data-todo=\"{0}\"><td><a href=\"/board/todos/{0}\">{0}</a></td><td>{1} \
                 (attempts {2})</td><td class=\"result\">{3}</td><td class=\"note\">{4}</td></tr>",
                esc(&i.todo_id),
                i.listed.state,
                i.listed.attempts_total,
                match i.applied {
                    Some(true) => "applied",
                    Some(false) => "skipped",
                    None => "left",
                },
                esc(i.note.as_deref().unwrap_or("")),
            );
        }
        body.push_str("</tbody></table>");
    }
    page(&format!("{verb} all: {}", b.queue), Some(csrf), &body)
}

/// Percent-encodes a query value (then escaped as an attribute by the caller).
fn query_escape(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

fn pretty(v: &Option<Value>) -> String {
    match v {
        None => "<p class=\"empty\">none</p>".into(),
        Some(v) => format!(
            "<pre>{}</pre>",
            esc(&serde_json::to_string_pretty(v).unwrap_or_default())
        ),
    }
}

/// An artifact is a link only for the handles the Board trusts; anything else stays text.
fn artifact(a: &str) -> String {
    if a.starts_with("https://") || a.starts_with("mcp://cairn/") {
        format!(
            "<a href=\"{0}\" rel=\"noreferrer noopener\">{0}</a>",
            esc(a)
        )
    } else {
        esc(a)
    }
}

fn duration(a: &Attempt) -> String {
    a.ended_at.map_or_else(
        || "open".into(),
        |e| format!("{} s", e.saturating_sub(a.claimed_at) / 1000),
    )
}

fn action(csrf: &str, id: &str, name: &str, label: &str, summary: bool) -> String {
    format!(
        "<form method=\"post\" action=\"/board/todos/{}\" class=\"action\">{}\
         <input type=\"hidden\" name=\"action\" value=\"{name}\">{}\
         <button type=\"submit\">{label}</button></form>",
        esc(id),
        csrf_field(csrf),
        if summary {
            format!(
                "<input name=\"summary\" placeholder=\"summary for {name}\" aria-label=\"summary for {name}\">"
            )
        } else {
            String::new()
        }
    )
}

/// A todo's place in the claim order, and while pending why it is not claimable yet (its
/// `run_at`, or its queue's limits: `held`).
fn waits(now: u64, t: &relay_core::ledger::Todo, held: Option<&Held>) -> Option<String> {
    match (t.priority, t.waits_until(now)) {
        (p, None) if let Some(h) = held => Some(format!("held back: {h} (priority {p})")),
        (0, None) => None,
        (p, None) => Some(format!("priority {p} (higher is claimed first)")),
        (p, Some(at)) => Some(format!(
            "waits until {}: not claimable before (priority {p})",
            rfc3339(at)
        )),
    }
}

pub fn todo(
    now: u64,
    csrf: &str,
    view: &TodoView,
    held: Option<Held>,
    error: Option<&str>,
) -> String {
    let t = &view.todo;
    let mut body = format!("<h1 data-todo=\"{}\">{}</h1>", esc(&t.id), esc(&t.title));
    if let Some(e) = error {
        body.push_str(&error_banner(e));
    }
    let _ = write!(
        body,
        "<dl class=\"fields\"><dt>id</dt><dd>{}</dd><dt>state</dt><dd class=\"state\">{}</dd>\
         <dt>queue</dt><dd><a href=\"/board/queues/{2}\">{2}</a></dd><dt>endpoint</dt><dd>{3}</dd>\
         <dt>kind</dt><dd>{4}</dd><dt>source</dt><dd>{5}</dd><dt>assignee</dt><dd>{6}</dd>\
         <dt>attempt</dt><dd>{7}/{8}</dd><dt>next retry</dt><dd>{9}</dd><dt>lease until</dt>\
         <dd>{10}</dd><dt>created</dt><dd>{11}</dd><dt>updated</dt><dd>{12} ({13} ago)</dd></dl>",
        esc(&t.id),
        esc(&state_of(t)),
        esc(&t.queue),
        esc(&t.endpoint),
        esc(t.kind.as_deref().unwrap_or("–")),
        esc(t.source.as_deref().unwrap_or("–")),
        esc(t.assignee.as_deref().unwrap_or("–")),
        t.attempt,
        t.max_attempts,
        time(t.next_retry_at),
        time(t.lease_expires_at),
        rfc3339(t.created_at),
        rfc3339(t.updated_at),
        age(now, Some(t.updated_at)),
    );
    if t.task_id.is_some() {
        // That it is a task and whose; never its id (a handle its client keeps).
        let _ = write!(
            body,
            "<p class=\"task\">An MCP task (the Tasks extension): its client, endpoint {}, \
             polls its status with tasks/get and may answer or cancel it. A task's end is final: \
             once finished it cannot be retried.</p>",
            esc(&t.endpoint)
        );
    }
    if let Some(k) = &t.concurrency_key {
        let _ = write!(body, "<p class=\"key\">concurrency_key {}</p>", esc(k));
    }
    if let Some(why) = waits(now, t, held.as_ref()) {
        let _ = write!(body, "<p class=\"schedule\">{}</p>", esc(&why));
    }
    if !t.spent.is_zero() || !t.budget.is_none() {
        let _ = write!(
            body,
            "<p class=\"spend\">spent {} of budget {}</p>",
            esc(&t.spent.describe()),
            esc(&t.budget.describe())
        );
    }
    if t.state == TodoState::InputRequired {
        body.push_str(&question(csrf, t, view.attempts.first()));
    }
    body.push_str("<div class=\"actions\">");
    for (name, label, summary) in [
        ("retry", "Retry", false),
        ("cancel", "Cancel", false),
        ("release", "Release", false),
        ("complete", "Complete", true),
        ("fail", "Fail", true),
    ] {
        body.push_str(&action(csrf, &t.id, name, label, summary));
    }
    body.push_str("</div>");
    body.push_str("<h2>Payload</h2>");
    body.push_str(&pretty(&t.payload));
    body.push_str("<h2>Result</h2>");
    body.push_str(&pretty(&t.result));
    let _ = write!(
        body,
        "<h2>Attempts</h2><p class=\"hint\">{} in all{}</p>",
        view.attempts_total,
        if view.attempts_pruned > 0 {
            format!(", {} oldest pruned", view.attempts_pruned)
        } else {
            String::new()
        }
    );
    body.push_str("<ol class=\"timeline\">");
    for a in &view.attempts {
        let died = a.outcome.is_some_and(|o| o.died());
        let _ = write!(
            body,
            "<li class=\"attempt{}\" data-seq=\"{}\"><header><strong>#{}</strong> attempt {}/{} · \
             <span class=\"outcome\">{}</span>{}{}</header>\
             <dl><dt>claimant</dt><dd>{}</dd><dt>claimer</dt><dd>{}{}</dd><dt>claimed</dt>\
             <dd>{}</dd><dt>last heartbeat</dt><dd>{}</dd><dt>ended</dt><dd>{}</dd>\
             <dt>duration</dt><dd>{}</dd><dt>disposition</dt><dd>{}</dd>{}</dl>{}{}</li>",
            if died { " died" } else { "" },
            a.seq,
            a.seq,
            a.attempt,
            t.max_attempts,
            esc(a.outcome.map_or("open", |o| o.as_str())),
            if died {
                " <span class=\"badge died\">died</span>"
            } else {
                ""
            },
            if a.summary_truncated {
                " <span class=\"badge\">summary truncated</span>"
            } else {
                ""
            },
            esc(a.claimant.as_deref().unwrap_or("–")),
            esc(a.claimer_kind.as_str()),
            a.claimer_endpoint
                .as_deref()
                .map(|e| format!(" ({})", esc(e)))
                .unwrap_or_default(),
            rfc3339(a.claimed_at),
            time(a.last_heartbeat_at),
            time(a.ended_at),
            duration(a),
            esc(a.disposition.map_or("–", |d| d.as_str())),
            a.closed_by
                .as_deref()
                .map(|o| format!("<dt>closed by</dt><dd class=\"closed-by\">{}</dd>", esc(o)))
                .unwrap_or_default(),
            a.summary
                .as_deref()
                .map(|s| format!("<p class=\"summary\">{}</p>", esc(s)))
                .unwrap_or_default(),
            a.artifact
                .as_deref()
                .map(|x| format!("<p class=\"artifact\">artifact: {}</p>", artifact(x)))
                .unwrap_or_default(),
        );
        // The question and what the attempt spent go inside its item, before it closes.
        let mut asked = String::new();
        if let Some(q) = &a.question {
            let _ = write!(
                asked,
                "<p class=\"asked\">asked: {}</p>{}",
                esc(&q.text),
                match (&q.answer, q.answered_at, &q.answered_by) {
                    (Some(ans), Some(at), Some(by)) => format!(
                        "<p class=\"answered\">answered {} by {}: {}</p>",
                        rfc3339(at),
                        esc(by),
                        esc(ans)
                    ),
                    _ => String::new(),
                }
            );
        }
        if !a.usage.is_zero() {
            let _ = write!(
                asked,
                "<p class=\"usage\">spent {}</p>",
                esc(&a.usage.describe())
            );
        }
        body.insert_str(body.len() - "</li>".len(), &asked);
    }
    body.push_str("</ol>");
    page(&t.title, Some(csrf), &body)
}

/// A waiting todo's question, prominent, with the form that answers it (the `answer` action:
/// the same operation as `answer_todo` and `relay todo answer`). The question was written by a
/// worker: it is shown as text, never as markup.
fn question(csrf: &str, t: &Todo, newest: Option<&Attempt>) -> String {
    let asked = newest.and_then(|a| a.question.as_ref());
    format!(
        "<section class=\"question\" data-key=\"question\"><h2>Waiting for an answer</h2>\
         <blockquote class=\"asked\">{}</blockquote><p class=\"hint\">asked {}{}</p>\
         <form method=\"post\" action=\"/board/todos/{}\" class=\"answer\">{}\
         <input type=\"hidden\" name=\"action\" value=\"answer\">\
         <textarea name=\"answer\" rows=\"4\" maxlength=\"8192\" required \
         aria-label=\"answer\"></textarea><button type=\"submit\">Answer</button></form></section>",
        esc(asked.map_or("", |q| q.text.as_str())),
        rfc3339(t.updated_at),
        t.asking
            .answer_due_at
            .map(|d| format!("; unanswered at {} it becomes a dead letter", rfc3339(d)))
            .unwrap_or_default(),
        esc(&t.id),
        csrf_field(csrf),
    )
}

/// What the add form shows in its fields (empty, or what was sent when it was refused).
pub struct AddValues<'a> {
    pub endpoint: &'a str,
    pub queue: &'a str,
    pub id: &'a str,
    pub title: &'a str,
    pub payload: &'a str,
}

/// The add-todo form: the owner picked from the live endpoints (only it can see and claim the
/// todo), the queue, an optional id, the title and an optional JSON payload.
pub fn add_todo(csrf: &str, owners: &[Endpoint], v: &AddValues<'_>, error: Option<&str>) -> String {
    let mut body = String::from("<h1>Add a todo</h1>");
    if let Some(e) = error {
        body.push_str(&error_banner(e));
    }
    if owners.is_empty() {
        body.push_str(
            "<p class=\"empty\">No live endpoint to own a todo; vend one with \
             <code>relay endpoint create NAME --verbs …</code>.</p>",
        );
    }
    let _ = write!(
        body,
        "<form method=\"post\" action=\"/board/add\" class=\"add\">{}\
         <label for=\"endpoint\">Owner (endpoint)</label><select id=\"endpoint\" name=\"endpoint\" required>",
        csrf_field(csrf)
    );
    for e in owners {
        let _ = write!(
            body,
            "<option value=\"{0}\"{1}>{0} ({2})</option>",
            esc(&e.name),
            if e.name == v.endpoint {
                " selected"
            } else {
                ""
            },
            esc(&e
                .queues
                .as_ref()
                .map_or("every queue".to_string(), |q| q.join(", "))),
        );
    }
    let _ = write!(
        body,
        "</select><label for=\"queue\">Queue</label>\
         <input id=\"queue\" name=\"queue\" required value=\"{}\">\
         <label for=\"id\">Id (optional)</label>\
         <input id=\"id\" name=\"id\" placeholder=\"drawn when empty\" value=\"{}\">\
         <label for=\"title\">Title</label><input id=\"title\" name=\"title\" required value=\"{}\">\
         <label for=\"payload\">Payload (JSON, optional)</label>\
         <textarea id=\"payload\" name=\"payload\" rows=\"5\">{}</textarea>\
         <button type=\"submit\">Add</button></form>",
        esc(v.queue),
        esc(v.id),
        esc(v.title),
        esc(v.payload),
    );
    page("Add a todo", Some(csrf), &body)
}

/// Every endpoint, with a Revoke button on each live one.
pub fn endpoints(csrf: &str, all: &[Endpoint], error: Option<&str>) -> String {
    let mut body = String::from("<h1>Endpoints</h1>");
    if let Some(e) = error {
        body.push_str(&error_banner(e));
    }
    if all.is_empty() {
        body.push_str(
            "<p class=\"empty\">No endpoints; vend one with \
             <code>relay endpoint create NAME --verbs …</code>.</p>",
        );
        return page("Endpoints", Some(csrf), &body);
    }
    body.push_str(
        "<table class=\"endpoints\"><thead><tr><th>name</th><th>verbs</th><th>queues</th>\
         <th>created</th><th>revoked</th><th></th></tr></thead><tbody>",
    );
    for e in all {
        let revoke = if e.revoked_at.is_none() {
            format!(
                "<form method=\"post\" action=\"/board/endpoints/{}/revoke\">{}\
                 <button type=\"submit\">Revoke</button></form>",
                esc(&e.name),
                csrf_field(csrf)
            )
        } else {
            String::new()
        };
        let _ = write!(
            body,
            "<tr data-endpoint=\"{0}\"><td>{0}</td><td>{1}</td><td>{2}</td><td>{3}</td>\
             <td class=\"revoked\">{4}</td><td>{5}</td></tr>",
            esc(&e.name),
            esc(&e.verbs.join(", ")),
            esc(&e
                .queues
                .as_ref()
                .map_or("every queue".to_string(), |q| q.join(", "))),
            rfc3339(e.created_at),
            time(e.revoked_at),
            revoke,
        );
    }
    body.push_str("</tbody></table>");
    page("Endpoints", Some(csrf), &body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_markup_character_is_escaped() {
        assert_eq!(
            esc("<script>alert('x')</script> & \"q\""),
            "&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt; &amp; &quot;q&quot;"
        );
    }

    #[test]
    fn only_trusted_artifact_handles_become_links() {
        assert!(artifact("https://ci.example/run/1").starts_with("<a "));
        assert!(artifact("mcp://cairn/notes/1").starts_with("<a "));
        assert_eq!(artifact("javascript:alert(1)"), "javascript:alert(1)");
        assert!(!artifact("http://plain.example").contains("<a"));
    }
}
