//! `std::net::SocketAddr` to and from the C `sockaddr_storage` UCX takes and gives.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

/// `addr` as a C socket address and its length.
pub fn to_c(addr: &SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: all-zero is a valid sockaddr_storage.
    let mut storage: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let len = match addr {
        SocketAddr::V4(a) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: a.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from_ne_bytes(a.ip().octets()),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_storage is larger than and aligned for sockaddr_in.
            unsafe { std::ptr::write((&mut storage as *mut libc::sockaddr_storage).cast(), sin) };
            std::mem::size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(a) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: a.port().to_be(),
                sin6_flowinfo: a.flowinfo(),
                sin6_addr: libc::in6_addr {
                    s6_addr: a.ip().octets(),
                },
                sin6_scope_id: a.scope_id(),
            };
            // SAFETY: sockaddr_storage is larger than and aligned for sockaddr_in6.
            unsafe { std::ptr::write((&mut storage as *mut libc::sockaddr_storage).cast(), sin6) };
            std::mem::size_of::<libc::sockaddr_in6>()
        }
    };
    (storage, len as libc::socklen_t)
}

/// A C socket address as a `SocketAddr`; `None` for families other than IPv4 and IPv6.
pub fn from_c(storage: &libc::sockaddr_storage) -> Option<SocketAddr> {
    let p = (storage as *const libc::sockaddr_storage).cast::<u8>();
    match storage.ss_family as libc::c_int {
        libc::AF_INET => {
            // SAFETY: the family says the storage holds a sockaddr_in; read unaligned-safe.
            let sin: libc::sockaddr_in = unsafe { std::ptr::read_unaligned(p.cast()) };
            let ip = Ipv4Addr::from(sin.sin_addr.s_addr.to_ne_bytes());
            Some(SocketAddr::new(IpAddr::V4(ip), u16::from_be(sin.sin_port)))
        }
        libc::AF_INET6 => {
            // SAFETY: the family says the storage holds a sockaddr_in6.
            let sin6: libc::sockaddr_in6 = unsafe { std::ptr::read_unaligned(p.cast()) };
            let ip = Ipv6Addr::from(sin6.sin6_addr.s6_addr);
            Some(SocketAddr::new(
                IpAddr::V6(ip),
                u16::from_be(sin6.sin6_port),
            ))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_survive_the_round_trip() {
        for a in [
            "127.0.0.1:5000",
            "10.231.0.2:65535",
            "[::1]:80",
            "[fe80::1]:1",
        ] {
            let addr: SocketAddr = a.parse().unwrap();
            let (storage, len) = to_c(&addr);
            assert!(len as usize <= std::mem::size_of::<libc::sockaddr_storage>());
            assert_eq!(from_c(&storage), Some(addr), "{a}");
        }
        // The port in network order, as the kernel reads it.
        let (storage, _) = to_c(&"1.2.3.4:258".parse().unwrap());
        let bytes: &[u8; 8] =
            // SAFETY: sockaddr_storage is at least 8 bytes.
            unsafe { &*(&storage as *const libc::sockaddr_storage).cast() };
        assert_eq!(&bytes[2..8], &[1, 2, 1, 2, 3, 4]);
    }
}
