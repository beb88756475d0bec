// The trust boundary for PD routing fields. A request body's pd_peer / bootstrap_host +
// bootstrap_port tell a decode engine where to connect, and pd_room / bootstrap_room which room
// to claim: from an arbitrary client they would let it point a decode at a host and port of its
// choice or collide with another user's room. dsv4-server honours them only from its router
// (the X-DSV4-Router-Token header equal to the server's --router-token-file) or when told that
// whatever sits in front of it is trusted (--trust-pd-fields); dsv4-router never takes them from
// its clients and picks rooms from the kernel's CSPRNG.
#pragma once

#include <sys/random.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>

namespace serve {

constexpr const char *kRouterTokenHeader = "X-DSV4-Router-Token";

// The body fields that steer PD traffic (SGLang's names and dsv4's).
constexpr const char *kPdFields[] = {"bootstrap_host", "bootstrap_port", "bootstrap_room", "pd_peer", "pd_room"};

// The shortest token accepted: a guessable one would be no boundary.
constexpr size_t kMinTokenBytes = 16;

// The token in `path`: its first line without surrounding whitespace. Throws naming the fix when
// the file cannot be read or the token is short or not a valid header value.
inline std::string read_token_file(const std::string &path) {
    std::ifstream f(path, std::ios::binary);
    if (!f)
        throw std::runtime_error("cannot read --router-token-file " + path + ": " + std::strerror(errno));
    std::string line;
    std::getline(f, line);
    const size_t a = line.find_first_not_of(" \t\r\n"), b = line.find_last_not_of(" \t\r\n");
    const std::string token = a == std::string::npos ? "" : line.substr(a, b - a + 1);
    const std::string fix = ": write at least 16 random bytes as text, e.g. `head -c 32 /dev/urandom | base64 > " + path + "`";
    if (token.size() < kMinTokenBytes)
        throw std::runtime_error("--router-token-file " + path + " holds a token of " + std::to_string(token.size()) +
                                 " bytes, under the 16 required" + fix);
    for (unsigned char c : token)
        if (c < 0x21 || c > 0x7e)
            throw std::runtime_error("--router-token-file " + path +
                                     " holds a token with a space or a non-printable byte (not a valid header value)" + fix);
    return token;
}

// Compares two secrets in time that depends on their lengths only.
inline bool same_secret(const std::string &a, const std::string &b) {
    unsigned char diff = a.size() == b.size() ? 0 : 1;
    const std::string &longer = a.size() >= b.size() ? a : b;
    for (size_t i = 0; i < longer.size(); i++)
        diff |= static_cast<unsigned char>((i < a.size() ? a[i] : 0) ^ (i < b.size() ? b[i] : 0));
    return diff == 0;
}

// 64 bits from the kernel's CSPRNG (getrandom). Throws if it fails, which it does not once the
// pool is initialised.
inline uint64_t random_u64() {
    uint64_t v = 0;
    size_t got = 0;
    while (got < sizeof(v)) {
        const ssize_t n = getrandom(reinterpret_cast<char *>(&v) + got, sizeof(v) - got, 0);
        if (n < 0) {
            if (errno == EINTR) continue;
            throw std::runtime_error(std::string("getrandom failed: ") + std::strerror(errno));
        }
        got += static_cast<size_t>(n);
    }
    return v;
}

}  // namespace serve
