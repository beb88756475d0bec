// dsv4.hpp — a header-only C++17 wrapper over dsv4.h: exceptions instead of status codes,
// std::string instead of (buf, cap, needed). Installed next to dsv4.h.
#ifndef DSV4_HPP
#define DSV4_HPP

#include <dsv4.h>

#include <stdexcept>
#include <string>

namespace dsv4 {

// A failed dsv4 call: what() is dsv4_last_error(), status() the DSV4_ERR_* code.
class error : public std::runtime_error {
public:
    error(dsv4_status status, const char *message)
        : std::runtime_error(message), status_(status) {}
    dsv4_status status() const noexcept { return status_; }
    const char *status_name() const noexcept { return dsv4_status_name(status_); }

private:
    dsv4_status status_;
};

inline void check(dsv4_status status) {
    if (status != DSV4_OK) throw error(status, dsv4_last_error());
}

namespace detail {
// Calls a (buf, cap, needed) function until its output fits (reports with live readings can
// grow between the size query and the call that fills the buffer).
template <typename Call>
std::string read_text(Call call) {
    size_t needed = 0;
    check(call(nullptr, 0, &needed));
    for (;;) {
        std::string out(needed, '\0');
        dsv4_status status = call(out.data(), out.size(), &needed);
        if (status == DSV4_ERR_BUFFER_TOO_SMALL) continue;
        check(status);
        out.resize(needed - 1);
        return out;
    }
}
}  // namespace detail

inline const char *version() noexcept { return dsv4_version(); }

// The full default params document (JSON).
inline std::string default_params() {
    return detail::read_text(
        [](char *buf, size_t cap, size_t *needed) { return dsv4_params_default(buf, cap, needed); });
}

// Validates params JSON and returns the resolved document; throws dsv4::error listing every
// problem otherwise.
inline std::string validate_params(const std::string &params_json) {
    return detail::read_text([&](char *buf, size_t cap, size_t *needed) {
        return dsv4_params_validate(params_json.c_str(), buf, cap, needed);
    });
}

// The memory plan as JSON.
inline std::string plan(const std::string &params_json) {
    return detail::read_text([&](char *buf, size_t cap, size_t *needed) {
        return dsv4_plan(params_json.c_str(), buf, cap, needed);
    });
}

// The memory plan as a table.
inline std::string plan_text(const std::string &params_json) {
    return detail::read_text([&](char *buf, size_t cap, size_t *needed) {
        return dsv4_plan_text(params_json.c_str(), buf, cap, needed);
    });
}

}  // namespace dsv4

#endif  // DSV4_HPP
