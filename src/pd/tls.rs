//! Optional encryption of TCP PD links (`pd.tls`): TLS 1.3 (rustls, with ring's ciphers) under
//! the link's frames. The prefill is the TLS server (`pd.tls_cert_file`, `pd.tls_key_file`);
//! the decode is the client and checks the prefill's certificate against `pd.tls_ca_file` for
//! the host its `pd_peer` names. Where the engines also hold a `pd.auth_key_file`, the
//! challenge-response runs inside TLS and its proofs cover a value exported from the session
//! ([`Session::binding`], RFC 8446 §7.5): a proof made in one session proves nothing in
//! another, so a relay that terminates TLS towards each engine cannot pass proofs along.
//!
//! One session serves a link's two threads. The reader takes ciphertext off the socket and
//! decrypts it under the session's lock, never holding the lock while it waits on the socket;
//! the writer encrypts a frame under the lock, then writes the records without it (holding the
//! link's wire lock, so records reach the socket in the order they were made). Neither side
//! can stall the other's socket work on the lock: the two directions never deadlock.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::{
    ClientConfig, ClientConnection, Connection, RootCertStore, ServerConfig, ServerConnection,
};

/// Bytes of the value exported from a session for the challenge-response.
pub const BINDING: usize = 32;
const BINDING_LABEL: &[u8] = b"EXPORTER-dsv4-pd-challenge-response";
/// Ciphertext read off the socket at once.
const RAW: usize = 64 << 10;

/// An engine's TLS settings: a prefill's certificate and key, a decode's trust anchors.
#[derive(Clone)]
pub struct Tls {
    server: Option<Arc<ServerConfig>>,
    client: Option<Arc<ClientConfig>>,
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Tls(server: {}, client: {})",
            self.server.is_some(),
            self.client.is_some()
        )
    }
}

/// ring's ciphers, AES-128-GCM preferred (the fastest with AES-NI: it runs over every state
/// byte on both sides).
fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    // Deprecated for lacking post-quantum key exchange; aws-lc-rs, which has it, needs cmake
    // and an assembler to build, which a fresh machine does not have.
    #[allow(deprecated)]
    let mut p = rustls::crypto::ring::default_provider();
    p.cipher_suites
        .sort_by_key(|s| s.suite() != rustls::CipherSuite::TLS13_AES_128_GCM_SHA256);
    Arc::new(p)
}

impl Tls {
    /// A prefill's: its certificate chain and private key (PEM files). Messages name the file
    /// and the fix; never a key.
    pub fn server(cert_file: &str, key_file: &str) -> Result<Tls, String> {
        let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert_file)
            .and_then(|i| i.collect())
            .map_err(|e| {
                format!(
                    "pd.tls_cert_file = {cert_file}: cannot read a PEM certificate chain: {e}: \
                     give the prefill's certificate (and its intermediates) in PEM"
                )
            })?;
        if certs.is_empty() {
            return Err(format!(
                "pd.tls_cert_file = {cert_file} holds no certificate: give the prefill's \
                 certificate in PEM"
            ));
        }
        let key = PrivateKeyDer::from_pem_file(key_file).map_err(|e| {
            format!(
                "pd.tls_key_file = {key_file}: cannot read a PEM private key: {e}: give the \
                 key of pd.tls_cert_file's certificate"
            )
        })?;
        let mut config = ServerConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| format!("pd.tls: {e}"))?
            .with_no_client_auth()
            .with_single_cert(certs, key)
            .map_err(|e| {
                format!(
                    "pd.tls_cert_file = {cert_file} and pd.tls_key_file = {key_file} do not \
                     go together: {e}"
                )
            })?;
        // Links are long-lived and never resumed.
        config.send_tls13_tickets = 0;
        Ok(Tls {
            server: Some(Arc::new(config)),
            client: None,
        })
    }

    /// A decode's: the certificates a prefill's must chain to (a PEM file).
    pub fn client(ca_file: &str) -> Result<Tls, String> {
        let mut roots = RootCertStore::empty();
        let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(ca_file)
            .and_then(|i| i.collect())
            .map_err(|e| {
                format!(
                    "pd.tls_ca_file = {ca_file}: cannot read PEM certificates: {e}: give the \
                     CA that signed the prefills' certificates"
                )
            })?;
        let (added, _) = roots.add_parsable_certificates(certs);
        if added == 0 {
            return Err(format!(
                "pd.tls_ca_file = {ca_file} holds no usable certificate: give the CA that \
                 signed the prefills' certificates, in PEM"
            ));
        }
        let config = ClientConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| format!("pd.tls: {e}"))?
            .with_root_certificates(roots)
            .with_no_client_auth();
        Ok(Tls {
            server: None,
            client: Some(Arc::new(config)),
        })
    }

    /// The prefill's side of a connection's TLS handshake, by `deadline` (the socket's read
    /// timeout is the polling interval) unless `stop` says the engine is shutting down.
    pub fn accept(
        &self,
        sock: TcpStream,
        deadline: Instant,
        stop: &dyn Fn() -> bool,
    ) -> Result<Arc<Session>, String> {
        let config = self
            .server
            .clone()
            .ok_or("this engine has no pd.tls_cert_file (a dsv4 bug: checked at create)")?;
        let conn = ServerConnection::new(config).map_err(|e| format!("TLS: {e}"))?;
        handshake(conn.into(), sock, deadline, stop)
    }

    /// The decode's side, to the prefill at `host` (whose certificate must name it).
    pub fn connect(
        &self,
        sock: TcpStream,
        host: &str,
        deadline: Instant,
        stop: &dyn Fn() -> bool,
    ) -> Result<Arc<Session>, String> {
        let config = self
            .client
            .clone()
            .ok_or("this engine has no pd.tls_ca_file (a dsv4 bug: checked at create)")?;
        let bare = host.trim_start_matches('[').trim_end_matches(']');
        let name = ServerName::try_from(bare.to_string())
            .map_err(|e| format!("the prefill's host {host} is no TLS server name: {e}"))?;
        let conn = ClientConnection::new(config, name).map_err(|e| format!("TLS: {e}"))?;
        handshake(conn.into(), sock, deadline, stop)
    }
}

/// The TLS an engine on `side` runs with (`pd.tls` and its files), or why it must not start.
pub fn for_engine(
    p: &crate::config::params::PdParams,
    side: super::Side,
) -> Result<Option<Tls>, String> {
    let files = [
        ("pd.tls_cert_file", &p.tls_cert_file),
        ("pd.tls_key_file", &p.tls_key_file),
        ("pd.tls_ca_file", &p.tls_ca_file),
    ];
    if !p.tls {
        if let Some((name, _)) = files.iter().find(|(_, f)| f.is_some()) {
            return Err(format!(
                "{name} is set but pd.tls is false: set pd.tls = true to encrypt the links, or \
                 drop {name}"
            ));
        }
        return Ok(None);
    }
    if p.transport == crate::config::params::PdTransport::Ucx {
        return Err(
            "pd.tls encrypts tcp links but pd.transport is \"ucx\": use pd.transport = \
             \"tcp\", or run ucx on a network only the engines reach (its links authenticate \
             with pd.auth_key_file; they are not encrypted)"
                .into(),
        );
    }
    match side {
        super::Side::Prefill => match (&p.tls_cert_file, &p.tls_key_file) {
            (Some(cert), Some(key)) => Tls::server(cert, key).map(Some),
            _ => Err(
                "pd.tls on a prefill needs pd.tls_cert_file and pd.tls_key_file: its \
                 certificate (naming the host decodes connect to) and that certificate's key"
                    .into(),
            ),
        },
        super::Side::Decode => match &p.tls_ca_file {
            Some(ca) => Tls::client(ca).map(Some),
            None => Err(
                "pd.tls on a decode needs pd.tls_ca_file: the CA certificates the prefills' \
                 certificates chain to"
                    .into(),
            ),
        },
    }
}

/// Runs the handshake on `sock` (blocking, polling by its read timeout).
fn handshake(
    mut conn: Connection,
    mut sock: TcpStream,
    deadline: Instant,
    stop: &dyn Fn() -> bool,
) -> Result<Arc<Session>, String> {
    let mut buf = vec![0u8; RAW];
    // Bytes of the last read past the handshake's end (the peer's first frames): the session
    // takes them as it reads.
    let mut left = 0..0;
    loop {
        while conn.wants_write() {
            conn.write_tls(&mut sock)
                .map_err(|e| format!("the TLS handshake: sending: {e}"))?;
        }
        if !conn.is_handshaking() {
            break;
        }
        // Checked at every turn: a peer that sends a byte at a time gets no more time.
        if stop() || Instant::now() >= deadline {
            return Err("no TLS handshake in time".into());
        }
        match sock.read(&mut buf) {
            Ok(0) => {
                return Err(
                    "the peer closed the connection during the TLS handshake (does it set \
                     pd.tls too?)"
                        .into(),
                )
            }
            Ok(n) => match take_handshake(&mut conn, &buf[..n]) {
                Ok(used) => left = used..n,
                Err(e) => {
                    // The alert that says why, if it can go.
                    let _ = conn.write_tls(&mut sock);
                    return Err(format!("the TLS handshake failed: {e}"));
                }
            },
            Err(e) if is_timeout(&e) => {}
            Err(e) => return Err(format!("the TLS handshake: {e}")),
        }
    }
    let (start, end) = (left.start, left.end);
    let binding = conn
        .export_keying_material([0u8; BINDING], BINDING_LABEL, None)
        .map_err(|e| format!("TLS: exporting the session's binding: {e}"))?;
    conn.set_buffer_limit(None);
    Ok(Arc::new(Session {
        conn: Mutex::new(conn),
        sock,
        raw: Mutex::new(Raw { buf, start, end }),
        binding,
    }))
}

/// Hands `bytes` of ciphertext to `conn` while it is handshaking, processing what they
/// complete: how many it took (the rest follow the handshake).
fn take_handshake(conn: &mut Connection, bytes: &[u8]) -> Result<usize, rustls::Error> {
    let mut rest = bytes;
    while !rest.is_empty() && conn.is_handshaking() {
        match conn.read_tls(&mut rest) {
            // Taking nothing: the peer closed its side (close_notify), or its records overflow
            // the session's buffer.
            Ok(0) => {
                return Err(rustls::Error::General(
                    "the peer sent more than the handshake after closing, or too much".into(),
                ))
            }
            Ok(_) => {}
            Err(e) => return Err(rustls::Error::General(e.to_string())),
        }
        conn.process_new_packets()?;
    }
    Ok(bytes.len() - rest.len())
}

/// Whether a read only ran out of its timeout (or was interrupted): try again, or give up
/// at a deadline.
pub(super) fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut | io::ErrorKind::Interrupted
    )
}

/// Ciphertext read off the socket and not yet taken by the session.
struct Raw {
    buf: Vec<u8>,
    start: usize,
    end: usize,
}

/// An established TLS session over a link's socket.
pub struct Session {
    conn: Mutex<Connection>,
    sock: TcpStream,
    /// The reader's (the one thread that reads the link).
    raw: Mutex<Raw>,
    binding: [u8; BINDING],
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Session({:?})", self.sock.peer_addr().ok())
    }
}

impl Session {
    fn conn(&self) -> MutexGuard<'_, Connection> {
        self.conn.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The value the challenge-response's proofs cover: exported from this session, the same
    /// on both ends of it and on no other session.
    pub fn binding(&self) -> &[u8; BINDING] {
        &self.binding
    }

    /// The socket under the session (timeouts, readiness; never its bytes).
    pub fn socket(&self) -> &TcpStream {
        &self.sock
    }

    /// Encrypts `parts` (in order): the records to write, in the order made (so the caller
    /// makes and writes them under one lock: the link's wire lock).
    pub fn encrypt(&self, parts: &[&[u8]]) -> io::Result<Vec<u8>> {
        let mut c = self.conn();
        for p in parts.iter().filter(|p| !p.is_empty()) {
            c.writer().write_all(p)?;
        }
        let mut out = Vec::with_capacity(parts.iter().map(|p| p.len()).sum::<usize>() + 256);
        while c.wants_write() {
            c.write_tls(&mut out)?;
        }
        Ok(out)
    }

    /// [`Self::encrypt`], then writes the records, blocking up to the socket's write timeout.
    /// One thread at a time (the link's wire lock, or the handshake's one thread).
    pub fn send(&self, parts: &[&[u8]]) -> io::Result<()> {
        let records = self.encrypt(parts)?;
        (&self.sock).write_all(&records)
    }

    /// Reads plaintext into `buf`: what the session holds, else what one read of the socket
    /// brings (which may time out: the socket's read timeout). `WouldBlock` when that read
    /// brought no plaintext (records without data, part of a record), so the caller's
    /// deadlines run; `Ok(0)` at the peer's close.
    pub fn read(&self, buf: &mut [u8]) -> io::Result<usize> {
        let bad = |e: rustls::Error| io::Error::new(io::ErrorKind::InvalidData, e);
        let mut raw = self.raw.lock().unwrap_or_else(|e| e.into_inner());
        let raw = &mut *raw;
        let mut read_once = false;
        loop {
            {
                let mut c = self.conn();
                match c.reader().read(buf) {
                    Ok(n) => return Ok(n),
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                    Err(e) => return Err(e),
                }
                if raw.start < raw.end {
                    let mut pending = &raw.buf[raw.start..raw.end];
                    let before = pending.len();
                    if c.read_tls(&mut pending)? == 0 {
                        // The peer closed its session: what follows is not read.
                        raw.start = raw.end;
                    }
                    raw.start += before - pending.len();
                    c.process_new_packets().map_err(bad)?;
                    continue;
                }
            }
            if read_once {
                return Err(io::Error::new(
                    io::ErrorKind::WouldBlock,
                    "no plaintext in what arrived yet",
                ));
            }
            read_once = true;
            let n = (&self.sock).read(&mut raw.buf)?;
            (raw.start, raw.end) = (0, n);
            if n == 0 {
                // The peer closed: the session says whether it did so cleanly.
                let mut c = self.conn();
                c.read_tls(&mut &[][..])?;
                c.process_new_packets().map_err(bad)?;
                return match c.reader().read(buf) {
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(0),
                    other => other,
                };
            }
        }
    }
}

/// A PD connection's byte stream: plain TCP, or TLS over it.
pub enum Stream {
    Tcp(TcpStream),
    Tls(Arc<Session>),
}

impl Stream {
    /// The socket (timeouts, readiness).
    pub fn tcp(&self) -> &TcpStream {
        match self {
            Stream::Tcp(s) => s,
            Stream::Tls(s) => s.socket(),
        }
    }

    pub fn try_clone(&self) -> io::Result<Stream> {
        Ok(match self {
            Stream::Tcp(s) => Stream::Tcp(s.try_clone()?),
            Stream::Tls(s) => Stream::Tls(s.clone()),
        })
    }

    /// What the challenge-response's proofs cover besides the nonces: the TLS session's
    /// binding, or nothing over plain TCP.
    pub fn binding(&self) -> &[u8] {
        match self {
            Stream::Tcp(_) => &[],
            Stream::Tls(s) => s.binding(),
        }
    }

    pub fn session(&self) -> Option<&Arc<Session>> {
        match self {
            Stream::Tcp(_) => None,
            Stream::Tls(s) => Some(s),
        }
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.read(buf),
            Stream::Tls(s) => s.read(buf),
        }
    }

    fn read_vectored(&mut self, bufs: &mut [io::IoSliceMut<'_>]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.read_vectored(bufs),
            Stream::Tls(s) => match bufs.iter_mut().find(|b| !b.is_empty()) {
                Some(b) => s.read(b),
                None => Ok(0),
            },
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.write(buf),
            Stream::Tls(s) => s.send(&[buf]).map(|()| buf.len()),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;
    use std::time::Duration;

    fn fixture(name: &str) -> String {
        format!("{}/tests/fixtures/tls/{name}", env!("CARGO_MANIFEST_DIR"))
    }

    /// A session each way over a loopback connection: (the prefill's, the decode's).
    fn sessions(ca: &str) -> (Result<Arc<Session>, String>, Result<Arc<Session>, String>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let server = Tls::server(&fixture("prefill.pem"), &fixture("prefill.key")).unwrap();
        let client = Tls::client(&fixture(ca)).unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        let accepted = std::thread::spawn(move || {
            let (sock, _) = listener.accept().unwrap();
            sock.set_read_timeout(Some(Duration::from_millis(20)))
                .unwrap();
            server.accept(sock, deadline, &|| false)
        });
        let sock = TcpStream::connect(addr).unwrap();
        sock.set_read_timeout(Some(Duration::from_millis(20)))
            .unwrap();
        let connected = client.connect(sock, "127.0.0.1", deadline, &|| false);
        (accepted.join().unwrap(), connected)
    }

    fn pattern(len: usize, seed: u32) -> Vec<u8> {
        (0..len as u32)
            .map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(seed) >> 13) as u8)
            .collect()
    }

    /// Reads `n` bytes of plaintext, waiting through the socket's read timeouts.
    fn read_exactly(s: &Session, n: usize) -> Vec<u8> {
        let mut out = vec![0u8; n];
        let mut at = 0;
        let deadline = Instant::now() + Duration::from_secs(30);
        while at < n {
            match s.read(&mut out[at..]) {
                Ok(0) => panic!("closed after {at} of {n} bytes"),
                Ok(k) => at += k,
                Err(e) if is_timeout(&e) => assert!(Instant::now() < deadline, "stuck at {at}"),
                Err(e) => panic!("{e}"),
            }
        }
        out
    }

    #[test]
    fn both_ends_share_the_binding_and_megabytes_cross_both_ways_at_once() {
        let (p, d) = sessions("ca.pem");
        let (p, d) = (p.unwrap(), d.unwrap());
        assert_eq!(p.binding(), d.binding());
        let (other_p, _) = sessions("ca.pem");
        assert_ne!(
            other_p.unwrap().binding(),
            p.binding(),
            "each session its own"
        );
        // Both sides write 8 MiB in frames of up to 256 KiB while the other reads: neither
        // direction waits on the other's lock (a writer blocked on a full socket does not
        // hold it).
        let len = 8 << 20;
        let run = |me: Arc<Session>, seed: u32, other_seed: u32| {
            std::thread::spawn(move || {
                let mine = pattern(len, seed);
                let writer = {
                    let me = me.clone();
                    std::thread::spawn(move || {
                        for chunk in mine.chunks(256 << 10) {
                            let (a, b) = chunk.split_at(chunk.len() / 3);
                            me.send(&[a, b, &[]]).unwrap();
                        }
                    })
                };
                let got = read_exactly(&me, len);
                writer.join().unwrap();
                assert!(
                    got == pattern(len, other_seed),
                    "the bytes arrive unchanged"
                );
            })
        };
        let (a, b) = (run(p.clone(), 1, 2), run(d.clone(), 2, 1));
        a.join().unwrap();
        b.join().unwrap();
    }

    #[test]
    fn a_decode_refuses_a_certificate_its_ca_did_not_sign() {
        let (p, d) = sessions("other-ca.pem");
        let d = d.unwrap_err();
        assert!(d.contains("the TLS handshake failed"), "{d}");
        assert!(d.contains("UnknownIssuer"), "{d}");
        assert!(p.is_err(), "the prefill's side fails too");
    }

    #[test]
    fn files_that_are_missing_or_not_pem_are_named_with_the_fix() {
        let e = Tls::server("/nonexistent.pem", &fixture("prefill.key")).unwrap_err();
        assert!(e.contains("pd.tls_cert_file = /nonexistent.pem"), "{e}");
        let e = Tls::server(&fixture("prefill.pem"), &fixture("ca.pem")).unwrap_err();
        assert!(e.contains("pd.tls_key_file"), "{e}");
        let e = Tls::server(&fixture("prefill.pem"), &fixture("README.md")).unwrap_err();
        assert!(e.contains("pd.tls_key_file"), "{e}");
        let e = Tls::client(&fixture("README.md")).unwrap_err();
        assert!(e.contains("pd.tls_ca_file"), "{e}");
    }

    #[test]
    fn an_engine_without_what_its_side_needs_is_refused_naming_the_setting() {
        use crate::config::params::Params;
        use crate::pd::Side;
        let pd = |extra: serde_json::Value| {
            let mut doc =
                serde_json::json!({"role": "prefill", "pd": {"listen": "tcp://127.0.0.1:0"}});
            for (k, v) in extra.as_object().unwrap() {
                doc["pd"][k] = v.clone();
            }
            Params::from_value(&doc).unwrap().pd
        };
        let (cert, key, ca) = (
            fixture("prefill.pem"),
            fixture("prefill.key"),
            fixture("ca.pem"),
        );
        let on = serde_json::json!({"tls": true});
        assert!(for_engine(&pd(serde_json::json!({})), Side::Prefill)
            .unwrap()
            .is_none());
        let e = for_engine(&pd(on.clone()), Side::Prefill).unwrap_err();
        assert!(e.contains("pd.tls_cert_file and pd.tls_key_file"), "{e}");
        let e = for_engine(&pd(on.clone()), Side::Decode).unwrap_err();
        assert!(e.contains("needs pd.tls_ca_file"), "{e}");
        let e = for_engine(&pd(serde_json::json!({"tls_ca_file": ca})), Side::Decode).unwrap_err();
        assert!(
            e.contains("pd.tls_ca_file is set but pd.tls is false"),
            "{e}"
        );
        let ucx = serde_json::json!({"tls": true, "transport": "ucx", "listen": "ucx://127.0.0.1:0",
                                     "tls_cert_file": cert, "tls_key_file": key});
        let e = for_engine(&pd(ucx), Side::Prefill).unwrap_err();
        assert!(e.contains("pd.transport is \"ucx\""), "{e}");
        let both = serde_json::json!({"tls": true, "tls_cert_file": cert, "tls_key_file": key});
        assert!(for_engine(&pd(both), Side::Prefill).unwrap().is_some());
    }

    #[test]
    fn a_handshake_dribbled_a_byte_at_a_time_ends_at_its_deadline() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let server = Tls::server(&fixture("prefill.pem"), &fixture("prefill.key")).unwrap();
        let dribbler = std::thread::spawn(move || {
            let mut s = TcpStream::connect(addr).unwrap();
            // A ClientHello's record header, then a byte every 10 ms, for 3 s at most.
            let _ = s.write_all(&[22, 3, 1, 0x40, 0]);
            for _ in 0..300 {
                if s.write_all(&[1]).is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        });
        let (sock, _) = listener.accept().unwrap();
        sock.set_read_timeout(Some(Duration::from_millis(20)))
            .unwrap();
        let started = Instant::now();
        let e = server
            .accept(sock, started + Duration::from_millis(300), &|| false)
            .unwrap_err();
        assert!(e.contains("no TLS handshake in time"), "{e}");
        assert!(
            started.elapsed() < Duration::from_millis(800),
            "{:?}",
            started.elapsed()
        );
        dribbler.join().unwrap();
    }
}
