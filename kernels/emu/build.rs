//! Compiles the CUDA kernels (`../src/cuda/*.cu`, `common.cuh` first) as C++ for the CPU through
//! the shim in `cpp/`.
fn main() {
    println!("cargo:rerun-if-changed=cpp/shim.h");
    println!("cargo:rerun-if-changed=cpp/emu.cpp");
    for f in ["common.cuh", "elementwise.cu", "attention.cu", "gemv.cu"] {
        println!("cargo:rerun-if-changed=../src/cuda/{f}");
    }
    cc::Build::new()
        .cpp(true)
        .file("cpp/emu.cpp")
        .std("c++20")
        .opt_level(2)
        .flag_if_supported("-Wno-unknown-pragmas")
        .flag_if_supported("-Wno-unused-function")
        .flag_if_supported("-pthread")
        .compile("thaw_cuda_emu");
    println!("cargo:rustc-link-lib=pthread");
}
