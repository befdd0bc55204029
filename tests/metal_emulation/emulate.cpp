// Runs dispatches of qkernels.metal on CPU threads (see shim.h for what is emulated and how).
// Built and driven by tests/metal_emulation.rs: `emulate JOB` reads a job file of lines
//   load NAME FILE            buffer NAME from a file
//   alloc NAME BYTES          buffer NAME of zeros
//   dispatch KERNEL GX GY GZ THREADS
//   bind INDEX NAME OFFSET    buffer argument INDEX of the last dispatch: NAME from byte OFFSET
//   run                       runs the last dispatch
//   save NAME FILE            writes buffer NAME to a file
// The standard headers come first: the shim's empty macros (`thread`, `device`, ...) would break
// them.
#include <cstdio>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <metal_stdlib>

#include "qkernels.metal"

#undef thread
#undef device
#undef constant
#undef kernel
#undef threadgroup

namespace {

// One emulated thread's arguments: the bound buffers and its place in the grid.
struct Call {
    void* const* b;
    uint3 tg;
    uint tid, lane, warp, gid;
};
using Entry = std::function<void(const Call&)>;

template <typename T>
T* at(const Call& c, int i) {
    return static_cast<T*>(c.b[i]);
}

std::map<std::string, Entry> kernels() {
    std::map<std::string, Entry> k;
#define EMU_QSDPA(TN, T, HD, BITS)                                                              \
    k["qsdpa_" #TN "_" #HD "_" #BITS] = [](const Call& c) {                                     \
        qsdpa_##TN##_##HD##_##BITS(*at<QsdpaParams>(c, 0), at<T>(c, 1), at<uint>(c, 2),          \
                                   at<T>(c, 3), at<T>(c, 4), at<uint>(c, 5), at<T>(c, 6),        \
                                   at<T>(c, 7), at<uint>(c, 8), at<T>(c, 9), at<float>(c, 10),   \
                                   at<float>(c, 11), c.tg, c.tid, c.lane, c.warp);               \
    };
#define EMU_QSDPA_HD(TN, T, BITS) \
    EMU_QSDPA(TN, T, 32, BITS)    \
    EMU_QSDPA(TN, T, 64, BITS)    \
    EMU_QSDPA(TN, T, 128, BITS)   \
    EMU_QSDPA(TN, T, 256, BITS)   \
    EMU_QSDPA(TN, T, 512, BITS)
#define EMU_QSDPA_T(TN, T)                                                                     \
    EMU_QSDPA_HD(TN, T, 4)                                                                     \
    EMU_QSDPA_HD(TN, T, 8)                                                                     \
    k["qsdpa_combine_" #TN] = [](const Call& c) {                                              \
        qsdpa_combine_##TN(*at<QsdpaParams>(c, 0), at<float>(c, 1), at<float>(c, 2),            \
                           at<T>(c, 3), c.tg.x, c.tid);                                        \
    };
    EMU_QSDPA_T(f32, float)
    EMU_QSDPA_T(f16, half)
    EMU_QSDPA_T(bf16, bfloat)
#define EMU_QMV(TN, T, SN, S, BITS, R)                                                          \
    k["qmatvec_" #TN "_" #SN "_" #BITS "_" #R] = [](const Call& c) {                            \
        qmatvec_##TN##_##SN##_##BITS##_##R(*at<QmatParams>(c, 0), at<T>(c, 1), at<uint>(c, 2),   \
                                           at<S>(c, 3), at<S>(c, 4), at<T>(c, 5), c.tg.x,        \
                                           c.lane, c.warp);                                      \
    };
#define EMU_QW_B(TN, T, SN, S, BITS)                                                            \
    EMU_QMV(TN, T, SN, S, BITS, 1)                                                              \
    EMU_QMV(TN, T, SN, S, BITS, 2)                                                              \
    EMU_QMV(TN, T, SN, S, BITS, 4)                                                              \
    EMU_QMV(TN, T, SN, S, BITS, 8)                                                              \
    k["dequant_" #TN "_" #SN "_" #BITS] = [](const Call& c) {                                   \
        dequant_##TN##_##SN##_##BITS(*at<QmatParams>(c, 0), at<uint>(c, 1), at<S>(c, 2),         \
                                     at<S>(c, 3), at<uint>(c, 4), *at<uint>(c, 5), at<T>(c, 6),  \
                                     c.gid);                                                     \
    };
#define EMU_QW_S(TN, T, SN, S) \
    EMU_QW_B(TN, T, SN, S, 4)  \
    EMU_QW_B(TN, T, SN, S, 8)
#define EMU_QW_T(TN, T)         \
    EMU_QW_S(TN, T, f32, float) \
    EMU_QW_S(TN, T, f16, half)  \
    EMU_QW_S(TN, T, bf16, bfloat)
    EMU_QW_T(f32, float)
    EMU_QW_T(f16, half)
    EMU_QW_T(bf16, bfloat)
#define EMU_QUANT(TN, T, BITS)                                                                  \
    k["quant_" #TN "_" #BITS] = [](const Call& c) {                                             \
        quant_##TN##_##BITS(*at<QmatParams>(c, 0), at<T>(c, 1), at<uint>(c, 2), at<T>(c, 3),     \
                            at<T>(c, 4), c.gid);                                                \
    };
    EMU_QUANT(f32, float, 4)
    EMU_QUANT(f32, float, 8)
    EMU_QUANT(f16, half, 4)
    EMU_QUANT(f16, half, 8)
    EMU_QUANT(bf16, bfloat, 4)
    EMU_QUANT(bf16, bfloat, 8)
#define EMU_DEQ_Q41(TN, T)                                                                      \
    k["dequant_q41_" #TN] = [](const Call& c) {                                                 \
        dequant_q41_##TN(*at<QmatParams>(c, 0), at<uchar>(c, 1), at<T>(c, 2), c.gid);           \
    };
    EMU_DEQ_Q41(f32, float)
    EMU_DEQ_Q41(f16, half)
    EMU_DEQ_Q41(bf16, bfloat)
    k["moe_route_f32"] = [](const Call& c) {
        moe_route_f32(*at<MoeParams>(c, 0), at<float>(c, 1), at<float>(c, 2), at<uint>(c, 3),
                      at<float>(c, 4), c.gid);
    };
    k["moe_group"] = [](const Call& c) {
        moe_group(*at<MoeParams>(c, 0), at<uint>(c, 1), at<uint>(c, 2), at<uint>(c, 3),
                  at<uint>(c, 4), at<uint>(c, 5), c.gid);
    };
#define EMU_MOE_QMV(TN, T, SN, S, BITS)                                                         \
    k["moe_qmatvec_" #TN "_" #SN "_" #BITS] = [](const Call& c) {                               \
        moe_qmatvec_##TN##_##SN##_##BITS(*at<MoeParams>(c, 0), at<T>(c, 1), at<uint>(c, 2),      \
                                         at<S>(c, 3), at<S>(c, 4), at<uint>(c, 5),              \
                                         at<uint>(c, 6), at<uint>(c, 7), at<T>(c, 8),           \
                                         uint2{c.tg.x, c.tg.y}, c.lane, c.warp);                \
    };
#define EMU_MOE_S(TN, T, SN, S) \
    EMU_MOE_QMV(TN, T, SN, S, 4) \
    EMU_MOE_QMV(TN, T, SN, S, 8)
#define EMU_MOE_T(TN, T)                                                                        \
    EMU_MOE_S(TN, T, f32, float)                                                                \
    EMU_MOE_S(TN, T, f16, half)                                                                 \
    EMU_MOE_S(TN, T, bf16, bfloat)                                                              \
    k["moe_matvec_" #TN] = [](const Call& c) {                                                  \
        moe_matvec_##TN(*at<MoeParams>(c, 0), at<T>(c, 1), at<T>(c, 2), at<uint>(c, 3),         \
                        at<uint>(c, 4), at<uint>(c, 5), at<T>(c, 6), uint2{c.tg.x, c.tg.y},     \
                        c.lane, c.warp);                                                        \
    };
    EMU_MOE_T(f32, float)
    EMU_MOE_T(f16, half)
    EMU_MOE_T(bf16, bfloat)
    return k;
}

[[noreturn]] void fail(const std::string& why) {
    std::cerr << "emulate: " << why << "\n";
    std::exit(2);
}

// Runs every threadgroup of a dispatch, in order, on `threads` OS threads; threads of a
// simdgroup meet in their simdgroup's barrier, all of a group in the group barrier.
void run(const Entry& f, const uint3 groups, const uint threads, void* const* bufs) {
    if (threads == 0 || threads % 32 != 0) fail("threads per group must be a multiple of 32");
    const uint simds = threads / 32;
    std::barrier<> group_barrier(threads), between(threads);
    std::vector<std::unique_ptr<std::barrier<>>> simd_barriers;
    for (uint s = 0; s < simds; ++s) simd_barriers.push_back(std::make_unique<std::barrier<>>(32));
    std::vector<float> simd_values(threads);
    std::vector<std::thread> pool;
    for (uint t = 0; t < threads; ++t) {
        pool.emplace_back([&, t] {
            const uint warp = t / 32, lane = t % 32;
            metal::emu_thread = {&group_barrier, simd_barriers[warp].get(),
                                 simd_values.data() + warp * 32, lane};
            uint linear = 0;
            for (uint z = 0; z < groups.z; ++z)
                for (uint y = 0; y < groups.y; ++y)
                    for (uint x = 0; x < groups.x; ++x, ++linear) {
                        f(Call{bufs, uint3{x, y, z}, t, lane, warp, linear * threads + t});
                        between.arrive_and_wait();
                    }
        });
    }
    for (auto& th : pool) th.join();
}

}  // namespace

int main(int argc, char** argv) {
    if (argc != 2) fail("usage: emulate JOB");
    std::ifstream job(argv[1]);
    if (!job) fail(std::string("cannot read ") + argv[1]);
    const auto table = kernels();
    std::map<std::string, std::vector<char>> buffers;
    std::string kernel;
    uint3 groups{0, 0, 0};
    uint threads = 0;
    std::vector<void*> bound(16, nullptr);
    std::string line;
    while (std::getline(job, line)) {
        std::istringstream in(line);
        std::string op;
        if (!(in >> op)) continue;
        if (op == "load") {
            std::string name, file;
            in >> name >> file;
            std::ifstream f(file, std::ios::binary);
            if (!f) fail("cannot read " + file);
            buffers[name] = std::vector<char>(std::istreambuf_iterator<char>(f), {});
            buffers[name].resize(buffers[name].size() + 16);  // room for placeholder reads
        } else if (op == "alloc") {
            std::string name;
            size_t bytes = 0;
            in >> name >> bytes;
            buffers[name] = std::vector<char>(bytes + 16, 0);
        } else if (op == "dispatch") {
            in >> kernel >> groups.x >> groups.y >> groups.z >> threads;
            if (!table.count(kernel)) fail("no kernel " + kernel);
            std::fill(bound.begin(), bound.end(), nullptr);
        } else if (op == "bind") {
            size_t index = 0, offset = 0;
            std::string name;
            in >> index >> name >> offset;
            if (index >= bound.size() || !buffers.count(name)) fail("bad bind: " + line);
            if (offset > buffers[name].size()) fail("offset past the end: " + line);
            bound[index] = buffers[name].data() + offset;
        } else if (op == "run") {
            run(table.at(kernel), groups, threads, bound.data());
        } else if (op == "save") {
            std::string name, file;
            in >> name >> file;
            if (!buffers.count(name)) fail("no buffer " + name);
            const auto& b = buffers[name];
            std::ofstream f(file, std::ios::binary);
            f.write(b.data(), std::streamsize(b.size() - 16));
        } else {
            fail("unknown line: " + line);
        }
    }
    return 0;
}
