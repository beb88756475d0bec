//! DeepSeek's chat template rendered by Rust code instead of minijinja, for the template text
//! the project's checkpoints carry ([`KNOWN`]). The template gathers the system prompt with
//! `{% set ns.system_prompt = ns.system_prompt + '\n\n' + message['content'] %}`: every system
//! message copies the prompt so far, so a Jinja engine takes time quadratic in the number of
//! messages, which a client chooses. Here the system prompts are joined once and everything is
//! pushed to one output string: linear in messages and bytes.
//!
//! The output is minijinja's, byte for byte, for every `messages` array, and so is every
//! refusal: the same message, naming the same template line (tests/chat_template_property.rs
//! compares the two). That includes the whitespace `trim_blocks`/`lstrip_blocks` leave (eight
//! spaces before an assistant turn, twelve before a tool call: `lstrip_blocks` strips only
//! before `{% %}` tags, not before `{{ }}`), minijinja's `.strip()` (Rust's `str::trim`: Unicode
//! White_Space, which unlike Python's leaves U+001C..U+001F) and what minijinja does with a
//! message that is not an object or a field of another type (an error for most, see
//! [`Native::render`]). The line numbers in the refusals are [`KNOWN`]'s.

use serde_json::{Map, Value};

use super::chat::{py_dumps, TEMPLATE_NAME};

const THINK: &str = "</think>";

/// The known template with the one context value it reads besides `messages` and
/// `add_generation_prompt`: `bos_token`, as `{{ bos_token }}` prints it.
pub(super) struct Native {
    bos: String,
}

impl Native {
    /// `Some` when `source` is [`KNOWN`] and the context cannot change what its names mean: the
    /// special tokens (every name ends in `_token`, as `from_config` makes them) cannot shadow
    /// `namespace` or `raise_exception`.
    pub(super) fn for_template(source: &str, special_tokens: &Map<String, Value>) -> Option<Self> {
        if source != KNOWN || !special_tokens.keys().all(|k| k.ends_with("_token")) {
            return None;
        }
        // minijinja prints a context value with its Display (undefined: nothing; none: "none").
        let bos = special_tokens
            .get("bos_token")
            .map(|v| minijinja::Value::from(minijinja::value::Serde(v)).to_string())
            .unwrap_or_default();
        Some(Self { bos })
    }

    /// The rendering of `messages`, or the refusal as minijinja words it (`{kind}: {detail} (in
    /// chat_template:{line})`). The template's two loops are kept as two passes: the first
    /// checks every role and gathers the system prompts, so its refusals come before any of
    /// the second's. `capacity` is a guess of the output's length (the request's).
    pub(super) fn render(
        &self,
        messages: &[Value],
        add_generation_prompt: bool,
        capacity: usize,
    ) -> Result<String, String> {
        let mut system: Vec<&str> = Vec::new();
        for message in messages {
            match item(message, "role") {
                Some(Value::String(r))
                    if ["system", "user", "assistant", "tool"].contains(&r.as_str()) => {}
                // raise_exception('Conversation roles must be ... not ' + message['role'])
                Some(Value::String(r)) => {
                    return Err(invalid(
                        &format!(
                            "Conversation roles must be system, user, assistant or tool, not {r}"
                        ),
                        5,
                    ))
                }
                // Not a string (or absent: undefined) is never in the list, and the refusal's
                // `'...' + message['role']` fails first.
                other => return Err(plus(other, 5)),
            }
            if item(message, "role").and_then(Value::as_str) == Some("system") {
                let line = if system.is_empty() { 9 } else { 12 };
                system.push(operand(item(message, "content"), line)?);
            }
        }

        let mut out = String::with_capacity(capacity);
        out.push_str(&self.bos);
        for (i, prompt) in system.iter().enumerate() {
            if i > 0 {
                out.push_str("\n\n");
            }
            out.push_str(prompt);
        }
        let mut is_tool = false;
        for message in messages {
            // The first pass left only objects with one of the four roles.
            let Some(m) = message.as_object() else {
                continue;
            };
            match m.get("role").and_then(Value::as_str) {
                Some("user") => {
                    is_tool = false;
                    out.push_str("<｜User｜>");
                    out.push_str(operand(m.get("content"), 20)?);
                }
                // 'tool_calls' in message: present, whatever its value (null included).
                Some("assistant") if m.contains_key("tool_calls") => {
                    is_tool = false;
                    out.push_str("<｜Assistant｜><｜tool▁calls▁begin｜>");
                    match &m["tool_calls"] {
                        // none iterates as nothing
                        Value::Null => {}
                        v @ (Value::Bool(_) | Value::Number(_)) => {
                            return Err(invalid(&format!("{} is not iterable", kind(Some(v))), 25))
                        }
                        // Iterating a string gives its characters, a map its keys: strings,
                        // whose ['type'] is undefined.
                        Value::String(s) if !s.is_empty() => return Err(plus(None, 26)),
                        Value::Object(o) if !o.is_empty() => return Err(plus(None, 26)),
                        Value::String(_) | Value::Object(_) => {}
                        Value::Array(calls) => {
                            for call in calls {
                                tool_call(call, &mut out)?;
                            }
                        }
                    }
                    out.push_str("        <｜tool▁calls▁end｜><｜end▁of▁sentence｜>");
                }
                Some("assistant") => {
                    is_tool = false;
                    let content = m.get("content");
                    // {% if '</think>' in content %}: a substring, an element or a key;
                    // undefined contains nothing.
                    let has_think = match content {
                        None => false,
                        Some(Value::String(s)) => s.contains(THINK),
                        Some(Value::Array(a)) => a.iter().any(|v| v.as_str() == Some(THINK)),
                        Some(Value::Object(o)) => o.contains_key(THINK),
                        Some(_) => {
                            return Err(invalid(
                                "cannot perform a containment check on this value",
                                33,
                            ))
                        }
                    };
                    let text = match content {
                        // content.split('</think>')[-1], then .strip()
                        Some(Value::String(s)) if has_think => {
                            s.rsplit(THINK).next().unwrap_or_default().trim()
                        }
                        Some(Value::String(s)) => s.trim(),
                        other if has_think => return Err(no_method(other, "split", 34)),
                        other => return Err(no_method(other, "strip", 36)),
                    };
                    out.push_str("        <｜Assistant｜>");
                    out.push_str(text);
                    out.push_str("<｜end▁of▁sentence｜>");
                }
                Some("tool") => {
                    is_tool = true;
                    out.push_str("<｜tool▁output▁begin｜>");
                    out.push_str(operand(m.get("content"), 40)?);
                    out.push_str("<｜tool▁output▁end｜>");
                }
                _ => {}
            }
        }
        if add_generation_prompt {
            out.push_str(if is_tool {
                "<｜Assistant｜><think>\n"
            } else {
                "<｜Assistant｜>"
            });
        }
        Ok(out)
    }
}

/// One element of `tool_calls`: `'<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' +
/// tool['function']['name'] + '\n```json\n' + (tool['function']['arguments'] | tojson) + ...`,
/// evaluated left to right as minijinja does (the first bad operand is the one reported).
fn tool_call(call: &Value, out: &mut String) -> Result<(), String> {
    out.push_str("            <｜tool▁call▁begin｜>");
    out.push_str(operand(item(call, "type"), 26)?);
    out.push_str("<｜tool▁sep｜>");
    // An attribute of undefined is an error; of anything else (none included) undefined.
    let Some(function) = item(call, "function") else {
        return Err(format!("undefined value (in {TEMPLATE_NAME}:26)"));
    };
    out.push_str(operand(item(function, "name"), 26)?);
    out.push_str("\n```json\n");
    match item(function, "arguments") {
        // The tojson filter prints undefined as null.
        None => out.push_str("null"),
        Some(v) => py_dumps(v, None, false, 0, out),
    }
    out.push_str("\n```<｜tool▁call▁end｜>");
    Ok(())
}

/// `value[key]` in minijinja: a map's entry; undefined for a missing key and for every other
/// kind of value.
fn item<'a>(value: &'a Value, key: &str) -> Option<&'a Value> {
    value.as_object().and_then(|m| m.get(key))
}

/// The right side of `'text' + value`: only a string adds to a string.
fn operand(value: Option<&Value>, line: u32) -> Result<&str, String> {
    match value {
        Some(Value::String(s)) => Ok(s),
        other => Err(plus(other, line)),
    }
}

fn plus(value: Option<&Value>, line: u32) -> String {
    invalid(
        &format!(
            "tried to use + operator on unsupported types string and {}",
            kind(value)
        ),
        line,
    )
}

fn no_method(value: Option<&Value>, method: &str, line: u32) -> String {
    format!(
        "unknown method: {} has no method named {method} (in {TEMPLATE_NAME}:{line})",
        kind(value)
    )
}

fn invalid(detail: &str, line: u32) -> String {
    format!("invalid operation: {detail} (in {TEMPLATE_NAME}:{line})")
}

/// minijinja's name for the kind of a JSON value (`None`: undefined).
fn kind(value: Option<&Value>) -> &'static str {
    match value {
        None => "undefined",
        Some(Value::Null) => "none",
        Some(Value::Bool(_)) => "bool",
        Some(Value::Number(_)) => "number",
        Some(Value::String(_)) => "string",
        Some(Value::Array(_)) => "sequence",
        Some(Value::Object(_)) => "map",
    }
}

/// The DeepSeek-V3-style template of `tests/fixtures/tokenizer/` and the built-in tiny model
/// (`assets/tiny-model/`), both written by tests/reference/make_tokenizer.py. Recognised only
/// when a checkpoint's `chat_template` is this text exactly: with `trim_blocks` and
/// `lstrip_blocks` any edit, even of whitespace, can change the output.
pub(super) const KNOWN: &str = r#"{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}
{% set ns = namespace(is_tool=false, is_output_first=true, system_prompt='', is_first_sp=true) %}
{%- for message in messages %}
    {%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}
        {{- raise_exception('Conversation roles must be system, user, assistant or tool, not ' + message['role']) }}
    {%- endif %}
    {%- if message['role'] == 'system' %}
        {%- if ns.is_first_sp %}
            {% set ns.system_prompt = ns.system_prompt + message['content'] %}
            {% set ns.is_first_sp = false %}
        {%- else %}
            {% set ns.system_prompt = ns.system_prompt + '\n\n' + message['content'] %}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{{ bos_token }}{{ ns.system_prompt }}
{%- for message in messages %}
    {%- if message['role'] == 'user' %}
        {%- set ns.is_tool = false -%}
        {{'<｜User｜>' + message['content']}}
    {%- endif %}
    {%- if message['role'] == 'assistant' and 'tool_calls' in message %}
        {%- set ns.is_tool = false -%}
        {{'<｜Assistant｜><｜tool▁calls▁begin｜>'}}
        {%- for tool in message['tool_calls'] %}
            {{'<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\n```json\n' + (tool['function']['arguments'] | tojson) + '\n```<｜tool▁call▁end｜>'}}
        {%- endfor %}
        {{'<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}
    {%- endif %}
    {%- if message['role'] == 'assistant' and 'tool_calls' not in message %}
        {%- set ns.is_tool = false -%}
        {% set content = message['content'] %}
        {% if '</think>' in content %}
            {% set content = content.split('</think>')[-1] %}
        {% endif %}
        {{'<｜Assistant｜>' + content.strip() + '<｜end▁of▁sentence｜>'}}
    {%- endif %}
    {%- if message['role'] == 'tool' %}
        {%- set ns.is_tool = true -%}
        {{'<｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}
    {%- endif %}
{%- endfor -%}
{% if add_generation_prompt and not ns.is_tool %}{{'<｜Assistant｜>'}}{% endif %}
{% if add_generation_prompt and ns.is_tool %}{{'<｜Assistant｜><think>\n'}}{% endif %}
"#;
