//! Turning a planned request into an OpenAI request body (token-id or text prompt, completions
//! or chat), streaming with usage, exactly `output_tokens` generated.

use std::fmt::Write;

use crate::workload::{Api, PlannedRequest, PromptFormat, TokenAlphabet};

/// The path a request goes to.
pub fn endpoint_path(api: Api) -> &'static str {
    match api {
        Api::Completions => "/v1/completions",
        Api::Chat => "/v1/chat/completions",
    }
}

/// The JSON body for `request`. Token-id prompts are written directly (a 8k-token prompt is a
/// 50 KB array; building a `serde_json::Value` of it would cost more than the rest).
pub fn request_body(
    api: Api,
    format: PromptFormat,
    model: &str,
    request: &PlannedRequest,
    alphabet: &TokenAlphabet,
) -> String {
    let model_json = serde_json::Value::String(model.to_string()).to_string();
    let mut body = String::with_capacity(request.tokens.len() * 7 + 256);
    let _ = write!(body, "{{\"model\":{model_json},");
    match (api, format) {
        (Api::Completions, PromptFormat::TokenIds) => {
            body.push_str("\"prompt\":[");
            for (position, token) in request.tokens.iter().enumerate() {
                if position > 0 {
                    body.push(',');
                }
                let _ = write!(body, "{token}");
            }
            body.push_str("],");
        }
        (Api::Completions, PromptFormat::Text) => {
            let text = serde_json::Value::String(alphabet.render(&request.tokens)).to_string();
            let _ = write!(body, "\"prompt\":{text},");
        }
        // Token-id chat is rejected when the workload is validated; render text regardless.
        (Api::Chat, _) => {
            let _ = write!(body, "\"messages\":{},", chat_messages(request, alphabet));
        }
    }
    let _ = write!(
        body,
        "\"max_tokens\":{0},\"ignore_eos\":true,\"temperature\":0,\"stream\":true,\
         \"stream_options\":{{\"include_usage\":true}}}}",
        request.output_tokens
    );
    body
}

/// The chat messages of a planned request: the shared part as the system message, the rest as
/// the user message (one user message when there is no split).
pub fn chat_messages(request: &PlannedRequest, alphabet: &TokenAlphabet) -> serde_json::Value {
    let split = request.shared_len.min(request.tokens.len());
    let messages = if split > 0 && split < request.tokens.len() {
        vec![
            serde_json::json!({"role": "system", "content": alphabet.render(&request.tokens[..split])}),
            serde_json::json!({"role": "user", "content": alphabet.render(&request.tokens[split..])}),
        ]
    } else {
        vec![serde_json::json!({"role": "user", "content": alphabet.render(&request.tokens)})]
    };
    serde_json::Value::Array(messages)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn planned() -> PlannedRequest {
        PlannedRequest {
            tokens: vec![1001, 1002, 1003],
            shared_len: 2,
            output_tokens: 400,
            label: 0,
        }
    }

    #[test]
    fn token_id_completions_body_is_valid_json_with_the_ids() {
        let body = request_body(
            Api::Completions,
            PromptFormat::TokenIds,
            "m\"odel",
            &planned(),
            &TokenAlphabet::token_ids(),
        );
        let json: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(json["model"], "m\"odel");
        assert_eq!(json["prompt"], serde_json::json!([1001, 1002, 1003]));
        assert_eq!(json["max_tokens"], 400);
        assert_eq!(json["ignore_eos"], true);
        assert_eq!(json["stream"], true);
        assert_eq!(json["stream_options"]["include_usage"], true);
    }

    #[test]
    fn chat_body_puts_the_shared_part_in_the_system_message() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../assets/tokenizers/deepseek-v3/tokenizer.json");
        let alphabet = TokenAlphabet::words_from_tokenizer(&path).unwrap();
        let request = PlannedRequest {
            tokens: (0..5).map(|draw| alphabet.pick(draw)).collect(),
            shared_len: 3,
            output_tokens: 7,
            label: 0,
        };
        let body = request_body(Api::Chat, PromptFormat::Text, "m", &request, &alphabet);
        let json: serde_json::Value = serde_json::from_str(&body).unwrap();
        let messages = json["messages"].as_array().unwrap();
        assert_eq!(messages[0]["role"], "system");
        assert_eq!(
            messages[0]["content"]
                .as_str()
                .unwrap()
                .split_whitespace()
                .count(),
            3
        );
        assert_eq!(
            messages[1]["content"]
                .as_str()
                .unwrap()
                .split_whitespace()
                .count(),
            2
        );
        assert_eq!(endpoint_path(Api::Chat), "/v1/chat/completions");
    }
}
