// Greedy generation for a few prompts through the C++ wrapper: each submit returns the stream
// of its request's events (one poller in the wrapper routes them); metrics; what a unified
// engine says to the PD calls; a submit after shutdown.
//   generate_cpp MODEL_DIR
#include <dsv4.hpp>

#include <iostream>
#include <map>
#include <vector>

int main(int argc, char **argv) {
    if (argc != 2) {
        std::cerr << "usage: " << argv[0] << " MODEL_DIR\n";
        return 2;
    }
    try {
        dsv4::engine engine("{\"model_path\": \"" + std::string(argv[1]) +
                            "\", \"threads\": 2, \"kv\": {\"device_memory_bytes\": \"32MiB\", "
                            "\"max_running_requests\": 4, \"page_size\": 128}}");
        std::vector<std::vector<int32_t>> prompts = {
            {5, 17, 300, 2, 9}, {44, 81, 120, 7, 66, 250}, {3, 19, 200, 11}};
        // All three run at once in the engine; each stream yields only its own events.
        std::vector<dsv4::stream> streams;
        for (const auto &p : prompts)
            streams.push_back(engine.submit(dsv4::request(p).max_new_tokens(8).temperature(0.0f)));
        std::map<uint64_t, std::vector<int32_t>> tokens;
        std::map<uint64_t, dsv4::finish_reason> reasons;
        for (dsv4::stream &s : streams) {
            for (const dsv4::event &e : s) {
                if (e.kind == dsv4::event_kind::token) {
                    tokens[s.id()].push_back(e.token);
                } else if (e.kind == dsv4::event_kind::finished) {
                    reasons[s.id()] = e.finish_reason;
                } else {
                    throw dsv4::error(static_cast<dsv4_status>(e.status), e.message);
                }
            }
        }
        for (const auto &[id, toks] : tokens) {
            std::cout << "request " << id << ":";
            for (int32_t t : toks) std::cout << ' ' << t;
            std::cout << " (" << dsv4::finish_reason_name(reasons[id]) << ")\n";
        }
        size_t received = 0;
        for (const auto &entry : tokens) received += entry.second.size();
        const dsv4_metrics m = engine.metrics();
        std::cout << "metrics: " << m.requests_total << " requests, " << m.generation_tokens_total
                  << " tokens (" << (m.generation_tokens_total == received ? "" : "not ")
                  << "as received), TTFT mean " << 1e3 * m.ttft_seconds_sum / m.ttft_count
                  << " ms\n";
        const std::string text = engine.prometheus();
        const size_t line = text.find("\ndsv4_num_running_reqs ");
        std::cout << text.substr(line + 1, text.find('\n', line + 1) - line - 1) << '\n';
        // Prefill/decode disaggregation: a unified engine is no PD peer. It has no endpoint, and
        // it refuses a request's pd_room / pd_peer (set on prefill and decode engines).
        try {
            const std::string endpoint = engine.pd_endpoint();
            std::cout << "pd_endpoint: " << endpoint << " (expected none)\n";
            return 1;
        } catch (const dsv4::error &e) {
            if (e.status() != dsv4::status::invalid_argument) throw;
            std::cout << "pd_endpoint: " << e.status_name() << ": " << e.what() << '\n';
        }
        dsv4::request pd = dsv4::request(prompts[0]).pd_room(7);
        try {
            engine.submit(pd);
            std::cout << "pd_room = 7: accepted (expected refused)\n";
            return 1;
        } catch (const dsv4::error &e) {
            if (e.status() != dsv4::status::invalid_argument) throw;
            std::cout << "pd_room = 7: " << e.status_name() << '\n';
        }
        engine.shutdown();
        dsv4::engine_state st = engine.state();
        std::cout << "state: " << static_cast<int>(st.state) << " (" << st.reason << ")\n";
        if (st.state != dsv4::state::stopped) return 1;
        engine.submit(dsv4::request({5}));  // throws: the engine is shut down
    } catch (const dsv4::error &e) {
        std::cout << "refused: " << e.status_name() << ": " << e.what() << '\n';
        return e.status() == dsv4::status::shutdown ? 0 : 1;
    }
    return 1;
}
