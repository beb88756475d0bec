// dsv4.h and dsv4.hpp compile as C++17 with -Wall -Wextra -Wpedantic -Werror, included twice.
#include <dsv4.h>
#include <dsv4.h>
#include <dsv4.hpp>
#include <dsv4.hpp>

#include <string>

static_assert(sizeof(dsv4_status) == 4, "dsv4_status is int32_t");
static_assert(static_cast<int32_t>(dsv4::state::failed) == DSV4_STATE_FAILED, "state values");

int main() {
    try {
        dsv4::validate_params("{\"kv\": {\"page_size\": 100}}");
        return 1;
    } catch (const dsv4::error &e) {
        if (e.status() != dsv4::status::config || e.code() != DSV4_ERR_CONFIG) return 1;
    }
    if (std::string(dsv4::finish_reason_name(DSV4_FINISH_STOP)) != "stop") return 1;
    return std::string(dsv4::version()) == DSV4_VERSION_STRING ? 0 : 1;
}
