// Greedy generation for a few prompts through the C++ wrapper: submit, poll, collect tokens;
// metrics; what a unified engine says to the PD calls; a submit after shutdown.
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
        std::map<uint64_t, std::vector<int32_t>> tokens;
        for (const auto &p : prompts) {
            dsv4_request r = dsv4::request(p);
            r.max_new_tokens = 8;
            r.temperature = 0.0f;
            tokens[engine.submit(r)];
        }
        size_t finished = 0;
        while (finished < prompts.size()) {
            for (const dsv4_event &e : engine.poll(64, 1000)) {
                if (e.kind == DSV4_EVENT_TOKEN) {
                    tokens[e.request_id].push_back(e.token);
                } else {
                    finished++;
                }
            }
        }
        for (const auto &[id, toks] : tokens) {
            std::cout << "request " << id << ":";
            for (int32_t t : toks) std::cout << ' ' << t;
            std::cout << '\n';
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
            if (e.status() != DSV4_ERR_INVALID_ARGUMENT) throw;
            std::cout << "pd_endpoint: " << e.status_name() << ": " << e.what() << '\n';
        }
        dsv4_request pd = dsv4::request(prompts[0]);
        pd.pd_room = 7;
        try {
            engine.submit(pd);
            std::cout << "pd_room = 7: accepted (expected refused)\n";
            return 1;
        } catch (const dsv4::error &e) {
            if (e.status() != DSV4_ERR_INVALID_ARGUMENT) throw;
            std::cout << "pd_room = 7: " << e.status_name() << '\n';
        }
        engine.shutdown();
        dsv4::engine_state st = engine.state();
        std::cout << "state: " << static_cast<int>(st.state) << " (" << st.reason << ")\n";
        if (st.state != dsv4::state::stopped) return 1;
        std::vector<int32_t> late = {5};
        engine.submit(dsv4::request(late));  // throws: the engine is shut down
    } catch (const dsv4::error &e) {
        std::cout << "refused: " << e.status_name() << ": " << e.what() << '\n';
        return e.status() == DSV4_ERR_SHUTDOWN ? 0 : 1;
    }
    return 1;
}
