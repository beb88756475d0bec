// Prints the memory plan for a params file using the C++ wrapper (bindings/cpp/dsv4.hpp).
//   plan_cpp PARAMS.json
#include <dsv4.hpp>

#include <fstream>
#include <iostream>
#include <sstream>

int main(int argc, char **argv) {
    if (argc != 2) {
        std::cerr << "usage: " << argv[0] << " PARAMS.json\n";
        return 2;
    }
    std::ifstream file(argv[1]);
    if (!file) {
        std::cerr << argv[1] << ": cannot open\n";
        return 1;
    }
    std::stringstream params;
    params << file.rdbuf();
    try {
        std::cout << dsv4::plan_text(params.str());
    } catch (const dsv4::error &e) {
        std::cerr << argv[1] << ": " << e.status_name() << ": " << e.what() << "\n";
        return 1;
    }
    return 0;
}
