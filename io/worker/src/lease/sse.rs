//! Server-sent events, parsed incrementally: bytes in as they arrive, whole events out.
//!
//! The rules are the WHATWG event-stream ones that matter to an MCP client: lines end in LF,
//! CRLF or a lone CR (also when a CRLF is split across two chunks); a line starting with `:` is
//! a comment; `field: value` drops one space after the colon; `data` lines accumulate joined by
//! `\n`; an empty line dispatches the event, and an event without data is dropped; `id` (without
//! a NUL) sets the last event id, which persists across events; `retry` takes digits only.

/// One dispatched event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SseEvent {
    /// The `event` field; `None` means the default type, `message`.
    pub event: Option<String>,
    pub data: String,
    /// The last event id seen on the stream when this event was dispatched.
    pub id: Option<String>,
    /// A `retry` hint in milliseconds, when this event carried one.
    pub retry: Option<u64>,
}

/// The incremental parser. Feed it chunks with [`SseParser::push`].
#[derive(Debug, Default)]
pub struct SseParser {
    /// Bytes of a line not yet terminated (kept as bytes so a UTF-8 character split across
    /// chunks survives).
    line: Vec<u8>,
    /// The previous chunk ended in CR: an LF opening the next one belongs to it.
    after_cr: bool,
    /// A line has ended before: only the first line may start with a BOM, which is ignored.
    started: bool,
    event: Option<String>,
    data: String,
    has_data: bool,
    last_id: Option<String>,
    retry: Option<u64>,
}

impl SseParser {
    pub fn new() -> SseParser {
        SseParser::default()
    }

    /// The last event id the stream set (for `Last-Event-ID` on a reconnect).
    pub fn last_event_id(&self) -> Option<&str> {
        self.last_id.as_deref()
    }

    /// Consumes a chunk, returning the events it completed.
    pub fn push(&mut self, chunk: &[u8]) -> Vec<SseEvent> {
        let mut out = Vec::new();
        for &b in chunk {
            let after_cr = std::mem::take(&mut self.after_cr);
            match b {
                b'\n' if after_cr => {}
                b'\n' => self.end_line(&mut out),
                b'\r' => {
                    self.end_line(&mut out);
                    self.after_cr = true;
                }
                _ => self.line.push(b),
            }
        }
        out
    }

    fn end_line(&mut self, out: &mut Vec<SseEvent>) {
        let mut line = String::from_utf8_lossy(&std::mem::take(&mut self.line)).into_owned();
        if !std::mem::replace(&mut self.started, true)
            && let Some(rest) = line.strip_prefix('\u{feff}')
        {
            line = rest.to_string();
        }
        if line.is_empty() {
            self.dispatch(out);
            return;
        }
        if line.starts_with(':') {
            return;
        }
        let (field, value) = match line.split_once(':') {
            Some((f, v)) => (f, v.strip_prefix(' ').unwrap_or(v)),
            None => (line.as_str(), ""),
        };
        match field {
            "event" => self.event = Some(value.to_string()),
            "data" => {
                if self.has_data {
                    self.data.push('\n');
                }
                self.data.push_str(value);
                self.has_data = true;
            }
            "id" if !value.contains('\0') => {
                self.last_id = (!value.is_empty()).then(|| value.to_string());
            }
            "retry" if !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit()) => {
                self.retry = value.parse().ok();
            }
            _ => {}
        }
    }

    fn dispatch(&mut self, out: &mut Vec<SseEvent>) {
        let event = self.event.take();
        let retry = self.retry.take();
        if !std::mem::take(&mut self.has_data) {
            return;
        }
        out.push(SseEvent {
            event,
            data: std::mem::take(&mut self.data),
            id: self.last_id.clone(),
            retry,
        });
    }
}

/// Every complete event in `body` (a whole SSE document, such as a POST answered as a stream).
pub fn parse_sse(body: &[u8]) -> Vec<SseEvent> {
    SseParser::new().push(body)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(events: &[SseEvent]) -> Vec<&str> {
        events.iter().map(|e| e.data.as_str()).collect()
    }

    #[test]
    fn one_event_per_blank_line() {
        let events = parse_sse(b"data: a\n\ndata: b\n\n");
        assert_eq!(data(&events), ["a", "b"]);
        assert_eq!(events[0].event, None);
    }

    #[test]
    fn multi_line_data_is_joined_with_newlines() {
        let events = parse_sse(b"data: {\"a\":\ndata:  1}\ndata\n\n");
        assert_eq!(data(&events), ["{\"a\":\n 1}\n"]);
    }

    #[test]
    fn comments_and_unknown_fields_are_ignored() {
        let events = parse_sse(b": keep-alive\n\n:another\nfoo: bar\ndata: x\n\n");
        assert_eq!(data(&events), ["x"]);
    }

    #[test]
    fn an_event_without_data_is_dropped() {
        let events = parse_sse(b"event: ping\n\nid: 7\n\ndata: y\n\n");
        assert_eq!(data(&events), ["y"]);
        // The event type does not leak into the next event; the id persists.
        assert_eq!(events[0].event, None);
        assert_eq!(events[0].id.as_deref(), Some("7"));
    }

    #[test]
    fn crlf_and_lone_cr_end_lines() {
        let events = parse_sse(b"event: message\r\ndata: a\r\n\r\ndata: b\r\rdata: c\n\n");
        assert_eq!(data(&events), ["a", "b", "c"]);
        assert_eq!(events[0].event.as_deref(), Some("message"));
    }

    #[test]
    fn chunks_split_anywhere_give_the_same_events() {
        let doc = "\u{feff}id: 1\r\nevent: message\r\ndata: {\"method\":\"notifications/todo_ready\",\"x\":\"é\"}\r\n\r\n: c\r\ndata: two\r\n\r\n";
        let whole = parse_sse(doc.as_bytes());
        assert_eq!(whole.len(), 2);
        for split in 0..doc.len() {
            let mut p = SseParser::new();
            let mut got = p.push(&doc.as_bytes()[..split]);
            got.extend(p.push(&doc.as_bytes()[split..]));
            assert_eq!(got, whole, "split at {split}");
        }
        assert_eq!(whole[0].id.as_deref(), Some("1"));
        assert!(whole[0].data.contains('é'));
    }

    #[test]
    fn retry_takes_digits_only_and_an_unterminated_event_waits() {
        let mut p = SseParser::new();
        let events = p.push(b"retry: 1500\ndata: a\n\nretry: 1x\ndata: b\n\ndata: pending\n");
        assert_eq!(events[0].retry, Some(1500));
        assert_eq!(events[1].retry, None);
        assert_eq!(events.len(), 2);
        assert_eq!(data(&p.push(b"\n")), ["pending"]);
    }
}
