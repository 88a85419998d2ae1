//! The token ids an engine computes for a text request, for the oracle's probe: the simulated
//! engines' own text model (crates/myelin-sim, text.rs: completions prompts with special
//! tokens, chat messages rendered with ChatML and tokenized without them, on the exact fast
//! tokenizer path when it applies), so the probe and the engines cannot disagree.

use myelin_sim::text::{TextError, TextModel};

use crate::request_body::chat_messages;
use crate::workload::{Api, PlannedRequest, PromptFormat, TokenAlphabet};

/// Tokenizes requests the way the simulated engines do.
pub struct EngineTokenizer {
    text: TextModel,
    /// Whether encoding with special tokens adds any (a BOS). When it adds none, a text
    /// completions prompt made of the alphabet's single-token words tokenizes to exactly the
    /// planned ids, and tokenizing it again on every request is skipped.
    adds_special_tokens: bool,
}

impl EngineTokenizer {
    /// The bundled tokenizer and the ChatML template (the simulated engines' defaults).
    pub fn bundled() -> Result<Self, TextError> {
        let text = TextModel::load(None, None)?;
        let adds_special_tokens = !text.encode_prompt("")?.is_empty();
        Ok(Self {
            text,
            adds_special_tokens,
        })
    }

    /// The prompt token ids an engine will compute for `request`.
    pub fn engine_tokens(
        &self,
        api: Api,
        format: PromptFormat,
        request: &PlannedRequest,
        alphabet: &TokenAlphabet,
    ) -> Result<Vec<u32>, String> {
        let ids = match (api, format) {
            (Api::Completions, PromptFormat::TokenIds) => return Ok(request.tokens.clone()),
            (Api::Completions, PromptFormat::Text) if !self.adds_special_tokens => {
                return Ok(request.tokens.clone());
            }
            (Api::Completions, PromptFormat::Text) => {
                self.text.encode_prompt(&alphabet.render(&request.tokens))
            }
            (Api::Chat, _) => self.text.encode_chat(&chat_messages(request, alphabet)),
        };
        ids.map_err(|error| error.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_completions_tokenize_to_the_planned_ids_and_chat_adds_the_template() {
        let engine = EngineTokenizer::bundled().unwrap();
        let path = myelin_tokenize::bundled_tokenizer_path().unwrap();
        let alphabet = TokenAlphabet::words_from_tokenizer(&path).unwrap();
        let request = PlannedRequest {
            tokens: (0..300)
                .map(|draw| alphabet.pick(crate::rng::draw(1, 2, draw)))
                .collect(),
            shared_len: 200,
            output_tokens: 1,
            label: 0,
        };
        let completions = engine
            .engine_tokens(Api::Completions, PromptFormat::Text, &request, &alphabet)
            .unwrap();
        assert!(completions.ends_with(&request.tokens));
        let encoded = myelin_tokenize::Tokenizer::bundled()
            .unwrap()
            .encode(&alphabet.render(&request.tokens), true)
            .unwrap();
        assert_eq!(completions, encoded);
        let chat = engine
            .engine_tokens(Api::Chat, PromptFormat::Text, &request, &alphabet)
            .unwrap();
        assert!(chat.len() > request.tokens.len());
        // The system message's words appear verbatim in the templated ids.
        assert!(
            chat.windows(200)
                .any(|window| window == &request.tokens[..200])
        );
    }
}
