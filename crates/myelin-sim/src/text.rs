//! Text in and out of the simulated model: the tokenizer and chat template shared with the
//! router (so both compute the same token ids), and the output vocabulary with the text of each
//! output token.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::path::Path;
use std::sync::{Mutex, PoisonError};

use myelin_tokenize::fast_bpe::FastPathRefused;
use myelin_tokenize::{
    ChatTemplate, FastBpe, TemplateError, TokenizeError, Tokenizer, TokenizerSource,
};
use serde_json::Value;

use crate::engine::OutputVocabulary;

/// Plain English the output vocabulary is cut from: its tokens re-tokenise to themselves, so a
/// follow-up chat turn that quotes the answer hits the cached answer blocks, as with a real model.
const OUTPUT_PASSAGE: &str = "The simulated engine answers every request with a steady stream \
of ordinary words, chosen so that each token stands alone and the text reads like a plain \
report. It describes the weather over the harbour, the ships that come and go, the market \
by the river and the people who work there from early morning until late at night. The \
report goes on about bread and fish, about bells and boats, about the long road to the \
hills and the small houses along the way, and then it begins again from the top.";

/// Why text could not be turned into tokens.
#[derive(Debug, thiserror::Error)]
pub enum TextError {
    /// Tokenizer failure.
    #[error(transparent)]
    Tokenize(#[from] TokenizeError),
    /// Chat template failure.
    #[error(transparent)]
    Template(#[from] TemplateError),
}

/// Tokenizer, chat template and output vocabulary of the simulated model.
#[derive(Debug)]
pub struct TextModel {
    tokenizer: Tokenizer,
    /// The exact fast tokenizer path (the router's), when it reproduces `tokenizer`: it keeps
    /// the simulated engines' tokenization from crowding a laptop's cores. Shared by the
    /// engines of a process; held only for one tokenization.
    fast: Option<Mutex<FastBpe>>,
    /// The ids `tokenizer` puts before a completion prompt when it only prepends them (BOS).
    completion_prefix: Option<Vec<u32>>,
    template: ChatTemplate,
    vocabulary: OutputVocabulary,
    token_text: HashMap<u32, String>,
}

impl TextModel {
    /// Loads the tokenizer (`None`: the bundled one) and chat template (`None`: ChatML).
    pub fn load(tokenizer: Option<&Path>, chat_template: Option<&Path>) -> Result<Self, TextError> {
        let source = TokenizerSource::from_option(tokenizer);
        let tokenizer = Tokenizer::load(&source)?;
        let fast = match FastBpe::verified_source(&source, &tokenizer) {
            Ok(fast) => Some(Mutex::new(fast)),
            Err(FastPathRefused::Load(error)) => return Err(error.into()),
            Err(FastPathRefused::Unsupported(_) | FastPathRefused::Disagrees(_)) => None,
        };
        let completion_prefix = tokenizer.completion_prefix();
        let template = match chat_template {
            Some(path) => ChatTemplate::from_path(path)?,
            None => ChatTemplate::chatml(),
        };
        let output_ids = tokenizer.encode(OUTPUT_PASSAGE, false)?;
        let mut token_text = HashMap::with_capacity(output_ids.len());
        for &id in &output_ids {
            if let Entry::Vacant(slot) = token_text.entry(id) {
                slot.insert(tokenizer.decode(&[id])?);
            }
        }
        Ok(TextModel {
            tokenizer,
            fast,
            completion_prefix,
            template,
            vocabulary: OutputVocabulary::new(output_ids),
            token_text,
        })
    }

    /// The output vocabulary for the engine model.
    pub fn vocabulary(&self) -> OutputVocabulary {
        self.vocabulary.clone()
    }

    /// Prompt tokens of a `/v1/completions` prompt string (with the BOS, as vLLM adds it).
    pub fn encode_prompt(&self, prompt: &str) -> Result<Vec<u32>, TextError> {
        match (&self.fast, &self.completion_prefix) {
            (Some(fast), Some(prefix)) => {
                let mut ids = prefix.clone();
                fast.lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .encode(prompt, &mut ids);
                Ok(ids)
            }
            _ => Ok(self.tokenizer.encode(prompt, true)?),
        }
    }

    /// Prompt tokens of a chat: the rendered template (which writes its own BOS), tokenised
    /// without special tokens.
    pub fn encode_chat(&self, messages: &Value) -> Result<Vec<u32>, TextError> {
        self.encode_chat_with_tools(messages, None)
    }

    /// [`Self::encode_chat`] with the request's `tools`, which the chat template may write
    /// into the prompt (vLLM passes them to the template).
    pub fn encode_chat_with_tools(
        &self,
        messages: &Value,
        tools: Option<&Value>,
    ) -> Result<Vec<u32>, TextError> {
        let rendered = self.template.render_with_tools(messages, tools, true)?;
        match &self.fast {
            Some(fast) => {
                let mut ids = Vec::new();
                fast.lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .encode(&rendered, &mut ids);
                Ok(ids)
            }
            None => Ok(self.tokenizer.encode(&rendered, false)?),
        }
    }

    /// Whether the fast tokenizer path is in use.
    pub fn uses_fast_path(&self) -> bool {
        self.fast.is_some()
    }

    /// Text of one output token.
    pub fn token_text(&self, token_id: u32) -> String {
        match self.token_text.get(&token_id) {
            Some(text) => text.clone(),
            None => self.tokenizer.decode(&[token_id]).unwrap_or_default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_fast_path_gives_the_tokenizers_ids() {
        let model = TextModel::load(None, None).unwrap();
        assert!(model.uses_fast_path(), "the bundled tokenizer has one");
        let hf = Tokenizer::bundled().unwrap();
        let prompt = "Once upon a time, 12345 ships sailed   to 東京 🚢 — and back.\n\n  Done.";
        assert_eq!(
            model.encode_prompt(prompt).unwrap(),
            hf.encode(prompt, true).unwrap()
        );
        let messages = json!([
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": prompt},
        ]);
        let rendered = ChatTemplate::chatml().render(&messages, true).unwrap();
        assert_eq!(
            model.encode_chat(&messages).unwrap(),
            hf.encode(&rendered, false).unwrap()
        );
    }
}
