//! Strict JSON for the two documents an operator writes by hand: the params and `config.json`.
//!
//! `serde_json::from_str::<Value>` keeps the last of two equal keys, so `{"kv": {"page_size":
//! 128, "page_size": 512}}` silently means 512 — an edit that was meant to replace a value may
//! instead be shadowed by a forgotten copy further down. [`parse_strict`] builds the same
//! [`Value`] but refuses a key that appears twice in one object, naming it by its path
//! (`kv.page_size`, `rope_parameters.main.rope_theta`, `layer_types[3].name`). Both parsers call
//! this one function; each wraps the error in its own kind.
//!
//! Nesting is bounded by serde_json's recursion limit (128 levels), which this visitor inherits
//! because every array and object still goes through serde_json's `deserialize_any`.

use std::cell::RefCell;
use std::fmt;

use serde::de::{self, DeserializeSeed, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Number, Value};

use super::size::shorten;

/// Why a document is not strict JSON.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JsonError {
    /// Not JSON at all (or nested deeper than 128 levels); `message` is serde_json's.
    Syntax {
        line: usize,
        column: usize,
        message: String,
    },
    /// One object names `path`'s last component twice; the position is the second occurrence.
    DuplicateKey {
        path: String,
        line: usize,
        column: usize,
    },
}

impl fmt::Display for JsonError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Syntax {
                line,
                column,
                message,
            } => write!(f, "invalid JSON at line {line} column {column}: {message}"),
            Self::DuplicateKey { path, line, column } => write!(
                f,
                "key `{path}` appears twice in the same object (second at line {line} column \
                 {column}): JSON keys must be unique, and dsv4 does not guess which one you \
                 meant; delete one of them"
            ),
        }
    }
}

/// Parses `text` into a [`Value`], refusing duplicate keys.
pub fn parse_strict(text: &str) -> Result<Value, JsonError> {
    // The visitor cannot return a typed error through serde, so it records the duplicate here
    // and aborts the parse with a placeholder error that is then replaced.
    let duplicate = RefCell::new(None);
    let mut de = serde_json::Deserializer::from_str(text);
    let result = ValueSeed {
        at: &Path::Root,
        duplicate: &duplicate,
    }
    .deserialize(&mut de)
    .and_then(|value| de.end().map(|()| value));
    result.map_err(|e| match duplicate.into_inner() {
        Some(path) => JsonError::DuplicateKey {
            path,
            line: e.line(),
            column: e.column(),
        },
        None => JsonError::Syntax {
            line: e.line(),
            column: e.column(),
            message: e.to_string(),
        },
    })
}

/// Where a value sits, as a chain of borrowed frames: the path string is only built when a
/// duplicate is found, so a million-element array costs no allocation per element.
enum Path<'a> {
    Root,
    Key(&'a Path<'a>, &'a str),
    Index(&'a Path<'a>, usize),
}

impl Path<'_> {
    fn render(&self, out: &mut String) {
        match self {
            Self::Root => {}
            Self::Key(parent, key) => {
                parent.render(out);
                if !out.is_empty() {
                    out.push('.');
                }
                // A hostile key may be megabytes long; the message shows its start and length.
                out.push_str(&shorten(key));
            }
            Self::Index(parent, i) => {
                parent.render(out);
                out.push_str(&format!("[{i}]"));
            }
        }
    }
}

#[derive(Clone, Copy)]
struct ValueSeed<'a> {
    at: &'a Path<'a>,
    duplicate: &'a RefCell<Option<String>>,
}

impl<'de> DeserializeSeed<'de> for ValueSeed<'_> {
    type Value = Value;

    fn deserialize<D: de::Deserializer<'de>>(self, deserializer: D) -> Result<Value, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for ValueSeed<'_> {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }

    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::Number(v.into()))
    }

    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::Number(v.into()))
    }

    fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
        // serde_json never hands a visitor a non-finite float; `Null` mirrors `Value`'s own
        // visitor should that ever change.
        Ok(Number::from_f64(v).map_or(Value::Null, Value::Number))
    }

    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_owned()))
    }

    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }

    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_none<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::new();
        loop {
            let at = Path::Index(self.at, items.len());
            let seed = ValueSeed {
                at: &at,
                duplicate: self.duplicate,
            };
            match seq.next_element_seed(seed)? {
                Some(item) => items.push(item),
                None => return Ok(Value::Array(items)),
            }
        }
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut object = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            if object.contains_key(&key) {
                let mut path = String::new();
                Path::Key(self.at, &key).render(&mut path);
                *self.duplicate.borrow_mut() = Some(path);
                return Err(de::Error::custom("duplicate key"));
            }
            let at = Path::Key(self.at, &key);
            let value = map.next_value_seed(ValueSeed {
                at: &at,
                duplicate: self.duplicate,
            })?;
            object.insert(key, value);
        }
        Ok(Value::Object(object))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn strict_parse_matches_serde_json_on_unique_keys() {
        let text = r#"{"a": [1, -2, 3.5, "x", null, true, {"b": {}}], "c": {"d": 1e3}}"#;
        let strict = parse_strict(text).unwrap();
        let loose: Value = serde_json::from_str(text).unwrap();
        assert_eq!(strict, loose);
        // Key order is kept (the crate enables preserve_order), as with serde_json.
        let keys: Vec<&String> = strict.as_object().unwrap().keys().collect();
        assert_eq!(keys, ["a", "c"]);
    }

    #[test]
    fn duplicate_keys_are_named_by_path() {
        let cases = [
            (
                r#"{"kv": {"page_size": 128, "page_size": 512}}"#,
                "kv.page_size",
            ),
            (r#"{"a": 1, "a": 1}"#, "a"),
            (r#"{"l": [{}, {"x": 1, "x": 2}]}"#, "l[1].x"),
            (r#"[{"k": 0, "k": 0}]"#, "[0].k"),
        ];
        for (text, path) in cases {
            match parse_strict(text) {
                Err(JsonError::DuplicateKey { path: got, .. }) => assert_eq!(got, path, "{text}"),
                other => panic!("{text}: {other:?}"),
            }
        }
        let message = parse_strict(cases[0].0).unwrap_err().to_string();
        assert!(
            message.contains("key `kv.page_size` appears twice"),
            "{message}"
        );
        assert!(message.contains("delete one of them"), "{message}");
        // Equal keys in different objects are fine.
        assert_eq!(
            parse_strict(r#"{"a": {"x": 1}, "b": {"x": 2}}"#).unwrap(),
            json!({"a": {"x": 1}, "b": {"x": 2}})
        );
    }

    #[test]
    fn syntax_errors_and_deep_nesting_are_errors_not_crashes() {
        assert!(matches!(
            parse_strict(r#"{"a": 1,"#),
            Err(JsonError::Syntax { line: 1, .. })
        ));
        assert!(matches!(
            parse_strict("{} x"),
            Err(JsonError::Syntax { .. })
        ));
        let deep = "[".repeat(100_000) + &"]".repeat(100_000);
        let err = parse_strict(&deep).unwrap_err().to_string();
        assert!(err.contains("recursion limit"), "{err}");
    }

    #[test]
    fn a_huge_duplicate_key_is_shown_shortened() {
        let key = "k".repeat(1 << 20);
        let text = format!(r#"{{"{key}": 1, "{key}": 2}}"#);
        let message = parse_strict(&text).unwrap_err().to_string();
        assert!(message.len() < 1000, "{} bytes", message.len());
        assert!(message.contains("1048576 bytes"), "{message}");
    }
}
