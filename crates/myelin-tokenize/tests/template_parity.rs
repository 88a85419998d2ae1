//! The router renders chat templates as Hugging Face's `apply_chat_template` does (what vLLM
//! runs): each template in `tests/templates/` (multi-line templates in the styles popular models
//! ship: ChatML, Llama 3, Mistral, Gemma, Phi-3 with tabs) is rendered over several
//! conversations by `ChatTemplate` and by Python's jinja2 set up as Hugging Face sets it up
//! (`ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)`, the loop-controls
//! extension, `raise_exception`), and the two must agree byte for byte, errors included.
//!
//! Needs python3 with jinja2 (scripts/setup installs it); fails, with a message, without it.

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};

use myelin_tokenize::ChatTemplate;
use serde_json::{Value, json};

const HUGGING_FACE_RENDER: &str = r#"
import json, sys
import jinja2.ext
from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

def raise_exception(message):
    raise TemplateError(message)

out = []
for case in json.load(sys.stdin):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.globals["raise_exception"] = raise_exception
    try:
        text = env.from_string(case["template"]).render(
            messages=case["messages"], add_generation_prompt=case["add_generation_prompt"],
            bos_token="<s>", eos_token="</s>")
        out.append({"text": text})
    except TemplateError as error:
        out.append({"error": str(error)})
json.dump(out, sys.stdout)
"#;

fn conversations() -> Vec<Value> {
    vec![
        json!([{"role": "user", "content": "Hello"}]),
        json!([
            {"role": "system", "content": "  Be brief.\nUse lists.  "},
            {"role": "user", "content": "What is a KV cache?"},
            {"role": "assistant", "content": "Saved attention keys\nand values."},
            {"role": "user", "content": "  And prefix caching?\n\n"}
        ]),
        json!([
            {"role": "user", "content": "one"},
            {"role": "assistant", "content": "two"},
            {"role": "user", "content": "three"}
        ]),
        // Not alternating: the Mistral template raises.
        json!([
            {"role": "user", "content": "a"},
            {"role": "user", "content": "b"}
        ]),
    ]
}

#[test]
fn templates_render_as_hugging_face_renders_them() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/templates");
    let mut names: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("tests/templates")
        .map(|entry| entry.expect("entry").path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "jinja"))
        .collect();
    names.sort();
    assert!(names.len() >= 5, "templates in {}", dir.display());

    let mut cases = Vec::new();
    let mut ours = Vec::new();
    for path in &names {
        let source = std::fs::read_to_string(path).expect("template");
        let template = ChatTemplate::from_source(source.clone(), "<s>".into(), "</s>".into())
            .unwrap_or_else(|error| panic!("{}: {error}", path.display()));
        for messages in conversations() {
            for add_generation_prompt in [true, false] {
                cases.push(json!({
                    "template": source,
                    "messages": messages,
                    "add_generation_prompt": add_generation_prompt,
                }));
                ours.push((
                    path.file_name().unwrap().to_string_lossy().to_string(),
                    template.render(&messages, add_generation_prompt),
                ));
            }
        }
    }

    let mut child = Command::new("python3")
        .args(["-c", HUGGING_FACE_RENDER])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|error| {
            panic!("this test needs python3 with jinja2 (scripts/setup installs it): {error}")
        });
    child
        .stdin
        .take()
        .unwrap()
        .write_all(Value::Array(cases).to_string().as_bytes())
        .unwrap();
    let output = child.wait_with_output().unwrap();
    assert!(
        output.status.success(),
        "this test needs python3 with jinja2 (scripts/setup installs it): {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let theirs: Vec<Value> = serde_json::from_slice(&output.stdout).expect("python's JSON");
    assert_eq!(theirs.len(), ours.len());

    let mut errors = 0;
    for ((name, ours), theirs) in ours.iter().zip(&theirs) {
        match (ours, theirs.get("text").and_then(Value::as_str)) {
            (Ok(text), Some(expected)) => assert_eq!(text, expected, "{name}"),
            (Err(error), None) => {
                errors += 1;
                let message = theirs["error"].as_str().unwrap();
                assert!(
                    error.to_string().contains(message),
                    "{name}: {error} / {message}"
                );
            }
            (ours, _) => panic!("{name}: ours {ours:?}, Hugging Face's {theirs}"),
        }
    }
    // The Mistral template raises on the conversation with a system message and on the one
    // that does not alternate, with and without the generation prompt.
    assert_eq!(errors, 4);
}
