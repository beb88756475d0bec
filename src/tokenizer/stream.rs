//! Streaming detokenization: one id in, the text it completes out, so that the pieces of a
//! stream concatenate to exactly `detokenize(all ids)`.
//!
//! A token can end in the middle of a UTF-8 character (byte-level BPE splits emoji and CJK
//! across tokens), and some decoders change a token's text depending on what precedes it
//! (leading-space rules). So each step decodes a short window of ids twice — up to the last
//! emitted position (`read`) and up to the new id — starting at `prefix`, the position before
//! the last emitted piece, and emits only the difference; while the window's text ends in an
//! incomplete character (U+FFFD from the lossy decode) nothing is emitted and the bytes wait for
//! the ids that complete them. This is the prefix-offset/read-offset scheme of Hugging Face
//! text-generation-inference and vLLM.

use std::sync::Arc;

use tokenizers::Tokenizer;

use super::{checked_ids, decode};
use crate::error::Result;

/// An incremental detokenizer. Holds only the ids since the last emitted piece's start.
#[derive(Clone)]
pub struct Detokenizer {
    tokenizer: Arc<Tokenizer>,
    ids: Vec<u32>,
    prefix: usize,
    read: usize,
}

impl Detokenizer {
    pub fn new(tokenizer: Arc<Tokenizer>) -> Self {
        Self {
            tokenizer,
            ids: Vec::new(),
            prefix: 0,
            read: 0,
        }
    }

    /// Adds `id` and returns the text it completes: `""` while it ends inside a character.
    /// An id outside the vocabulary is an error and changes nothing.
    pub fn feed(&mut self, id: i32) -> Result<String> {
        let id = checked_ids(&self.tokenizer, &[id])?[0];
        self.ids.push(id);
        let before = decode(&self.tokenizer, &self.ids[self.prefix..self.read])?;
        let after = decode(&self.tokenizer, &self.ids[self.prefix..])?;
        if after.len() <= before.len()
            || after.ends_with('\u{FFFD}')
            || !after.is_char_boundary(before.len())
        {
            return Ok(String::new());
        }
        let piece = after[before.len()..].to_string();
        // The emitted piece's ids become the next window's context (prefix = old read); the
        // ids before them are never decoded again, so they are dropped.
        self.ids.drain(..self.read);
        self.prefix = 0;
        self.read = self.ids.len();
        Ok(piece)
    }
}
