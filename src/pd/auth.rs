//! Who may be a PD peer: engines that hold the same secret (`pd.auth_key_file`). A link's first
//! frames are a mutual challenge-response keyed by the secret, with a fresh nonce from each
//! side, before either side says anything else (layouts, digests, endpoints):
//!
//! ```text
//! decode  → prefill   AUTH  {nonce_d}
//! prefill → decode    AUTH  {nonce_p}
//! decode  → prefill   PROOF {HMAC(K, "dsv4-pd decode proof" ‖ nonce_d ‖ nonce_p)}
//! prefill → decode    PROOF {HMAC(K, "dsv4-pd prefill proof" ‖ nonce_d ‖ nonce_p)}
//! ```
//!
//! A captured exchange cannot be replayed (the other side's nonce is new each time), and the
//! proofs are bound to the side that makes them (a prefill's proof is no decode's). The key
//! file holds one or two secrets, a line each: the first signs, both verify, so a secret
//! rotates without downtime (add the new one second everywhere, then first, then drop the old).
//! The prefill answers with the secret the decode's proof verified under.
//!
//! Request digests a claim carries are keyed too ([`keyed_digest`]): a digest seen on the wire
//! or in a message is no offline oracle for guessing a prompt.

use std::path::Path;

use ring::{hkdf, hmac, rand::SecureRandom};

/// Bytes of a nonce.
pub const NONCE: usize = 32;
/// Shortest secret accepted: 32 bytes (`openssl rand -hex 32` writes 64 characters).
pub const MIN_SECRET: usize = 32;

/// The secrets of `pd.auth_key_file`: the first signs, every one verifies. Never printed.
#[derive(Clone)]
pub struct Keys {
    secrets: Vec<Vec<u8>>,
}

impl std::fmt::Debug for Keys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Keys({} secrets, redacted)", self.secrets.len())
    }
}

/// Which side of the handshake makes a proof.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Prover {
    Decode,
    Prefill,
}

impl Keys {
    /// Reads the key file: one or two secrets, a line each (surrounding whitespace ignored),
    /// each at least [`MIN_SECRET`] bytes. The message names the file and the fix, never a
    /// secret.
    pub fn load(path: &Path) -> Result<Keys, String> {
        let shown = path.display();
        let text = std::fs::read(path).map_err(|e| {
            format!("pd.auth_key_file = {shown}: cannot read it: {e}: give a readable file")
        })?;
        let text = String::from_utf8(text).map_err(|_| {
            format!(
                "pd.auth_key_file = {shown} is not text: write each secret as a line (e.g. the \
                 output of `openssl rand -hex 32`)"
            )
        })?;
        let lines: Vec<&str> = text
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .collect();
        if lines.is_empty() || lines.len() > 2 {
            return Err(format!(
                "pd.auth_key_file = {shown} holds {} secrets: it takes one, or two while \
                 rotating (the first signs, both verify)",
                lines.len()
            ));
        }
        if let Some((i, l)) = lines.iter().enumerate().find(|(_, l)| l.len() < MIN_SECRET) {
            return Err(format!(
                "pd.auth_key_file = {shown}: secret {} is {} bytes; at least {MIN_SECRET} are \
                 needed (e.g. `openssl rand -hex 32`)",
                i + 1,
                l.len()
            ));
        }
        Ok(Keys::from_secrets(
            lines.iter().map(|l| l.as_bytes().to_vec()).collect(),
        ))
    }

    /// Keys from secrets already in memory (tests, hosts that read their own).
    pub fn from_secrets(secrets: Vec<Vec<u8>>) -> Keys {
        Keys { secrets }
    }

    /// How many secrets verify.
    pub fn len(&self) -> usize {
        self.secrets.len()
    }

    pub fn is_empty(&self) -> bool {
        self.secrets.is_empty()
    }

    /// `prover`'s proof under secret `index` (0 signs) for the two nonces and the
    /// connection's `binding` (a TLS session's exported value; empty over plain TCP and UCX).
    pub fn proof(
        &self,
        index: usize,
        prover: Prover,
        decode: &[u8],
        prefill: &[u8],
        binding: &[u8],
    ) -> Vec<u8> {
        let key = hmac::Key::new(hmac::HMAC_SHA256, &self.secrets[index]);
        hmac::sign(&key, &transcript(prover, decode, prefill, binding))
            .as_ref()
            .to_vec()
    }

    /// The secret `proof` verifies under (compared in constant time), if any.
    pub fn verify(
        &self,
        prover: Prover,
        decode: &[u8],
        prefill: &[u8],
        binding: &[u8],
        proof: &[u8],
    ) -> Option<usize> {
        let msg = transcript(prover, decode, prefill, binding);
        (0..self.secrets.len()).find(|&i| {
            let key = hmac::Key::new(hmac::HMAC_SHA256, &self.secrets[i]);
            hmac::verify(&key, &msg, proof).is_ok()
        })
    }

    /// A link's frame keys, for the side `me`: HKDF-SHA256 of secret `index` salted with both
    /// nonces, so every link has its own ([`super::seal`]).
    pub fn frame_keys(
        &self,
        index: usize,
        decode: &[u8],
        prefill: &[u8],
        me: Prover,
    ) -> super::seal::FrameKeys {
        let salt = [decode, prefill].concat();
        let expand = |info: &[u8]| {
            let mut key = [0u8; 16];
            key.copy_from_slice(&self.derive_from(index, &salt, info)[..16]);
            super::seal::FrameKey::new(key)
        };
        let (to_prefill, to_decode) = (
            expand(b"dsv4-pd frames decode to prefill"),
            expand(b"dsv4-pd frames prefill to decode"),
        );
        let rma = expand(b"dsv4-pd rma-written bytes");
        match me {
            Prover::Decode => super::seal::FrameKeys {
                send: to_prefill,
                recv: to_decode,
                rma,
            },
            Prover::Prefill => super::seal::FrameKeys {
                send: to_decode,
                recv: to_prefill,
                rma,
            },
        }
    }

    /// The key request digests are keyed with on links authenticated under secret `index`:
    /// HKDF-SHA256 of the secret (the same on both engines, whatever the nonces).
    pub fn digest_key(&self, index: usize) -> DigestKey {
        let key = self.derive_from(index, b"dsv4-pd", b"dsv4-pd request digest");
        DigestKey(hmac::Key::new(hmac::HMAC_SHA256, &key))
    }

    /// 32 bytes of HKDF-SHA256 from secret `index`, salted with `salt`, for `info`.
    fn derive_from(&self, index: usize, salt: &[u8], info: &[u8]) -> [u8; 32] {
        let prk = hkdf::Salt::new(hkdf::HKDF_SHA256, salt).extract(&self.secrets[index]);
        let mut out = [0u8; 32];
        // 32 bytes is HKDF-SHA256's hash length, within its output limit: expand and fill
        // cannot fail.
        if let Ok(okm) = prk.expand(&[info], hkdf::HKDF_SHA256) {
            let _ = okm.fill(&mut out);
        }
        out
    }
}

/// The keys an engine listening on `listen` runs with (`pd.auth_key_file`), or why it must not
/// start: an engine reachable beyond loopback needs a key unless the operator said
/// `pd.insecure_no_auth`.
pub fn for_listen(
    key_file: Option<&str>,
    insecure: bool,
    listen: &crate::config::params::Endpoint,
) -> Result<Option<Keys>, String> {
    let keys = key_file.map(|f| Keys::load(Path::new(f))).transpose()?;
    if keys.is_none() && !insecure && !is_loopback(&listen.host) {
        return Err(format!(
            "pd.listen = {} is reachable beyond this host but pd.auth_key_file is not set: \
             anyone who reaches the port could claim prompts' KV. Give both engines the same \
             key file (`openssl rand -hex 32 > pd.key`), or set pd.insecure_no_auth = true on \
             a network you trust",
            listen.text()
        ));
    }
    Ok(keys)
}

/// Whether `host` names this host only (127.0.0.0/8, ::1, localhost).
pub fn is_loopback(host: &str) -> bool {
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    match bare.parse::<std::net::IpAddr>() {
        Ok(ip) => ip.is_loopback(),
        Err(_) => bare.eq_ignore_ascii_case("localhost"),
    }
}

/// What a proof signs: the prover's label, the decode's and the prefill's nonces, then the
/// connection's binding (fixed length where present: 32 bytes from a TLS session).
fn transcript(prover: Prover, decode: &[u8], prefill: &[u8], binding: &[u8]) -> Vec<u8> {
    let label: &[u8] = match prover {
        Prover::Decode => b"dsv4-pd decode proof",
        Prover::Prefill => b"dsv4-pd prefill proof",
    };
    [label, decode, prefill, binding].concat()
}

/// What an authenticated link keeps for its rooms: the key of its request digests and the
/// key of the MAC over bytes written by RMA ([`super::seal`]).
#[derive(Clone, Debug)]
pub struct LinkKeys {
    pub digest: DigestKey,
    pub rma: super::seal::Keyed,
}

impl Keys {
    /// A link's room keys, authenticated under secret `index` with frame keys `frames`.
    pub fn link_keys(&self, index: usize, frames: &super::seal::FrameKeys) -> LinkKeys {
        LinkKeys {
            digest: self.digest_key(index),
            rma: super::seal::Keyed::new(&frames.rma),
        }
    }
}

/// The key of a link's request digests.
#[derive(Clone)]
pub struct DigestKey(hmac::Key);

impl std::fmt::Debug for DigestKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DigestKey(redacted)")
    }
}

/// The request digest a claim carries on a link: keyed (HMAC-SHA256 of the unkeyed digest,
/// first 8 bytes) where the link is authenticated, else the unkeyed digest.
pub fn keyed_digest(key: Option<&DigestKey>, digest: u64) -> u64 {
    match key {
        None => digest,
        Some(DigestKey(k)) => {
            let tag = hmac::sign(k, &digest.to_le_bytes());
            let mut first = [0u8; 8];
            first.copy_from_slice(&tag.as_ref()[..8]);
            u64::from_le_bytes(first)
        }
    }
}

/// A fresh nonce from the OS's CSPRNG.
pub fn nonce() -> Result<[u8; NONCE], String> {
    let mut n = [0u8; NONCE];
    ring::rand::SystemRandom::new()
        .fill(&mut n)
        .map_err(|_| "the operating system's random source failed".to_string())?;
    Ok(n)
}

/// Hex of `bytes` (nonces and proofs travel as JSON strings).
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Bytes of hex `text`, when it is exactly `len` bytes of it.
pub fn unhex(text: &str, len: usize) -> Option<Vec<u8>> {
    if text.len() != 2 * len || !text.is_ascii() {
        return None;
    }
    (0..len)
        .map(|i| u8::from_str_radix(&text[2 * i..2 * i + 2], 16).ok())
        .collect()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Keys of these secrets (also the handshake's tests').
    pub(crate) fn keys(secrets: &[&str]) -> Keys {
        Keys::from_secrets(secrets.iter().map(|s| s.as_bytes().to_vec()).collect())
    }

    const A: &str = "a0a1a2a3a4a5a6a7a8a9aaabacadaeafb0b1b2b3b4b5b6b7b8b9babbbcbdbebf";
    const B: &str = "c0c1c2c3c4c5c6c7c8c9cacbcccdcecfd0d1d2d3d4d5d6d7d8d9dadbdcdddedf";

    #[test]
    fn a_proof_is_hmac_sha256_of_the_label_and_both_nonces() {
        // Independent reference: HMAC-SHA256 per RFC 2104 built here from ring's SHA-256.
        let (d, p) = ([1u8; NONCE], [2u8; NONCE]);
        let proof = keys(&[A]).proof(0, Prover::Decode, &d, &p, &[]);
        let sha = |parts: &[&[u8]]| {
            let mut c = ring::digest::Context::new(&ring::digest::SHA256);
            parts.iter().for_each(|x| c.update(x));
            c.finish().as_ref().to_vec()
        };
        let mut k = A.as_bytes().to_vec();
        k.resize(64, 0);
        let ipad: Vec<u8> = k.iter().map(|b| b ^ 0x36).collect();
        let opad: Vec<u8> = k.iter().map(|b| b ^ 0x5c).collect();
        let inner = sha(&[&ipad, b"dsv4-pd decode proof", &d, &p]);
        assert_eq!(proof, sha(&[&opad, &inner]));
    }

    #[test]
    fn proofs_verify_under_the_right_secret_side_and_nonces_only() {
        let (d, p) = ([1u8; NONCE], [2u8; NONCE]);
        let old_new = keys(&[A, B]);
        let new_old = keys(&[B, A]);
        // Rotation: each side signs with its first secret; the other verifies under either.
        let proof = old_new.proof(0, Prover::Decode, &d, &p, &[]);
        assert_eq!(new_old.verify(Prover::Decode, &d, &p, &[], &proof), Some(1));
        assert_eq!(old_new.verify(Prover::Decode, &d, &p, &[], &proof), Some(0));
        // A decode's proof is no prefill's; other nonces (a replay) do not verify.
        assert_eq!(new_old.verify(Prover::Prefill, &d, &p, &[], &proof), None);
        assert_eq!(
            new_old.verify(Prover::Decode, &d, &[3u8; NONCE], &[], &proof),
            None
        );
        // Another secret does not.
        assert_eq!(keys(&[B]).verify(Prover::Decode, &d, &p, &[], &proof), None);
        assert_eq!(
            new_old.verify(Prover::Decode, &d, &p, &[], &proof[..31]),
            None
        );
    }

    #[test]
    fn a_proof_made_in_one_tls_session_does_not_verify_in_another() {
        // A relay that terminates TLS towards each engine holds two sessions with different
        // exported values: the proof it would pass along covers the other one.
        let (d, p) = ([1u8; NONCE], [2u8; NONCE]);
        let k = keys(&[A]);
        let (one, other) = ([7u8; 32], [8u8; 32]);
        let proof = k.proof(0, Prover::Decode, &d, &p, &one);
        assert_eq!(k.verify(Prover::Decode, &d, &p, &one, &proof), Some(0));
        assert_eq!(k.verify(Prover::Decode, &d, &p, &other, &proof), None);
        assert_eq!(k.verify(Prover::Decode, &d, &p, &[], &proof), None);
    }

    #[test]
    fn digests_are_keyed_by_the_secret_alone() {
        let (a, b) = (keys(&[A]), keys(&[B, A]));
        let d = 0x1234_5678_9abc_def0;
        assert_eq!(keyed_digest(None, d), d);
        let ka = keyed_digest(Some(&a.digest_key(0)), d);
        assert_ne!(ka, d);
        // The same secret keys the same digest on both engines, whichever line holds it.
        assert_eq!(keyed_digest(Some(&b.digest_key(1)), d), ka);
        assert_ne!(keyed_digest(Some(&b.digest_key(0)), d), ka);
    }

    #[test]
    fn key_files_take_one_or_two_long_secrets_and_never_print_them() {
        let dir = std::env::temp_dir().join(format!("dsv4-auth-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = |name: &str, text: &str| {
            let p = dir.join(name);
            std::fs::write(&p, text).unwrap();
            p
        };
        let k = Keys::load(&file("one", &format!("{A}\n"))).unwrap();
        assert_eq!(k.len(), 1);
        assert!(!format!("{k:?}").contains(A));
        assert_eq!(
            Keys::load(&file("two", &format!("  {A}\n\n{B}  \n")))
                .unwrap()
                .len(),
            2
        );
        let e = Keys::load(&file("three", &format!("{A}\n{B}\n{A}\n"))).unwrap_err();
        assert!(e.contains("holds 3 secrets"), "{e}");
        let e = Keys::load(&file("short", "hunter2\n")).unwrap_err();
        assert!(e.contains("secret 1 is 7 bytes; at least 32"), "{e}");
        assert!(!e.contains("hunter2"), "{e}");
        let e = Keys::load(&file("empty", "\n")).unwrap_err();
        assert!(e.contains("holds 0 secrets"), "{e}");
        let e = Keys::load(&dir.join("missing")).unwrap_err();
        assert!(e.contains("cannot read it"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn an_engine_beyond_loopback_needs_a_key_or_the_operators_word() {
        use crate::config::params::Endpoint;
        let ep = |t: &str| Endpoint::parse(t).unwrap();
        assert!(is_loopback("127.0.0.1") && is_loopback("::1") && is_loopback("[::1]"));
        assert!(is_loopback("localhost") && is_loopback("127.8.0.1"));
        assert!(!is_loopback("0.0.0.0") && !is_loopback("10.0.0.1") && !is_loopback("::"));
        assert!(for_listen(None, false, &ep("tcp://127.0.0.1:0"))
            .unwrap()
            .is_none());
        let e = for_listen(None, false, &ep("tcp://0.0.0.0:7000")).unwrap_err();
        assert!(
            e.contains("pd.listen = tcp://0.0.0.0:7000 is reachable beyond"),
            "{e}"
        );
        assert!(e.contains("pd.insecure_no_auth = true"), "{e}");
        assert!(for_listen(None, true, &ep("tcp://0.0.0.0:7000"))
            .unwrap()
            .is_none());
        let dir = std::env::temp_dir().join(format!("dsv4-listen-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("key");
        std::fs::write(&f, format!("{A}\n")).unwrap();
        let f = f.to_str().unwrap();
        assert!(for_listen(Some(f), false, &ep("tcp://0.0.0.0:7000"))
            .unwrap()
            .is_some());
        assert!(for_listen(Some(f), false, &ep("ucx://10.0.0.1:7000"))
            .unwrap()
            .is_some());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn nonces_are_fresh_and_hex_round_trips() {
        let (a, b) = (nonce().unwrap(), nonce().unwrap());
        assert_ne!(a, b);
        assert_eq!(unhex(&hex(&a), NONCE).unwrap(), a.to_vec());
        assert_eq!(unhex("zz", 1), None);
        assert_eq!(unhex("00", 2), None);
    }
}
