//! Moving a running request to other pools: its state as regions ([`state::export`]) and a
//! request rebuilt from such a state ([`state::import`]), evicting cached prefixes for room.

use crate::backend::Backend;
use crate::error::{Error, Result};

use super::{PrefixCache, Request};
use crate::kv::state::{self, SequenceState};

impl<B: Backend> PrefixCache<B> {
    /// The state of `req` in these pools ([`state::export`]): regions only, nothing copied;
    /// read them with [`state::read`] on [`Self::pools`] before `req` steps or ends.
    pub fn export(&self, req: &Request) -> Result<SequenceState> {
        if req.is_loading() {
            return Err(Error::invalid_argument(
                "the request is still loading its prefix back from the host tier: export it \
                 after complete_load returns true",
            ));
        }
        Ok(state::export(&self.pools, &req.kv))
    }

    /// Bytes of `req`'s pages complete so far, page-table indices `from..`, at their offsets in
    /// the state it will have at `final_position` ([`state::complete_pages`]), and how many
    /// pages are complete; nothing while it loads back from the host tier.
    pub fn complete_pages(
        &self,
        req: &Request,
        final_position: usize,
        from: usize,
    ) -> Result<(state::Pieces, usize)> {
        if req.is_loading() {
            return Ok((Vec::new(), from));
        }
        state::complete_pages(&self.pools, &req.kv, final_position, from)
    }

    /// A request rebuilt from an exported state and its bytes ([`state::import`]), evicting
    /// cached prefixes when the free pages run short (only once the state passed its checks).
    /// It continues a prompt of `prompt_len` tokens under `salt`: snapshots, insertion and
    /// `finish` work as for any request given all its tokens. It holds no tree lock and counts
    /// no reused tokens. Refusals take nothing (see [`state::import`]).
    pub fn import(
        &mut self,
        salt: Option<&str>,
        prompt_len: usize,
        state: &SequenceState,
        bytes: &[u8],
    ) -> Result<Request> {
        let pages = state::check_import(&self.pools, state, bytes)?;
        self.free_pages_for_import(pages);
        let kv = state::import(&mut self.pools, state, bytes)?;
        self.stats.requests += 1;
        Ok(Self::imported(kv, salt, prompt_len))
    }

    /// Evicts cached prefixes until `pages` pages are free (when a slot is: evicting cannot
    /// free one, so without a slot the import fails anyway).
    fn free_pages_for_import(&mut self, pages: usize) {
        if pages > self.pools.page_allocator().free_count()
            && self.pools.slot_allocator().free_count() > 0
        {
            self.evict_until(|pools| pools.page_allocator().free_count() >= pages);
        }
    }

    fn imported(kv: crate::kv::pools::SeqKv, salt: Option<&str>, prompt_len: usize) -> Request {
        Request {
            kv,
            salt: salt.map(str::to_owned),
            prompt_len,
            lock: None,
            reused: 0,
            reused_host: 0,
            latest: None,
            loading: None,
            branch: None,
        }
    }

    /// A PD decode's destination for a prompt of `prompt_len` tokens (a slot and the pages
    /// its KV fills), evicting cached prefixes when the free pages run short; the state
    /// arrives later ([`Self::fill_import`]). `DSV4_ERR_CAPACITY` with nothing taken when it
    /// does not fit now.
    pub fn reserve_import(&mut self, salt: Option<&str>, prompt_len: usize) -> Result<Request> {
        let pages = self.pools.pages_for(prompt_len);
        self.free_pages_for_import(pages);
        let kv = state::open_destination(&mut self.pools, prompt_len, pages)?;
        self.stats.requests += 1;
        Ok(Self::imported(kv, salt, prompt_len))
    }

    /// The most state bytes [`Self::reserve_import`]'s destination for `prompt_len` tokens
    /// takes.
    pub fn import_bytes(&self, prompt_len: usize) -> usize {
        state::byte_len_at(&self.pools, prompt_len)
    }

    /// Writes an arrived state (`position` tokens in `pages` pages) into `req`'s reserved
    /// destination ([`state::write_arrival`]).
    pub fn fill_import(
        &mut self,
        req: &Request,
        position: usize,
        pages: usize,
        bytes: &[u8],
    ) -> Result<()> {
        state::write_arrival(&mut self.pools, position, pages, bytes, &req.kv)
    }

    /// Checks a state of `bytes` bytes that a transport wrote straight into `req`'s
    /// destination ([`Self::landing`]) ([`state::check_arrival`]).
    pub fn check_landed(
        &self,
        req: &Request,
        position: usize,
        pages: usize,
        bytes: usize,
    ) -> Result<()> {
        state::check_arrival(&self.pools, position, pages, bytes, &req.kv)
    }

    /// Where `req`'s destination takes a state's bytes, in arrival order; `None` on pools a
    /// transport cannot write directly. The caller keeps `req` (its pages) until nothing
    /// writes through it any more.
    pub fn landing(&self, req: &Request) -> Option<crate::kv::Landing> {
        crate::kv::Landing::of(&self.pools, &req.kv)
    }
}
