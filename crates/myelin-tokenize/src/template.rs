//! Chat templates: HuggingFace-style Jinja templates (from a model's `tokenizer_config.json` or
//! a `.jinja` file) rendered with minijinja, with a bundled ChatML default.
//!
//! Rendered the way Hugging Face's `apply_chat_template` (and so vLLM) renders them: Jinja's
//! `trim_blocks` (the first newline after a block tag is dropped) and `lstrip_blocks` (spaces
//! and tabs before a block tag on its line are dropped) are on, trailing newlines are not kept,
//! and `raise_exception` is a global. Without the first two, a template written over several
//! lines renders with extra line breaks, so every prompt's tokens differ from the engine's and
//! no prefix can match its cache.

use std::path::{Path, PathBuf};

use minijinja::{Environment, ErrorKind, context};
use serde_json::Value;

/// ChatML, the template of Qwen/Yi-style models and a common serving default.
const CHATML_TEMPLATE: &str = "{% for message in messages %}\
<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n\
{% endfor %}\
{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

const TEMPLATE_NAME: &str = "chat";

/// Why a template could not be loaded or rendered.
#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    /// The file could not be read.
    #[error("cannot read chat template {path}: {source}")]
    Read {
        /// The file tried.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A `tokenizer_config.json` had no usable `chat_template`.
    #[error("{path} has no chat_template (string, or list with a \"default\" entry)")]
    NoTemplate {
        /// The file tried.
        path: PathBuf,
    },
    /// The file is not valid JSON.
    #[error("cannot parse {path}: {source}")]
    Json {
        /// The file tried.
        path: PathBuf,
        /// The parse error.
        source: serde_json::Error,
    },
    /// The template failed to compile or render (including `raise_exception` from the template).
    #[error("chat template: {0}")]
    Render(String),
}

/// A compiled chat template plus the special tokens it may refer to.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
    /// The template reads `tools` ([`Self::uses_tools`]).
    uses_tools: bool,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish()
    }
}

impl ChatTemplate {
    /// The bundled ChatML template.
    pub fn chatml() -> Self {
        Self::from_source(CHATML_TEMPLATE.to_string(), String::new(), String::new())
            .unwrap_or_else(|_| unreachable!("the bundled ChatML template compiles"))
    }

    /// Loads a template from a model's `tokenizer_config.json` (its `chat_template`,
    /// `bos_token`, `eos_token`) or, for any other file, the file's text as Jinja source.
    pub fn from_path(path: impl AsRef<Path>) -> Result<Self, TemplateError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| TemplateError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        if path.extension().is_some_and(|ext| ext == "json") {
            let config: Value =
                serde_json::from_str(&text).map_err(|source| TemplateError::Json {
                    path: path.to_path_buf(),
                    source,
                })?;
            let source =
                template_from_config(&config).ok_or_else(|| TemplateError::NoTemplate {
                    path: path.to_path_buf(),
                })?;
            Self::from_source(
                source,
                special_token(&config, "bos_token"),
                special_token(&config, "eos_token"),
            )
        } else {
            Self::from_source(text, String::new(), String::new())
        }
    }

    /// Compiles Jinja source.
    pub fn from_source(
        source: String,
        bos_token: String,
        eos_token: String,
    ) -> Result<Self, TemplateError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_keep_trailing_newline(false);
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |message: String| -> Result<String, minijinja::Error> {
                Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
            },
        );
        env.add_template_owned(TEMPLATE_NAME, source)
            .map_err(|error| TemplateError::Render(error.to_string()))?;
        let uses_tools = env
            .get_template(TEMPLATE_NAME)
            .map_err(|error| TemplateError::Render(error.to_string()))?
            .undeclared_variables(false)
            .contains("tools");
        Ok(Self {
            env,
            bos_token,
            eos_token,
            uses_tools,
        })
    }

    /// Whether the template reads `tools` (the request's tool definitions, which such
    /// templates write into the prompt, usually at its head).
    pub fn uses_tools(&self) -> bool {
        self.uses_tools
    }

    /// Renders `messages` (OpenAI chat messages, a JSON array). Content given as a list of
    /// parts is flattened to its text parts, as engines do for string-content templates.
    pub fn render(
        &self,
        messages: &Value,
        add_generation_prompt: bool,
    ) -> Result<String, TemplateError> {
        self.render_with_tools(messages, None, add_generation_prompt)
    }

    /// [`Self::render`] with the request's `tools` (none: `tools` is none, as Hugging Face's
    /// `apply_chat_template` and so vLLM pass it).
    pub fn render_with_tools(
        &self,
        messages: &Value,
        tools: Option<&Value>,
        add_generation_prompt: bool,
    ) -> Result<String, TemplateError> {
        let messages = normalize_messages(messages);
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|error| TemplateError::Render(error.to_string()))?;
        template
            .render(context! {
                messages => messages,
                tools => tools,
                add_generation_prompt => add_generation_prompt,
                bos_token => self.bos_token,
                eos_token => self.eos_token,
            })
            .map_err(|error| TemplateError::Render(error.to_string()))
    }
}

fn template_from_config(config: &Value) -> Option<String> {
    match config.get("chat_template")? {
        Value::String(source) => Some(source.clone()),
        Value::Array(named) => named
            .iter()
            .find(|entry| entry.get("name").and_then(Value::as_str) == Some("default"))
            .or_else(|| named.first())
            .and_then(|entry| entry.get("template"))
            .and_then(Value::as_str)
            .map(str::to_string),
        _ => None,
    }
}

/// `bos_token` / `eos_token` are strings or `{"content": "..."}` objects in tokenizer configs.
fn special_token(config: &Value, key: &str) -> String {
    match config.get(key) {
        Some(Value::String(token)) => token.clone(),
        Some(Value::Object(token)) => token
            .get("content")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string(),
        _ => String::new(),
    }
}

/// The messages as the template sees them: a message whose `content` is an array of parts
/// has it as the text of its text parts joined by newlines. Borrowed, so a long conversation
/// is not copied before the template engine reads it.
fn normalize_messages(messages: &Value) -> NormalizedMessages<'_> {
    NormalizedMessages(messages)
}

struct NormalizedMessages<'a>(&'a Value);

impl serde::Serialize for NormalizedMessages<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeSeq;
        let Some(list) = self.0.as_array() else {
            return self.0.serialize(serializer);
        };
        let mut seq = serializer.serialize_seq(Some(list.len()))?;
        for message in list {
            seq.serialize_element(&NormalizedMessage(message))?;
        }
        seq.end()
    }
}

struct NormalizedMessage<'a>(&'a Value);

impl serde::Serialize for NormalizedMessage<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let (Some(fields), Some(Value::Array(parts))) = (self.0.as_object(), self.0.get("content"))
        else {
            return self.0.serialize(serializer);
        };
        let text = parts
            .iter()
            .filter(|part| part.get("type").and_then(Value::as_str) == Some("text"))
            .filter_map(|part| part.get("text").and_then(Value::as_str))
            .collect::<Vec<_>>()
            .join("\n");
        let mut map = serializer.serialize_map(Some(fields.len()))?;
        for (key, value) in fields {
            if key == "content" {
                map.serialize_entry(key, &text)?;
            } else {
                map.serialize_entry(key, value)?;
            }
        }
        map.end()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn chatml_renders_roles_and_generation_prompt() {
        let messages = json!([
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "image_url", "image_url": {}}]}
        ]);
        let rendered = ChatTemplate::chatml()
            .render(&messages, true)
            .expect("render");
        assert_eq!(
            rendered,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
        let no_prompt = ChatTemplate::chatml()
            .render(&messages, false)
            .expect("render");
        assert!(!no_prompt.ends_with("assistant\n"));
    }

    #[test]
    fn tokenizer_config_template_with_python_methods_and_bos() {
        let dir = std::env::temp_dir().join(format!("myelin-template-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("tokenizer_config.json");
        let config = json!({
            "bos_token": {"content": "<s>"},
            "chat_template": "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}{% endif %}[{{ m['role'].upper() }}] {{ m['content'].strip() }}\n{% endfor %}"
        });
        std::fs::write(&path, config.to_string()).expect("write");
        let template = ChatTemplate::from_path(&path).expect("load");
        let rendered = template
            .render(&json!([{"role": "user", "content": "  hello  "}]), true)
            .expect("render");
        assert_eq!(rendered, "<s>[USER] hello\n");
        let error = template
            .render(&json!([{"role": "tool", "content": "x"}]), true)
            .expect_err("template raises");
        assert!(error.to_string().contains("no tools"));
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn multi_line_templates_render_with_trim_and_lstrip_blocks() {
        let source = "{% for message in messages %}\n    {% if message.role == 'user' %}\n<u>{{ message.content }}</u>\n    {% else %}\n<a>{{ message.content }}</a>\n    {% endif %}\n{% endfor %}\n";
        let template =
            ChatTemplate::from_source(source.to_string(), String::new(), String::new()).unwrap();
        let rendered = template
            .render(
                &json!([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]),
                false,
            )
            .unwrap();
        // Without trim_blocks and lstrip_blocks this is "\n    \n<u>q</u>\n    \n..." with a
        // line break and indentation left by every tag.
        assert_eq!(rendered, "<u>q</u>\n<a>a</a>\n");
    }

    #[test]
    fn a_template_that_writes_the_tools_gets_them_and_says_so() {
        let source = "{% if tools %}<tools>{{ tools | tojson }}</tools>\n{% endif %}\
            {% for m in messages %}{{ m.content }}\n{% endfor %}";
        let template =
            ChatTemplate::from_source(source.to_string(), String::new(), String::new()).unwrap();
        assert!(template.uses_tools());
        assert!(!ChatTemplate::chatml().uses_tools());
        let messages = json!([{"role": "user", "content": "q"}]);
        let tools = json!([{"type": "function", "function": {"name": "search"}}]);
        let with = template
            .render_with_tools(&messages, Some(&tools), true)
            .unwrap();
        assert!(with.starts_with("<tools>[{"), "{with}");
        assert!(with.contains("\"search\""), "{with}");
        assert_eq!(template.render(&messages, true).unwrap(), "q\n");
        assert_eq!(
            template.render_with_tools(&messages, None, true).unwrap(),
            "q\n"
        );
    }

    #[test]
    fn config_without_template_is_an_error() {
        let dir = std::env::temp_dir().join(format!("myelin-template-none-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("tokenizer_config.json");
        std::fs::write(&path, "{}").expect("write");
        assert!(matches!(
            ChatTemplate::from_path(&path),
            Err(TemplateError::NoTemplate { .. })
        ));
        std::fs::remove_dir_all(&dir).ok();
    }
}
