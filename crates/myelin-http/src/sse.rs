//! Incremental Server-Sent Events parsing (the subset OpenAI-style streams use: `data:`,
//! `event:`, comments, CRLF or LF line ends), fed arbitrary chunk boundaries.

/// One dispatched event.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SseEvent {
    /// The `event:` field, if any.
    pub event: Option<String>,
    /// The `data:` lines joined with `\n`.
    pub data: String,
}

impl SseEvent {
    /// True for OpenAI's end-of-stream sentinel `data: [DONE]`.
    pub fn is_done(&self) -> bool {
        self.data == "[DONE]"
    }
}

/// Buffers partial lines between chunks.
#[derive(Debug, Default)]
pub struct SseParser {
    line: Vec<u8>,
    current: SseEvent,
    has_data: bool,
}

impl SseParser {
    /// A parser at the start of a stream.
    pub fn new() -> Self {
        Self::default()
    }

    /// Feeds a chunk; returns the events it completed.
    pub fn feed(&mut self, chunk: &[u8]) -> Vec<SseEvent> {
        let mut events = Vec::new();
        for &byte in chunk {
            if byte == b'\n' {
                if self.line.last() == Some(&b'\r') {
                    self.line.pop();
                }
                let line = std::mem::take(&mut self.line);
                self.process_line(&line, &mut events);
            } else {
                self.line.push(byte);
            }
        }
        events
    }

    fn process_line(&mut self, line: &[u8], events: &mut Vec<SseEvent>) {
        if line.is_empty() {
            if self.has_data || self.current.event.is_some() {
                events.push(std::mem::take(&mut self.current));
                self.has_data = false;
            }
            return;
        }
        if line[0] == b':' {
            return;
        }
        let text = String::from_utf8_lossy(line);
        let (field, value) = match text.split_once(':') {
            Some((field, value)) => (field, value.strip_prefix(' ').unwrap_or(value)),
            None => (text.as_ref(), ""),
        };
        match field {
            "data" => {
                if self.has_data {
                    self.current.data.push('\n');
                }
                self.current.data.push_str(value);
                self.has_data = true;
            }
            "event" => self.current.event = Some(value.to_string()),
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_events_across_arbitrary_chunks() {
        let stream = b"data: {\"a\":1}\n\n: keep-alive\r\n\r\nevent: error\ndata: x\ndata: y\r\n\r\ndata: [DONE]\n\n";
        for split in 0..stream.len() {
            let mut parser = SseParser::new();
            let mut events = parser.feed(&stream[..split]);
            events.extend(parser.feed(&stream[split..]));
            assert_eq!(events.len(), 3, "split at {split}");
            assert_eq!(events[0].data, "{\"a\":1}");
            assert_eq!(events[1].event.as_deref(), Some("error"));
            assert_eq!(events[1].data, "x\ny");
            assert!(events[2].is_done());
        }
    }

    #[test]
    fn incomplete_event_is_not_dispatched() {
        let mut parser = SseParser::new();
        assert!(parser.feed(b"data: partial\n").is_empty());
        assert_eq!(parser.feed(b"\n").len(), 1);
    }

    proptest::proptest! {
        /// Engine streams are untrusted bytes: any input parses without panicking, and the
        /// events do not depend on where the network split the chunks.
        #[test]
        fn any_bytes_any_split_same_events(
            stream in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..512),
            split in 0usize..512,
        ) {
            let split = split.min(stream.len());
            let mut whole = SseParser::new();
            let expected = whole.feed(&stream);
            let mut parts = SseParser::new();
            let mut events = parts.feed(&stream[..split]);
            events.extend(parts.feed(&stream[split..]));
            proptest::prop_assert_eq!(events, expected);
        }
    }
}
