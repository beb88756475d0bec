// Requests by their caller's "rid" (SGLang's request id), so POST /abort_request can reach them:
// dsv4-server maps a rid to its engine request, dsv4-router to the two halves it sent.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <iterator>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>

namespace serve {

// The longest rid a client may pass (the router appends a retry's suffix to it).
constexpr size_t kMaxRidBytes = 256;

// An abort may arrive before its request (a router aborts the decode's half when the prefill
// refuses, and the two race): such a rid is remembered for a minute and its request is answered
// as aborted without running. Rids that ended recently are remembered too, so a late abort of
// one (a router's, after its request finished) is not taken for an early one. Both memories hold
// at most 4096 rids.
template <typename V>
class rid_registry {
public:
    enum class added { ok, aborted_early, in_flight };

    // True (and forgotten) when `rid` was aborted before its request came.
    bool aborted_before(const std::string &rid) {
        std::lock_guard<std::mutex> lock(mu_);
        return early_.erase(rid) > 0;
    }

    // Registers a request: aborted_early when the rid was aborted meanwhile (the caller aborts
    // the request then), in_flight when another request holds it.
    added add(const std::string &rid, V value) {
        std::lock_guard<std::mutex> lock(mu_);
        if (early_.erase(rid)) return added::aborted_early;
        if (!live_.emplace(rid, std::move(value)).second) return added::in_flight;
        return added::ok;
    }

    // Replaces what a live rid maps to (a router's retry on other servers).
    void update(const std::string &rid, V value) {
        std::lock_guard<std::mutex> lock(mu_);
        auto it = live_.find(rid);
        if (it != live_.end()) it->second = std::move(value);
    }

    void remove(const std::string &rid) {
        std::lock_guard<std::mutex> lock(mu_);
        live_.erase(rid);
        remember(ended_, rid);
    }

    // What the rid maps to, or nothing (then, with `remember_early`, the rid is remembered as
    // aborted early unless its request already ended).
    std::optional<V> take_for_abort(const std::string &rid, bool remember_early = true) {
        std::lock_guard<std::mutex> lock(mu_);
        auto it = live_.find(rid);
        if (it != live_.end()) return it->second;
        if (remember_early && !ended_.count(rid)) remember(early_, rid);
        return std::nullopt;
    }

private:
    using clock = std::chrono::steady_clock;
    using recent = std::unordered_map<std::string, clock::time_point>;
    static constexpr size_t kMax = 4096;

    // Adds `rid` to `set`, dropping what is older than a minute and, when still full, the
    // oldest entry (never the new one).
    static void remember(recent &set, const std::string &rid) {
        const auto now = clock::now();
        for (auto it = set.begin(); it != set.end();)
            it = now - it->second > std::chrono::seconds(60) ? set.erase(it) : std::next(it);
        if (set.size() >= kMax) {
            auto oldest = std::min_element(set.begin(), set.end(),
                                           [](const auto &a, const auto &b) { return a.second < b.second; });
            set.erase(oldest);
        }
        set[rid] = now;
    }

    std::mutex mu_;
    std::unordered_map<std::string, V> live_;
    recent early_, ended_;
};

// Keeps a request's rid registered while its answer is being produced.
template <typename V>
class rid_entry {
public:
    rid_entry(rid_registry<V> &registry, std::string rid) : registry_(registry), rid_(std::move(rid)) {}
    rid_entry(const rid_entry &) = delete;
    rid_entry &operator=(const rid_entry &) = delete;
    ~rid_entry() { registry_.remove(rid_); }

private:
    rid_registry<V> &registry_;
    std::string rid_;
};

}  // namespace serve
