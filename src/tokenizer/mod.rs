//! Text in and out of the engine: the checkpoint's `tokenizer.json` (Hugging Face `tokenizers`,
//! the same Rust code the Python package wraps, so ids match it exactly), an incremental
//! detokenizer for streaming ([`Detokenizer`]) and `tokenizer_config.json`'s `chat_template`
//! ([`ChatTemplate`]).
//!
//! Both files are optional: a checkpoint without them serves token ids, and every text call
//! says so with [`ErrorKind::Unsupported`] and the fix. A file that is present but unusable does
//! not fail engine creation either (the engine still serves ids); the text calls then report why
//! the file could not be used.

mod chat;
mod deepseek;
mod stream;

use std::path::Path;
use std::sync::Arc;

use serde_json::Value;
use tokenizers::Tokenizer;

pub use chat::ChatTemplate;
pub use stream::Detokenizer;

use crate::error::{Error, ErrorKind, Result};

/// `tokenizer_config.json` is read whole; a real one is a few hundred KiB at most (DeepSeek's is
/// ~10 KiB), so anything larger is not one.
const MAX_TOKENIZER_CONFIG_BYTES: u64 = 16 << 20;

/// The engine's text side: a tokenizer and a chat template, each either loaded or the sentence
/// that explains why not (returned as the error of every call that needs it).
#[derive(Clone)]
pub struct TextCodec {
    tokenizer: std::result::Result<Arc<Tokenizer>, String>,
    template: std::result::Result<Arc<ChatTemplate>, String>,
}

impl TextCodec {
    /// Loads what `dir` (the model directory) has, for a model with `vocab_size` embedding
    /// rows. Never fails: absent or broken files are recorded and reported by the calls that
    /// need them.
    pub fn load(dir: &Path, vocab_size: usize) -> Self {
        let path = dir.join("tokenizer.json");
        let tokenizer = if path.is_file() {
            Tokenizer::from_file(&path)
                .map_err(|e| e.to_string())
                .and_then(|t| match t.get_vocab_size(true) {
                    // A tokenizer may have fewer ids than the model has rows (checkpoints pad
                    // the embedding), never more: its ids past the last row would index out
                    // of the embedding. This is what another model's tokenizer.json looks like.
                    n if n > vocab_size => Err(format!(
                        "it has {n} ids but the model's vocab_size is {vocab_size}, so it \
                         belongs to another model"
                    )),
                    _ => Ok(Arc::new(t)),
                })
                .map_err(|e| {
                    let m = format!(
                        "{} could not be loaded ({e}): replace it with the checkpoint's \
                         original tokenizer.json, or pass token ids",
                        path.display()
                    );
                    log::warn!("{m}");
                    m
                })
        } else {
            Err(format!(
                "this checkpoint has no tokenizer.json ({} is absent): pass token ids, or add \
                 the model's tokenizer.json to the model directory",
                path.display()
            ))
        };
        let config_path = dir.join("tokenizer_config.json");
        let template = load_template(&config_path).map(Arc::new);
        if let Err(m) = &template {
            if config_path.is_file() {
                log::warn!("{m}");
            }
        }
        Self {
            tokenizer,
            template,
        }
    }

    pub fn has_tokenizer(&self) -> bool {
        self.tokenizer.is_ok()
    }

    pub fn has_chat_template(&self) -> bool {
        self.template.is_ok()
    }

    pub fn tokenizer(&self) -> Result<&Arc<Tokenizer>> {
        self.tokenizer
            .as_ref()
            .map_err(|m| Error::unsupported(m.clone()))
    }

    /// `text` as token ids. `add_special` adds what the tokenizer's post-processor adds (for
    /// DeepSeek: the BOS token), like Python's `encode(text, add_special_tokens=...)`.
    /// Special-token text in `text` (e.g. `<｜User｜>`) becomes its single id either way.
    pub fn tokenize(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        let encoding = self
            .tokenizer()?
            .encode(text, add_special)
            .map_err(|e| Error::internal(format!("tokenizing failed: {e}")))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// The text of `ids`, special tokens included (Python's `decode(ids,
    /// skip_special_tokens=False)`). An id outside the vocabulary is an error, not skipped.
    pub fn detokenize(&self, ids: &[i32]) -> Result<String> {
        let tokenizer = self.tokenizer()?;
        let ids = checked_ids(tokenizer, ids)?;
        decode(tokenizer, &ids)
    }

    /// A streaming detokenizer over this tokenizer.
    pub fn detokenizer(&self) -> Result<Detokenizer> {
        Ok(Detokenizer::new(self.tokenizer()?.clone()))
    }

    /// Renders the chat template (see [`ChatTemplate::render`]).
    pub fn chat_apply(&self, messages_json: &str, add_generation_prompt: bool) -> Result<String> {
        self.template
            .as_ref()
            .map_err(|m| Error::unsupported(m.clone()))?
            .render(messages_json, add_generation_prompt)
    }
}

/// `ids` as the tokenizer's `u32`s, each checked against the vocabulary (added tokens included).
pub(crate) fn checked_ids(tokenizer: &Tokenizer, ids: &[i32]) -> Result<Vec<u32>> {
    let size = tokenizer.get_vocab_size(true);
    ids.iter()
        .enumerate()
        .map(|(i, &id)| match u32::try_from(id) {
            Ok(u) if (u as usize) < size => Ok(u),
            _ => Err(Error::invalid_argument(format!(
                "token id {id} at index {i} is outside the tokenizer's vocabulary (0..{size}): \
                 pass ids the model produced"
            ))),
        })
        .collect()
}

pub(crate) fn decode(tokenizer: &Tokenizer, ids: &[u32]) -> Result<String> {
    tokenizer
        .decode(ids, false)
        .map_err(|e| Error::internal(format!("detokenizing failed: {e}")))
}

fn load_template(path: &Path) -> std::result::Result<ChatTemplate, String> {
    if !path.is_file() {
        return Err(format!(
            "this checkpoint has no tokenizer_config.json ({} is absent), so no chat template: \
             render the prompt yourself and pass its text or ids",
            path.display()
        ));
    }
    let bytes = std::fs::File::open(path)
        .and_then(|f| {
            use std::io::Read;
            let mut bytes = Vec::new();
            f.take(MAX_TOKENIZER_CONFIG_BYTES).read_to_end(&mut bytes)?;
            Ok(bytes)
        })
        .map_err(|e| format!("cannot read {} ({e}): make it readable", path.display()))?;
    let doc: Value = serde_json::from_slice(&bytes).map_err(|e| {
        format!(
            "{} is not valid JSON ({e}): replace it with the checkpoint's original",
            path.display()
        )
    })?;
    ChatTemplate::from_config(&doc).map_err(|e| {
        if e.kind() == ErrorKind::Unsupported {
            format!("{} {}", path.display(), e.message())
        } else {
            format!("{}: {}", path.display(), e.message())
        }
    })
}
