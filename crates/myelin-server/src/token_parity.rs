//! Tokenization parity: the router routes by its own token ids, which are only worth anything
//! if they are the engine's. Each engine answer's `usage.prompt_tokens` says how many tokens the
//! engine saw; when it differs from the router's count for the same request, the router's
//! prefixes do not line up with the engine's blocks (a wrong chat template or tokenizer
//! silently gives zero overlap). Mismatches are counted per backend
//! (`myelin_tokenization_mismatch_total{backend}`), the last one is kept for
//! `GET /admin/backends`, and the first one per backend is logged with both counts and the
//! likely cause.
//!
//! The record is process-wide, one slot per backend, touched only when counts differ (never on
//! a healthy request path) and when the admin API lists backends. The request path never waits
//! on a lock for it, even when every answer differs (a misconfigured deployment): each data
//! core keeps its own handle on a backend's slot (the process-wide map is locked once per
//! backend and core), the count and the metric are atomics, and the last mismatch is replaced
//! only when its lock is free at once (under contention a core's mismatch may not become the
//! shown "last"; it is still counted).

use crate::backends::BackendId;
use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::{Value, json};

/// Which endpoint the request went to: chats are rendered through a template first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PromptKind {
    Chat,
    Completion,
}

/// One request whose token counts differ.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mismatch {
    /// Tokens the router counted for the prompt.
    pub router_tokens: u64,
    /// `usage.prompt_tokens` from the engine.
    pub engine_tokens: u64,
    pub kind: PromptKind,
    /// When it was seen, milliseconds since the Unix epoch.
    pub at_unix_ms: u64,
}

impl Mismatch {
    /// The likely cause, from the size of the difference.
    pub fn likely_cause(&self) -> &'static str {
        likely_cause(self.router_tokens, self.engine_tokens, self.kind)
    }

    pub fn to_json(&self) -> Value {
        json!({
            "router_prompt_tokens": self.router_tokens,
            "engine_prompt_tokens": self.engine_tokens,
            "api": match self.kind {
                PromptKind::Chat => "chat",
                PromptKind::Completion => "completions",
            },
            "likely_cause": self.likely_cause(),
            "at_unix_ms": self.at_unix_ms,
        })
    }
}

/// Chat templates differ by a few tokens per message (role headers, turn markers); more than
/// this per request points at the tokenizer itself.
const TEMPLATE_DIFFERENCE_MAX: u64 = 64;

/// The likely cause of a difference between the router's and the engine's prompt tokens.
pub fn likely_cause(router_tokens: u64, engine_tokens: u64, kind: PromptKind) -> &'static str {
    let difference = router_tokens.abs_diff(engine_tokens);
    if difference == 1 && kind == PromptKind::Chat {
        "an added BOS token or a line break: one side adds a beginning-of-sequence token the \
         other does not (the tokenizer's add_bos_token, or a template that writes its own \
         bos_token), or the chat template's whitespace renders differently (give myelin serve \
         the engine model's --chat-template; myelin renders it with trim_blocks and \
         lstrip_blocks, as Hugging Face and vLLM do)"
    } else if difference == 1 {
        "an added BOS token: one side adds a beginning-of-sequence token the other does not \
         (the tokenizer's add_bos_token, or a template that writes its own bos_token)"
    } else if kind == PromptKind::Chat && difference <= TEMPLATE_DIFFERENCE_MAX {
        "the chat template: the engine renders the messages with other role headers or turn \
         markers than the router (give myelin serve the engine model's --chat-template)"
    } else {
        "the tokenizer: the engine splits the text into other tokens than the router (give \
         myelin serve the engine model's --tokenizer)"
    }
}

/// What the router knows about one backend's parity.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BackendParity {
    /// Requests whose counts differed.
    pub mismatches: u64,
    pub last: Option<Mismatch>,
}

/// One backend's record.
struct Slot {
    mismatches: AtomicU64,
    last: Mutex<Option<Mismatch>>,
    counter: metrics::Counter,
}

static SLOTS: Mutex<Option<HashMap<BackendId, Arc<Slot>>>> = Mutex::new(None);

thread_local! {
    /// This thread's handles on the slots it has used.
    static HANDLES: RefCell<HashMap<BackendId, Arc<Slot>>> = RefCell::new(HashMap::new());
}

/// `backend`'s slot, created on its first mismatch in the process.
fn slot(backend: BackendId) -> Arc<Slot> {
    HANDLES.with(|handles| {
        if let Some(slot) = handles.borrow().get(&backend) {
            return slot.clone();
        }
        let slot = SLOTS
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .get_or_insert_with(HashMap::new)
            .entry(backend)
            .or_insert_with(|| {
                Arc::new(Slot {
                    mismatches: AtomicU64::new(0),
                    last: Mutex::new(None),
                    counter: metrics::counter!(
                        crate::metrics::TOKENIZATION_MISMATCH_TOTAL,
                        "backend" => crate::metrics::backend_label(backend)
                    ),
                })
            })
            .clone();
        handles.borrow_mut().insert(backend, slot.clone());
        slot
    })
}

/// Compares the router's count with the engine's for one answered request of `backend` (at
/// `url`, for the log). Returns whether they differ; on a difference counts it, keeps it as
/// the backend's last, and logs it if it is the backend's first.
pub fn check(
    backend: BackendId,
    url: &str,
    router_tokens: u64,
    engine_tokens: u64,
    kind: PromptKind,
) -> bool {
    if router_tokens == engine_tokens {
        return false;
    }
    let slot = slot(backend);
    slot.counter.increment(1);
    let mismatch = Mismatch {
        router_tokens,
        engine_tokens,
        kind,
        at_unix_ms: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |since| since.as_millis() as u64),
    };
    let first = slot.mismatches.fetch_add(1, Ordering::Relaxed) == 0;
    if let Ok(mut last) = slot.last.try_lock() {
        *last = Some(mismatch.clone());
    }
    if first {
        eprintln!(
            "myelin: WARNING tokenization mismatch on backend {backend} ({url}): the router counted {} \
             prompt tokens, the engine {} ({}); likely cause: {}. Prefix routing cannot match \
             this engine's cache until they agree (myelin_tokenization_mismatch_total counts \
             every mismatch; GET /admin/backends shows the last).",
            mismatch.router_tokens,
            mismatch.engine_tokens,
            match kind {
                PromptKind::Chat => "chat",
                PromptKind::Completion => "completion",
            },
            mismatch.likely_cause()
        );
    }
    true
}

/// The parity record of `backend`, for `GET /admin/backends`.
pub fn of(backend: BackendId) -> BackendParity {
    let slot = SLOTS
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .as_ref()
        .and_then(|slots| slots.get(&backend).cloned());
    slot.map_or_else(BackendParity::default, |slot| BackendParity {
        mismatches: slot.mismatches.load(Ordering::Relaxed),
        last: slot
            .last
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn causes_follow_the_size_of_the_difference() {
        assert!(likely_cause(100, 101, PromptKind::Chat).contains("BOS"));
        assert!(likely_cause(100, 101, PromptKind::Chat).contains("trim_blocks"));
        assert!(likely_cause(101, 100, PromptKind::Completion).contains("BOS"));
        assert!(!likely_cause(101, 100, PromptKind::Completion).contains("trim_blocks"));
        assert!(likely_cause(100, 112, PromptKind::Chat).contains("chat template"));
        assert!(likely_cause(100, 112, PromptKind::Completion).contains("tokenizer"));
        assert!(likely_cause(1000, 1300, PromptKind::Chat).contains("tokenizer"));
    }

    #[test]
    fn mismatches_are_counted_per_backend_and_the_last_is_kept() {
        let (backend, url) = (9_001, "http://parity-test:1");
        assert!(!check(BackendId(backend), url, 50, 50, PromptKind::Chat));
        assert_eq!(of(BackendId(backend)), BackendParity::default());
        assert!(check(BackendId(backend), url, 50, 58, PromptKind::Chat));
        assert!(check(
            BackendId(backend),
            url,
            70,
            71,
            PromptKind::Completion
        ));
        let parity = of(BackendId(backend));
        assert_eq!(parity.mismatches, 2);
        let last = parity.last.unwrap();
        assert_eq!((last.router_tokens, last.engine_tokens), (70, 71));
        let json = last.to_json();
        assert_eq!(json["api"], "completions");
        assert!(json["likely_cause"].as_str().unwrap().contains("BOS"));
        assert_eq!(of(BackendId(9_002)).mismatches, 0);
    }

    #[test]
    fn mismatches_from_many_threads_are_all_counted() {
        let backend = 9_003;
        let threads: Vec<_> = (0..4)
            .map(|_| {
                std::thread::spawn(move || {
                    for _ in 0..250 {
                        assert!(check(
                            BackendId(backend),
                            "http://parity-threads:1",
                            10,
                            11,
                            PromptKind::Completion
                        ));
                    }
                })
            })
            .collect();
        for thread in threads {
            thread.join().unwrap();
        }
        let parity = of(BackendId(backend));
        assert_eq!(parity.mismatches, 1000);
        assert_eq!(parity.last.map(|last| last.engine_tokens), Some(11));
    }
}
