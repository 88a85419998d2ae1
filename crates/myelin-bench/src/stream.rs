//! Reading one OpenAI-style SSE response: when the first content token arrived, how many
//! tokens came, what `usage` said, whether the stream ended properly. Pure: fed events and
//! times, so it is tested without a socket.

use std::borrow::Cow;
use std::time::Instant;

use myelin_http::sse::SseEvent;
use serde::Deserialize;

#[derive(Deserialize)]
struct StreamChunk<'a> {
    #[serde(default, borrow)]
    choices: Vec<ChunkChoice<'a>>,
    #[serde(default)]
    usage: Option<ChunkUsage>,
    #[serde(default)]
    error: Option<serde_json::Value>,
}

#[derive(Deserialize)]
struct ChunkChoice<'a> {
    /// `/v1/completions`.
    #[serde(default, borrow)]
    text: Option<Cow<'a, str>>,
    /// `/v1/chat/completions`.
    #[serde(default, borrow)]
    delta: Option<ChunkDelta<'a>>,
}

#[derive(Deserialize)]
struct ChunkDelta<'a> {
    #[serde(default, borrow)]
    content: Option<Cow<'a, str>>,
}

#[derive(Deserialize)]
struct ChunkUsage {
    #[serde(default)]
    prompt_tokens: Option<u32>,
    #[serde(default)]
    completion_tokens: Option<u32>,
    #[serde(default)]
    prompt_tokens_details: Option<PromptTokensDetails>,
}

#[derive(Deserialize)]
struct PromptTokensDetails {
    #[serde(default)]
    cached_tokens: Option<u32>,
}

/// What a finished stream said.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StreamSummary {
    pub first_token_at: Option<Instant>,
    /// Chunks carrying content.
    pub content_chunks: u32,
    pub prompt_tokens: Option<u32>,
    pub completion_tokens: Option<u32>,
    pub cached_tokens: Option<u32>,
}

/// The state of a stream being read.
#[derive(Debug, Default)]
pub struct StreamReader {
    summary: StreamSummary,
    done: bool,
}

impl StreamReader {
    /// A reader at the start of a stream.
    pub fn new() -> Self {
        Self::default()
    }

    /// Whether `data: [DONE]` arrived.
    pub fn is_done(&self) -> bool {
        self.done
    }

    /// Takes one event that arrived at `now`. An error event or an `error` object ends the
    /// request as failed.
    pub fn on_event(&mut self, event: &SseEvent, now: Instant) -> Result<(), String> {
        if event.is_done() {
            self.done = true;
            return Ok(());
        }
        if event.event.as_deref() == Some("error") {
            return Err(format!("error event: {}", truncate(&event.data)));
        }
        let chunk: StreamChunk<'_> = serde_json::from_str(&event.data)
            .map_err(|error| format!("bad chunk ({error}): {}", truncate(&event.data)))?;
        if let Some(error) = chunk.error {
            return Err(format!("error in stream: {}", truncate(&error.to_string())));
        }
        // A completions chunk is sent for generated tokens, so its `text` marks one even when
        // empty (a token whose text the engine withholds: a special token, or part of a
        // multi-byte character). A chat delta must carry text: the first chunk is the role's,
        // with empty content and no token.
        let has_content = chunk.choices.iter().any(|choice| match &choice.text {
            Some(_) => true,
            None => choice
                .delta
                .as_ref()
                .and_then(|delta| delta.content.as_deref())
                .is_some_and(|text| !text.is_empty()),
        });
        if has_content {
            self.summary.content_chunks += 1;
            self.summary.first_token_at.get_or_insert(now);
        }
        if let Some(usage) = chunk.usage {
            self.summary.prompt_tokens = usage.prompt_tokens.or(self.summary.prompt_tokens);
            self.summary.completion_tokens =
                usage.completion_tokens.or(self.summary.completion_tokens);
            if let Some(cached) = usage
                .prompt_tokens_details
                .and_then(|details| details.cached_tokens)
            {
                self.summary.cached_tokens = Some(cached);
            }
        }
        Ok(())
    }

    /// Ends the stream: it must have carried content and `[DONE]`.
    pub fn finish(self) -> Result<StreamSummary, (String, StreamSummary)> {
        if !self.done {
            return Err(("stream ended without [DONE]".into(), self.summary));
        }
        if self.summary.first_token_at.is_none() {
            return Err(("stream carried no content token".into(), self.summary));
        }
        Ok(self.summary)
    }
}

fn truncate(text: &str) -> &str {
    match text.char_indices().nth(200) {
        Some((cut, _)) => &text[..cut],
        None => text,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(text: &str) -> SseEvent {
        SseEvent {
            event: None,
            data: text.into(),
        }
    }

    #[test]
    fn first_content_token_is_the_ttft_not_the_role_chunk() {
        let start = Instant::now();
        let later = start + std::time::Duration::from_millis(5);
        let mut reader = StreamReader::new();
        reader
            .on_event(
                &data(r#"{"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}"#),
                start,
            )
            .unwrap();
        reader
            .on_event(
                &data(r#"{"choices":[{"index":0,"delta":{"content":"Hi"}}],"usage":null}"#),
                later,
            )
            .unwrap();
        reader
            .on_event(
                &data(r#"{"choices":[],"usage":{"prompt_tokens":10,"completion_tokens":2,"total_tokens":12,"prompt_tokens_details":{"cached_tokens":8}}}"#),
                later,
            )
            .unwrap();
        reader.on_event(&data("[DONE]"), later).unwrap();
        let summary = reader.finish().unwrap();
        assert_eq!(summary.first_token_at, Some(later));
        assert_eq!(summary.content_chunks, 1);
        assert_eq!(
            (
                summary.prompt_tokens,
                summary.completion_tokens,
                summary.cached_tokens
            ),
            (Some(10), Some(2), Some(8))
        );
    }

    #[test]
    fn an_empty_completions_text_is_a_token_an_empty_chat_delta_is_not() {
        let start = Instant::now();
        let later = start + std::time::Duration::from_millis(5);
        let mut reader = StreamReader::new();
        // vLLM withholds the text of a token that ends inside a multi-byte character.
        reader
            .on_event(&data(r#"{"choices":[{"text":"","index":0}]}"#), start)
            .unwrap();
        reader
            .on_event(&data(r#"{"choices":[{"text":"é","index":0}]}"#), later)
            .unwrap();
        reader.on_event(&data("[DONE]"), later).unwrap();
        let summary = reader.finish().unwrap();
        assert_eq!(
            (summary.first_token_at, summary.content_chunks),
            (Some(start), 2)
        );

        let mut reader = StreamReader::new();
        reader
            .on_event(
                &data(r#"{"choices":[{"index":0,"delta":{"content":""}}]}"#),
                start,
            )
            .unwrap();
        reader.on_event(&data("[DONE]"), later).unwrap();
        assert_eq!(
            reader.finish().unwrap_err().0,
            "stream carried no content token"
        );
    }

    #[test]
    fn completions_text_counts_and_broken_streams_fail() {
        let now = Instant::now();
        let mut reader = StreamReader::new();
        reader
            .on_event(&data(r#"{"choices":[{"text":" a","index":0}]}"#), now)
            .unwrap();
        assert_eq!(
            reader.finish().unwrap_err().0,
            "stream ended without [DONE]"
        );

        let mut reader = StreamReader::new();
        reader.on_event(&data("[DONE]"), now).unwrap();
        assert_eq!(
            reader.finish().unwrap_err().0,
            "stream carried no content token"
        );

        let mut reader = StreamReader::new();
        let error = SseEvent {
            event: Some("error".into()),
            data: "{\"error\":{\"message\":\"upstream broke\"}}".into(),
        };
        assert!(
            reader
                .on_event(&error, now)
                .unwrap_err()
                .contains("upstream broke")
        );
        assert!(
            reader
                .on_event(&data(r#"{"error":{"message":"x"}}"#), now)
                .is_err()
        );
        assert!(reader.on_event(&data("not json"), now).is_err());
    }
}
