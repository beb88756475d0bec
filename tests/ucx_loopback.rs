//! The UCX layer against the real libucp (Debian's libucx0, which `scripts/deps.sh` installs;
//! these tests fail, never skip, without it), on UCX's tcp, self and shared-memory transports
//! (`UCX_TLS=tcp,self,sm`: no RDMA here): a server worker listens, a client connects, the
//! server registers a buffer and sends its address and packed remote key by active message,
//! the client writes a known pattern into it by RMA puts, flushes and says done, and the
//! server's buffer equals the pattern byte for byte (compared with the client's source, as
//! memcmp does). Active messages large enough to go by rendezvous arrive whole.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use dsv4::pd::ucx::{Context, Listener, Message, Worker};

const TLS: &str = "tcp,self,sm";
const ADDR_KEY: u32 = 1;
const DONE: u32 = 2;

fn context() -> Arc<Context> {
    Context::new(None, Some(TLS)).unwrap_or_else(|e| panic!("{e}"))
}

/// Progresses both workers until `done` gives a value; fails after 10 s.
fn drive<T>(a: &Worker, b: &Worker, what: &str, mut done: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        a.progress();
        b.progress();
        if let Some(v) = done() {
            return v;
        }
        assert!(Instant::now() < deadline, "{what}: not after 10 s");
        std::thread::sleep(Duration::from_micros(50));
    }
}

/// A server worker receiving `DONE` messages of at most `max_header` + `max_data` bytes and
/// listening on a free loopback port, and a client worker (with its context, for more).
fn server_and_client(
    max_header: usize,
    max_data: usize,
) -> (Worker, Listener, Worker, Arc<Context>) {
    let (sctx, cctx) = (context(), context());
    let (server, client) = (Worker::new(&sctx).unwrap(), Worker::new(&cctx).unwrap());
    server.receive(DONE, max_header, max_data).unwrap();
    let listener = server.listen("127.0.0.1:0".parse().unwrap()).unwrap();
    (server, listener, client, cctx)
}

fn take(w: &Worker, id: u32) -> Option<Message> {
    w.take_message().inspect(|m| assert_eq!(m.id, id, "{m:?}"))
}

/// An independent byte pattern (not a multiple of any page or chunk size).
fn pattern(len: usize, seed: u32) -> Vec<u8> {
    (0..len as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(seed) >> 13) as u8)
        .collect()
}

#[test]
fn puts_land_in_the_peers_registered_memory_byte_for_byte() {
    let (sctx, cctx) = (context(), context());
    let (server, client) = (Worker::new(&sctx).unwrap(), Worker::new(&cctx).unwrap());
    server.receive(DONE, 64, 2 << 20).unwrap();
    client.receive(ADDR_KEY, 64, 4096).unwrap();
    let listener = server
        .listen("127.0.0.1:0".parse::<SocketAddr>().unwrap())
        .unwrap();
    let addr = listener.local_addr();
    assert_ne!(addr.port(), 0, "the listener's bound port");
    let to_server = client.connect(addr).unwrap();
    let to_client = drive(&server, &client, "the connection request", || {
        server.accept()
    })
    .unwrap();

    // 4 MiB + 3 bytes of destination, registered, its address and key sent to the client.
    let len = (4 << 20) + 3;
    let mut dest = vec![0u8; len];
    // SAFETY: `dest` outlives the registration (dropped below, before `dest`), and the client
    // writes only while it is registered.
    let reg = unsafe { sctx.register(dest.as_mut_ptr(), len) }.unwrap();
    let mut sent = to_client
        .send(ADDR_KEY, reg.addr.to_le_bytes().to_vec(), reg.rkey.clone())
        .unwrap();
    let m = drive(&server, &client, "the address and key", || {
        take(&client, ADDR_KEY)
    });
    assert!(sent.poll().is_some_and(|r| r.is_ok()));
    assert_eq!(m.from, Some(to_server.key()), "the message's connection");
    let base = u64::from_le_bytes(m.header[..8].try_into().unwrap());
    let rkey = to_server.unpack_rkey(&m.data).unwrap();

    // The pattern, in pieces of every size class: 64 KiB frames, one odd piece, the tail.
    let source = Arc::new(pattern(len, 7));
    let mut puts = Vec::new();
    let mut at = 0;
    for size in std::iter::once(1).chain(std::iter::repeat(65_536)) {
        if at >= len {
            break;
        }
        let n = size.min(len - at);
        let piece = source[at..at + n].to_vec();
        puts.push(to_server.put(piece, base + at as u64, &rkey).unwrap());
        at += n;
    }
    // Over tcp the puts are carried out by the server's progress: both workers run here.
    let mut flush = to_server.flush().unwrap();
    drive(&server, &client, "the flush", || flush.poll()).unwrap();
    for p in &mut puts {
        assert!(
            p.poll().is_some_and(|r| r.is_ok()),
            "a put not done after the flush"
        );
    }
    // Done, with a 1 MiB payload (over UCX's eager limit: it goes by rendezvous).
    let payload = pattern(1 << 20, 99);
    let mut done = to_server
        .send(DONE, b"done".to_vec(), payload.clone())
        .unwrap();
    let m = drive(&server, &client, "the done message", || take(&server, DONE));
    assert!(drive(&server, &client, "the send's completion", || done.poll()).is_ok());
    assert_eq!(m.header, b"done");
    assert_eq!(m.data.len(), payload.len());
    assert!(m.data == payload, "the rendezvous payload differs");
    assert_eq!(m.from, Some(to_client.key()));
    assert!(
        dest == *source,
        "the registered memory differs from the source"
    );

    drop(rkey);
    let mut closing = to_server.close(false).unwrap();
    assert!(drive(&server, &client, "the close", || closing.poll()).is_ok());
    drop(reg);
    drop(dest);
    assert!(client.take_errors().is_empty());
}

#[test]
fn a_peer_that_goes_away_is_reported_on_the_endpoint() {
    let (server, listener, client, cctx) = server_and_client(64, 64);
    let to_server = client.connect(listener.local_addr()).unwrap();
    let mut hello = to_server.send(DONE, b"hi".to_vec(), Vec::new()).unwrap();
    let to_client = drive(&server, &client, "the connection", || server.accept()).unwrap();
    drive(&server, &client, "the hello", || take(&server, DONE));
    assert!(hello.poll().is_some_and(|r| r.is_ok()));
    // The server's side goes, forcibly (as a process killed does: no goodbye).
    drop(to_client);
    drop(listener);
    drop(server);
    let errors = drive(&client, &Worker::new(&cctx).unwrap(), "the error", || {
        let e = client.take_errors();
        (!e.is_empty()).then_some(e)
    });
    assert_eq!(errors[0].0, to_server.key(), "{errors:?}");
}

/// A listener that refuses a connection request (a prefill shutting down): the client's
/// endpoint fails at once, its message never delivered, and the server holds no endpoint.
#[test]
fn a_rejected_connection_request_fails_the_clients_endpoint() {
    let (server, listener, client, _) = server_and_client(64, 64);
    assert!(listener.reject_next().is_none(), "no request yet");
    let to_server = client.connect(listener.local_addr()).unwrap();
    let _hello = to_server.send(DONE, b"hi".to_vec(), Vec::new()).unwrap();
    drive(&server, &client, "the connection request", || {
        listener.reject_next()
    })
    .unwrap();
    let errors = drive(&server, &client, "the client's error", || {
        let e = client.take_errors();
        (!e.is_empty()).then_some(e)
    });
    assert_eq!(errors[0].0, to_server.key(), "{errors:?}");
    assert!(
        server.take_message().is_none(),
        "a message through a refused connection"
    );
    assert!(
        server.accept().is_none(),
        "the request was taken by the rejection"
    );
}

#[test]
fn a_message_over_the_receivers_limits_is_dropped_and_its_endpoint_reported() {
    let (server, listener, client, _) = server_and_client(16, 1024);
    let to_server = client.connect(listener.local_addr()).unwrap();
    let _to_client = drive(&server, &client, "the connection", || server.accept()).unwrap();
    // Within the limits, then data over them (eager), then far over them (rendezvous).
    let mut sends = vec![
        to_server.send(DONE, vec![1; 16], vec![2; 1024]).unwrap(),
        to_server.send(DONE, vec![1; 4], vec![3; 1025]).unwrap(),
        to_server.send(DONE, vec![1; 4], vec![4; 4 << 20]).unwrap(),
    ];
    let m = drive(&server, &client, "the first message", || {
        take(&server, DONE)
    });
    assert_eq!((m.header.len(), m.data.len()), (16, 1024));
    let errors = drive(&server, &client, "both refusals", || {
        let e = server.take_errors();
        (e.len() == 2).then_some(e)
    });
    for (ep, why) in &errors {
        assert_eq!(Some(*ep), m.from);
        assert!(why.contains("over the limits of 16 + 1024"), "{why}");
    }
    for s in &mut sends {
        let _ = drive(&server, &client, "the sends' completion", || s.poll());
    }
    assert!(
        server.take_message().is_none(),
        "a refused message was delivered"
    );
}

#[test]
fn what_is_queued_for_a_forgotten_endpoint_is_dropped() {
    let (server, listener, client, _) = server_and_client(64, 64);
    let to_server = client.connect(listener.local_addr()).unwrap();
    let to_client = drive(&server, &client, "the connection", || server.accept()).unwrap();
    let mut sends: Vec<_> = (0..3u8)
        .map(|i| to_server.send(DONE, vec![i], Vec::new()).unwrap())
        .collect();
    for s in &mut sends {
        drive(&server, &client, "a send", || s.poll()).unwrap();
    }
    drive(&server, &client, "the three queued", || {
        (server.queued() == 3).then_some(())
    });
    server.forget(to_client.key());
    assert_eq!(server.queued(), 0);
    assert!(
        server.take_message().is_none(),
        "a forgotten endpoint's message was delivered"
    );
    // Later messages from the endpoint are queued again.
    let mut again = to_server.send(DONE, vec![9], Vec::new()).unwrap();
    let m = drive(&server, &client, "a later message", || take(&server, DONE));
    assert_eq!(m.header, vec![9]);
    assert!(again.poll().is_some());
}
