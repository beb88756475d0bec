//! The challenge-response of [`super::auth`] as frames on a connection, for both sides. The
//! caller supplies how a frame is read (with its deadline) and written; on success each side
//! knows which secret the link is authenticated under (its digest key follows from it) and
//! the link's frame keys.
//! A prefill that refuses says only [`REFUSED`]: why goes to its log.

use super::auth::{self, Keys, Prover};
use super::room::FailReason;
use super::seal::FrameKeys;
use super::wire::{self, Frame, Kind, Refusal};

/// What a side knows once the peer proved it holds the secret.
#[derive(Debug)]
pub struct Authenticated {
    /// The line of the key file the link is authenticated under.
    pub index: usize,
    /// This side's keys for the link's frames.
    pub keys: FrameKeys,
}

/// All a peer that failed to authenticate is told.
pub const REFUSED: &str = "the connection was refused";

/// The one refusal an unauthenticated peer gets.
pub fn refusal() -> Vec<u8> {
    wire::encode_json(
        Kind::Refuse,
        0,
        &Refusal {
            reason: FailReason::Mismatch,
            message: REFUSED.into(),
        },
    )
}

type ReadFrame<'a> = &'a mut dyn FnMut() -> Result<Frame, String>;
type WriteBytes<'a> = &'a mut dyn FnMut(&[u8]) -> Result<(), String>;

fn nonce_of(frame: &Frame) -> Result<Vec<u8>, String> {
    if frame.kind != Kind::Auth {
        return Err(format!("it sent {:?} where AUTH was due", frame.kind));
    }
    let a: wire::Auth = wire::parse(frame)?;
    auth::unhex(&a.nonce, auth::NONCE).ok_or_else(|| "its nonce is not 32 bytes of hex".into())
}

fn proof_of(frame: &Frame) -> Result<Vec<u8>, String> {
    if frame.kind != Kind::Proof {
        return Err(format!("it sent {:?} where PROOF was due", frame.kind));
    }
    let p: wire::Proof = wire::parse(frame)?;
    auth::unhex(&p.proof, 32).ok_or_else(|| "its proof is not 32 bytes of hex".into())
}

fn auth_frame(nonce: &[u8]) -> Vec<u8> {
    wire::encode_json(
        Kind::Auth,
        0,
        &wire::Auth {
            nonce: auth::hex(nonce),
        },
    )
}

fn proof_frame(proof: &[u8]) -> Vec<u8> {
    wire::encode_json(
        Kind::Proof,
        0,
        &wire::Proof {
            proof: auth::hex(proof),
        },
    )
}

/// The decode's side, a step at a time (for a caller that cannot block on the peer: the UCX
/// thread). [`Initiator::start`] gives the AUTH to send first.
pub struct Initiator {
    ours: [u8; auth::NONCE],
    theirs: Vec<u8>,
    /// What the proofs cover besides the nonces: a TLS session's exported value, or nothing.
    binding: Vec<u8>,
}

impl Initiator {
    /// A fresh nonce, and the AUTH frame that carries it; `binding`: the connection's TLS
    /// session's exported value (empty without TLS).
    pub fn start(binding: &[u8]) -> Result<(Initiator, Vec<u8>), String> {
        let ours = auth::nonce()?;
        let frame = auth_frame(&ours);
        Ok((
            Initiator {
                ours,
                theirs: Vec::new(),
                binding: binding.to_vec(),
            },
            frame,
        ))
    }

    /// The prefill's AUTH: the PROOF to send.
    pub fn on_auth(&mut self, keys: &Keys, answer: &Frame) -> Result<Vec<u8>, String> {
        refused(answer)?;
        self.theirs = nonce_of(answer)?;
        Ok(proof_frame(&keys.proof(
            0,
            Prover::Decode,
            &self.ours,
            &self.theirs,
            &self.binding,
        )))
    }

    /// The prefill's PROOF: the secret it proved it holds, or what went wrong (naming the
    /// fix where the prefill refused).
    pub fn on_proof(&self, keys: &Keys, answer: &Frame) -> Result<Authenticated, String> {
        refused(answer)?;
        let proof = proof_of(answer)?;
        let index = keys
            .verify(
                Prover::Prefill,
                &self.ours,
                &self.theirs,
                &self.binding,
                &proof,
            )
            .ok_or_else(|| {
                "its proof verifies under none of pd.auth_key_file's secrets: it does not hold \
                 this engine's secret"
                    .to_string()
            })?;
        Ok(Authenticated {
            index,
            keys: keys.frame_keys(index, &self.ours, &self.theirs, Prover::Decode),
        })
    }
}

/// What the decode says when the prefill refused it during the handshake.
fn refused(f: &Frame) -> Result<(), String> {
    if f.kind != Kind::Refuse {
        return Ok(());
    }
    let said = wire::parse::<Refusal>(f).map_or_else(|e| e, |r| r.message);
    if said != REFUSED {
        // A refusal that names its own fix (a prefill without a key, or with pd.tls).
        return Err(format!("it refused the connection: {said}"));
    }
    Err(format!(
        "it refused the connection ({said}): give both engines the same secret in \
         pd.auth_key_file (one line of each engine's file must match)"
    ))
}

/// The prefill's side, a step at a time; on an error the caller sends [`refusal`] and closes.
pub struct Responder {
    theirs: Vec<u8>,
    ours: [u8; auth::NONCE],
    binding: Vec<u8>,
}

impl Responder {
    /// The decode's first frame (its AUTH): the responder and the AUTH to answer with;
    /// `binding` as for [`Initiator::start`].
    pub fn on_auth(first: &Frame, binding: &[u8]) -> Result<(Responder, Vec<u8>), String> {
        let theirs = nonce_of(first)?;
        let ours = auth::nonce()?;
        let frame = auth_frame(&ours);
        let binding = binding.to_vec();
        Ok((
            Responder {
                theirs,
                ours,
                binding,
            },
            frame,
        ))
    }

    /// The decode's PROOF: the secret it proved it holds, and the PROOF to answer with.
    pub fn on_proof(&self, keys: &Keys, frame: &Frame) -> Result<(Authenticated, Vec<u8>), String> {
        let proof = proof_of(frame)?;
        let index = keys
            .verify(
                Prover::Decode,
                &self.theirs,
                &self.ours,
                &self.binding,
                &proof,
            )
            .ok_or("its proof verifies under none of pd.auth_key_file's secrets")?;
        let answer = proof_frame(&keys.proof(
            index,
            Prover::Prefill,
            &self.theirs,
            &self.ours,
            &self.binding,
        ));
        Ok((
            Authenticated {
                index,
                keys: keys.frame_keys(index, &self.theirs, &self.ours, Prover::Prefill),
            },
            answer,
        ))
    }
}

/// The prefill's side, given the connection's first frame: the secret the decode proved it
/// holds, or why not (for the log; the peer gets [`refusal`], written here).
pub fn accept(
    keys: &Keys,
    binding: &[u8],
    first: Frame,
    read: ReadFrame<'_>,
    write: WriteBytes<'_>,
) -> Result<Authenticated, String> {
    let outcome = (|| {
        let (responder, answer) = Responder::on_auth(&first, binding)?;
        write(&answer)?;
        let (authenticated, answer) = responder.on_proof(keys, &read()?)?;
        write(&answer)?;
        Ok(authenticated)
    })();
    if outcome.is_err() {
        let _ = write(&refusal());
    }
    outcome
}

/// The decode's side: the secret the prefill proved it holds, or what went wrong (naming the
/// fix where the prefill refused).
pub fn initiate(
    keys: &Keys,
    binding: &[u8],
    read: ReadFrame<'_>,
    write: WriteBytes<'_>,
) -> Result<Authenticated, String> {
    let (mut initiator, first) = Initiator::start(binding)?;
    write(&first)?;
    let proof = initiator.on_auth(keys, &read()?)?;
    write(&proof)?;
    initiator.on_proof(keys, &read()?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pd::auth::tests::keys;
    use std::collections::VecDeque;
    use std::sync::mpsc::{channel, Receiver, Sender};

    const A: &str = "0123456789abcdef0123456789abcdef-a";
    const B: &str = "0123456789abcdef0123456789abcdef-b";

    /// Both sides on two threads over channels of encoded frames; `tap` sees what the decode
    /// sent.
    fn run(decode: Keys, prefill: Keys) -> (Result<usize, String>, Result<usize, String>) {
        let (d, p) = run_keys(decode, prefill);
        (d.map(|a| a.index), p.map(|a| a.index))
    }

    type Outcome = Result<Authenticated, String>;

    fn run_keys(decode: Keys, prefill: Keys) -> (Outcome, Outcome) {
        let (to_p, from_d): (Sender<Vec<u8>>, Receiver<Vec<u8>>) = channel();
        let (to_d, from_p): (Sender<Vec<u8>>, Receiver<Vec<u8>>) = channel();
        let p = std::thread::spawn(move || {
            let mut read = || {
                let bytes = from_d.recv().map_err(|e| e.to_string())?;
                wire::read_frame_from(&mut &bytes[..]).map_err(|e| format!("{e:?}"))
            };
            let first = read().unwrap();
            accept(&prefill, &[], first, &mut read, &mut |b: &[u8]| {
                to_d.send(b.to_vec()).map_err(|e| e.to_string())
            })
        });
        let d = initiate(
            &decode,
            &[],
            &mut || {
                let bytes = from_p.recv().map_err(|e| e.to_string())?;
                wire::read_frame_from(&mut &bytes[..]).map_err(|e| format!("{e:?}"))
            },
            &mut |b: &[u8]| to_p.send(b.to_vec()).map_err(|e| e.to_string()),
        );
        (d, p.join().unwrap())
    }

    #[test]
    fn engines_with_a_common_secret_authenticate_each_other() {
        assert_eq!(run(keys(&[A]), keys(&[A])), (Ok(0), Ok(0)));
        // Rotation: the decode signs with the new secret, the prefill still with the old one
        // but verifies both; it answers under the secret the decode's proof used.
        assert_eq!(run(keys(&[B, A]), keys(&[A, B])), (Ok(0), Ok(1)));
    }

    #[test]
    fn both_sides_derive_the_same_frame_keys_for_each_direction_and_new_ones_per_link() {
        use crate::pd::seal::{verify, Sequence};
        let (d, p) = run_keys(keys(&[A]), keys(&[A]));
        let (d, p) = (d.unwrap().keys, p.unwrap().keys);
        let check = |send, recv| {
            let (mut tx, mut rx) = (Sequence::new(send), Sequence::new(recv));
            let tag = tx.tag(&[b"frame"]);
            let mut h = rx.begin();
            h.update(b"frame");
            verify(h, &tag)
        };
        assert!(check(d.send.clone(), p.recv.clone()));
        assert!(check(p.send.clone(), d.recv.clone()));
        // The two directions differ; another link (other nonces) has other keys.
        assert!(!check(d.send.clone(), d.recv.clone()));
        let (d2, _) = run_keys(keys(&[A]), keys(&[A]));
        assert!(!check(d2.unwrap().keys.send, p.recv));
    }

    #[test]
    fn a_wrong_secret_gets_one_generic_refusal() {
        let (d, p) = run(keys(&[A]), keys(&[B]));
        let d = d.unwrap_err();
        assert!(d.contains(&format!("({REFUSED})")), "{d}");
        assert!(d.contains("pd.auth_key_file"), "{d}");
        assert!(p.unwrap_err().contains("verifies under none"));
    }

    #[test]
    fn a_replayed_exchange_does_not_authenticate() {
        // A recording of a good decode's frames, played back to a prefill: its nonce is new,
        // so the recorded proof does not verify.
        let (to_p, from_d) = channel::<Vec<u8>>();
        let (to_d, from_p) = channel::<Vec<u8>>();
        let prefill = keys(&[A]);
        let record = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let (pk, rec) = (prefill.clone(), record.clone());
        let p = std::thread::spawn(move || {
            let mut read = || {
                let bytes = from_d.recv().map_err(|e| e.to_string())?;
                rec.lock().unwrap().push(bytes.clone());
                wire::read_frame_from(&mut &bytes[..]).map_err(|e| format!("{e:?}"))
            };
            let first = read().unwrap();
            accept(&pk, &[], first, &mut read, &mut |b: &[u8]| {
                to_d.send(b.to_vec()).map_err(|e| e.to_string())
            })
        });
        let d = initiate(
            &keys(&[A]),
            &[],
            &mut || {
                let bytes = from_p.recv().map_err(|e| e.to_string())?;
                wire::read_frame_from(&mut &bytes[..]).map_err(|e| format!("{e:?}"))
            },
            &mut |b: &[u8]| to_p.send(b.to_vec()).map_err(|e| e.to_string()),
        );
        assert_eq!((d.unwrap().index, p.join().unwrap().unwrap().index), (0, 0));
        let mut replay: VecDeque<Vec<u8>> = record.lock().unwrap().clone().into();
        assert_eq!(replay.len(), 2);
        let first = wire::read_frame_from(&mut &replay.pop_front().unwrap()[..]).unwrap();
        let mut sent = Vec::new();
        let out = accept(
            &prefill,
            &[],
            first,
            &mut || {
                let bytes = replay.pop_front().ok_or("nothing left")?;
                wire::read_frame_from(&mut &bytes[..]).map_err(|e| format!("{e:?}"))
            },
            &mut |b: &[u8]| {
                sent.push(b.to_vec());
                Ok(())
            },
        );
        assert!(out.unwrap_err().contains("verifies under none"));
        // It got the prefill's nonce and the generic refusal, nothing else.
        assert_eq!(sent.len(), 2);
        assert_eq!(sent[1], refusal());
    }
}
