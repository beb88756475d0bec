//! `tokenizer_config.json`'s `chat_template`, rendered the way `transformers`'
//! `apply_chat_template(..., tokenize=False)` renders it: Jinja2 with `trim_blocks` and
//! `lstrip_blocks`, loop controls, Python string methods, `raise_exception`, a Python-style
//! `tojson`, and the context `messages`, `add_generation_prompt`, `tools`/`documents` (none) and
//! every special token the config names (`bos_token`, `eos_token`, ...).
//!
//! A template the project knows (`deepseek::KNOWN`) is rendered natively instead, with the
//! same output and refusals in time linear in the conversation; minijinja renders the rest.

use minijinja::value::{Kwargs, Value as JValue};
use minijinja::{Environment, ErrorKind as JErrorKind};
use serde_json::{Map, Value};

use super::deepseek::Native;
use crate::error::{Error, Result};

/// Templates this large are not chat templates (DeepSeek's is ~3 KiB).
const MAX_TEMPLATE_BYTES: usize = 1 << 20;

/// The template's name in the environment, which minijinja's errors quote (`(in
/// chat_template:26)`); the native renderer's refusals quote it too.
pub(super) const TEMPLATE_NAME: &str = "chat_template";

/// A compiled chat template with the special tokens its context carries.
pub struct ChatTemplate {
    env: Environment<'static>,
    special_tokens: Map<String, Value>,
    /// Set when the source is a template rendered natively (see `deepseek.rs`).
    native: Option<Native>,
}

impl ChatTemplate {
    /// From a parsed `tokenizer_config.json`: its `chat_template` (a string, or the list of
    /// `{"name", "template"}` transformers also accepts, of which `default` is used) and its
    /// `*_token` entries (strings or AddedToken objects `{"content": ...}`).
    pub fn from_config(doc: &Value) -> Result<Self> {
        let source =
            match doc.get("chat_template") {
                None | Some(Value::Null) => None,
                Some(Value::String(s)) if s.is_empty() => None,
                Some(Value::String(s)) => Some(s.clone()),
                Some(Value::Array(list)) => list
                    .iter()
                    .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                    .and_then(|t| t.get("template"))
                    .and_then(Value::as_str)
                    .map(str::to_string),
                Some(_) => return Err(Error::model_format(
                    "chat_template is neither a string nor a list of {name, template}: replace \
                     the file with the checkpoint's original",
                )),
            };
        let Some(source) = source else {
            return Err(Error::unsupported(
                "has no chat_template: render the prompt yourself and pass its text or ids",
            ));
        };
        let mut special_tokens = Map::new();
        if let Some(obj) = doc.as_object() {
            for (key, value) in obj {
                if !key.ends_with("_token") {
                    continue;
                }
                let text = match value {
                    Value::String(s) => Some(s.clone()),
                    Value::Object(o) => o.get("content").and_then(Value::as_str).map(Into::into),
                    _ => None,
                };
                if let Some(text) = text {
                    special_tokens.insert(key.clone(), Value::String(text));
                }
            }
        }
        Self::new(source, special_tokens)
    }

    /// Compiles `source` with `special_tokens` (name → text) for its context.
    pub fn new(source: String, special_tokens: Map<String, Value>) -> Result<Self> {
        if source.len() > MAX_TEMPLATE_BYTES {
            return Err(Error::model_format(format!(
                "chat_template is {} bytes, more than the {MAX_TEMPLATE_BYTES} a chat template \
                 can be: replace it with the checkpoint's original",
                source.len()
            )));
        }
        let mut env = Environment::new();
        // transformers compiles with trim_blocks and lstrip_blocks; templates rely on them.
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| Error::internal(format!("chat template syntax: {e}")))?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_filter("tojson", tojson);
        let native = Native::for_template(&source, &special_tokens);
        env.add_template_owned(TEMPLATE_NAME, source).map_err(|e| {
            Error::model_format(format!(
                "chat_template does not compile ({e:#}): replace it with the checkpoint's \
                 original"
            ))
        })?;
        Ok(Self {
            env,
            special_tokens,
            native,
        })
    }

    /// Whether [`render`](Self::render) uses the native renderer: the source is the DeepSeek
    /// template the project's checkpoints carry, rendered in linear time with minijinja's
    /// output. Other templates render with minijinja, in whatever time the template takes.
    pub fn is_native(&self) -> bool {
        self.native.is_some()
    }

    /// Renders `messages_json` (a JSON array of messages such as `{"role": "user", "content":
    /// "hi"}`) to the prompt text; `add_generation_prompt` appends the assistant turn's opening.
    pub fn render(&self, messages_json: &str, add_generation_prompt: bool) -> Result<String> {
        let messages = parse_messages(messages_json)?;
        match &self.native {
            Some(native) => native
                .render(&messages, add_generation_prompt, messages_json.len())
                .map_err(refusal),
            None => self.render_minijinja(messages, add_generation_prompt),
        }
    }

    /// Tests only: [`render`](Self::render) with minijinja even where the native renderer
    /// applies, to compare the two.
    #[doc(hidden)]
    pub fn render_with_minijinja(
        &self,
        messages_json: &str,
        add_generation_prompt: bool,
    ) -> Result<String> {
        self.render_minijinja(parse_messages(messages_json)?, add_generation_prompt)
    }

    fn render_minijinja(
        &self,
        messages: Vec<Value>,
        add_generation_prompt: bool,
    ) -> Result<String> {
        let mut ctx = self.special_tokens.clone();
        ctx.insert("messages".into(), Value::Array(messages));
        ctx.insert("add_generation_prompt".into(), add_generation_prompt.into());
        ctx.insert("tools".into(), Value::Null);
        ctx.insert("documents".into(), Value::Null);
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| Error::internal(format!("chat template missing: {e}")))?;
        template
            .render(minijinja::value::Serde(&ctx))
            .map_err(|e| refusal(format!("{e:#}")))
    }
}

/// `messages_json` parsed, refused unless it is a JSON array.
fn parse_messages(messages_json: &str) -> Result<Vec<Value>> {
    let messages: Value = serde_json::from_str(messages_json).map_err(|e| {
        Error::invalid_argument(format!(
            "messages_json is not valid JSON ({e}): pass an array of messages such as \
             [{{\"role\": \"user\", \"content\": \"Hello\"}}]"
        ))
    })?;
    match messages {
        Value::Array(list) => Ok(list),
        _ => Err(Error::invalid_argument(
            "messages_json is not a JSON array: pass an array of messages such as \
             [{\"role\": \"user\", \"content\": \"Hello\"}]",
        )),
    }
}

/// A template's refusal (`raise_exception`'s message, or the operation that failed and where),
/// worded the same whichever renderer made it.
fn refusal(detail: String) -> Error {
    Error::invalid_argument(format!(
        "the chat template could not render these messages: {detail}"
    ))
}

/// `raise_exception(message)`: how Hugging Face templates refuse a conversation (e.g. roles
/// that do not alternate); the message reaches the caller.
fn raise_exception(message: String) -> std::result::Result<JValue, minijinja::Error> {
    Err(minijinja::Error::new(JErrorKind::InvalidOperation, message))
}

/// transformers' `tojson`: `json.dumps(x, ensure_ascii=False, indent=..., sort_keys=...)`.
/// minijinja's own escapes `<`, `>`, `&` and `'` for HTML, which would change the prompt.
fn tojson(value: JValue, kwargs: Kwargs) -> std::result::Result<JValue, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let _: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    let v: Value = serde_json::to_value(&value)
        .map_err(|e| minijinja::Error::new(JErrorKind::InvalidOperation, e.to_string()))?;
    let mut out = String::new();
    py_dumps(&v, indent, sort_keys.unwrap_or(false), 0, &mut out);
    Ok(JValue::from_safe_string(out))
}

/// Python's `json.dumps` layout: `", "` and `": "` separators without an indent, newlines and
/// `indent` spaces per level with one, non-ASCII characters as they are.
pub(super) fn py_dumps(
    v: &Value,
    indent: Option<usize>,
    sort: bool,
    level: usize,
    out: &mut String,
) {
    let newline = |out: &mut String, level: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * level));
        }
    };
    let sep = if indent.is_some() { "," } else { ", " };
    match v {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => out.push_str(&n.to_string()),
        Value::String(s) => py_string(s, out),
        Value::Array(items) if items.is_empty() => out.push_str("[]"),
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(sep);
                }
                newline(out, level + 1);
                py_dumps(item, indent, sort, level + 1, out);
            }
            newline(out, level);
            out.push(']');
        }
        Value::Object(map) if map.is_empty() => out.push_str("{}"),
        Value::Object(map) => {
            let mut entries: Vec<_> = map.iter().collect();
            if sort {
                entries.sort_by(|a, b| a.0.cmp(b.0));
            }
            out.push('{');
            for (i, (k, item)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push_str(sep);
                }
                newline(out, level + 1);
                py_string(k, out);
                out.push_str(": ");
                py_dumps(item, indent, sort, level + 1, out);
            }
            newline(out, level);
            out.push('}');
        }
    }
}

fn py_string(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tojson_matches_python_json_dumps() {
        // Expected strings are what Python 3's json.dumps(..., ensure_ascii=False) prints.
        let v = serde_json::json!({"b": [1, "x\"<>&'é\n"], "a": {}});
        let mut out = String::new();
        py_dumps(&v, None, false, 0, &mut out);
        assert_eq!(out, r#"{"b": [1, "x\"<>&'é\n"], "a": {}}"#);
        let mut out = String::new();
        py_dumps(&v, Some(2), true, 0, &mut out);
        assert_eq!(
            out,
            "{\n  \"a\": {},\n  \"b\": [\n    1,\n    \"x\\\"<>&'é\\n\"\n  ]\n}"
        );
    }
}
